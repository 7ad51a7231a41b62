"""The ``storage`` connector: safetensors files, atomic writes, integrity checks on load."""

from __future__ import annotations

import json
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kv_helpers import DTYPES, SIZES, block_bytes, keys_for, make_caches
from safetensors import SafetensorError, safe_open

import kvcore
from kvcore import KVCaches
from kvcore.connectors import KVTransferError, get_connector
from kvcore.connectors.storage import FILE_FORMAT, StorageConnector


def storage_for(kv: KVCaches, root: Path, **config) -> StorageConnector:
    conn = get_connector("storage", root=root, **config)
    conn.register_kv_caches(kv)
    return conn


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("cross", [False, True], ids=["per_layer", "cross_layer"])
def test_blocks_survive_the_process_bit_exact(tmp_path, cross, dtype):
    writer = make_caches(cross_layer=cross, dtype=dtype)
    keys = keys_for(random.randrange(2**31), 4)
    with storage_for(writer, tmp_path) as conn:
        assert conn.save(keys, [2, 5, 6, 10]).wait().ok
    # Another engine (new cache, new connector) on the same root.
    reader = make_caches(cross_layer=cross, dtype=dtype)
    untouched = block_bytes(reader, [0, 1])
    with storage_for(reader, tmp_path) as conn:
        assert conn.lookup(keys) == 4
        result = conn.load(keys, [9, 3, 11, 4]).wait()
    assert result.succeeded == (9, 3, 11, 4) and not result.failed
    assert torch.equal(block_bytes(reader, [9, 3, 11, 4]), block_bytes(writer, [2, 5, 6, 10]))
    assert torch.equal(block_bytes(reader, [0, 1]), untouched)


def test_file_is_safetensors_with_layout_and_checksum(tmp_path):
    kv = make_caches(cross_layer=False, dtype="fp8")
    (key,) = keys_for(random.randrange(2**31), 1)
    with storage_for(kv, tmp_path) as conn:
        conn.save([key], [7]).wait()
        path = conn.path_of(key)
    assert path.is_relative_to(tmp_path) and path.name == f"{key}.safetensors"
    raw = path.read_bytes()
    header_len = struct.unpack("<Q", raw[:8])[0]
    assert raw[8:9] == b"{"  # a JSON header: no pickle anywhere
    assert json.loads(raw[8:8 + header_len])["kv"]["dtype"] == "U8"
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensor = f.get_tensor("kv")
    assert meta["format"] == FILE_FORMAT
    assert (meta["dtype"], meta["block_size"]) == ("float8_e4m3fn", "4")
    assert json.loads(meta["layout"]) == kv.layout.to_dict()
    assert len(meta["sha256"]) == 64
    assert tuple(tensor.shape) == (kv.num_layers, kv.page_size_bytes)
    assert torch.equal(tensor, block_bytes(kv, [7])[0])
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_faults_fail_exactly_the_bad_blocks_and_stay_failed(tmp_path):
    kv = make_caches(cross_layer=True)
    keys = keys_for(random.randrange(2**31), 6)
    with storage_for(kv, tmp_path) as conn:
        assert conn.save(keys, [0, 1, 2, 3, 4, 5]).wait().ok
        good = block_bytes(kv, [0, 5])
        paths = [conn.path_of(k) for k in keys]

        data = bytearray(paths[1].read_bytes())
        data[-3] ^= 0x5A  # one flipped bit pattern in the block bytes
        paths[1].write_bytes(bytes(data))
        paths[2].write_bytes(paths[2].read_bytes()[:-100])  # truncated
        paths[3].unlink()  # missing
        # A block written by an HND engine, dropped into this engine's directory.
        with storage_for(make_caches(cross_layer=True, layout="hnd"), tmp_path / "hnd") as hnd:
            hnd.save([keys[4]], [4]).wait()
            shutil.copy(hnd.path_of(keys[4]), paths[4])

        before = block_bytes(kv, [6, 7, 8, 9])
        result = conn.load([*keys[1:5], keys[0], keys[5]], [6, 7, 8, 9, 10, 11]).wait()
        assert result.succeeded == (10, 11)
        assert set(result.failed) == {6, 7, 8, 9}
        assert "checksum mismatch" in result.failed[6]
        assert "unreadable safetensors file" in result.failed[7]
        assert "no file for key" in result.failed[8]
        assert "layout mismatch" in result.failed[9]
        assert "B,L,2,H,N,D" in result.failed[9] and "B,L,2,N,H,D" in result.failed[9]
        assert torch.equal(block_bytes(kv, [10, 11]), good)
        assert torch.equal(block_bytes(kv, [6, 7, 8, 9]), before)  # no partial writes
        # The bad files are gone: the scheduler is not offered them again.
        assert [conn.lookup([k]) for k in keys] == [1, 0, 0, 0, 0, 1]
        assert conn.stats.failed_blocks == 4


def test_interrupted_write_leaves_no_file_and_fails_the_block(tmp_path, monkeypatch):
    import safetensors.torch

    kv = make_caches(cross_layer=False)
    keys = keys_for(random.randrange(2**31), 2)
    real_save_file = safetensors.torch.save_file

    def disk_full_on_second(tensors, filename, metadata):
        if Path(filename).name.startswith(f".{keys[1]}"):
            Path(filename).write_bytes(b"partial")
            raise OSError(28, "No space left on device")
        real_save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full_on_second)
    with storage_for(kv, tmp_path) as conn:
        result = conn.save(keys, [3, 4]).wait()
        assert result.succeeded == (3,) and list(result.failed) == [4]
        assert "No space left on device" in result.failed[4]
        assert conn.lookup(keys) == 1
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [f"{keys[0]}.safetensors"]


def test_write_errors_of_any_type_fail_their_blocks_and_keep_the_written_ones(tmp_path,
                                                                             monkeypatch):
    import safetensors.torch

    kv = make_caches(cross_layer=True)
    keys = keys_for(random.randrange(2**31), 4)
    real_save_file = safetensors.torch.save_file
    calls = []

    def full_after_two(tensors, filename, metadata):
        calls.append(filename)
        if len(calls) > 2:  # what safetensors raises on ENOSPC: not an OSError
            raise SafetensorError("Error while serializing: I/O error: No space left on "
                                  "device (os error 28)")
        real_save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_after_two)
    with storage_for(kv, tmp_path) as conn:
        result = conn.save(keys, [3, 4, 5, 6]).wait()
        assert result.succeeded == (3, 4) and set(result.failed) == {5, 6}
        assert "SafetensorError: Error while serializing" in result.failed[5]
        assert result.num_bytes == 2 * conn.block_bytes
        assert (conn.stats.saved_blocks, conn.stats.failed_blocks) == (2, 2)
        assert conn.lookup(keys) == 2
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def _can_mount_tmpfs() -> bool:
    try:
        return subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
def test_full_filesystem_fails_the_blocks_that_did_not_fit(tmp_path):
    if not _can_mount_tmpfs():
        pytest.skip("cannot mount a tmpfs here (needs unshare -Urm: user namespaces)")
    # A 256 KiB tmpfs in a private mount namespace holds 4 to 5 files of 48 KiB blocks.
    script = Path(__file__).with_name("storage_full_disk.py")
    proc = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", 'mount -t tmpfs -o size=256k tmpfs "$0" && '
         'exec "$1" "$2" "$0"', str(tmp_path), sys.executable, str(script)],
        capture_output=True, text=True, timeout=300, cwd=script.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    succeeded, failed = report["succeeded"], {int(b): why for b, why in
                                              report["failed"].items()}
    assert 0 < len(succeeded) < 12 and sorted(succeeded + list(failed)) == list(range(12))
    assert all("No space left on device" in why for why in failed.values())
    assert report["num_bytes"] == len(succeeded) * report["block_bytes"]
    assert report["stats"] == {"saved_blocks": len(succeeded), "failed_blocks": len(failed)}
    # Exactly the reported blocks are on disk, whole (they load bit-exact), no temp files.
    assert report["files"] == sorted(f"{report['keys'][b]}.safetensors" for b in succeeded)
    assert report["loaded_ok"] and report["exact"]


@pytest.mark.parametrize("damage", ["flipped_byte", "truncated", "not_safetensors"])
def test_saving_over_a_corrupted_file_rewrites_it(tmp_path, damage):
    kv = make_caches(cross_layer=False)
    keys = keys_for(random.randrange(2**31), 2)
    with storage_for(kv, tmp_path) as conn:
        assert conn.save(keys, [1, 2]).wait().ok
        path = conn.path_of(keys[0])
        data = path.read_bytes()
        bad = {"flipped_byte": data[:-3] + bytes([data[-3] ^ 0x5A]) + data[-2:],
               "truncated": data[:-100],
               "not_safetensors": b"garbage"}[damage]
        path.write_bytes(bad)
        result = conn.save(keys, [1, 2]).wait()
        assert result.succeeded == (1, 2) and result.num_bytes == conn.block_bytes  # 1 copy
        assert path.read_bytes() != bad
        assert conn.load(keys, [5, 6]).wait().ok  # verified: layout and checksum
    assert torch.equal(block_bytes(kv, [5, 6]), block_bytes(kv, [1, 2]))


@pytest.mark.parametrize("layout", [
    '{"version": 1, "logical_shape": [Infinity, 4, 2, 4, 2, 8], "stride_order": [1, 0, 2, 3, '
    '4, 5], "dim_names": ["L", "B", "2", "N", "H", "D"], "dtype": "float32"}',
    "[" * 100_000 + "]" * 100_000,
    '{"version": 1, "logical_shape": ' + "[" * 5000 + "]" * 5000 + "}",
], ids=["infinity", "deep_json", "deep_field"])
def test_a_file_with_malformed_layout_metadata_is_one_failed_block(tmp_path, layout):
    """Bad metadata fails its block and removes its file; the other blocks of the same load
    and save go through, and lookup stops offering it."""
    import safetensors.torch

    kv = make_caches(cross_layer=True)
    keys = keys_for(random.randrange(2**31), 3)
    with storage_for(kv, tmp_path) as conn:
        assert conn.save(keys, [0, 1, 2]).wait().ok
        path = conn.path_of(keys[1])
        with safe_open(str(path), framework="pt") as f:
            metadata, tensor = f.metadata(), f.get_tensor("kv")
        safetensors.torch.save_file({"kv": tensor}, str(path),
                                    metadata={**metadata, "layout": layout})
        result = conn.load(keys, [5, 6, 7]).wait()
        assert result.succeeded == (5, 7) and list(result.failed) == [6]
        assert "unreadable layout metadata" in result.failed[6]
        assert not path.exists() and conn.lookup(keys) == 1
        safetensors.torch.save_file({"kv": tensor}, str(path),
                                    metadata={**metadata, "layout": layout})
        result = conn.save(keys, [0, 1, 2]).wait()  # rewrites the bad file
        assert result.ok and result.num_bytes == conn.block_bytes
        assert conn.lookup(keys) == 3 and conn.load(keys[1:2], [6]).wait().ok
    assert torch.equal(block_bytes(kv, [5, 6, 7]), block_bytes(kv, [0, 1, 2]))


def test_a_failed_rewrite_of_a_corrupted_file_is_reported_and_leaves_no_file(tmp_path,
                                                                              monkeypatch):
    import safetensors.torch

    kv = make_caches(cross_layer=True)
    (key,) = keys_for(random.randrange(2**31), 1)
    with storage_for(kv, tmp_path) as conn:
        assert conn.save([key], [0]).wait().ok
        path = conn.path_of(key)
        path.write_bytes(path.read_bytes()[:-100])

        def disk_full(tensors, filename, metadata):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
        result = conn.save([key], [0]).wait()
        assert result.succeeded == () and "No space left on device" in result.failed[0]
        assert not path.exists() and conn.lookup([key]) == 0


def test_fail_policy_raises_with_the_result(tmp_path):
    kv = make_caches(cross_layer=True)
    keys = keys_for(random.randrange(2**31), 2)
    with storage_for(kv, tmp_path, failure_policy="fail") as conn:
        conn.save(keys[:1], [0]).wait()
        with pytest.raises(KVTransferError, match=r"load failed for 1 of 2 blocks: block 5: "
                                                  r"no file for key") as info:
            conn.load(keys, [4, 5]).wait()
    assert info.value.result.succeeded == (4,)


def test_engines_with_other_layouts_do_not_share_files(tmp_path):
    keys = keys_for(random.randrange(2**31), 1)
    with storage_for(make_caches(cross_layer=False), tmp_path) as nhd, \
            storage_for(make_caches(cross_layer=False, layout="hnd"), tmp_path) as hnd:
        nhd.save(keys, [1]).wait()
        assert (nhd.lookup(keys), hnd.lookup(keys)) == (1, 0)
        assert nhd.path_of(keys[0]).parent.parent != hnd.path_of(keys[0]).parent.parent


def test_path_escaping_keys_are_refused(tmp_path):
    kv = make_caches(cross_layer=True)
    with storage_for(kv, tmp_path / "root") as conn:
        for call in (lambda: conn.save(["../../etc/passwd"], [0]),
                     lambda: conn.load(["../../etc/passwd"], [0]),
                     lambda: conn.lookup(["../../etc/passwd"])):
            with pytest.raises(ValueError, match=r"keys\[0\]='../../etc/passwd' is not a block"):
                call()
        with pytest.raises(ValueError, match=r"key\[0\]='/etc/passwd'"):
            conn.path_of("/etc/passwd")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]


@pytest.mark.parametrize("where", ["namespace", "shard", "file"])
def test_symbolic_links_below_the_root_are_never_followed(tmp_path, where):
    """A link at the namespace dir, the two-character shard dir or the block file itself:
    lookup does not offer the key, load refuses it and deletes nothing outside the root, and
    save writes nothing there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    kv = make_caches(cross_layer=True)
    (key,) = keys_for(random.randrange(2**31), 1)
    with storage_for(kv, tmp_path / "root") as conn:
        path = conn.path_of(key)
        if where == "file":  # a valid block file of this key, outside the root
            assert conn.save([key], [2]).wait().ok
            target = elsewhere / path.name
            path.rename(target)
            path.symlink_to(target)
        else:  # a damaged file where the link leads: a load would delete it, a save rewrite it
            link = path.parent if where == "shard" else path.parent.parent
            target = elsewhere / path.relative_to(link)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(b"not a block")
            if link.exists():
                shutil.rmtree(link)
            link.symlink_to(elsewhere, target_is_directory=True)
        before = target.read_bytes()
        assert conn.lookup([key]) == 0
        result = conn.load([key], [5]).wait()
        assert list(result.failed) == [5] and "symbolic link" in result.failed[5]
        assert target.read_bytes() == before
        result = conn.save([key], [2]).wait()
        assert target.read_bytes() == before
        assert sorted(p.name for p in elsewhere.rglob("*")) == sorted(
            p.name for p in [target, *target.relative_to(elsewhere).parents][:-1])
        if where == "file":  # the link is replaced by a real file under the root
            assert result.ok and path.is_file() and not path.is_symlink()
            assert conn.lookup([key]) == 1
        else:
            assert list(result.failed) == [2] and "symbolic link" in result.failed[2]
            assert conn.lookup([key]) == 0


def test_bad_config_names_the_option():
    with pytest.raises(ValueError, match="num_workers=0 must be a positive integer"):
        get_connector("storage", root="/tmp/x", num_workers=0)
    with pytest.raises(TypeError, match="root must be a directory path, got 5"):
        get_connector("storage", root=5)


@pytest.mark.gpu
def test_cuda_cache_roundtrip_bit_exact(tmp_path):
    kv = kvcore.allocate_kv_caches("CPU_ATTN", **SIZES, dtype=torch.float16, device="cuda",
                                   cross_layer=False)
    kv.storage.copy_(torch.randn(kv.storage.shape, device="cuda"))
    keys = keys_for(random.randrange(2**31), 3)
    with storage_for(kv, tmp_path) as conn:
        saved = block_bytes(kv, [0, 4, 8])
        assert conn.save(keys, [0, 4, 8]).wait().ok
        assert conn.load(keys, [1, 5, 9]).wait().ok
        assert torch.equal(block_bytes(kv, [1, 5, 9]), saved)


def test_missing_safetensors_names_the_extra(tmp_path, monkeypatch):
    for name in ("safetensors", "safetensors.torch"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'kvcore\[storage\]'"):
        get_connector("storage", root=tmp_path)
