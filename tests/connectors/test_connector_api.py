"""The connector API shared by every connector: registry, validation, policies, lifetime."""

from __future__ import annotations

import random

import pytest
import torch
from kv_helpers import HndBackend, InterleavedBackend, LegacyBackend, keys_for, make_caches

import kvcore
from kvcore.backends.cpu_attn import CpuAttentionBackend
from kvcore.connectors import (
    KVConnector,
    KVTransferError,
    TransferHandle,
    TransferResult,
    get_connector,
)
from kvcore.connectors.offload import OffloadConnector
from kvcore.connectors.p2p import P2PConnector
from kvcore.connectors.storage import StorageConnector


@pytest.fixture(params=["offload", "storage"])
def connector(request, tmp_path) -> KVConnector:
    config = {"offload": {"capacity_bytes": 1 << 20}, "storage": {"root": tmp_path}}
    with get_connector(request.param, **config[request.param]) as conn:
        yield conn


def test_builtins_register_through_the_hook_lazily(fresh_kvcore):
    import subprocess
    import sys

    registry = kvcore.connector_registry()
    builtins = {n for n in registry.names() if registry.get(n).plugin == "builtin_connectors"}
    assert builtins == {"mooncake", "nixl", "offload", "p2p", "storage"}
    code = ("import sys, kvcore; kvcore.connector_registry()\n"
            "print(sorted(m for m in sys.modules if m.startswith(('kvcore.connectors.',"
            " 'safetensors'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    # Registering imported the hook module and the public API's modules (the layout
    # conversion plan and the TP rank arithmetic among them), not a connector (nor
    # safetensors).
    assert out == "['kvcore.connectors.base', 'kvcore.connectors.blocks', " \
                  "'kvcore.connectors.builtin', 'kvcore.connectors.convert', " \
                  "'kvcore.connectors.convert_args', 'kvcore.connectors.copiers', " \
                  "'kvcore.connectors.keys', " \
                  "'kvcore.connectors.tp']"


@pytest.mark.parametrize(("name", "cls"), [("offload", OffloadConnector),
                                           ("OFFLOAD", OffloadConnector),
                                           ("storage", StorageConnector)])
def test_get_connector_resolves_by_name(tmp_path, name, cls):
    config = {"capacity_bytes": 4096} if cls is OffloadConnector else {"root": tmp_path}
    with get_connector(name, **config) as conn:
        assert type(conn) is cls


def test_unknown_connector_lists_the_valid_names(fresh_kvcore, monkeypatch):
    monkeypatch.setenv("KVCORE_DISABLE_PLUGIN_AUTOLOAD", "1")  # only kvcore's own connectors
    kvcore.reset_plugins()
    with pytest.raises(kvcore.UnknownNameError,
                       match="unknown KV connector 'lmcache'; valid options are: mooncake, nixl, "
                             "offload, p2p, storage$"):
        get_connector("lmcache")


def test_unknown_and_missing_options_are_named():
    with pytest.raises(TypeError, match=r"connector 'offload': unknown option\(s\) capacity; "
                                        r"missing option\(s\) capacity_bytes \(options: "
                                        r"block_copier, capacity_bytes, chunk_bytes, "
                                        r"failure_policy, pin_in_background\)"):
        get_connector("offload", capacity=1 << 20)


def test_failure_policy_is_validated():
    with pytest.raises(ValueError, match="failure_policy='retry' must be one of 'recompute', "
                                         "'fail'"):
        get_connector("offload", capacity_bytes=4096, failure_policy="retry")


def test_transfers_need_registered_caches(connector):
    for call in (lambda: connector.save(keys_for(1, 1), [0]),
                 lambda: connector.load(keys_for(1, 1), [0]),
                 lambda: connector.lookup(keys_for(1, 1))):
        with pytest.raises(ValueError, match=r"call register_kv_caches\(kv_caches\) first"):
            call()


def test_register_checks_its_argument(connector):
    with pytest.raises(TypeError, match="kv_caches must be a kvcore.KVCaches"):
        connector.register_kv_caches(torch.zeros(4, 2))
    connector.register_kv_caches(make_caches(cross_layer=True))
    with pytest.raises(ValueError, match="already has KV caches registered"):
        connector.register_kv_caches(make_caches(cross_layer=True))


def test_legacy_layout_is_refused_with_its_reason(connector):
    with pytest.raises(ValueError, match="block is not one contiguous byte run"):
        connector.register_kv_caches(make_caches(cross_layer=False, layout="legacy"))


@pytest.mark.parametrize(
    ("keys", "block_ids", "error", "message"),
    [("abc", [0], TypeError, "keys must be a list or tuple"),
     (["ABCDEF0123456789"], [0], ValueError, r"keys\[0\]='ABCDEF0123456789' is not a block key"),
     ([None], [0], TypeError, r"keys\[0\] must be a str hex digest"),
     (2, [0], TypeError, "keys must be a list or tuple"),
     ("k2", [0], ValueError, "keys has 2 entries but block_ids has 1"),
     ("k1", [12], ValueError, r"block_ids\[0\]=12 is outside the cache's 12 blocks"),
     ("k1", [-1], ValueError, r"block_ids\[0\]=-1 is outside"),
     ("k1", [True], TypeError, r"block_ids\[0\]=True must be an int"),
     ("k1", 0, TypeError, "block_ids must be a sequence of ints or a 1-D integer tensor"),
     ("k1", torch.tensor([[0]]), TypeError, "block_ids must be a 1-D int32/int64 tensor")],
    ids=["keys_str", "upper_case", "not_str", "keys_int", "count", "id_high", "id_negative",
         "id_bool", "ids_int", "ids_2d"])
def test_bad_transfer_arguments_are_named(connector, keys, block_ids, error, message):
    connector.register_kv_caches(make_caches(cross_layer=False))
    if keys in ("k1", "k2"):
        keys = keys_for(3, int(keys[1]))
    for call in (connector.save, connector.load):
        with pytest.raises(error, match=message):
            call(keys, block_ids)


def test_duplicates_are_refused(connector):
    connector.register_kv_caches(make_caches(cross_layer=True))
    keys = keys_for(4, 2)
    with pytest.raises(ValueError, match=rf"keys repeats \['{keys[0]}'\]"):
        connector.save([keys[0], keys[0]], [0, 1])
    with pytest.raises(ValueError, match=r"block_ids repeats \[3\]"):
        connector.load(keys, [3, 3])


def test_block_ids_may_be_a_tensor(connector):
    kv = make_caches(cross_layer=True)
    connector.register_kv_caches(kv)
    keys = keys_for(random.randrange(2**31), 2)
    assert connector.save(keys, torch.tensor([4, 2], dtype=torch.int32)).wait().succeeded == (4, 2)


def test_path_escaping_key_is_refused_by_every_connector(connector):
    connector.register_kv_caches(make_caches(cross_layer=True))
    with pytest.raises(ValueError, match=r"keys\[1\]='../../etc/passwd' is not a block key"):
        connector.save([keys_for(5, 1)[0], "../../etc/passwd"], [0, 1])


def test_fail_policy_raises_on_a_failed_load_only():
    kv = make_caches(cross_layer=False)
    keys = keys_for(random.randrange(2**31), 2)
    with get_connector("offload", capacity_bytes=1 << 20, failure_policy="fail") as conn:
        conn.register_kv_caches(kv)
        assert conn.save(keys[:1], [1]).wait().ok
        with pytest.raises(KVTransferError, match="load failed for 1 of 2 blocks") as info:
            conn.load(keys, [2, 3]).wait()
        assert info.value.result.succeeded == (2,)
        assert list(info.value.result.failed) == [3]


def test_closed_connector_refuses_work(connector):
    connector.register_kv_caches(make_caches(cross_layer=True))
    connector.close()
    connector.close()  # idempotent
    with pytest.raises(ValueError, match="is closed"):
        connector.load(keys_for(6, 1), [0])
    with pytest.raises(ValueError, match="is closed"):
        connector.lookup(keys_for(6, 1))


def test_handle_wait_timeout_and_result():
    result = TransferResult("load", (1, 2), {}, 2_000_000_000, 0.5)
    handle = TransferHandle("load", "recompute", lambda: False, lambda t: False, lambda: result)
    assert not handle.done()
    with pytest.raises(TimeoutError, match=r"load still running after timeout=0.01 s"):
        handle.wait(timeout=0.01)
    assert TransferHandle.completed("load", "recompute", result).wait() is result
    assert result.gbps == 4.0 and result.ok


@pytest.mark.parametrize("timeout", [-1, -0.5, float("nan"), -float("inf"), True, "1", [1]],
                         ids=repr)
def test_handle_wait_refuses_a_timeout_that_is_no_duration_before_waiting(timeout):
    blocked = []
    handle = TransferHandle("save", "recompute", lambda: False,
                            lambda t: blocked.append(t) or False, lambda: None)
    with pytest.raises(ValueError, match=r"timeout=.* must be None \(no limit\), math.inf "
                       r"\(no limit\) or a number of seconds >= 0"):
        handle.wait(timeout=timeout)
    assert blocked == []  # refused before any wait


def test_handle_wait_with_an_infinite_timeout_waits_without_limit():
    result = TransferResult("load", (1,), {}, 8, 0.5)
    waited = []
    handle = TransferHandle("load", "recompute", lambda: False,
                            lambda t: waited.append(t) or True, lambda: result)
    assert handle.wait(timeout=float("inf")) is result
    assert waited == [None]  # "no limit", never a deadline computed from inf


def test_handle_of_a_transfer_that_raised_is_done_and_wait_raises():
    from concurrent.futures import Future

    future: Future = Future()
    future.set_exception(RuntimeError("worker died"))
    handle = TransferHandle.from_future("save", "recompute", future)
    assert handle.done()  # polling never raises
    for _ in range(2):
        with pytest.raises(RuntimeError, match="worker died"):
            handle.wait(timeout=0)
    calls = []

    def collect():
        calls.append(1)
        raise OSError("disk gone")

    handle = TransferHandle("load", "recompute", lambda: True, lambda t: True, collect)
    assert handle.done() and handle.done()
    with pytest.raises(OSError, match="disk gone"):
        handle.wait()
    assert len(calls) == 1  # collect releases resources: it runs once


@pytest.mark.parametrize(
    ("connector_cls", "backend", "expected"),
    [(OffloadConnector, CpuAttentionBackend, True),
     (StorageConnector, HndBackend, True),
     (OffloadConnector, InterleavedBackend, True),
     (OffloadConnector, LegacyBackend, False),  # no cross-layer support
     (P2PConnector, CpuAttentionBackend, False)],  # prefers per-layer
    ids=["offload-cpu_attn", "storage-hnd", "offload-interleaved", "offload-legacy",
         "p2p-cpu_attn"])
def test_cross_layer_allocation_follows_the_connector(connector_cls, backend, expected):
    cross = connector_cls.cross_layer_for(backend)
    assert cross is expected
    kv = kvcore.allocate_kv_caches(backend, num_layers=2, num_blocks=4, block_size=4,
                                   num_kv_heads=1, head_size=8, dtype=torch.float16,
                                   device="cpu", cross_layer=cross)
    assert kv.is_cross_layer is expected
