"""The CUDA platform (NVIDIA GPUs)."""

from __future__ import annotations

import torch

from kvcore.config import AttentionSelectorConfig
from kvcore.platform import Platform
from kvcore.platform_types import DeviceCapability

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

    def query_device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        major, minor = torch.cuda.get_device_capability(device_id)
        return DeviceCapability(major, minor)

    def get_backend_priorities(
        self, config: AttentionSelectorConfig, device_capability: DeviceCapability | None
    ) -> list[str]:
        if config.use_mla:
            # FlashInfer's MLA kernels (fa3) lead on Hopper and later; before it, TRITON_MLA.
            if device_capability is not None and device_capability.major >= 9:
                return ["FLASHINFER_MLA", "TRITON_MLA"]
            return ["TRITON_MLA", "FLASHINFER_MLA"]
        # On Blackwell (10.x) FlashInfer's kernels are the tuned ones; before it, flash-attn.
        if device_capability is not None and device_capability.major >= 10:
            return ["FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"]
        return ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"]
