"""Build and load kvcore-nvidia's CUDA C++ extension when first asked for, never at import.

The sources live in the repository's top-level ``csrc/nvidia/``; ``kvcore_nvidia/csrc`` is a
symlink to it, so an editable install reads them in place, and a built wheel holds real copies
(setuptools copies the package data through the link). The build runs
``torch.utils.cpp_extension.load`` (ninja + nvcc) for the architectures of the visible GPUs and
is cached: the build directory is keyed by a hash of the sources, the torch version and its
CUDA version, so a later process only loads the compiled library. ``KVCORE_NVIDIA_BUILD_DIR``
moves the cache (default ``~/.cache/kvcore_nvidia``).

A failed build is remembered (in the process, and as a ``FAILED`` file in the build directory,
so the next process does not spend minutes on nvcc again): :func:`status` reports it, and
deleting the directory retries.

Builds of several processes are serialised by an OS file lock (``flock``), which the kernel
releases when its holder dies. torch's own lock file (``lock`` in the build directory) is not:
a build killed mid-way (a time limit, Ctrl-C) leaves it behind, and every later
``cpp_extension.load`` waits on it forever. Holding the OS lock, a leftover torch lock can only
be stale, so it is removed before building.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

import kvcore

logger = logging.getLogger(__name__)

EXTENSION_NAME = "kvcore_nvidia_C"
#: The sources: a symlink to the repository's ``csrc/nvidia`` in a checkout, real files in a
#: wheel.
CSRC = Path(__file__).parent.parent / "csrc"
SOURCES = ("bindings.cpp", "cache_kernels.cu", "copy_blocks.cu")
HEADERS = ("kvcore_nvidia.h",)
_FAILED = "FAILED"
#: torch.utils.cpp_extension's lock file in the build directory (its ``FileBaton``).
_TORCH_BATON = "lock"
_lock = threading.Lock()


@contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Hold an OS file lock on ``directory`` (released by the kernel if this process dies) and
    remove torch's lock file left by a build that was killed: with the OS lock held, no other
    kvcore process is building there."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock file is all there is
        yield
        return
    with open(directory / ".kvcore_build_lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            baton = directory / _TORCH_BATON
            if baton.exists():
                logger.warning("kvcore-nvidia: removing %s, left by a build that did not "
                               "finish", baton)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cuda_home() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME


def missing_sources() -> list[str]:
    """Source files that are not readable where the build looks for them."""
    return [name for name in (*SOURCES, *HEADERS) if not (CSRC / name).is_file()]


def unavailable_reason() -> str | None:
    """Why the CUDA C++ kernels cannot be built and run here (``None``: they can)."""
    if torch.version.cuda is None:
        return (f"this torch build ({torch.__version__}) has no CUDA support; kvcore-nvidia's "
                "CUDA C++ kernels need a CUDA build of torch and an NVIDIA GPU")
    if not torch.cuda.is_available():
        return "no NVIDIA GPU is visible (torch.cuda.is_available() is False)"
    missing = missing_sources()
    if missing:
        return (f"the CUDA C++ sources {', '.join(missing)} are missing from {CSRC}; reinstall "
                "kvcore-nvidia (pip install -e plugins/nvidia from a full checkout)")
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
    for name in (*SOURCES, *HEADERS):
        path = CSRC / name
        digest.update(path.read_bytes() if path.is_file() else b"")
    digest.update(f"{torch.__version__}|{torch.version.cuda}".encode())
    root = Path(os.environ.get("KVCORE_NVIDIA_BUILD_DIR",
                               Path.home() / ".cache" / "kvcore_nvidia"))
    return root / f"{EXTENSION_NAME}-{digest.hexdigest()[:16]}"


def _library(directory: Path) -> Path | None:
    return next(iter(sorted(directory.glob(f"{EXTENSION_NAME}*.so"))), None)


def _recorded_failure(directory: Path) -> str | None:
    marker = directory / _FAILED
    if not marker.is_file():
        return None
    return (f"the build failed in an earlier run ({marker.read_text().strip()}); delete "
            f"{directory} to retry")


def status() -> str:
    """One line for ``kvcore plugins`` / ``kvcore collect-env``, without building anything:
    ``loaded (path)``, ``built (path)``, ``not built yet: ...`` or ``unavailable: reason``
    (a failed build included)."""
    if load_or_reason.cache_info().currsize:  # this process already tried
        module, reason = load_or_reason()
        return f"loaded ({module.__file__})" if module else f"unavailable: {reason}"
    reason = unavailable_reason() or _recorded_failure(build_directory())
    if reason is not None:
        return f"unavailable: {reason}"
    library = _library(build_directory())
    if library is not None:
        return f"built ({library})"
    return ("not built yet: compiled on first use (about a minute of nvcc), or now with "
            "kvcore_nvidia.ops.build_extension()")


@functools.cache
def load_or_reason() -> tuple[ModuleType | None, str | None]:
    """``(extension, None)``, building it on the first call of the process unless cached on
    disk, or ``(None, reason)`` when it cannot be built here or the build failed; never raises.
    """
    reason = unavailable_reason()
    if reason is not None:
        return None, reason
    directory = build_directory()
    failure = _recorded_failure(directory)
    if failure is not None:
        return None, failure
    from torch.utils.cpp_extension import load as cpp_load

    directory.mkdir(parents=True, exist_ok=True)
    with _lock, _build_lock(directory):
        # A build in progress announces itself; loading a built library is quick and silent.
        step = kvcore.long_step("kvcore-nvidia: compiling the CUDA C++ extension (nvcc: cache "
                                "writes, block copies)", estimate="about a minute",
                                cache=directory, after_s=0 if _library(directory) is None else 1)
        try:
            # No fast math: the fp8 path rounds its multiply exactly as the reference does.
            with step:
                    module = cpp_load(
                    name=EXTENSION_NAME,
                    sources=[str(CSRC / name) for name in SOURCES],
                    extra_cflags=["-O3"],
                    extra_cuda_cflags=["-O3"],
                    build_directory=str(directory),
                    verbose=os.environ.get("KVCORE_NVIDIA_BUILD_VERBOSE") == "1",
                )
        except Exception as exc:  # nvcc/ninja/loader errors: a reason, never a crash
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            message = f"{type(exc).__name__}: {first}"
            (directory / _FAILED).write_text(message + "\n")
            logger.warning("kvcore-nvidia: building the CUDA C++ extension failed (%s); "
                           "KVCORE_NVIDIA_BUILD_VERBOSE=1 shows the compiler output", message)
            return None, f"the build failed ({message}); delete {directory} to retry"
    return module, None


def load() -> ModuleType:
    """The compiled extension (see :func:`load_or_reason`).

    Raises:
        RuntimeError: the kernels cannot be built here or the build failed; the message gives
            the reason.
    """
    module, reason = load_or_reason()
    if module is None:
        raise RuntimeError(f"kvcore-nvidia CUDA C++ kernels are unavailable: {reason}")
    return module
