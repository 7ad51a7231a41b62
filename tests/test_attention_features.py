"""Attention sinks and the logit soft-cap in kvcore's contract: the impl's checks and its
refusal of a feature its backend does not declare, the selector field and its reasons, and
CPU_ATTN's batched op against the references (float64, fresh random data each case)."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import kvcore
from kvcore.backends.cpu_attn import CpuAttentionImpl
from kvcore.ops import paged_attention_ref, paged_attention_torch
from kvcore.testing import contiguous_attention_ref, random_block_tables


def _gen(name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def make_step(gen, q_lens, seq_lens, *, num_heads=8, num_kv_heads=2, head_size=32,
              block_size=8, dtype=torch.float64):
    pages = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages) + 2
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    for i, ids in enumerate(random_block_tables(seq_lens, block_size, num_blocks, gen)):
        table[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    kc = torch.randn(shape, generator=gen).to(dtype)
    vc = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, kc, vc, dict(query_start_loc=qsl, seq_lens=torch.tensor(seq_lens),
                               block_table=table, scale=head_size ** -0.5)


# -- the impl ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"logits_soft_cap": 0.0}, ValueError, r"logits_soft_cap=0\.0 must be None or a finite"),
    ({"logits_soft_cap": -5.0}, ValueError, "logits_soft_cap=-5.0"),
    ({"logits_soft_cap": float("nan")}, ValueError, "logits_soft_cap=nan"),
    ({"logits_soft_cap": True}, ValueError, "logits_soft_cap=True"),
    ({"sinks": [0.0] * 8}, TypeError, "sinks must be None or a torch.Tensor"),
    ({"sinks": torch.zeros(4)}, ValueError, r"sinks has shape \(4,\).*num_heads=8"),
    ({"sinks": torch.zeros(8, 1)}, ValueError, r"must be 1-D of length num_heads=8"),
    ({"sinks": torch.zeros(8, dtype=torch.int32)}, ValueError, "floating point"),
], ids=["cap-zero", "cap-negative", "cap-nan", "cap-bool", "sinks-list", "sinks-length",
        "sinks-2d", "sinks-int"])
def test_the_impl_refuses_bad_feature_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        CpuAttentionImpl(8, 32, 32 ** -0.5, 2, **kwargs)


def test_the_impl_keeps_its_features_for_the_op():
    sinks = torch.zeros(8)
    impl = CpuAttentionImpl(8, 32, 32 ** -0.5, 2, logits_soft_cap=50, sinks=sinks)
    assert impl.logits_soft_cap == 50.0 and impl.sinks is sinks
    assert impl.attention_features == {"logits_soft_cap": 50.0, "sinks": sinks}
    assert CpuAttentionImpl(8, 32, 0.1, 2).attention_features == {}


def test_an_impl_refuses_a_feature_its_backend_does_not_declare():
    class PlainImpl(CpuAttentionImpl):
        pass

    class Plain(kvcore.AttentionBackend):
        NAME = "PLAIN_ATTN"
        IMPL_CLS = PlainImpl
        PLATFORMS = ("cpu",)

    assert PlainImpl.BACKEND is Plain
    with pytest.raises(NotImplementedError, match=(
            r"sinks=a tensor of shape \(8,\): PlainImpl \(backend PLAIN_ATTN\) does not "
            r"support attention sinks \(its backend does not declare SUPPORTS_SINK\); choose "
            r"a backend that does \(kvcore select --sink --explain lists them\)")):
        PlainImpl(8, 32, 0.1, 2, sinks=torch.zeros(8))
    with pytest.raises(NotImplementedError, match="logits_soft_cap=30: PlainImpl"):
        PlainImpl(8, 32, 0.1, 2, logits_soft_cap=30.0)
    PlainImpl(8, 32, 0.1, 2)  # without the features it runs as before


def test_a_backend_reusing_an_impl_honours_its_own_declarations_whatever_the_order():
    class SharedImpl(CpuAttentionImpl):
        pass

    class First(kvcore.AttentionBackend):  # binds SharedImpl, declares nothing
        NAME = "FIRST_ATTN"
        IMPL_CLS = SharedImpl
        PLATFORMS = ("cpu",)

    class Capped(kvcore.AttentionBackend):  # reuses it, declares the soft-cap only
        NAME = "CAPPED_ATTN"
        IMPL_CLS = SharedImpl
        PLATFORMS = ("cpu",)
        SUPPORTS_LOGITS_SOFT_CAP = True

    class Same(kvcore.AttentionBackend):  # reuses it with First's declarations
        NAME = "SAME_ATTN"
        IMPL_CLS = SharedImpl
        PLATFORMS = ("cpu",)

    class CappedChild(Capped):  # inherits Capped's impl and adds sinks
        NAME = "CAPPED_CHILD_ATTN"
        SUPPORTS_SINK = True

    assert First.get_impl_cls() is SharedImpl and SharedImpl.BACKEND is First
    assert Same.get_impl_cls() is SharedImpl
    capped = Capped.get_impl_cls()
    assert capped is not SharedImpl and issubclass(capped, SharedImpl)
    assert capped.BACKEND is Capped and capped.__qualname__ == SharedImpl.__qualname__
    assert capped(8, 32, 0.1, 2, logits_soft_cap=30.0).logits_soft_cap == 30.0
    with pytest.raises(NotImplementedError, match=r"logits_soft_cap=30: SharedImpl \(backend "
                                                  r"FIRST_ATTN\) does not support"):
        First.get_impl_cls()(8, 32, 0.1, 2, logits_soft_cap=30.0)
    with pytest.raises(NotImplementedError, match=r"sinks=.*\(backend CAPPED_ATTN\)"):
        capped(8, 32, 0.1, 2, sinks=torch.zeros(8))
    child = CappedChild.get_impl_cls()
    assert child.BACKEND is CappedChild
    assert child(8, 32, 0.1, 2, sinks=torch.zeros(8), logits_soft_cap=5.0).attention_features


# -- selection ---------------------------------------------------------------------------------

def test_the_selector_field_refuses_a_backend_without_the_capability():
    config = kvcore.AttentionSelectorConfig(head_size=64, has_logits_soft_cap=True,
                                            has_sink=True, dtype=torch.float32)
    assert kvcore.get_attn_backend(config, platform="cpu").get_name() == "CPU_ATTN"
    reasons = kvcore.resolve_backend("CPU_MLA").validate_configuration(
        **config.as_kwargs(), device_capability=None)
    assert "has_logits_soft_cap=True: CPU_MLA does not support logit soft-capping" in reasons
    assert "has_sink=True: CPU_MLA does not support attention sinks" in reasons
    with pytest.raises(TypeError, match="has_logits_soft_cap='yes' must be a bool"):
        kvcore.AttentionSelectorConfig(head_size=64, has_logits_soft_cap="yes")


@pytest.mark.parametrize("name", ["CPU_ATTN", "TRITON_ATTN", "TRITON_ATTN_HND"])
def test_the_portable_backends_declare_both_features(name):
    backend = kvcore.resolve_backend(name)
    assert backend.SUPPORTS_SINK and backend.SUPPORTS_LOGITS_SOFT_CAP
    assert {"has_sink", "has_logits_soft_cap"} <= set(backend.capabilities()["features"])


# -- the CPU op against the references --------------------------------------------------------

@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
@pytest.mark.parametrize(("has_sink", "cap"), [(True, None), (False, 1.5), (True, 1.5)],
                         ids=["sinks", "softcap", "both"])
def test_cpu_op_matches_the_contiguous_float64_reference(has_sink, cap, window):
    gen = _gen(f"cpu-{has_sink}-{cap}-{window}")
    q_lens, seq_lens = [1, 7, 1, 4], [19, 12, 3, 4]
    query, kc, vc, step = make_step(gen, q_lens, seq_lens)
    sinks = (torch.randn(8, generator=gen) + 2).double() if has_sink else None
    out = paged_attention_torch(query, kc, vc, **step, sliding_window=window,
                                logits_soft_cap=cap, sinks=sinks)
    ref = paged_attention_ref(query, kc, vc, **step, sliding_window=window,
                              logits_soft_cap=cap, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    # The paged reference agrees with the independent contiguous one, request by request.
    starts = step["query_start_loc"].tolist()
    for i, seq_len in enumerate(seq_lens):
        pages = step["block_table"][i, :-(-seq_len // 8)].long()
        k = kc[pages].flatten(0, 1)[:seq_len]
        v = vc[pages].flatten(0, 1)[:seq_len]
        expect = contiguous_attention_ref(query[starts[i]:starts[i + 1]], k, v, step["scale"],
                                          sliding_window=window, logits_soft_cap=cap,
                                          sinks=sinks)
        torch.testing.assert_close(ref[starts[i]:starts[i + 1]], expect, atol=1e-12,
                                   rtol=1e-12)


def test_limits_of_the_features_are_plain_attention():
    gen = _gen("limits")
    query, kc, vc, step = make_step(gen, [1, 5], [30, 5])
    plain = paged_attention_ref(query, kc, vc, **step)
    no_sink = paged_attention_ref(query, kc, vc, **step, sinks=torch.full((8,), -1e4).double())
    huge_cap = paged_attention_ref(query, kc, vc, **step, logits_soft_cap=1e9)
    torch.testing.assert_close(no_sink, plain, atol=1e-12, rtol=0)
    torch.testing.assert_close(huge_cap, plain, atol=1e-9, rtol=0)
    # A sink of log(n) beside n equal scores takes half of each row: the output halves.
    one = {**step, "query_start_loc": torch.tensor([0, 1]), "seq_lens": step["seq_lens"][:1],
           "block_table": step["block_table"][:1]}
    flat = torch.zeros_like(query[:1])
    sinks = torch.full((8,), math.log(30), dtype=torch.float64)
    half = paged_attention_ref(flat, kc, vc, **one, sinks=sinks)
    torch.testing.assert_close(half, paged_attention_ref(flat, kc, vc, **one) / 2, atol=1e-12,
                               rtol=0)


def test_cpu_op_keeps_a_request_s_bits_alone_and_in_a_batch_with_sinks():
    gen = _gen("invariant")
    query, kc, vc, step = make_step(gen, [1, 1, 1], [300, 40, 513], dtype=torch.float32)
    sinks = torch.randn(8, generator=gen) + 2
    batch = paged_attention_torch(query, kc, vc, **step, sinks=sinks, logits_soft_cap=3.0)
    alone = paged_attention_torch(query[1:2], kc, vc, query_start_loc=torch.tensor([0, 1]),
                                  seq_lens=step["seq_lens"][1:2],
                                  block_table=step["block_table"][1:2], scale=step["scale"],
                                  sinks=sinks, logits_soft_cap=3.0)
    assert torch.equal(batch[1:2], alone)
