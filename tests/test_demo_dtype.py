"""``kvcore demo``'s dtype on a platform whose backends differ in dtypes: with no ``--dtype``
it picks one the selected backend supports; a forced backend given a dtype it does not support
gets a first line naming ``--dtype`` and the values that work. Checked on a simulated CUDA
device (selection only: the demo itself needs the device)."""

from __future__ import annotations

import pytest

import kvcore
from kvcore.demo.config import MODEL_PRESETS
from kvcore.demo.scenario import DemoOptions, choose_dtype, demo_selector_config


@pytest.fixture
def cuda(fresh_kvcore, monkeypatch):
    monkeypatch.setenv("KVCORE_PLATFORM", "cuda")
    monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", "9.0")
    fresh_kvcore.clear_platform_cache()
    return fresh_kvcore.current_platform()


@pytest.mark.parametrize("model", list(MODEL_PRESETS))
def test_without_dtype_the_demo_picks_one_the_selected_cuda_backend_supports(cuda, model):
    choice = choose_dtype(DemoOptions(model=model), cuda)
    backend = kvcore.get_attn_backend(demo_selector_config(model, choice.dtype, 16), None, cuda)
    assert kvcore.parse_dtype(choice.dtype) in backend.SUPPORTED_DTYPES
    assert choice.picked and choice.note.startswith(f"{choice.dtype} (no --dtype given")
    # The float64 reference's exact float32 where a backend runs it, else a 16-bit dtype.
    assert choice.dtype == ("bfloat16" if MODEL_PRESETS[model].is_mla else "float32")


def _cuda_backends() -> list[str]:
    registry = kvcore.backend_registry()
    return [name for name in registry.names()
            if "cuda" in kvcore.resolve_backend(name).PLATFORMS]


@pytest.mark.parametrize("backend", _cuda_backends())
def test_a_forced_backend_gets_a_dtype_it_declares(cuda, backend):
    cls = kvcore.resolve_backend(backend)
    model = "mla-small" if cls.IS_MLA else "small"
    choice = choose_dtype(DemoOptions(model=model, backend=backend), cuda)
    assert kvcore.parse_dtype(choice.dtype) in cls.SUPPORTED_DTYPES
    config = demo_selector_config(model, choice.dtype, 16)
    report = kvcore.explain_selection(config, cuda, backend)
    reasons = next(c.reasons for c in report.candidates if c.name == backend)
    assert not any(r.startswith("dtype=") for r in reasons), reasons


@pytest.mark.parametrize(("model", "backend", "first_line"), [
    ("small", "FLASHINFER", "--dtype float32: FLASHINFER supports bfloat16, float16; pass "
                            "--dtype bfloat16 (or leave out --dtype and the demo picks one)"),
    ("mla-small", "TRITON_MLA", "--dtype float32: TRITON_MLA supports bfloat16, float16; pass "
                                "--dtype bfloat16 (or leave out --dtype and the demo picks one)"),
    ("mla-small", None, "--dtype float32: no backend on cuda runs this model in float32; it "
                        "runs in bfloat16, float16; pass --dtype bfloat16 (or leave out --dtype "
                        "and the demo picks one)"),
])
def test_a_dtype_the_backend_cannot_run_names_dtype_before_the_full_report(cuda, model, backend,
                                                                           first_line):
    with pytest.raises(ValueError) as info:
        choose_dtype(DemoOptions(model=model, backend=backend, dtype="float32"), cuda)
    first, *report = str(info.value).splitlines()
    assert first == first_line
    assert "dtype=float32 (supported: float16, bfloat16)" in "\n".join(report)


def test_a_dtype_given_and_supported_is_kept(cuda):
    choice = choose_dtype(DemoOptions(model="small", dtype="bf16"), cuda)
    assert (choice.dtype, choice.picked, choice.note) == ("bfloat16", False, "bfloat16 (--dtype)")


def test_a_16_bit_near_tie_scales_with_the_dtypes_epsilon_and_the_models_depth():
    """bf16 rounding error grows with depth (measured: 2.6 eps sqrt(layers) std per logit), so
    a gap of 0.15 std is rounding in a 16-layer bf16 model, a real mismatch in a 4-layer one
    and in fp16 (eps 8x smaller)."""
    import torch

    from kvcore.demo.engine import Request
    from kvcore.demo.scenario import check_against_reference, tie_tolerance

    z = torch.randn(1, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    best = int(z[0].argmax())
    other = (best + 1) % 512
    z[0, other] = z[0, best] - 0.15 * z[0].std()
    req = Request("r", [1, 2], max_new_tokens=1)
    req.output = [other]
    assert tie_tolerance(torch.bfloat16, 4) == pytest.approx(0.1)

    def ties(dtype: torch.dtype, layers: int) -> int:
        check = check_against_reference([req], [z], dtype, num_layers=layers)
        assert check.ties + len(check.problems) == 1
        return check.ties

    assert ties(torch.bfloat16, 16) == 1
    assert ties(torch.bfloat16, 4) == 0 and ties(torch.float16, 16) == 0
