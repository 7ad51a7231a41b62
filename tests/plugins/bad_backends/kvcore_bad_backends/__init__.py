"""Test fixture: backends whose faults must stay their own (registration hooks only here)."""

import kvcore

_HERE = "kvcore_bad_backends"


@kvcore.hookimpl
def kvcore_register_backends(register):
    # PLATFORMS = None in the class: every selection used to raise TypeError.
    register("NO_PLATFORMS", f"{_HERE}.no_platforms:NoPlatformsBackend")
    # Registered for cuda: a selection on another platform must not import it.
    register("EXIT_ON_CUDA", f"{_HERE}.exit_on_cuda:ExitBackend", platforms=("cuda",))
    # No platforms registered: imported to read them; its sys.exit() is its load error.
    register("EXIT_ANYWHERE", f"{_HERE}.exit_anywhere:ExitBackend")
    # A CPU backend whose import probe raises.
    register("RAISING_PROBE", f"{_HERE}.raising_probe:RaisingProbeBackend", platforms=("cpu",))
    # Registered for cpu, but the class says cuda.
    register("PLATFORMS_DISAGREE", f"{_HERE}.raising_probe:DisagreeingBackend",
             platforms=("cpu",))
