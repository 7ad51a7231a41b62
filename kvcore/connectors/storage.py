"""``storage``: one safetensors file per KV block under a directory that processes share.

Files live at ``<root>/<namespace>/<key[:2]>/<key>.safetensors``. The namespace is a digest of
the cache layout (everything but the number of blocks), so engines whose pages differ never
read each other's blocks; keys are content hashes (include the model in them, see
:func:`~kvcore.connectors.hash_block_tokens`'s ``extra``). Keys are validated as hex digests,
so no key can name a path outside the root, and no symbolic link below the root is followed:
a namespace or shard directory that is a link fails the blocks that would go through it
(nothing is read, written or deleted there; remove the link), and a block file that is a link
is not offered, loaded or trusted (a save replaces the link with a real file).

Each file holds one uint8 tensor ``kv`` of shape ``(num_layers, page_size_bytes)`` (the bytes
of the block, layer-major: exact for every dtype, fp8 included) and metadata: the format, the
layout (:meth:`kvcore.KVCacheLayout.to_dict`), dtype, block size and the SHA-256 of the bytes.
Writes go to a temporary file that is renamed into place, so a reader sees a whole file or
none. A load checks the layout and the checksum before a byte reaches the cache; a file that
fails either is deleted (so :meth:`lookup` stops offering it) and its block reported failed.
A save counts a key as stored only after the same check: a corrupted file is deleted and
written again. Every error of a save or a load (a full disk, a read-only or vanished
directory, whatever exception the file library raises) fails the blocks it hit, each with the
reason, never the whole transfer; the blocks written before it are reported saved.
No pickle is involved anywhere: safetensors stores raw tensors and string metadata. safetensors
is the ``kvcore[storage]`` extra, imported when a connector is made.

With ``convert=True`` a connector also
looks up and loads blocks that engines of another layout wrote under the same root (another
stride order, per-layer or cross-layer: :func:`~kvcore.connectors.plan_conversion` with the
same block size, heads and dtype, since keys name blocks of tokens), converting each on load;
what it writes stays in its own layout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kvcore import KVCacheLayout
from kvcore.connectors.base import (
    KVConnector,
    RegisteredCaches,
    TransferHandle,
    TransferResult,
    layout_block_size,
)
from kvcore.connectors.blocks import _host_buffer
from kvcore.connectors.convert import (
    ConversionPlan,
    LayoutConversionError,
    block_rows_layout,
    plan_conversion,
)
from kvcore.connectors.keys import check_block_keys

__all__ = ["StorageConnector", "FILE_FORMAT"]

FILE_FORMAT = "kvcore-kv-block-v1"
_TENSOR = "kv"


def _layout_signature(layout: KVCacheLayout) -> dict:
    """The layout as a dict with the number of blocks zeroed: what two engines must share."""
    data = layout.to_dict()
    data["logical_shape"][layout.block_dim] = 0
    return data


class _BadFile(Exception):
    """A block file that exists but must not be loaded (the message says why)."""


class _LinkedDir(Exception):
    """A directory on a block's path below the root is a symbolic link (the message says
    which): the block is refused, and nothing is touched there."""


def _safetensors() -> Any:
    """The ``safetensors.torch`` module, or an ``ImportError`` saying how to install it."""
    try:
        import safetensors.torch
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "safetensors":
            raise
        raise ImportError("the storage connector needs safetensors, which is not installed "
                          "(pip install 'kvcore[storage]')") from None
    return safetensors.torch


class StorageConnector(KVConnector):
    """Save KV blocks as files under ``root`` and load them back (connector name ``storage``).

    Args:
        root: the shared directory (created if missing).
        num_workers: threads doing file I/O; each save or load call runs on one of them.
        convert: also look up and load blocks written by engines of another layout under the
            same root (same block size, heads and dtype; another stride order, per-layer or
            cross-layer), converted on load. Default ``False``: only this layout's blocks.
        failure_policy: ``"recompute"`` or ``"fail"`` (see :data:`FAILURE_POLICIES`).
    """

    prefer_cross_layer_blocks = True  # a whole block is then one gather

    def __init__(self, *, root: str | os.PathLike[str], num_workers: int = 4,
                 convert: bool = False, failure_policy: str = "recompute") -> None:
        if not isinstance(root, (str, os.PathLike)) or not str(root):
            raise TypeError(f"root must be a directory path, got {root!r}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers={num_workers!r} must be a positive integer")
        if not isinstance(convert, bool):
            raise TypeError(f"convert must be a bool, got {convert!r}")
        self.convert = convert
        #: Namespace directory name -> the plan from its files' rows, or None (not convertible).
        self._plans: dict[str, ConversionPlan | None] = {}
        self._st = _safetensors()
        super().__init__(failure_policy=failure_policy)
        self.root = Path(root)
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="kvcore-storage")

    def _register(self, reg: RegisteredCaches) -> None:
        layout = reg.kv_caches.layout
        signature = json.dumps(_layout_signature(layout), sort_keys=True)
        digest = hashlib.sha256(signature.encode()).hexdigest()[:16]
        self._dir = self.root / f"{str(layout.dtype).removeprefix('torch.')}-{digest}"
        self.root.mkdir(parents=True, exist_ok=True)
        if not self._dir.is_symlink():
            self._dir.mkdir(exist_ok=True)  # a link here fails every block, with the reason
        self._layout = layout
        self._row_shape = (reg.kv_caches.num_layers, reg.kv_caches.page_size_bytes)
        self._metadata = {
            "format": FILE_FORMAT,
            "layout": json.dumps(layout.to_dict()),
            "dtype": str(layout.dtype).removeprefix("torch."),
            "block_size": str(layout_block_size(layout)),
        }

    def _sources(self) -> list[tuple[Path, ConversionPlan]]:
        """Other namespaces under the root whose blocks convert into this cache (``convert``
        only; a namespace's layout is read once, from one of its files)."""
        if not self.convert:
            return []
        try:
            names = sorted(entry.name for entry in os.scandir(self.root)
                           if entry.is_dir(follow_symlinks=False) and entry.name != self._dir.name)
        except OSError:
            return []
        found = []
        for name in names:
            if name not in self._plans:
                plan = self._plan_for(self.root / name)
                if plan is False:
                    continue
                self._plans[name] = plan
            if self._plans[name] is not None:
                found.append((self.root / name, self._plans[name]))
        return found

    def _plan_for(self, directory: Path) -> ConversionPlan | bool | None:
        """The plan from ``directory``'s block rows into this cache; None when its layout does
        not convert with the same block size (keys name blocks of tokens) or is unreadable;
        False while it holds no block file to read the layout from (asked again later)."""
        try:
            path = next((f for shard in sorted(directory.iterdir())
                         if shard.is_dir() and not shard.is_symlink()
                         for f in sorted(shard.glob("*.safetensors")) if not f.is_symlink()),
                        None)
            if path is None:
                return False
            with self._st.safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
            theirs = KVCacheLayout.from_dict(json.loads(metadata.get("layout", "")))
            plan = plan_conversion(block_rows_layout(theirs), self._layout)
        except (LayoutConversionError, ValueError, RecursionError):
            return None
        except Exception:  # a file vanishing or garbage: safetensors raises many types
            return False
        return plan if plan.src_block_size == plan.dst_block_size else None

    def _find(self, key: str) -> tuple[Path, ConversionPlan | None] | None:
        """Where ``key``'s block is: this namespace's file (plan None), else another
        namespace's with the plan that converts it (``convert``); None when nowhere."""
        path = self._path(key)
        if self._is_block_file(path):
            return path, None
        for directory, plan in self._sources():
            other = directory / key[:2] / f"{key}.safetensors"
            if not other.parent.is_symlink() and other.is_file() and not other.is_symlink():
                return other, plan
        return None

    def path_of(self, key: str) -> Path:
        """The file that holds ``key`` (validated: a hex digest, so always under the root)."""
        self._registered()
        (key,) = check_block_keys([key], "key")
        return self._path(key)

    def _path(self, key: str) -> Path:
        return self._dir / key[:2] / f"{key}.safetensors"

    def _check_dirs(self, path: Path) -> None:
        """Raise :class:`_LinkedDir` when the namespace or shard directory of ``path`` is a
        symbolic link (checked before every use: the root is shared)."""
        for directory in (self._dir, path.parent):
            if directory.is_symlink():
                raise _LinkedDir(f"{directory} is a symbolic link; the storage connector "
                                 "follows no link below its root (remove it)")

    def _is_block_file(self, path: Path) -> bool:
        """Whether ``path`` is a regular file reached through no symbolic link below the root."""
        try:
            self._check_dirs(path)
        except _LinkedDir:
            return False
        return path.is_file() and not path.is_symlink()

    # -- transfers --------------------------------------------------------------------------

    def _save(self, keys: list[str], block_ids: list[int]) -> TransferHandle:
        future = self._executor.submit(self._save_blocks, keys, block_ids, self._caller_fence())
        return TransferHandle.from_future("save", self.failure_policy, future)

    def _load(self, keys: list[str], block_ids: list[int]) -> TransferHandle:
        future = self._executor.submit(self._load_blocks, keys, block_ids)
        return TransferHandle.from_future("load", self.failure_policy, future)

    def _lookup(self, keys: list[str]) -> int:
        for i, key in enumerate(keys):
            if (self._find(key) if self.convert else
                    self._is_block_file(self._path(key)) or None) is None:
                return i
        return len(keys)

    def _close(self) -> None:
        self._executor.shutdown(wait=True)

    def _save_blocks(self, keys: list[str], block_ids: list[int],
                     blocks_written: Callable[[], None]) -> TransferResult:
        started = time.perf_counter()
        paths = [self._path(k) for k in keys]
        todo = [i for i, p in enumerate(paths) if not self._holds(p)]  # content-addressed
        blocks_written()
        data = self._read_blocks([block_ids[i] for i in todo]).cpu() if todo else None
        failed: dict[int, str] = {}
        written = 0
        for row, i in enumerate(todo):
            try:
                self._write_file(paths[i], data[row])
                written += 1
            except Exception as exc:  # OSError, and safetensors' own error type for the same
                failed[block_ids[i]] = f"writing {paths[i]}: {type(exc).__name__}: {exc}"
        succeeded = [b for b in block_ids if b not in failed]
        result = self._result("save", succeeded, failed, written * self.block_bytes,
                              time.perf_counter() - started)
        return self._record(result)

    def _holds(self, path: Path) -> bool:
        """Whether ``path`` holds a block that a load would accept. A file that fails the
        check is deleted, so that a save rewrites it and a failed rewrite leaves nothing."""
        try:
            self._read_file(path)
        except (FileNotFoundError, _LinkedDir):
            return False  # a linked directory fails the write, with the reason
        except _BadFile:
            self._unlink(path)
            return False
        return True

    def _write_file(self, path: Path, row: torch.Tensor) -> None:
        self._check_dirs(path)
        path.parent.mkdir(exist_ok=True)
        self._check_dirs(path)  # created by another process meanwhile
        metadata = {**self._metadata, "sha256": hashlib.sha256(_host_buffer(row)).hexdigest()}
        # Same directory as the target, so the rename is atomic (one file system).
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            self._st.save_file({_TENSOR: row.view(self._row_shape)}, tmp, metadata=metadata)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def _load_blocks(self, keys: list[str], block_ids: list[int]) -> TransferResult:
        started = time.perf_counter()
        rows: list[torch.Tensor] = []
        loaded: list[int] = []
        failed: dict[int, str] = {}
        # Blocks of other layouts, by plan: (plan, rows, block ids).
        converted: dict[int, tuple[ConversionPlan, list[torch.Tensor], list[int]]] = {}
        for key, block in zip(keys, block_ids, strict=True):
            path = self._path(key)
            found = self._find(key) if self.convert else None
            if found is not None and found[1] is not None:
                path, plan = found
                try:
                    row = self._read_file(path, plan.src)
                except (FileNotFoundError, _LinkedDir, _BadFile) as exc:
                    failed[block] = f"{path} (another layout's block): {exc}"
                    continue
                entry = converted.setdefault(id(plan), (plan, [], []))
                entry[1].append(row)
                entry[2].append(block)
                continue
            try:
                rows.append(self._read_file(path))
                loaded.append(block)
            except FileNotFoundError:
                failed[block] = f"no file for key {key} ({path})"
            except _LinkedDir as exc:
                failed[block] = f"key {key}: {exc}"
            except _BadFile as exc:
                failed[block] = f"{path}: {exc}"
                self._unlink(path)  # garbage: stop offering it to lookup()
        if loaded:
            self._write_blocks(loaded, torch.stack(rows).flatten(1), "storage load")
        for plan, plan_rows, plan_blocks in converted.values():
            plan.apply(torch.stack(plan_rows), self._reg.kv_caches, list(range(len(plan_rows))),
                       plan_blocks)
            loaded.extend(plan_blocks)
        if loaded:
            storage = self._reg.kv_caches.storage
            if storage.is_cuda:  # written on this worker thread's stream
                torch.cuda.current_stream(storage.device).synchronize()
        result = self._result("load", loaded, failed, len(loaded) * self.block_bytes,
                              time.perf_counter() - started)
        return self._record(result)

    def _read_file(self, path: Path, layout: KVCacheLayout | None = None) -> torch.Tensor:
        """The verified ``(num_layers, page_size_bytes)`` bytes of a block file of ``layout``
        (default: this cache's)."""
        layout = self._layout if layout is None else layout
        row_shape = (layout.num_layers, layout.page_size_bytes)
        self._check_dirs(path)
        if path.is_symlink():
            raise _BadFile("is a symbolic link; the storage connector follows no link below "
                           "its root")
        if not path.is_file():
            raise FileNotFoundError(path)
        try:
            with self._st.safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                names = list(f.keys())
                tensor = f.get_tensor(_TENSOR) if names == [_TENSOR] else None
        except FileNotFoundError:
            raise
        except Exception as exc:  # safetensors reports truncation and garbage as many types
            raise _BadFile(f"unreadable safetensors file ({type(exc).__name__}: {exc})") from exc
        if metadata.get("format") != FILE_FORMAT:
            raise _BadFile(f"format {metadata.get('format')!r}, expected {FILE_FORMAT!r}")
        if tensor is None:
            raise _BadFile(f"holds tensors {names}, expected exactly [{_TENSOR!r}]")
        try:  # json raises RecursionError on deep nesting; from_dict only ValueError
            theirs = KVCacheLayout.from_dict(json.loads(metadata.get("layout", "")))
        except (ValueError, RecursionError) as exc:
            raise _BadFile(f"unreadable layout metadata ({type(exc).__name__}: "
                           f"{str(exc)[:300]})") from exc
        # Files hold block rows, alike for per-layer and cross-layer caches of one order.
        diffs = block_rows_layout(theirs).differences(block_rows_layout(layout),
                                                      ignore_num_blocks=True)
        if diffs:
            raise _BadFile(f"layout mismatch (file {theirs.describe()}; this cache "
                           f"{layout.describe()}): {'; '.join(diffs)}")
        if tensor.dtype != torch.uint8 or tuple(tensor.shape) != row_shape:
            raise _BadFile(f"tensor is {tensor.dtype} {tuple(tensor.shape)}, expected uint8 "
                           f"{row_shape}")
        tensor = tensor.contiguous()
        digest = hashlib.sha256(_host_buffer(tensor)).hexdigest()
        if digest != metadata.get("sha256"):
            raise _BadFile(f"checksum mismatch (file says {metadata.get('sha256')}, bytes hash "
                           f"to {digest})")
        return tensor

    def _unlink(self, path: Path) -> None:
        """Delete a bad block file (a link itself, never its target); one that cannot be
        deleted (read-only share, or its directory became a link) stays, and the next load or
        save checks it again."""
        with contextlib.suppress(OSError, _LinkedDir):
            self._check_dirs(path)
            path.unlink(missing_ok=True)
