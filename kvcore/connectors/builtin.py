"""The connectors that ship with kvcore, registered through the same hook and entry point as
any plugin's: ``mooncake``, ``nixl``, ``offload``, ``p2p`` and ``storage``. Registration is
lazy: nothing here imports a connector module."""

from kvcore.hookspecs import RegisterFn, hookimpl


@hookimpl
def kvcore_register_connectors(register: RegisterFn) -> None:
    register("mooncake", "kvcore.connectors.mooncake:MooncakeConnector")
    register("nixl", "kvcore.connectors.nixl:NixlConnector")
    register("offload", "kvcore.connectors.offload:OffloadConnector")
    register("p2p", "kvcore.connectors.p2p:P2PConnector")
    register("storage", "kvcore.connectors.storage:StorageConnector")
