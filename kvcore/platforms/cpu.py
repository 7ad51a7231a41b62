"""The CPU platform: always present, the embedded default (CPU_ATTN; CPU_MLA for MLA)."""

from __future__ import annotations

from kvcore.config import AttentionSelectorConfig
from kvcore.platform import Platform
from kvcore.platform_types import DeviceCapability


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    detection_priority = 0  # the fallback when no accelerator is found

    def probe(self) -> str | None:
        return None

    def check_device_capability(self, capability: DeviceCapability) -> str | None:
        return (f"a CPU has no device capability ({capability} is a GPU's: cuda takes 9.0 "
                "style, rocm gfx942 style)")

    def get_backend_priorities(
        self, config: AttentionSelectorConfig, device_capability: DeviceCapability | None
    ) -> list[str]:
        return ["CPU_MLA"] if config.use_mla else ["CPU_ATTN"]
