"""The ROCm platform (AMD GPUs)."""

from __future__ import annotations

import logging

import torch

from kvcore.config import AttentionSelectorConfig
from kvcore.platform import Platform
from kvcore.platform_types import DeviceCapability

logger = logging.getLogger(__name__)

_ROCM = "kvcore-rocm (pip install -e plugins/rocm)"
_MLA = "kvcore-mla (pip install -e plugins/mla)"


class RocmPlatform(Platform):
    name = "rocm"
    device_type = "cuda"  # torch exposes HIP devices as "cuda"
    detection_priority = 100
    CAPABILITY_EXAMPLE = "gfx942"  # MI300X
    BACKEND_PROVIDERS = {
        "ROCM_ATTN": _ROCM,
        "ROCM_AITER_UNIFIED_ATTN": _ROCM,
        "ROCM_AITER_FA": _ROCM,
        "TRITON_MLA": _MLA,
    }

    def probe(self) -> str | None:
        if getattr(torch.version, "hip", None) is None:
            return f"this torch build ({torch.__version__}) has no ROCm (HIP) support"
        if not torch.cuda.is_available():
            return "no AMD GPU is visible to torch"
        return None

    def check_device_capability(self, capability: DeviceCapability) -> str | None:
        if capability.arch is not None:
            return None
        return (f"{capability} is an NVIDIA compute capability (platform cuda); ROCm devices "
                "are named by their gfx architecture, e.g. gfx90a, gfx942, gfx950")

    def query_device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        arch = torch.cuda.get_device_properties(device_id).gcnArchName.split(":")[0]
        try:
            return DeviceCapability.parse(arch)
        except ValueError:
            major, minor = torch.cuda.get_device_capability(device_id)
            return DeviceCapability(major, minor, arch)

    def get_backend_priorities(
        self, config: AttentionSelectorConfig, device_capability: DeviceCapability | None
    ) -> list[str]:
        if config.use_mla:
            return ["TRITON_MLA"]
        candidates = ["ROCM_ATTN", "ROCM_AITER_UNIFIED_ATTN", "ROCM_AITER_FA", "TRITON_ATTN"]
        if config.use_kv_connector:
            # ROCM_ATTN keeps the legacy (2, num_blocks, ...) layout that connectors cannot
            # move; leave it out rather than let it be picked and corrupt transfers.
            candidates.remove("ROCM_ATTN")
            logger.info(
                "KV connector in use: ROCM_ATTN left out of the ROCm candidates %s", candidates
            )
        return candidates
