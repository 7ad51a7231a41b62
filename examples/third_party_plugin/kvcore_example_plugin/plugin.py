"""Entry point of kvcore-example-plugin (group ``kvcore.plugins``): registration hooks only.

Registration is lazy: the ``"module:Class"`` paths are imported only when kvcore selects,
lists or resolves the backend or connector, so installing this plugin costs nothing until then.
"""

from __future__ import annotations

from collections.abc import Callable

import kvcore

_BACKENDS = "kvcore_example_plugin.backends"
_CONNECTORS = "kvcore_example_plugin.connectors"


@kvcore.hookimpl
def kvcore_register_backends(register: Callable[..., None]) -> None:
    # platforms= repeats the class's PLATFORMS, so that selection on another platform never
    # imports the module.
    register("SDPA_GATHER", f"{_BACKENDS}.sdpa_gather:SdpaGatherBackend",
             platforms=("cpu", "cuda", "rocm"))


@kvcore.hookimpl
def kvcore_register_connectors(register: Callable[[str, str], None]) -> None:
    register("example_memory", f"{_CONNECTORS}.in_memory:InMemoryConnector")
