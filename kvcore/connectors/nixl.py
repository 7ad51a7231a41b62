"""``nixl``: KV blocks read straight from another engine's cache through NIXL.

For disaggregated prefill/decode: a **producer** engine (prefill) publishes blocks with
:meth:`~NixlConnector.save`; a **consumer** engine (decode), on the same machine or another,
finds them with :meth:`~NixlConnector.lookup` and READs them with :meth:`~NixlConnector.load`
straight from the producer's cache into its own blocks through NIXL (UCX underneath: RDMA,
NVLink, CUDA IPC, shared memory or TCP, whichever the two sides share). No bytes are staged.

Memory: each side registers its cache's storage with its NIXL agent (``VRAM`` on a GPU,
``DRAM`` on the CPU). A load issues one NIXL transfer per run of blocks that are consecutive
on both sides, with one descriptor per region kind (per layer, or one for cross-layer).

The side channel, the leases and every bound are :mod:`kvcore.connectors.pull`'s (shared with
the ``mooncake`` connector): the producer's hello carries its NIXL agent metadata, and a
consumer's READ carries the notification ``<lease>:<first>:<end>`` per run; when it arrives
the producer releases the blocks and the save reports them done.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from kvcore.connectors.base import RegisteredCaches
from kvcore.connectors.convert import TPRank
from kvcore.connectors.pull import DEFAULT_STAGING_BYTES, PullConnector
from kvcore.connectors.pull_engine import Regions, Run, memory_kind

__all__ = ["UCX_DEFAULTS", "NixlConnector", "nixl_unavailable_reason"]

logger = logging.getLogger(__name__)


#: Where NIXL's Python API lives: the ``nixl`` meta package, or one CUDA build's wheel alone
#: (``nixl-cu12`` installs the module ``nixl_cu12``, ``nixl-cu13`` the module ``nixl_cu13``).
_NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


def _nixl_module_order() -> tuple[str, ...]:
    """:data:`_NIXL_MODULES`, the build matching torch's CUDA major version first: UCX's CUDA
    transport of the other build cannot load, and NIXL then refuses to register VRAM."""
    cuda = getattr(torch.version, "cuda", None)
    if not cuda:
        return _NIXL_MODULES
    own = f"nixl_cu{cuda.split('.')[0]}._api"
    return tuple(sorted(_NIXL_MODULES, key=lambda name: name != own))


def _nixl_api() -> Any:
    """NIXL's ``_api`` module (with ``nixl_agent`` and ``nixl_agent_config``)."""
    errors = []
    for name in _nixl_module_order():
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # an ImportError, or a broken install raising anything
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if hasattr(module, "nixl_agent") and hasattr(module, "nixl_agent_config"):
            return module
        errors.append(f"{name}: has no nixl_agent")
    raise ImportError("; ".join(errors))


def nixl_unavailable_reason() -> str | None:
    """Why the ``nixl`` connector cannot run here, or ``None`` when it can."""
    try:
        _nixl_api()
    except ImportError as exc:
        return (f"NIXL's Python API is not importable ({exc}); install it with "
                "pip install 'kvcore[nixl]' (the nixl-cu12 wheel, Linux only; on CUDA 13, "
                "pip install nixl-cu13)")
    return None


_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block (one block at a time)."""
    if not values:
        yield
        return
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


#: UCX transports (and UCX_TLS aliases of them) that cannot handle a peer's failure, so
#: UCX's default error handling mode ('peer') refuses them for its active messages.
_NO_PEER_FAILURE_TLS = frozenset({
    "self", "sm", "shm", "sysv", "posix", "cma", "knem", "xpmem", "cuda", "cuda_ipc",
    "cuda_copy", "gdr_copy", "rocm", "rocm_ipc", "rocm_copy"})


def _no_peer_failure_handling(ucx_tls: str) -> bool:
    """Whether a ``UCX_TLS`` list allows only transports in :data:`_NO_PEER_FAILURE_TLS` (an
    exclusion list, ``all`` or a name not known here is left to UCX)."""
    names = [n.strip().lower() for n in ucx_tls.split(",") if n.strip()]
    if not names or ucx_tls.strip().startswith("^"):
        return False
    return all(n in _NO_PEER_FAILURE_TLS for n in names)


#: UCX settings applied while the UCX backend of a cache in CUDA memory is created, each
#: unless the environment sets it. UCX's cuda_ipc transport offers GET (a consumer's READ)
#: only between GPUs it finds NVLink between; two processes on one GPU, or GPUs on PCIe, then
#: READ over TCP or host memory instead, hundreds of times slower (``docs/connector.md``).
#: Set ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto`` to keep UCX's own rule.
UCX_DEFAULTS: Mapping[str, str] = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}


class _Agent:
    """One NIXL agent with the cache's storage registered; every call into NIXL goes through
    it, under one lock (the Python API is not documented as thread-safe)."""

    def __init__(self, name: str, storage: torch.Tensor, backends: tuple[str, ...],
                 backend_params: Mapping[str, Mapping[str, str]] | None = None,
                 ucx_tls: str | None = None, progress_thread: bool = True) -> None:
        api = _nixl_api()
        self.name = name
        self.lock = threading.Lock()
        self.agent = api.nixl_agent(name, api.nixl_agent_config(
            enable_prog_thread=progress_thread, backends=[]))
        available = self.agent.get_plugin_list()
        missing = [b for b in backends if b not in available]
        if missing:
            raise ValueError(f"backends={list(backends)!r}: NIXL has no plugin for "
                             f"{', '.join(missing)} (available: {', '.join(available)})")
        for backend in backends:
            params = dict((backend_params or {}).get(backend, {}))
            # UCX reads its settings from the environment when the backend is created.
            tls = ucx_tls if backend == "UCX" else None
            env = {"UCX_TLS": tls} if tls else {}
            if backend == "UCX" and storage.is_cuda and torch.version.hip is None:
                # CUDA settings only for CUDA memory (UCX warns of unused variables elsewhere).
                env.update((k, v) for k, v in UCX_DEFAULTS.items() if k not in os.environ)
            with _environment(env):
                try:
                    self.agent.create_backend(backend, params)
                except Exception as exc:
                    # Every variable set for it: a default of UCX_DEFAULTS may be the cause.
                    settings = ", ".join(f"{k}={v}" for k, v in env.items())
                    raise RuntimeError(f"NIXL could not create backend {backend} with "
                                       f"parameters {params}" +
                                       (f" and {settings}" if settings else "") +
                                       f": {exc}") from exc
        self.mem_type, dev_id = memory_kind(storage, "nixl")
        nbytes = storage.numel() * storage.element_size()
        try:
            self._reg_descs = self.agent.register_memory(
                [(storage.data_ptr(), nbytes, dev_id, "")], self.mem_type)
        except Exception as exc:
            raise RuntimeError(f"NIXL could not register the KV cache ({nbytes} bytes of "
                               f"{self.mem_type} on {storage.device}) with backends "
                               f"{list(backends)}: {exc}") from exc
        self._storage = storage  # the registered memory stays alive while the agent is
        self._progress_thread = progress_thread
        self._staged: list[tuple[Any, torch.Tensor]] = []  # a converting consumer's buffers

    # -- producer -------------------------------------------------------------------------

    def hello(self) -> dict[str, Any]:
        with self.lock:
            return {"metadata": base64.b64encode(self.agent.get_agent_metadata()).decode()}

    def notifications(self) -> list[tuple[str, bytes]]:
        with self.lock:
            if self.agent is None:
                return []
            notifs = self.agent.get_new_notifs()
        return [(consumer, raw) for consumer, messages in notifs.items() for raw in messages]

    # -- consumer -------------------------------------------------------------------------

    def connect(self, reply: dict[str, Any]) -> str:
        with self.lock:
            remote = self.agent.add_remote_agent(base64.b64decode(reply["metadata"]))
            if isinstance(remote, bytes):
                remote = remote.decode()
            # Connect now: the first READ would otherwise pay for the UCX wire-up.
            self.agent.make_connection(remote)
        return remote

    def forget(self, remote: str) -> None:
        with self.lock:
            if self.agent is not None:
                try:
                    self.agent.remove_remote_agent(remote)
                except Exception as exc:
                    logger.info("nixl consumer: removing the producer's agent: %s", exc)

    def start_read(self, run: Run, lease: str | None, local: Regions, remote_regions: Regions,
                   remote: str) -> None:
        n = run.end - run.first
        # The producer counts the run read when the notification arrives (after the data);
        # none before the lease exists (the consumer notifies once it checked the lease).
        message = b"" if lease is None else f"{lease}:{run.first}:{run.end}".encode()
        with self.lock:
            local_descs = self.agent.get_xfer_descs(local.run_descs(run.dst, n),
                                                    local.mem_type)
            remote_descs = self.agent.get_xfer_descs(remote_regions.run_descs(run.src, n),
                                                     remote_regions.mem_type)
            run.handle = self.agent.initialize_xfer("READ", local_descs, remote_descs, remote,
                                                    message)
            if self.agent.transfer(run.handle) == "ERR":
                raise RuntimeError("NIXL transfer() returned ERR")

    def notify(self, remote: str, message: bytes) -> None:
        with self.lock:
            self.agent.send_notif(remote, message)
            if not self._progress_thread:
                # Nothing else drives UCX until the next READ's polls: push the message out
                # now (NIXL's notification query progresses the worker), or it may wait there
                # until the agent closes and is cancelled with it.
                self.agent.get_new_notifs()

    def poll(self, run: Run) -> str:
        with self.lock:
            try:
                state = self.agent.check_xfer_state(run.handle)
            except Exception as exc:
                return f"ERR ({exc})"
        return state if state in ("DONE", "PROC") else str(state)

    def release(self, run: Run) -> bool:
        """Free the transfer handle; NIXL cancels an active one. Returns whether that worked
        (NIXL keeps a handle it could not cancel)."""
        if run.handle is None:
            return True
        handle, run.handle = run.handle, None
        with self.lock:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as exc:
                logger.warning("nixl consumer: releasing a transfer handle failed: %s", exc)
                return False
        return True

    def register_staging(self, staging: torch.Tensor) -> None:
        nbytes = staging.numel() * staging.element_size()
        with self.lock:
            try:
                descs = self.agent.register_memory(
                    [(staging.data_ptr(), nbytes, memory_kind(staging, "nixl")[1], "")],
                    self.mem_type)
            except Exception as exc:
                raise RuntimeError(f"NIXL could not register the consumer's staging buffer "
                                   f"({nbytes} bytes on {staging.device}): {exc}") from exc
            self._staged.append((descs, staging))

    def close(self) -> None:
        with self.lock:
            if self.agent is None:
                return
            for descs in (self._reg_descs, *(d for d, _ in self._staged)):
                try:
                    self.agent.deregister_memory(descs)
                except Exception as exc:  # closing must go on; the agent frees it anyway
                    logger.warning("nixl agent %s: deregistering memory failed: %s", self.name,
                                   exc)
            self.agent = None
            self._storage = None
            self._staged = []


# -- the connector --------------------------------------------------------------------------


class NixlConnector(PullConnector):
    """Publish KV blocks to other engines, or READ them from one (connector name ``nixl``).

    Args:
        role: ``"producer"`` (publishes blocks with :meth:`save`, listens on ``host:port``)
            or ``"consumer"`` (connects to a producer at ``host:port``, :meth:`lookup` and
            :meth:`load`). A producer's ``load`` and a consumer's ``save`` fail every block
            with the reason; a producer's ``lookup`` is 0.
        host: producer: the address to listen on (``"0.0.0.0"`` for every interface);
            consumer: the producer's address.
        port: producer: the port to listen on, ``0`` for a free one (read :attr:`port`);
            consumer: the producer's port.
        connect_timeout_s: consumer: how long connecting and the handshake may take
            (registration raises ``ConnectionError`` after it); producer: how long a
            connecting consumer may take to say hello.
        timeout_s: consumer: the bound on one request to the producer and on one load
            (blocks not read whole by then fail). Keep it well below the producer's
            ``publish_timeout_s``.
        publish_timeout_s: producer: how long a saved block waits for a consumer; then it is
            released and the save reports it failed.
        max_lease_s: producer: the longest lease a consumer may take (a consumer asks for
            twice its ``timeout_s``; a longer one is refused, naming this option). It bounds
            how long a consumer that froze keeps blocks from other consumers; one whose
            connection closes loses its leases at once.
        backends: NIXL transfer backends to create (``UCX`` by default).
        backend_params: per backend, its NIXL init parameters (strings), e.g.
            ``{"UCX": {"ucx_error_handling_mode": "none"}}``; NIXL lists a plugin's with
            ``nixl_agent.get_plugin_params(name)`` (UCX: ``ucx_devices``, ``num_workers``,
            ``ucx_error_handling_mode``). Unknown backends are refused.
        ucx_tls: the UCX transports to allow (UCX's ``UCX_TLS`` syntax, e.g.
            ``"cuda_ipc,cuda_copy,tcp"`` for VRAM between processes on one host), set only
            while the UCX backend is created; ``None`` (the default): UCX's own choice, or
            ``UCX_TLS`` from the environment. A list of shared-memory and CUDA transports only
            (``"cuda_ipc,cuda_copy,sm,self"``) needs ``ucx_error_handling_mode`` ``"none"``
            (UCX's default ``peer`` mode finds no transport for its messages among them);
            it is refused otherwise. Which transports UCX picked: run with
            ``UCX_PROTO_INFO=y`` (``benchmarks/bench_nixl.py --matrix`` does); see
            ``docs/connector.md`` for what was measured.
        progress_thread: whether this side's NIXL agent runs NIXL's progress thread (a
            thread that drives UCX in the background). ``None`` (the default): on for a
            producer (it moves its notifications and UCX's connection messages while the
            connector does not ask), off for a consumer, whose loads drive UCX themselves
            while they poll their READs: the progress thread contends with them for UCX, and
            without it one NIXL READ of 1 GiB between two processes on an H100 ran at 1466
            instead of 1022 GB/s (``benchmarks/RESULTS.md``).
        failure_policy: ``"recompute"`` or ``"fail"`` (see :data:`FAILURE_POLICIES`).
        tp: this engine's tensor-parallel ``(degree, rank)`` (or a
            :class:`~kvcore.connectors.TPRank`; default TP 1): its cache holds that rank's
            slice of the KV heads. Sent in the handshake.
        num_kv_heads: the model's KV heads over all ranks, when the layouts cannot tell
            (both sides one head per rank); sent in the handshake.
        kv_scales: consumer: this cache's per-layer K/V fp8 scales, ``(num_layers, 2)`` or
            one float; passing them allows a wider producer cache to be quantised into this
            fp8 one on load (refused otherwise).
        staging_bytes: consumer: the buffer a load READs into when the two layouts differ
            (:data:`~kvcore.connectors.pull.DEFAULT_STAGING_BYTES`); a load converts as many
            blocks at a time as it holds.
        staging_buffers: consumer: ``2`` (the default) splits the staging buffer in two
            parts when it holds two of the plan's block groups or more, so the READ of one
            chunk overlaps the gather of the previous one (on a GPU the gather runs on the
            connector's CUDA stream); ``1`` READs and gathers in turn.
        map_producer: consumer, when the layouts differ: read the producer's cache where it
            lies when this process can map it, the producer's cache on this cache's GPU of
            one host (CUDA IPC) or the producer in this very process: each load is then one
            gather from the producer's leased blocks into this cache, one pass over memory,
            with no READ and no staging buffer (on one GPU a READ and a gather are two full
            passes). ``True`` (the default) where possible (:attr:`converts_in_place` says
            whether it is, :attr:`in_place_reason` why not); ``False``: always READ through
            NIXL into the staging buffer.
        readers: producer: how many different consumers READ each published block before it
            is released and its save reports it done (default 1). Tensor-parallel consumers
            that read one producer rank each take its blocks: pass
            ``len(kvcore.connectors.reader_ranks(num_kv_heads, tp, consumer_degree))``. A
            consumer never reads a block twice.

    Layouts may differ: the handshake plans the conversion
    (:func:`~kvcore.connectors.plan_conversion`, producer -> consumer, from both layouts and
    ``tp``) and refuses, before any byte moves, what cannot convert. The bytes then cross
    once in the producer's layout into the staging buffer, and one gather per load rearranges
    them into the consumer's blocks (:attr:`plan`); where the consumer maps the producer's
    cache (``map_producer``), that gather reads the producer's blocks in place. With block
    sizes that differ, keys name the producer's blocks (:attr:`key_block_size`) and
    ``block_ids`` the consumer's blocks those tokens fill (``docs/connector.md``).
    """

    transport = "nixl"
    label = "NIXL"
    hello_fields = ("metadata",)

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
        backends: Sequence[str] = ("UCX",),
        backend_params: Mapping[str, Mapping[str, str]] | None = None,
        ucx_tls: str | None = None,
        progress_thread: bool | None = None,
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
        if isinstance(backends, str) or not isinstance(backends, Sequence) or not backends \
                or not all(isinstance(b, str) and b for b in backends):
            raise TypeError(f"backends must be a non-empty list of NIXL backend names such as "
                            f"['UCX'], got {backends!r}")
        if backend_params is not None:
            if not isinstance(backend_params, Mapping) or not all(
                    isinstance(params, Mapping)
                    and all(isinstance(k, str) and isinstance(v, str)
                            for k, v in params.items())
                    for params in backend_params.values()):
                raise TypeError("backend_params must map a backend name to a dict of str "
                                f"parameters, e.g. {{'UCX': {{'num_workers': '2'}}}}, got "
                                f"{backend_params!r}")
            unknown = [b for b in backend_params if b not in backends]
            if unknown:
                raise ValueError(f"backend_params names {unknown}, which are not in "
                                 f"backends={list(backends)!r}: add them there or drop them")
        if ucx_tls is not None and (not isinstance(ucx_tls, str) or not ucx_tls.strip()
                                    or "UCX" not in backends):
            raise ValueError(f"ucx_tls={ucx_tls!r} must be a non-empty UCX_TLS string such as "
                             "'cuda_ipc,cuda_copy,tcp', with 'UCX' in backends "
                             f"(backends={list(backends)!r})")
        if ucx_tls is not None:
            given = (backend_params or {}).get("UCX", {}).get("ucx_error_handling_mode")
            mode = "peer" if given is None else given
            if mode != "none" and _no_peer_failure_handling(ucx_tls):
                raise ValueError(
                    f"ucx_tls={ucx_tls!r} lists only transports without peer failure handling "
                    "(shared memory, self, CUDA), and with ucx_error_handling_mode "
                    f"{mode!r}{' (the default)' if given is None else ''} UCX finds no "
                    "transport for its messages "
                    "and NIXL cannot create the backend: add tcp or an RDMA transport (e.g. "
                    "'cuda_ipc,cuda_copy,tcp'), or pass backend_params={'UCX': "
                    "{'ucx_error_handling_mode': 'none'}} (UCX then no longer reports a dead "
                    "peer; the connector's timeouts still bound every wait)")
        if progress_thread is not None and not isinstance(progress_thread, bool):
            raise TypeError(f"progress_thread={progress_thread!r} must be True, False or None "
                            "(None: on for a producer, off for a consumer)")
        self.progress_thread = role == "producer" if progress_thread is None \
            else progress_thread
        self.backends = tuple(backends)
        self.backend_params = {b: dict(p) for b, p in (backend_params or {}).items()}
        self.ucx_tls = ucx_tls
        self._start(role, host, port, failure_policy)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return nixl_unavailable_reason()

    def _open_engine(self, reg: RegisteredCaches, regions: Regions) -> _Agent:
        return _Agent(self.agent_name, reg.kv_caches.storage, self.backends,
                      self.backend_params, self.ucx_tls, self.progress_thread)
