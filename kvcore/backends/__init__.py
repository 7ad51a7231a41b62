"""The backends that ship with kvcore itself, registered through the same hook and entry
point as any plugin: ``CPU_ATTN`` and ``CPU_MLA`` (pure torch, always there) and
``TRITON_ATTN``; and the compile-check cases of kvcore's Triton kernels
(:mod:`kvcore.testing.compile_cases`)."""

from kvcore.hookspecs import hookimpl


@hookimpl
def kvcore_register_backends(register):
    # platforms= repeats each class's PLATFORMS: selection elsewhere imports nothing.
    register("CPU_ATTN", "kvcore.backends.cpu_attn:CpuAttentionBackend", platforms=("cpu",))
    register("CPU_MLA", "kvcore.backends.cpu_mla:CpuMLABackend", platforms=("cpu",))
    register("TRITON_ATTN", "kvcore.backends.triton_attn:TritonAttentionBackend",
             platforms=("cuda", "rocm"))
    register("TRITON_ATTN_HND", "kvcore.backends.triton_attn:TritonAttentionHNDBackend",
             platforms=("cuda", "rocm"))


@hookimpl
def kvcore_register_kernel_compile_cases(register):
    register("kvcore", "kvcore.testing.compile_cases:compile_cases")
