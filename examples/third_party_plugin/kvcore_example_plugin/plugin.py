"""The module the ``kvcore.plugins`` entry point names: registration hooks only.

Registration is lazy: the ``"module:Class"`` paths are imported only when kvcore selects,
lists or resolves the backend or connector, so installing this plugin costs nothing until then.
"""

import kvcore


@kvcore.hookimpl
def kvcore_register_backends(register):
    register("SDPA_GATHER", "kvcore_example_plugin.backend:SdpaGatherBackend")


@kvcore.hookimpl
def kvcore_register_connectors(register):
    register("example_memory", "kvcore_example_plugin.connector:InMemoryConnector")
