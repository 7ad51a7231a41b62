"""kvcore's built-in platforms (``cpu``, ``cuda``, ``rocm``), registered through the same
``kvcore_register_platforms`` hook and entry point a third-party platform would use."""

from kvcore.hookspecs import hookimpl


@hookimpl
def kvcore_register_platforms(register):
    register("cpu", "kvcore.platforms.cpu:CpuPlatform")
    register("cuda", "kvcore.platforms.cuda:CudaPlatform")
    register("rocm", "kvcore.platforms.rocm:RocmPlatform")
