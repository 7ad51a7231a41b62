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
    #: kvcore's CUDA backends timed by ``bench_matrix.py --ranking`` (kvcore tune's format) on
    #: an H100: benchmarks/RESULTS.md, "Model matrix, and the shipped CUDA order".
    SHIPPED_RANKING = ("kvcore.platforms", "cuda_ranking.json")

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
        # The backends CUDA offers, in the order that stands where nothing was measured:
        # FlashInfer's kernels first (its MLA ones need 9.0, else TRITON_MLA), flash-attn
        # next, then kvcore's Triton kernels, FLEX_ATTENTION last (compiled per shape). Where
        # the shipped ranking measured the config's kind, its order replaces this one among
        # the backends it timed (ShippedOrder.reorder).
        if config.use_mla:
            order = (["FLASHINFER_MLA", "TRITON_MLA"] if device_capability is not None
                     and device_capability.major >= 9 else ["TRITON_MLA", "FLASHINFER_MLA"])
        else:
            order = ["FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"]
        shipped = self.shipped_order(config, device_capability)
        return order if shipped is None else shipped.reorder(order)
