"""``mooncake``: KV blocks read straight from another engine's cache through Mooncake's
transfer engine.

The same connector as ``nixl`` (:mod:`kvcore.connectors.pull` has the protocol: producer and
consumer roles, leases, the layout handshake, bounded waits), on the transfer library SGLang
and vLLM's MooncakeConnector use. Each side creates a ``mooncake.engine.TransferEngine`` in
P2P handshake mode (no metadata server: the producer's hello names its engine,
``host:rpc_port``, and Mooncake's own handshake does the rest) and registers its cache's
storage once. A load READs a run of blocks with one asynchronous batch per region
descriptor (one per block run for a cross-layer cache, one per layer for a per-layer one)
and confirms each run read whole with ``done`` on the side channel, which releases the
producer's blocks.

Transports (``protocol``): ``tcp`` (any machine; the ``mooncake-transfer-engine-non-cuda``
wheel, CPU memory) and ``rdma`` (RDMA NICs, ``device_name`` picks them); the CUDA builds add
GPU memory and ``nvlink``. Mooncake cannot cancel a READ: one still in flight at the deadline
fails its blocks (named so) and is reaped once the engine ends it (its TCP transport gives up
after ``MC_TCP_PROGRESS_TIMEOUT_SEC``, 30 s by default, without progress).
"""

from __future__ import annotations

import importlib
import logging
import socket
import threading
import time
from typing import Any

import torch

from kvcore.connectors.base import RegisteredCaches
from kvcore.connectors.convert import TPRank
from kvcore.connectors.pull import DEFAULT_STAGING_BYTES, PullConnector
from kvcore.connectors.pull_engine import Regions, Run

__all__ = ["MOONCAKE_PROTOCOLS", "MooncakeConnector", "mooncake_unavailable_reason"]

logger = logging.getLogger(__name__)

#: The transports ``protocol`` may name (Mooncake's own ``initialize`` accepts any string and
#: fails only at the first transfer). Which ones a wheel has depends on its build.
MOONCAKE_PROTOCOLS = ("tcp", "rdma", "nvlink", "efa", "barex", "ascend", "cxl", "nvmeof")

#: The module of Mooncake's transfer engine (every wheel installs it under this name).
_MOONCAKE_MODULE = "mooncake.engine"

_WILDCARDS = ("0.0.0.0", "::", "")


def _mooncake_engine() -> Any:
    """Mooncake's ``engine`` module (with ``TransferEngine``)."""
    try:
        module = importlib.import_module(_MOONCAKE_MODULE)
    except Exception as exc:  # an ImportError, or a broken install raising anything
        raise ImportError(f"{_MOONCAKE_MODULE}: {type(exc).__name__}: {exc}") from exc
    if not hasattr(module, "TransferEngine"):
        raise ImportError(f"{_MOONCAKE_MODULE}: has no TransferEngine")
    return module


def mooncake_unavailable_reason() -> str | None:
    """Why the ``mooncake`` connector cannot run here, or ``None`` when it can."""
    try:
        _mooncake_engine()
    except ImportError as exc:
        reason = (f"Mooncake's transfer engine is not importable ({exc}); install it with pip "
                  "install 'kvcore[mooncake]' (the mooncake-transfer-engine-non-cuda wheel: "
                  "CPU memory over TCP; for GPU memory pip install mooncake-transfer-engine, "
                  "or mooncake-transfer-engine-cuda13 on CUDA 13)")
        if "libibverbs" in str(exc):
            reason += ("; every wheel links the system's libibverbs.so.1: install it "
                       "(Debian/Ubuntu: apt-get install libibverbs1; RHEL/Fedora: dnf "
                       "install libibverbs)")
        return reason
    return None


def _route_address(host: str, port: int) -> str:
    """The local address this machine reaches ``host`` from (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


class _Engine:
    """One Mooncake ``TransferEngine`` with the cache's storage registered (a
    :class:`kvcore.connectors.pull.Engine`). Its calls go through one lock."""

    def __init__(self, name: str, storage: torch.Tensor, hostname: str, protocol: str,
                 device_name: str, reap_s: float) -> None:
        module = _mooncake_engine()
        self.name = name
        self.lock = threading.Lock()
        self.reap_s = reap_s
        if storage.is_cuda and not getattr(module, "SUPPORT_CUDA", False):
            raise ValueError(f"the KV cache is on {storage.device}, but this build of "
                             "Mooncake's transfer engine has no CUDA support (the non-cuda "
                             "wheel): pip install mooncake-transfer-engine (CUDA 12) or "
                             "mooncake-transfer-engine-cuda13 instead")
        self.engine = module.TransferEngine()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise RuntimeError(f"Mooncake's transfer engine did not start (initialize returned "
                               f"{rc}) on {hostname} with protocol={protocol!r}, "
                               f"device_name={device_name!r}; its log on stderr says why")
        self.session = f"{hostname}:{self.engine.get_rpc_port()}"
        self.addr = storage.data_ptr()
        nbytes = storage.numel() * storage.element_size()
        rc = self.engine.register_memory(self.addr, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake could not register the KV cache ({nbytes} bytes on "
                               f"{storage.device}) with protocol={protocol!r}: register_memory "
                               f"returned {rc}")
        self._storage = storage  # the registered memory stays alive while the engine is
        self.orphans: list[int] = []  # batches of READs given up on, still in flight
        self._staged: list[torch.Tensor] = []  # a converting consumer's staging buffers

    # -- producer -------------------------------------------------------------------------

    def hello(self) -> dict[str, Any]:
        return {"engine": self.session}

    def notifications(self) -> list[tuple[str, bytes]]:
        return []  # READs are confirmed on the side channel

    # -- consumer -------------------------------------------------------------------------

    def connect(self, reply: dict[str, Any]) -> str:
        session = reply.get("engine")
        if not isinstance(session, str) or ":" not in session:
            raise ConnectionError(f"mooncake consumer: the producer named its transfer engine "
                                  f"{session!r}, not host:port")
        # Reach it now: the first READ would otherwise pay for the handshake, and an engine
        # this side cannot reach is a clear error here rather than failed loads later.
        with self.lock:
            rc = self.engine.send_probe(session)
        if rc != 0:
            raise ConnectionError(f"mooncake consumer: the producer's transfer engine at "
                                  f"{session} did not answer a probe (returned {rc}): check "
                                  "that this machine reaches that address and port")
        return session

    def forget(self, remote: Any) -> None:
        pass  # the Python API keeps a producer's segment until the engine goes (close)

    def start_read(self, run: Run, lease: str | None, local: Regions, remote_regions: Regions,
                   remote: str) -> None:
        n = run.end - run.first
        descs = zip(local.run_descs(run.dst, n), remote_regions.run_descs(run.src, n),
                    strict=True)
        run.handle = []
        with self.lock:
            # One batch a descriptor: the Python API polls a batch's first task only.
            for (dst, nbytes, _), (src, _, _) in descs:
                batch = self.engine.batch_transfer_async_read(remote, [dst], [src], [nbytes])
                if not 0 < batch < 1 << 63:  # 0: not submitted; -1 (as unsigned): no segment
                    raise RuntimeError(f"Mooncake did not submit the READ (returned {batch}); "
                                       f"the producer's engine at {remote} is unreachable or "
                                       "gone")
                run.handle.append(batch)

    def poll(self, run: Run) -> str:
        pending, failure = [], None
        with self.lock:
            for batch in run.handle:
                status = self.engine.transfer_check_status(batch)  # frees it when it ends
                if status == 0:
                    pending.append(batch)
                elif status == -1:
                    failure = ("the transfer failed (the producer died, closed, or refused "
                               "the addresses; the engines' logs on stderr say why)")
                elif status != 1:
                    pending.append(batch)  # timed out in the engine: not freed, still owned
                    failure = f"the engine reported status {status} (timed out)"
        run.handle = pending
        if failure is not None:
            return failure
        return "PROC" if pending else "DONE"

    def release(self, run: Run) -> bool:
        """Mooncake cannot cancel a READ: batches still in flight are reaped later."""
        pending, run.handle = run.handle or [], None
        with self.lock:
            self._reap()
            self.orphans.extend(pending)
        return not pending

    def _reap(self) -> None:
        """Free the orphaned batches that ended (caller holds ``lock``)."""
        self.orphans = [b for b in self.orphans if self.engine.transfer_check_status(b) == 0]

    def register_staging(self, staging: torch.Tensor) -> None:
        with self.lock:
            rc = self.engine.register_memory(staging.data_ptr(),
                                             staging.numel() * staging.element_size())
        if rc != 0:
            raise RuntimeError(f"Mooncake could not register the consumer's staging buffer "
                               f"({staging.numel()} bytes on {staging.device}): "
                               f"register_memory returned {rc}")
        self._staged.append(staging)

    def close(self) -> None:
        deadline = time.monotonic() + self.reap_s
        with self.lock:
            if self.engine is None:
                return
            self._reap()
            while self.orphans and time.monotonic() < deadline:
                time.sleep(0.01)
                self._reap()
            if self.orphans:
                # A READ may still write into the cache: keep the engine and the memory.
                logger.warning("mooncake engine %s: %d READ(s) still in flight after %.1f s; "
                               "the engine and its registered cache are kept until the "
                               "process exits", self.name, len(self.orphans), self.reap_s)
                _KEPT.append((self.engine, self._storage, *self._staged))
            else:
                for addr in (self.addr, *(t.data_ptr() for t in self._staged)):
                    rc = self.engine.unregister_memory(addr)
                    if rc != 0:
                        logger.warning("mooncake engine %s: unregistering memory returned %d",
                                       self.name, rc)
            self.engine = None
            self._storage = None
            self._staged = []


#: Engines closed with READs in flight, and their caches (see :meth:`_Engine.close`).
_KEPT: list[tuple[Any, ...]] = []


class MooncakeConnector(PullConnector):
    """Publish KV blocks to other engines, or READ them from one, through Mooncake's transfer
    engine (connector name ``mooncake``).

    Args:
        role, host, port, connect_timeout_s, timeout_s, publish_timeout_s, max_lease_s,
        failure_policy:
            as for :class:`~kvcore.connectors.nixl.NixlConnector` (the side channel, the
            roles and every bound are the same).
        protocol: Mooncake's transport, one of :data:`MOONCAKE_PROTOCOLS`: ``"tcp"`` (the
            default; CPU memory with the non-cuda wheel) or ``"rdma"`` on RDMA NICs.
        device_name: the RDMA NICs to use, comma-separated (``""``: Mooncake finds them).
        engine_host: the address this side's transfer engine listens on and is known by.
            ``None``: a producer uses ``host`` (or, when ``host`` is a wildcard such as
            ``"0.0.0.0"``, this machine's address by its host name); a consumer the local
            address that routes to the producer's ``host``.
        tp, num_kv_heads, kv_scales, staging_bytes, staging_buffers, map_producer, readers:
            layout
            conversion and tensor-parallel readers, as for
            :class:`~kvcore.connectors.nixl.NixlConnector`.
    """

    transport = "mooncake"
    label = "Mooncake"
    confirms_over_channel = True
    hello_fields = ("engine",)

    def __init__(
        self,
        *,
        role: str,
        host: str = "127.0.0.1",
        port: int = 0,
        connect_timeout_s: float = 30.0,
        timeout_s: float = 10.0,
        publish_timeout_s: float = 60.0,
        max_lease_s: float = 120.0,
        protocol: str = "tcp",
        device_name: str = "",
        engine_host: str | None = None,
        failure_policy: str = "recompute",
        tp: TPRank | tuple[int, int] | None = None,
        num_kv_heads: int | None = None,
        kv_scales: torch.Tensor | float | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        staging_buffers: int = 2,
        map_producer: bool = True,
        readers: int = 1,
    ) -> None:
        super().__init__(role=role, host=host, port=port, connect_timeout_s=connect_timeout_s,
                         timeout_s=timeout_s, publish_timeout_s=publish_timeout_s,
                         max_lease_s=max_lease_s, failure_policy=failure_policy, tp=tp,
                         num_kv_heads=num_kv_heads, kv_scales=kv_scales,
                         staging_bytes=staging_bytes, staging_buffers=staging_buffers,
                         map_producer=map_producer, readers=readers)
        if protocol not in MOONCAKE_PROTOCOLS:
            raise ValueError(f"protocol={protocol!r} is not a Mooncake transport; use one of "
                             f"{', '.join(map(repr, MOONCAKE_PROTOCOLS))} ('tcp' works on any "
                             "machine)")
        if not isinstance(device_name, str):
            raise TypeError(f"device_name must be a str of comma-separated NIC names (or ''), "
                            f"got {device_name!r}")
        if engine_host is not None and (not isinstance(engine_host, str)
                                        or engine_host in _WILDCARDS):
            raise ValueError(f"engine_host={engine_host!r} must be an address peers reach this "
                             "machine at (not a wildcard), or None")
        self.protocol = protocol
        self.device_name = device_name
        self.engine_host = engine_host
        self._start(role, host, port, failure_policy)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return mooncake_unavailable_reason()

    def _engine_hostname(self) -> str:
        if self.engine_host is not None:
            return self.engine_host
        if self.role == "consumer":
            return _route_address(self.host, self.port)
        if self.host in _WILDCARDS:
            return socket.gethostbyname(socket.gethostname())
        return self.host

    def _open_engine(self, reg: RegisteredCaches, regions: Regions) -> _Engine:
        # A closing consumer waits this long for READs given up on to end in the engine.
        return _Engine(self.agent_name, reg.kv_caches.storage, self._engine_hostname(),
                       self.protocol, self.device_name, reap_s=self.timeout_s)

