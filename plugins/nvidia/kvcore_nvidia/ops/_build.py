"""Build and load kvcore-nvidia's CUDA C++ extension (``kvcore_nvidia/csrc``) on first use.

The sources ship inside the package, so an installed wheel builds them too. The build runs
``torch.utils.cpp_extension.load`` (ninja + nvcc) for the architectures of the visible GPUs
and is cached: the build directory is keyed by a hash of the sources, the torch version and
its CUDA version, so a second process (or a second run on the same machine) only loads the
compiled library. ``KVCORE_NVIDIA_BUILD_DIR`` moves the cache (default
``~/.cache/kvcore_nvidia``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

EXTENSION_NAME = "kvcore_nvidia_C"
# The sources stay at the package root (kvcore_nvidia/csrc), shipped as package data.
CSRC = Path(__file__).parent.parent / "csrc"
SOURCES = ("bindings.cpp", "cache_kernels.cu", "copy_blocks.cu")
_HEADERS = ("kvcore_nvidia.h",)


def _cuda_home() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME


def unavailable_reason() -> str | None:
    """Why the CUDA C++ kernels cannot be built and run here (``None``: they can)."""
    if torch.version.cuda is None:
        return (f"this torch build ({torch.__version__}) has no CUDA support; kvcore-nvidia's "
                "CUDA C++ kernels need a CUDA build of torch and an NVIDIA GPU")
    if not torch.cuda.is_available():
        return "no NVIDIA GPU is visible (torch.cuda.is_available() is False)"
    home = _cuda_home()
    if home is None or not (Path(home) / "bin" / "nvcc").exists():
        return ("nvcc not found: the CUDA C++ kernels are compiled on first use; install the "
                f"CUDA toolkit matching torch's CUDA {torch.version.cuda} and set CUDA_HOME")
    if shutil.which("ninja") is None:
        return "ninja not found: torch.utils.cpp_extension builds with it (pip install ninja)"
    return None


def build_directory() -> Path:
    """Where the extension is (or will be) built: one directory per sources/torch/CUDA."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *_HEADERS):
        digest.update((CSRC / name).read_bytes())
    digest.update(f"{torch.__version__}|{torch.version.cuda}".encode())
    root = Path(os.environ.get("KVCORE_NVIDIA_BUILD_DIR",
                               Path.home() / ".cache" / "kvcore_nvidia"))
    return root / f"{EXTENSION_NAME}-{digest.hexdigest()[:16]}"


@functools.cache
def load() -> ModuleType:
    """The compiled extension, built on the first call of the process if not cached on disk.

    Raises:
        RuntimeError: the kernels cannot be built here; the message gives the reason.
    """
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"kvcore-nvidia CUDA C++ kernels are unavailable: {reason}")
    from torch.utils.cpp_extension import load as cpp_load

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    # No fast math: the fp8 path divides by the scale exactly as the reference does.
    return cpp_load(
        name=EXTENSION_NAME,
        sources=[str(CSRC / name) for name in SOURCES],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3"],
        build_directory=str(directory),
        verbose=os.environ.get("KVCORE_NVIDIA_BUILD_VERBOSE") == "1",
    )
