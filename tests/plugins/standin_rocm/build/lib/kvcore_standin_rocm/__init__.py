"""Test fixture: stand-in ROCm backends (no kernels; they only exercise selection rules)."""

import kvcore


@kvcore.hookimpl
def kvcore_register_backends(register):
    register("ROCM_ATTN", "kvcore_standin_rocm.backends:StandInRocmAttnBackend")
    register("ROCM_AITER_UNIFIED_ATTN", "kvcore_standin_rocm.backends:StandInAiterUnifiedBackend")
