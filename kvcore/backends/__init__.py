"""The backends that ship with kvcore itself, registered through the same hook and entry
point as any plugin: ``CPU_ATTN`` and ``CPU_MLA`` (pure torch, always there) and
``TRITON_ATTN``; and the compile-check cases of kvcore's Triton kernels
(:mod:`kvcore.testing.compile_cases`)."""

from kvcore.hookspecs import hookimpl


@hookimpl
def kvcore_register_backends(register):
    register("CPU_ATTN", "kvcore.backends.cpu_attn:CpuAttentionBackend")
    register("CPU_MLA", "kvcore.backends.cpu_mla:CpuMLABackend")
    register("TRITON_ATTN", "kvcore.backends.triton_attn:TritonAttentionBackend")
    register("TRITON_ATTN_HND", "kvcore.backends.triton_attn:TritonAttentionHNDBackend")


@hookimpl
def kvcore_register_kernel_compile_cases(register):
    register("kvcore", "kvcore.testing.compile_cases:compile_cases")
