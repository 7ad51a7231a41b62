"""The ``vllm.general_plugins`` entry point: register kvcore's backends with vLLM.

vLLM calls :func:`register` once in every process it starts (the engine core, each worker),
before it selects attention backends. Registering imports no kernel: vLLM resolves the class
path (``kvcore_vllm.backends.KVCORE_<NAME>``) only for the backend it selects.
"""

from __future__ import annotations

import logging
import os

import kvcore

logger = logging.getLogger(__name__)

#: The vLLM name of the backend kvcore's selector picks for (``KVCORE``), and the prefix of
#: the names of the backends bound to one kvcore backend (``KVCORE_TRITON_ATTN``).
SELECTED = "KVCORE"
PREFIX = "KVCORE_"


def vllm_names() -> dict[str, str]:
    """vLLM backend name -> class path, for every backend kvcore's registry knows."""
    names = {SELECTED: f"kvcore_vllm.backends.{SELECTED}"}
    for name in kvcore.backend_registry().names():
        names[PREFIX + name] = f"kvcore_vllm.backends.{PREFIX}{name}"
    return names


def unsupported_vllm(version: str | None = None) -> str | None:
    """Why the installed vLLM (or ``version``) is outside :data:`SUPPORTED_VLLM`, else ``None``.

    vLLM 0.31 and older resolve a backend's name through their fixed enum of names (a plugin
    may only override a member or take ``CUSTOM``), so the ``KVCORE_<NAME>`` names cannot
    exist there; later minors change the backend interface without notice.
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from kvcore_vllm import SUPPORTED_VLLM

    if version is None:
        import vllm

        version = vllm.__version__
    if SpecifierSet(SUPPORTED_VLLM).contains(Version(version), prereleases=True):
        return None
    return (f"kvcore-vllm supports vLLM {SUPPORTED_VLLM} but vLLM {version} is installed; it "
            "registers no backend, so vLLM runs its own (install a vLLM in that range, or "
            "pip uninstall kvcore-vllm)")


def register() -> None:
    """Register kvcore's backends with vLLM (idempotent: vLLM may call it more than once).

    On a CPU, vLLM's platform returns ``CPU_ATTN`` whatever ``--attention-backend`` says, so
    ``CPU_ATTN`` is pointed at ``KVCORE`` unless ``KVCORE_VLLM_CPU=0``.
    """
    unsupported = unsupported_vllm()
    if unsupported:
        logger.error("%s", unsupported)
        return
    from kvcore_vllm.vllm_private import backend_enum, cpu_platform_is_current, register_backend

    enum = backend_enum()
    for name, path in vllm_names().items():
        if name not in enum.__members__:
            register_backend(name, path)
    if cpu_platform_is_current() and os.environ.get("KVCORE_VLLM_CPU", "1") != "0":
        register_backend(enum.CPU_ATTN, f"kvcore_vllm.backends.{SELECTED}")
        logger.info("kvcore-vllm: CPU_ATTN runs through kvcore's selector "
                    "(KVCORE_VLLM_CPU=0 keeps vLLM's own)")
