"""Engine layout names: vLLM's ``[L, B, H, N, C]`` family as kvcore stride orders.

vLLM (``vllm/v1/kv_cache_layout.py``, RFC #42082; LMCache uses the same names) describes a KV
cache as logically ``[L, B, H, N, C]``: layer, block, KV head, token in block, and ``C`` the
content of one head and token, K and V side by side (``C = head_size + head_size_v``). A name
is the physical order of those five dims, outermost first. kvcore's logical cache of one layer
is ``(B, 2, N, H, D)`` (``L`` in front for a multi-layer cache); ``C`` is kvcore's ``2`` and
``D`` next to each other, ``2`` outer. So a vLLM name maps onto one kvcore stride order, and
the mapping is pure arithmetic on dim indices: this module holds it, imports nothing, and
every other module (the backends' declarations, adoption, ``kvcore layout``) reads it here.

kvcore's own default orders (NHD ``(0, 1, 2, 3, 4)``, HND ``(0, 1, 3, 2, 4)``) keep a block's
K half apart from its V half; they have no vLLM name.
"""

from __future__ import annotations

__all__ = ["VLLM_LAYOUTS", "vllm_layout_name", "vllm_layout_order"]

#: vLLM's layout names and their permutations of ``[L, B, H, N, C]`` (vLLM's own values).
VLLM_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}

# vLLM's logical dim -> kvcore's logical dims of (L, B, 2, N, H, D): C is K/V (2) then D.
_VLLM_TO_KVCORE = {0: (0,), 1: (1,), 2: (4,), 3: (3,), 4: (2, 5)}


def vllm_layout_order(name: str, *, include_num_layers_dimension: bool = True
                      ) -> tuple[int, ...]:
    """The kvcore stride order of vLLM layout ``name``.

    With ``include_num_layers_dimension`` (the default) an order of the 6 dims ``(L, B, 2, N,
    H, D)``, as ``get_kv_cache_stride_order(True)`` returns; without it the order within one
    layer, of ``(B, 2, N, H, D)`` (``get_kv_cache_stride_order(False)``'s form).

    Example: ``LBNHC`` is ``(0, 1, 3, 4, 2, 5)``, one layer ``(0, 2, 3, 1, 4)``: per block,
    tokens, then heads, then K and V of that token and head side by side.

    Raises:
        ValueError: ``name`` is not one of :data:`VLLM_LAYOUTS`, listing them.
    """
    key = name.upper() if isinstance(name, str) else name
    if key not in VLLM_LAYOUTS:
        raise ValueError(f"KV cache layout {name!r} is not a vLLM layout name; the names are "
                         f"{', '.join(VLLM_LAYOUTS)}")
    order = tuple(d for v in VLLM_LAYOUTS[key] for d in _VLLM_TO_KVCORE[v])
    if include_num_layers_dimension:
        return order
    return tuple(d - 1 for d in order if d != 0)


def vllm_layout_name(stride_order: tuple[int, ...]) -> str | None:
    """The vLLM name of a kvcore stride order of ``(L, B, 2, N, H, D)`` (6 dims) or of one
    layer's ``(B, 2, N, H, D)`` (5 dims: the layer dim outermost), or ``None`` when the order
    is none of vLLM's (K and V not side by side per token and head, or an order no name has).
    """
    order = tuple(stride_order)
    if len(order) == 5:
        order = (0, *(d + 1 for d in order))
    for name in VLLM_LAYOUTS:
        if vllm_layout_order(name) == order:
            return name
    return None
