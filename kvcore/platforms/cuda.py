"""The CUDA platform (NVIDIA GPUs)."""

from __future__ import annotations

import torch

from kvcore.config import AttentionSelectorConfig
from kvcore.platform import Platform
from kvcore.platform_types import DeviceCapability, PhaseRanking

_NVIDIA = "kvcore-nvidia (pip install -e plugins/nvidia)"
_MLA = "kvcore-mla (pip install -e plugins/mla)"


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    detection_priority = 100
    CAPABILITY_EXAMPLE = "9.0"  # H100, H200
    BACKEND_PROVIDERS = {
        "FLASH_ATTN": _NVIDIA,
        "FLASHINFER": _NVIDIA,
        "FLEX_ATTENTION": _NVIDIA,
        "FLASHINFER_MLA": _NVIDIA,
        "TRITON_MLA": _MLA,
    }

    def probe(self) -> str | None:
        if torch.version.cuda is None:
            return f"this torch build ({torch.__version__}) has no CUDA support"
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False (no NVIDIA GPU or driver visible)"
        return None

    def check_device_capability(self, capability: DeviceCapability) -> str | None:
        if capability.arch is None:
            return None
        return (f"{capability.arch} is an AMD GPU architecture (platform rocm); a CUDA device "
                "capability is spelled 9.0, 90 or sm_90")

    def query_device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        major, minor = torch.cuda.get_device_capability(device_id)
        return DeviceCapability(major, minor)

    def get_backend_priorities(
        self, config: AttentionSelectorConfig, device_capability: DeviceCapability | None
    ) -> list[str]:
        # A shipped ranking's order leads where it measured (Platform.SHIPPED_RANKING); the
        # rest follows in this order.
        if config.use_mla:
            # FlashInfer's MLA kernels (fa3) lead on Hopper and later; before it, TRITON_MLA.
            if device_capability is not None and device_capability.major >= 9:
                order = ["FLASHINFER_MLA", "TRITON_MLA"]
            else:
                order = ["TRITON_MLA", "FLASHINFER_MLA"]
        else:
            # Ordered by the H200 (9.0) measurements of _MEASURED_PHASES (the timings are in
            # benchmarks/RESULTS.md): FLASHINFER is fastest or tied in both phases; FLASH_ATTN
            # prefills as fast but decodes slower (flash-attn-4 has no split-KV on 9.0);
            # TRITON_ATTN decodes as fast as FLASHINFER but prefills about 1.8x slower.
            # Unmeasured on 8.x and 10.x, where the same order stands (on 8.x FLASH_ATTN's
            # flash-attn 2 needs 256-token blocks).
            order = ["FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"]
        shipped = self.shipped_order(config, device_capability)
        if shipped is None:
            return order
        return [*shipped.order, *(b for b in order if b not in shipped.order)]

    def phase_rankings(
        self, config: AttentionSelectorConfig, device_capability: DeviceCapability | None
    ) -> tuple[PhaseRanking, ...]:
        shipped = self.shipped_order(config, device_capability)
        if shipped is not None:
            return shipped.phases
        if config.use_mla or device_capability is None or device_capability.major != 9:
            return ()
        return _MEASURED_PHASES


#: The priority list's measurements, per phase (backends within ~5% share a group):
#: decode at 16x4096, 64x4096, 8x32768 and 256x1024 requests x tokens; prefill of 4x2048,
#: 1x8192 and 4x512 new tokens over a 16k prefix.
_MEASURED = "an H200 (9.0), bf16, 32 query / 8 KV heads, head size 128, block 16"
_MEASURED_PHASES = (
    PhaseRanking("decode", (("TRITON_ATTN", "FLASHINFER"), ("FLASH_ATTN",)), _MEASURED),
    PhaseRanking("prefill", (("FLASHINFER", "FLASH_ATTN"), ("TRITON_ATTN",)), _MEASURED),
)
