"""How the conformance suite runs a backend on one case, and judges what it got.

:class:`CaseRun` (:class:`MLACaseRun` for MLA backends) holds one numerical case: the
backend, its :class:`~kvcore.testing.batch.CaseConfig`, device and seed, and the helpers the
checks call it with (allocation in the backend's layout, a mixed batch written and attended,
the float64 references, the diffs that messages quote). The tolerance tables and
:func:`tolerance_for` say how close is close enough; :func:`fail` makes the
:class:`ConformanceError` every check raises.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import torch

from kvcore.allocate import KVCaches, allocate_kv_caches
from kvcore.backend import AttentionBackend
from kvcore.impl import AttentionImpl
from kvcore.layout import KVCacheLayout
from kvcore.metadata import LayerScales
from kvcore.ops.mla_reference import concat_and_cache_mla_ref
from kvcore.ops.reference import paged_attention_ref, reshape_and_cache_ref, scale_value
from kvcore.platform_types import AttentionType
from kvcore.testing.batch import (
    NUM_HEADS,
    NUM_KV_HEADS,
    CaseConfig,
    MixedBatch,
    make_mixed_batch,
    mla_dims,
    random_like,
    short_dtype,
)
from kvcore.testing.checks import backend_label, check_cross_layer_claim, check_shape, fail
from kvcore.testing.reference import contiguous_attention_ref, contiguous_mla_ref
from kvcore.testing.rules import ConformanceError

__all__ = [
    "DEFAULT_TOLERANCES",
    "MLA_NORM_TOLERANCES",
    "NORM_TOLERANCES",
    "CaseRun",
    "MLACaseRun",
    "bits",
    "cache_diff",
    "case_run",
    "shape_text",
    "split_kv_views",
    "tolerance_for",
]


#: ``(atol, rtol)`` per key. A model dtype bounds ``forward`` against the float64 reference; an
#: fp8 ``kv_cache_dtype`` name bounds a cache write against the reference quantisation,
#: compared as stored values (one fp8 step: e4m3 has 3 mantissa bits, e5m2 two). Writes of
#: ``"auto"`` caches are copies and are always compared bit for bit. A backend narrows or
#: widens an entry with a ``CONFORMANCE_TOLERANCES`` class attribute of the same form.
DEFAULT_TOLERANCES: dict[torch.dtype | str, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    # TF32 tensor-core products (Triton's default for fp32 dot) round inputs to 10 bits.
    torch.float32: (2e-3, 2e-3),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2e-2, 2e-2),
    "fp8": (2.0**-9, 2.0**-3),
    "fp8_e4m3": (2.0**-9, 2.0**-3),
    "fp8_e5m2": (2.0**-16, 2.0**-2),
}

#: Largest relative error norm of one token's output (all heads and dims) per model dtype:
#: ``||out - round(ref)|| / ||round(ref)||`` with ``round(ref)`` the float64 reference rounded
#: to the model dtype, what a correct kernel's last rounding gives. A correct kernel with fp32
#: accumulation that rounds the probabilities to the model dtype before the P.V product (as
#: flash-style kernels do) stays well below (bf16 about 3e-3, fp16 and TF32 about 5e-4); a
#: systematic 1% error gives 1e-2 in every dtype. Unlike the element-wise bound, this one
#: does not grow with the cancellation in an output element near zero.
NORM_TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 2e-3,  # TF32 dots (Triton's default for fp32) round inputs to 10 bits
    torch.float16: 2e-3,
    torch.bfloat16: 5e-3,
}

#: :data:`NORM_TOLERANCES` for MLA backends (``MLACaseRun.norm_tolerances``). Below 1%, so a 1%
#: error fails; above what a correct absorbed kernel's extra roundings (``q_latent`` and the
#: latent output in the model dtype) give, which in bf16 is near 4e-3.
MLA_NORM_TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    # TF32 dots (Triton's default for fp32) round inputs to 10 bits.
    torch.float32: 2e-3,
    torch.float16: 2e-3,
    torch.bfloat16: 7e-3,
}

_DIM_WORDS = {"B": "block", "2": "K/V", "N": "token", "H": "head", "D": "dim", "L": "layer"}


def tolerance_for(
    backend: type[AttentionBackend], key: torch.dtype | str
) -> tuple[tuple[float, float], str]:
    """``((atol, rtol), source)`` for ``key``: the backend's declaration or the default table."""
    declared = backend.CONFORMANCE_TOLERANCES
    if key in declared:
        return tuple(declared[key]), f"{backend_label(backend)}.CONFORMANCE_TOLERANCES"
    return DEFAULT_TOLERANCES[key], "kvcore.testing.DEFAULT_TOLERANCES"



# -- numerical checks ----------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as integers of the same width (NaN-safe, exact comparison)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def split_kv_views(kv_cache: torch.Tensor,
                   layout: KVCacheLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views ``(num_blocks, block_size, num_kv_heads, head_size)`` of one layer."""
    key_cache, value_cache = kv_cache.unbind(layout.layer_dim_names.index("2"))
    return key_cache, value_cache


class CaseRun:
    """One numerical case: the backend, its config and device, and the helpers to call it."""

    #: What the last dim of the output is, for messages.
    OUTPUT_DIM = "head_size"
    #: ``num_kv_heads`` of the caches this kind of attention allocates.
    CACHE_KV_HEADS = NUM_KV_HEADS
    #: Per-token error norm bounds of :meth:`output_diff` (a kind of attention whose correct
    #: kernels round more, e.g. MLA's absorbed path, sets its own) and their name in messages.
    norm_tolerances: dict[torch.dtype, float] = NORM_TOLERANCES
    norm_source = "kvcore.testing.NORM_TOLERANCES"

    def __init__(self, backend: type[AttentionBackend], config: CaseConfig,
                 device: torch.device, seed: int) -> None:
        self.backend = backend
        self.config = config
        self.device = device
        self.gen = torch.Generator().manual_seed(seed)
        self.seed = seed
        # Sinks near the log of a request's key count, so they take a large share of each
        # row's softmax: a kernel that drops them (or adds them twice) is far off.
        self.sinks = (torch.randn(NUM_HEADS, generator=self.gen) + 3.0).to(device) \
            if config.has_sink else None
        # The numerical checks only make sense once the layout contract holds.
        check_shape(backend, config.block_size, config.head_size)
        check_cross_layer_claim(backend)

    def where(self) -> str:
        return (f"config: {self.config.describe(self.backend.IS_MLA)}; device {self.device}; "
                f"seed {self.seed}")

    def make_batch(self) -> MixedBatch:
        return make_mixed_batch(self.config, self.device, self.gen)

    def tokens(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Random ``(query, key, value)`` for ``rows`` new tokens."""
        d, dtype = self.config.head_size, self.config.dtype
        return (random_like((rows, NUM_HEADS, d), dtype, self.device, self.gen),
                random_like((rows, NUM_KV_HEADS, d), dtype, self.device, self.gen),
                random_like((rows, NUM_KV_HEADS, d), dtype, self.device, self.gen))

    def page_elements(self) -> int:
        """Elements of one block of one layer."""
        return 2 * self.config.block_size * NUM_KV_HEADS * self.config.head_size

    def output_shape(self, rows: int) -> tuple[int, ...]:
        return (rows, NUM_HEADS, self.config.head_size)

    def reference_write(self, batch: MixedBatch, kv_cache: torch.Tensor, layout: KVCacheLayout,
                        scales: LayerScales, slot_mapping: torch.Tensor) -> None:
        """What ``do_kv_cache_update`` must do, done by the reference on ``kv_cache``."""
        key_cache, value_cache = split_kv_views(kv_cache, layout)
        reshape_and_cache_ref(batch.key, batch.value, key_cache, value_cache, slot_mapping,
                              self.config.kv_cache_dtype, scales.k_scale, scales.v_scale)

    def fail(self, rule: str, detail: str) -> ConformanceError:
        return fail(self.backend, rule, f"{detail}\n{self.where()}")

    def allocate(self, num_blocks: int, num_layers: int = 1, cross_layer: bool = False,
                 fill: bool = True) -> KVCaches:
        caches = allocate_kv_caches(
            self.backend, num_layers=num_layers, num_blocks=num_blocks,
            block_size=self.config.block_size, num_kv_heads=self.CACHE_KV_HEADS,
            head_size=self.config.head_size, dtype=self.config.dtype, device=self.device,
            cross_layer=cross_layer, kv_cache_dtype=self.config.kv_cache_dtype)
        if fill:  # random everywhere, so stray writes and reads of stale data show
            caches.storage.copy_(random_like(caches.storage.shape, caches.storage.dtype,
                                             self.device, self.gen))
        return caches

    def scales(self) -> LayerScales:
        if not self.config.is_fp8:
            return LayerScales()
        # Non-trivial per-tensor scales, as fp8 engines pass them: 1-element float32 tensors.
        return LayerScales(torch.tensor([0.5], device=self.device),
                           torch.tensor([0.25], device=self.device))

    def impl_kwargs(self) -> dict[str, Any]:
        """What the case's ``AttentionImpl`` is constructed with."""
        d = self.config.head_size
        features = {k: v for k, v in (("logits_soft_cap", self.config.logits_soft_cap),
                                      ("sinks", self.sinks)) if v is not None}
        return dict(num_heads=NUM_HEADS, head_size=d, scale=d**-0.5, num_kv_heads=NUM_KV_HEADS,
                    sliding_window=self.config.sliding_window,
                    kv_cache_dtype=self.config.kv_cache_dtype, attn_type=self.config.attn_type,
                    **features)

    def impl(self) -> AttentionImpl:
        return self.call("constructing the AttentionImpl", self.backend.get_impl_cls(),
                         **self.impl_kwargs())

    def setup_layer(self, num_blocks: int, fill: bool = True
                    ) -> tuple[KVCaches, torch.Tensor, LayerScales, AttentionImpl]:
        """What most checks start from: a one-layer allocation of ``num_blocks`` (random
        unless ``fill=False``), its layer view, the case's scales and a fresh impl."""
        caches = self.allocate(num_blocks, fill=fill)
        return caches, caches.layers[0], self.scales(), self.impl()

    def call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise self.fail("validation-refuses-before-kernel", (
                f"validate_configuration accepted this configuration, but {what} raised "
                f"{type(exc).__name__}: {exc}")) from exc

    def write(self, impl: AttentionImpl, scales: LayerScales, batch: MixedBatch,
              kv_cache: torch.Tensor) -> None:
        self.call("do_kv_cache_update", impl.do_kv_cache_update, scales, batch.key,
                  batch.value, kv_cache, batch.metadata.slot_mapping)

    def forward(self, impl: AttentionImpl, scales: LayerScales, batch: MixedBatch,
                kv_cache: torch.Tensor, output: torch.Tensor | None) -> torch.Tensor:
        result = self.call("forward", impl.forward, scales, batch.query, batch.key, batch.value,
                           kv_cache, batch.metadata, output=output)
        rows = self.output_shape(batch.query.shape[0])
        if not isinstance(result, torch.Tensor) or tuple(result.shape) != tuple(rows):
            raise self.fail("forward-reference", (
                f"forward returned {shape_text(result)}; it must return the output, shape "
                f"{tuple(rows)} (num_tokens, num_heads, {self.OUTPUT_DIM})"))
        return result

    def reference_forward(self, batch: MixedBatch, kv_cache: torch.Tensor,
                          layout: KVCacheLayout, scales: LayerScales) -> torch.Tensor:
        """float64 attention of the real tokens over ``kv_cache`` as it is now.

        A layer that is not a decoder (fresh prefills only, see :func:`make_mixed_batch`)
        attends over its own step's keys without the causal mask: computed from the tokens,
        not the cache, so it holds whether or not such a layer writes the cache.
        """
        m = batch.metadata
        n = m.num_actual_tokens
        scale = self.config.head_size**-0.5
        if self.config.attn_type is not AttentionType.DECODER:
            starts = m.query_start_loc.tolist()
            return torch.cat([
                contiguous_attention_ref(batch.query[a:b], batch.key[a:b], batch.value[a:b],
                                         scale, causal=False,
                                         sliding_window=self.config.sliding_window,
                                         logits_soft_cap=self.config.logits_soft_cap,
                                         sinks=self.sinks)
                for a, b in itertools.pairwise(starts)])
        key_cache, value_cache = split_kv_views(kv_cache, layout)
        if not self.config.is_fp8:
            key_cache, value_cache = key_cache.double(), value_cache.double()
        return paged_attention_ref(
            batch.query[:n].double(), key_cache, value_cache,
            query_start_loc=m.query_start_loc, seq_lens=m.seq_lens, block_table=m.block_table,
            scale=scale, causal=m.causal, sliding_window=self.config.sliding_window,
            kv_cache_dtype=self.config.kv_cache_dtype, k_scale=scales.k_scale,
            v_scale=scales.v_scale, logits_soft_cap=self.config.logits_soft_cap,
            sinks=None if self.sinks is None else self.sinks.double())

    def output_diff(self, out: torch.Tensor, ref: torch.Tensor, batch: MixedBatch) -> str | None:
        """Where ``out`` misses the float64 ``ref``, or ``None``.

        Two bounds: element-wise ``|out - ref| <= atol + rtol * |ref|`` (a wrong element, NaN),
        then each token's relative error norm against ``ref`` rounded to the model dtype (a
        small error on every element, which the element-wise bound lets through in bf16).
        """
        (atol, rtol), source = tolerance_for(self.backend, self.config.dtype)
        err = (out.double() - ref).abs()
        bad = ~(err <= atol + rtol * ref.abs())  # NaN counts as bad
        if bad.any():
            token, head, dim = bad.nonzero()[0].tolist()
            finite = torch.isfinite(out)
            worst = err[finite.to(err.device)].max().item() if finite.any() else float("nan")
            return (
                f"{int(bad.sum())} of {bad.numel()} output elements exceed atol={atol:g}, "
                f"rtol={rtol:g} (from {source}); largest finite error {worst:.3g}; "
                f"{int((~finite).sum())} non-finite. First at {batch.locate(token)}, head {head}, "
                f"dim {dim}: got {out[token, head, dim].item():.6g}, expected "
                f"{ref[token, head, dim].item():.6g}.\n{batch.describe()}")
        limit = self.norm_tolerances[self.config.dtype]
        rounded = ref.to(self.config.dtype).double()
        rel = ((out.double() - rounded).flatten(1).norm(dim=1)
               / rounded.flatten(1).norm(dim=1).clamp_min(1e-30))
        if not (rel > limit).any():
            return None
        token = int(rel.argmax())
        return (
            f"{int((rel > limit).sum())} of {rel.numel()} tokens have a relative error norm "
            f"over their heads above {limit:g} ({self.norm_source}, against the "
            f"reference rounded to {short_dtype(self.config.dtype)}): worst {rel[token]:.3g} "
            f"at {batch.locate(token)}, median {rel.median():.3g}; a correct kernel stays "
            f"near the dtype's rounding, a systematic 1% error gives 0.01.\n"
            f"{batch.describe()}")


class MLACaseRun(CaseRun):
    """A numerical case of an MLA backend: latent cache, ``kv_b_proj`` weight, model dims.

    ``head_size`` is the latent size; :func:`mla_dims` splits it. ``key`` / ``value`` of a
    batch are ``kv_c`` ``(rows, kv_lora_rank)`` / ``k_pe`` ``(rows, rope_dim)``.
    """

    OUTPUT_DIM = "v_head_dim"
    CACHE_KV_HEADS = 1
    norm_tolerances = MLA_NORM_TOLERANCES
    norm_source = "kvcore.testing.MLA_NORM_TOLERANCES"

    def __init__(self, backend: type[AttentionBackend], config: CaseConfig,
                 device: torch.device, seed: int) -> None:
        super().__init__(backend, config, device, seed)
        self.dims = mla_dims(config.head_size)
        d = self.dims
        # Scaled so that k = W_UK c and v = W_UV c have unit variance, as in a trained model.
        self.weight = (torch.randn(NUM_HEADS * (d.qk_nope_head_dim + d.v_head_dim),
                                   d.kv_lora_rank, generator=self.gen)
                       * d.kv_lora_rank**-0.5).to(config.dtype).to(device)
        self.scale = (d.qk_nope_head_dim + d.qk_rope_head_dim) ** -0.5

    def make_batch(self) -> MixedBatch:
        batch = make_mixed_batch(self.config, self.device, self.gen)
        query, kv_c, k_pe = self.tokens(batch.query.shape[0])
        return dataclasses.replace(batch, query=query, key=kv_c, value=k_pe)

    def tokens(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d, dtype, device = self.dims, self.config.dtype, self.device
        return (random_like((rows, NUM_HEADS, d.qk_nope_head_dim + d.qk_rope_head_dim), dtype,
                            device, self.gen),
                random_like((rows, d.kv_lora_rank), dtype, device, self.gen),
                random_like((rows, d.qk_rope_head_dim), dtype, device, self.gen))

    def page_elements(self) -> int:
        return self.config.block_size * self.config.head_size

    def output_shape(self, rows: int) -> tuple[int, ...]:
        return (rows, NUM_HEADS, self.dims.v_head_dim)

    def impl_kwargs(self) -> dict[str, Any]:
        d = self.dims
        return dict(num_heads=NUM_HEADS, head_size=self.config.head_size, scale=self.scale,
                    num_kv_heads=1, sliding_window=None,
                    kv_cache_dtype=self.config.kv_cache_dtype, attn_type=AttentionType.DECODER,
                    kv_lora_rank=d.kv_lora_rank, qk_nope_head_dim=d.qk_nope_head_dim,
                    qk_rope_head_dim=d.qk_rope_head_dim, v_head_dim=d.v_head_dim,
                    kv_b_proj_weight=self.weight)

    def reference_write(self, batch: MixedBatch, kv_cache: torch.Tensor, layout: KVCacheLayout,
                        scales: LayerScales, slot_mapping: torch.Tensor) -> None:
        concat_and_cache_mla_ref(batch.key, batch.value, kv_cache, slot_mapping,
                                 self.config.kv_cache_dtype, scales.k_scale)

    def reference_forward(self, batch: MixedBatch, kv_cache: torch.Tensor,
                          layout: KVCacheLayout, scales: LayerScales) -> torch.Tensor:
        """float64, unabsorbed MLA of the real tokens over each request's latents, read from
        ``kv_cache`` as it is now and laid out contiguously (fp8 dequantised)."""
        m = batch.metadata
        starts, lens = m.query_start_loc.tolist(), m.seq_lens.tolist()
        scale = scale_value(scales.k_scale) if self.config.is_fp8 else 1.0
        rank = self.dims.kv_lora_rank
        block_size = self.config.block_size
        outs = []
        for i, seq_len in enumerate(lens):
            pos = torch.arange(seq_len, device=kv_cache.device)
            table = torch.tensor(batch.block_tables[i], device=kv_cache.device, dtype=torch.int64)
            latents = kv_cache[table[pos // block_size], pos % block_size].double() * scale
            outs.append(contiguous_mla_ref(
                batch.query[starts[i]:starts[i + 1]], latents[:, :rank], latents[:, rank:],
                self.weight, self.scale, qk_nope_head_dim=self.dims.qk_nope_head_dim,
                v_head_dim=self.dims.v_head_dim))
        return torch.cat(outs)

    def output_diff(self, out: torch.Tensor, ref: torch.Tensor, batch: MixedBatch) -> str | None:
        """The element-wise bound too against the reference rounded to the model dtype: the
        absorbed path rounds more than a last rounding can, element by element."""
        return super().output_diff(out, ref.to(self.config.dtype).double(), batch)


def case_run(backend: type[AttentionBackend], config: CaseConfig, device: torch.device,
         seed: int) -> CaseRun:
    return (MLACaseRun if backend.IS_MLA else CaseRun)(backend, config, device, seed)


def shape_text(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value)


def cache_diff(got: torch.Tensor, expected: torch.Tensor, layout: KVCacheLayout,
                batch: MixedBatch, block_size: int, tol: tuple[float, float] | None) -> str | None:
    """Where a written cache differs from the expected one, or ``None`` if it does not."""
    if tol is None:
        bad = bits(got) != bits(expected)
    else:
        g, e = got.float(), expected.float()
        bad = ~((g - e).abs() <= tol[0] + tol[1] * e.abs())
    if not bad.any():
        return None
    names = layout.layer_dim_names
    idx = bad.nonzero().cpu()
    slots = idx[:, names.index("B")] * block_size + idx[:, names.index("N")]
    targets = batch.metadata.slot_mapping.cpu()
    in_target = torch.isin(slots, targets[targets >= 0])
    first = idx[0].tolist()
    where = ", ".join(f"{_DIM_WORDS[n]} {v}" for n, v in zip(names, first, strict=True))
    tolerance = "bit-exact" if tol is None else f"atol={tol[0]:g}, rtol={tol[1]:g}"
    return (
        f"{int(bad.sum())} of {bad.numel()} cache elements differ ({tolerance}): "
        f"{int(in_target.sum())} in slots slot_mapping names (wrong values), "
        f"{int((~in_target).sum())} in slots it does not name (written where nothing should "
        f"be). First at {where}: got {got[tuple(first)].float().item():.6g}, expected "
        f"{expected[tuple(first)].float().item():.6g}.\n{batch.describe()}")
