"""Rule ``window-non-causal``: a sliding window on a non-causal layer is symmetric.

A causal layer's window keeps the query and the ``sliding_window - 1`` keys before it
(``q_pos - k_pos < sliding_window``). A non-causal layer (encoder-only, or a step with
``causal=False``) also sees keys after the query, and its window cuts them the same way:
``|q_pos - k_pos| < sliding_window`` (bidirectional windows, e.g. EmbeddingGemma). A kernel
that keeps only the causal edge, or drops the window without the causal mask, returns another
attention with no error. The check runs the mixed batch non-causally with a window that cuts
inside a block, and an encoder-only layer with it, against the float64 reference; a backend
that declares ``NON_CAUSAL_WINDOW_UNSUPPORTED`` must instead refuse the combination with a
``ValueError`` carrying that reason.
"""

from __future__ import annotations

import torch

from kvcore.backend import AttentionBackend
from kvcore.testing.batch import CaseConfig, random_like
from kvcore.testing.checks import fail
from kvcore.testing.numeric_checks import check_forward
from kvcore.testing.rules import ConformanceError
from kvcore.testing.runs import case_run

__all__ = ["check_window_non_causal"]

RULE = "window-non-causal"


def check_window_non_causal(backend: type[AttentionBackend], config: CaseConfig,
                            device: torch.device, seed: int) -> None:
    """``config`` is non-causal (``causal=False`` or an encoder attention type) with a
    ``sliding_window``: forward matches the symmetric reference, or the declared refusal."""
    reason = backend.NON_CAUSAL_WINDOW_UNSUPPORTED
    if reason:
        _check_refused(backend, config, device, seed, reason)
        return
    try:
        check_forward(backend, config, device, seed)
    except ConformanceError as exc:
        if exc.rule.id != "forward-reference":
            raise
        raise fail(backend, RULE, (
            f"forward on a non-causal layer with sliding_window={config.sliding_window} does "
            "not match the symmetric window |q_pos - k_pos| < sliding_window (keys after the "
            "query are cut as far as keys before it); implement it, or declare "
            f"NON_CAUSAL_WINDOW_UNSUPPORTED and refuse the combination.\n{exc.detail}")) from None


def _check_refused(backend: type[AttentionBackend], config: CaseConfig, device: torch.device,
                   seed: int, reason: str) -> None:
    run = case_run(backend, config, device, seed)
    batch = run.make_batch()
    caches = run.allocate(batch.num_blocks)
    layer, scales = caches.layers[0], run.scales()
    where = f"sliding_window={config.sliding_window} on a non-causal layer"
    try:
        impl = backend.get_impl_cls()(**run.impl_kwargs())
        run.write(impl, scales, batch, layer)
        impl.forward(scales, batch.query, batch.key, batch.value, layer, batch.metadata,
                     output=random_like(run.output_shape(batch.query.shape[0]), config.dtype,
                                        device, run.gen))
    except ValueError as exc:
        if reason not in str(exc):
            raise run.fail(RULE, (
                f"{backend.get_name()} declares NON_CAUSAL_WINDOW_UNSUPPORTED but refused "
                f"{where} without that reason: {exc}")) from exc
        return
    except Exception as exc:
        raise run.fail(RULE, (
            f"{backend.get_name()} declares NON_CAUSAL_WINDOW_UNSUPPORTED; {where} must be "
            f"refused with a ValueError, got {type(exc).__name__}: {exc}")) from exc
    raise run.fail(RULE, (
        f"{backend.get_name()} declares NON_CAUSAL_WINDOW_UNSUPPORTED ({reason}) but ran "
        f"{where}; refuse it (AttentionBackend.check_non_causal_window) at construction or in "
        "forward"))
