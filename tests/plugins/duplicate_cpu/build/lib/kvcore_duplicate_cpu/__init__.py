"""Test fixture: a plugin that registers a name the core already uses."""

import kvcore


@kvcore.hookimpl
def kvcore_register_backends(register):
    register("CPU_ATTN", "kvcore.backends.cpu_attn:CpuAttentionBackend")
