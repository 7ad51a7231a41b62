"""What must hold on whatever platform this process runs on, real or simulated.

``.ci/matrix`` runs every ``platform_matrix`` test once per simulated platform (``cpu``;
``cuda`` at 8.0, 9.0 and 10.0; ``rocm`` at gfx942) through ``KVCORE_PLATFORM`` and
``KVCORE_DEVICE_CAPABILITY``; these tests read those variables rather than setting them, so
the same assertions check selection, validation and layouts on each leg.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest
import torch

import kvcore
from kvcore import AttentionSelectorConfig as Config
from kvcore.testing.checks import check_cross_layer_claim, check_shape, check_stride_order

pytestmark = pytest.mark.platform_matrix

CONFIGS = {
    "bf16-D128": Config(head_size=128),
    "fp16-D64-kv-connector": Config(head_size=64, dtype=torch.float16, use_kv_connector=True),
    "bf16-D128-fp8-cache": Config(head_size=128, kv_cache_dtype="fp8"),
    "fp32-D80-bs32": Config(head_size=80, dtype=torch.float32, block_size=32),
    "mla-D576": Config(head_size=576, use_mla=True),
}


@pytest.fixture
def platform() -> Iterator[kvcore.Platform]:
    """The current platform as the environment defines it, with no state from other tests."""
    kvcore.clear_platform_cache()
    kvcore.clear_selection_cache()
    yield kvcore.current_platform()
    kvcore.clear_platform_cache()
    kvcore.clear_selection_cache()


def test_current_platform_is_the_one_the_environment_names(platform):
    forced = os.environ.get("KVCORE_PLATFORM")
    if forced:
        assert platform.name == forced
    else:
        assert platform.probe() is None  # detected, hence present
    capability = os.environ.get("KVCORE_DEVICE_CAPABILITY")
    if capability:
        assert platform.get_device_capability() == kvcore.DeviceCapability.parse(capability)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_selection_takes_the_first_valid_candidate_and_explains_the_rest(platform, config):
    report = kvcore.explain_selection(config)
    assert report.platform == platform.name
    for candidate in report.candidates:
        assert candidate.valid or all(r.strip() for r in candidate.reasons), candidate
    valid = [c for c in report.candidates if c.valid]
    if not valid:
        with pytest.raises(kvcore.NoValidBackendError) as err:
            kvcore.get_attn_backend(config)
        for candidate in report.candidates:
            assert all(reason in str(err.value) for reason in candidate.reasons)
        return
    assert report.selected is valid[0]
    chosen = kvcore.get_attn_backend(config)
    assert chosen.get_name() == valid[0].name
    assert platform.name in chosen.PLATFORMS
    if config.use_kv_connector:
        assert chosen.supports_kv_connector()


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_selector_reasons_include_every_validation_reason(platform, config):
    """For backends of this platform; one registered for others is refused by its
    registration alone (its module is not imported), with that one reason."""
    capability = platform.get_device_capability()
    report = kvcore.explain_selection(config)
    for candidate in report.candidates:
        if candidate.name not in kvcore.backend_registry():
            continue
        if platform.name not in kvcore.backend_platforms(candidate.name):
            assert candidate.reasons == [f"platform={platform.name} (supported: "
                                         f"{', '.join(kvcore.backend_platforms(candidate.name))})"]
            continue
        try:
            backend = kvcore.resolve_backend(candidate.name)
        except kvcore.ResolveError:
            continue
        own = backend.validate_configuration(**{**config.as_kwargs(),
                                                "device_capability": capability})
        # The selector spells "how to simulate such a device" for the platform at hand.
        assert {_unsimulated(r) for r in own} <= {_unsimulated(r) for r in candidate.reasons}, \
            candidate.name


def _unsimulated(reason: str) -> str:
    """``reason`` without its "(set ... to simulate such a device)" hint."""
    return re.sub(r" \(set [^()]* to simulate such a device\)$", "", reason)


def test_layout_contract_of_every_backend_valid_here(platform):
    """The contract checks of the conformance suite, on each backend this platform can pick."""
    capability = platform.get_device_capability()
    checked = []
    for name in kvcore.backend_registry().names():
        try:
            backend = kvcore.resolve_backend(name)
        except kvcore.ResolveError:
            continue
        if platform.name not in backend.PLATFORMS:
            continue
        config = next((c for c in CONFIGS.values() if not backend.validate_configuration(
            **c.as_kwargs(), device_capability=capability)), None)
        if config is None:
            continue
        check_shape(backend, config.block_size, config.head_size)
        check_stride_order(backend)
        check_cross_layer_claim(backend)
        caches = kvcore.allocate_kv_caches(
            backend, num_layers=2, num_blocks=3, block_size=config.block_size, num_kv_heads=1,
            head_size=config.head_size, dtype=config.dtype, device="meta")
        assert caches.layout.is_blocks_first or not backend.supports_kv_connector()
        checked.append(name)
    if platform.name == "cpu":
        assert "CPU_ATTN" in checked
