"""One allocation shared with a peer that maps it: a CUDA allocation with another process of
the host (CUDA IPC, through the handle torch's ``reduce_tensor`` makes of it), or any
allocation with a peer in this very process (which uses it as it is: CUDA IPC cannot open a
handle in the process that made it).

:func:`share_allocation` makes the handle (JSON values: it travels in a side channel's
hello); :func:`map_allocation` opens it on the peer's side, or raises ``ValueError`` saying
why it cannot be opened there. The ``p2p`` connector's ``ipc`` staging slots and the pull
connectors' in-place conversion (a consumer reading the producer's cache where it lies) use
it.
"""

from __future__ import annotations

import base64
import os
import secrets
import socket
import weakref
from typing import Any

import torch

__all__ = ["host_identity", "map_allocation", "peer_facts", "share_allocation",
           "shareable_with", "visible_gpus"]

#: This process's shared allocations by token: a peer in the same process maps them as they
#: are. Weak: an allocation its owner dropped is not kept alive by having been shared.
_OWN: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
#: The fields of torch's CUDA IPC reduction (``rebuild_cuda_tensor``'s arguments), by position.
_CUDA_FIELDS = ("tensor_cls", "size", "stride", "offset", "storage_cls", "dtype", "device",
                "handle", "storage_bytes", "storage_offset", "requires_grad", "ref_counter",
                "ref_counter_offset", "event", "event_sync")
_FIXED_FIELDS = ("tensor_cls", "storage_cls", "dtype", "device")


def host_identity() -> str:
    """This host as peers compare it: the hostname and, where Linux tells, the boot id (two
    processes agree on both only on one machine)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def visible_gpus() -> list[str]:
    """UUIDs of the CUDA devices this process sees, by device index (none without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid)
            for i in range(torch.cuda.device_count())]


def _encode(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"bytes": base64.b64encode(value).decode()}
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        return base64.b64decode(value["bytes"])
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def peer_facts() -> dict[str, Any]:
    """What a peer tells a sharer so it can decide whether an allocation can reach it
    (:func:`shareable_with`): its process, host and visible GPUs."""
    return {"pid": os.getpid(), "host": host_identity(), "gpus": visible_gpus()}


def shareable_with(data: torch.Tensor, peer: Any) -> str | None:
    """Why a peer with these :func:`peer_facts` could not map ``data``, or ``None`` if it
    can: a peer in this process maps anything; one in another process only a CUDA
    allocation of this host on a GPU it sees."""
    if not isinstance(peer, dict) or not {"pid", "host", "gpus"} <= peer.keys():
        return f"the peer sent no mapping facts (got {str(peer)[:100]!r})"
    if peer["pid"] == os.getpid() and peer["host"] == host_identity():
        return None
    if not data.is_cuda:
        return (f"the allocation is CPU memory of process {os.getpid()}, which another "
                "process cannot map (only CUDA allocations are shared across processes)")
    if peer["host"] != host_identity():
        return (f"the peer runs on host {peer['host']!r}, the allocation is on "
                f"{host_identity()!r}: CUDA IPC maps memory of one host only")
    gpu = str(torch.cuda.get_device_properties(data.device).uuid)
    if gpu not in (peer["gpus"] or ()):
        return f"the allocation is on GPU {gpu}, which the peer does not see"
    return None


def share_allocation(data: torch.Tensor, *, other_processes: bool = True) -> dict[str, Any]:
    """A handle of ``data`` (a contiguous uint8 tensor on a CUDA device or the CPU) for a peer
    to map with :func:`map_allocation`: ``{"kind": "cuda" | "process", "nbytes", "pid",
    "token", "host", ...}`` (CUDA: the GPU's UUID and the IPC fields of torch's reduction,
    bytes in base64). A CPU tensor can be mapped only by a peer in this process. Keep this
    very tensor object referenced while peers use it: a peer in this process gets it (held
    weakly here), one in another process maps its memory.

    A CUDA handle is for **one** peer process (``other_processes=False``: for peers in this
    process only, made without CUDA IPC): torch counts each such handle as one reference,
    which the peer gives back when its mapping goes (or :func:`map_allocation`, when it
    cannot open it), and keeps the memory allocated, even after this process frees it,
    until every handle made was given back. Make one per peer process that will map it,
    never one that no process maps."""
    if data.dtype != torch.uint8 or not data.is_contiguous():
        raise ValueError(f"share_allocation takes a contiguous uint8 tensor, got "
                         f"{data.dtype} with strides {data.stride()}")
    token = secrets.token_hex(8)
    _OWN[token] = data
    handle: dict[str, Any] = {"kind": "process", "nbytes": data.numel(), "pid": os.getpid(),
                              "token": token, "host": host_identity()}
    if data.is_cuda and other_processes:
        from torch.multiprocessing import reductions

        rebuild, args = reductions.reduce_tensor(data)
        if rebuild is not reductions.rebuild_cuda_tensor or len(args) != len(_CUDA_FIELDS):
            raise RuntimeError(f"torch {torch.__version__} shares CUDA tensors in a way kvcore "
                               "does not know (reduce_tensor changed)")
        handle.update(kind="cuda", gpu=str(torch.cuda.get_device_properties(data.device).uuid),
                      ipc={k: _encode(v) for k, v in zip(_CUDA_FIELDS, args, strict=True)
                           if k not in _FIXED_FIELDS})
    return handle


def map_allocation(handle: Any) -> torch.Tensor:
    """Open a peer's :func:`share_allocation` handle here: a flat uint8 tensor of its
    ``nbytes``, on the peer's GPU (this process's index of it) or the CPU. Raises
    ``ValueError`` with the reason when it cannot be opened in this process: another host,
    a GPU this process does not see, a CPU allocation of another process."""
    missing = [k for k in ("kind", "nbytes", "pid", "token")
               if not isinstance(handle, dict) or k not in handle]
    if missing:
        raise ValueError(f"the shared allocation's handle {str(handle)[:200]!r} lacks "
                         f"{', '.join(missing)}")
    kind, nbytes, pid, token = (handle[k] for k in ("kind", "nbytes", "pid", "token"))
    if pid == os.getpid() and handle.get("host") == host_identity():
        own = _OWN.get(token)
        if own is None:
            raise ValueError("the shared allocation was made in this process and is freed")
        return own
    if kind == "process":
        raise ValueError(f"the peer's allocation is CPU memory of process {pid}, which another "
                         "process cannot map (only CUDA allocations are shared across "
                         "processes)")
    if kind != "cuda":
        raise ValueError(f"a shared allocation of kind {kind!r}: this kvcore maps 'cuda' and "
                         "'process' ones")
    try:
        data = _open_cuda(handle)
    except ValueError:
        _give_back(handle)
        raise
    except Exception as exc:  # the driver refused it (another IPC namespace, say)
        _give_back(handle)
        raise ValueError(f"CUDA IPC could not open the peer's allocation: {exc}") from None
    if data.numel() != nbytes:
        raise ValueError(f"the peer's allocation maps as {data.numel()} bytes, its handle "
                         f"says {nbytes}")
    return data.view(-1)


def _open_cuda(handle: dict[str, Any]) -> torch.Tensor:
    if handle.get("host") != host_identity():
        raise ValueError(f"the peer's allocation is on host {handle.get('host')!r}, this "
                         f"process runs on {host_identity()!r}: CUDA IPC maps memory of one "
                         "host only")
    gpus = visible_gpus()
    if handle.get("gpu") not in gpus:
        raise ValueError(f"the peer's allocation is on GPU {handle.get('gpu')}, which this "
                         f"process does not see (visible: {gpus or 'none'})")
    from torch.multiprocessing import reductions

    fields = {k: _decode(v) for k, v in handle["ipc"].items()}
    fields.update(tensor_cls=torch.Tensor, storage_cls=torch.storage.TypedStorage,
                  dtype=torch.uint8, device=gpus.index(handle["gpu"]),
                  size=torch.Size(fields["size"]), stride=tuple(fields["stride"]))
    return reductions.rebuild_cuda_tensor(*(fields[k] for k in _CUDA_FIELDS))


def _give_back(handle: dict[str, Any]) -> None:
    """A CUDA handle this process will not map: give its reference back, so the sharer's
    memory can be freed (torch's count, in shared memory of the host; a handle from another
    host has no count here to give back)."""
    try:
        fields = {k: _decode(v) for k, v in handle["ipc"].items()}
        torch.UntypedStorage._release_ipc_counter_cuda(fields["ref_counter"],
                                                       fields["ref_counter_offset"])
    except Exception:  # another host, or a malformed handle: nothing here to give back
        pass
