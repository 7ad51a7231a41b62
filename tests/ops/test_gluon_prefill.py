"""The Gluon Hopper prefill kernel ``gluon_ws_pingpong`` (:class:`GluonPrefillConfig`,
:mod:`kvcore.ops.gluon_prefill`).

On the CPU: what :func:`gluon_prefill_unmet` refuses, how a :data:`GLUON_PREFILL_TILES` row
is picked and falls back to the Triton row, and (slow) an ahead-of-time compile for sm90 that
checks the schedule the kernel exists for. On an sm90 GPU (``gpu``): the kernel
against the float64 and fp32 references on prefill, chunked-prefill and mixed batches, GQA
groups with padded rows, both head sizes and tiles, windows, non-causal, caches seen through
cross-layer views (bit-exact against contiguous copies) and NaN in every slot a request does
not own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from test_triton_attention import check_against_references, make_batch

from kvcore.ops import GluonPrefillConfig, paged_attention_ref
from kvcore.ops import TritonAttentionPlan as Plan
from kvcore.ops import attention_config as tables

triton_attention = pytest.importorskip("kvcore.ops.triton_attention")
dispatch = pytest.importorskip("kvcore.ops.attention_dispatch")


def gluon_config(num_heads: int, num_kv_heads: int, block_n: int = 128,
                 num_stages: int = 3) -> GluonPrefillConfig:
    """A ``gluon_ws_pingpong`` config for this GQA group."""
    g_pad = 1 << (num_heads // num_kv_heads - 1).bit_length()
    return GluonPrefillConfig(block_q=128 // g_pad, g_pad=g_pad, block_n=block_n,
                              num_stages=num_stages)


def gluon_plan(*args, **kwargs) -> Plan:
    return Plan(config=gluon_config(*args, **kwargs))


#: (block_n, num_stages) of the GPU tests, with their ids.
TILES = {"n64-s3": (64, 3), "n128-s3": (128, 3)}


def _cpu_args(dtype=torch.bfloat16, head_size=128, cache_dtype=None):
    query = torch.randn(40, 8, head_size).to(dtype)
    k = torch.randn(6, 16, 2, head_size).to(cache_dtype or dtype)
    return query, k, k.clone()


REFUSALS = {
    "rows": (dict(block_q=16), {}, "runs 128"),
    "block-n": (dict(block_n=32), {}, "block_n 64 or 128"),
    "stages": (dict(num_stages=5), {}, "2 to 4 stages"),
    "smem": (dict(num_stages=4), {}, "shared memory"),
    "fp32-query": ({}, dict(dtype=torch.float32), "bf16 or fp16"),
    "fp8-cache": ({}, dict(cache_dtype=torch.float8_e4m3fn), "bf16 or fp16"),
    "head-size": ({}, dict(head_size=96), "head_size 64 or 128"),
    "cpu-device": ({}, {}, "Hopper|TRITON_INTERPRET"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_unmet_conditions_are_named_with_the_fix(case: str) -> None:
    if dispatch.gluon_prefill_available() is not None:
        pytest.skip(dispatch.gluon_prefill_available())
    change, args, match = REFUSALS[case]
    query, k, v = _cpu_args(**args)
    cfg = dataclasses.replace(gluon_config(8, 2, num_stages=2), **change)
    kv_dtype = "fp8_e4m3" if case == "fp8-cache" else "auto"
    reason = dispatch.gluon_prefill_unmet(query, k, v, kv_dtype, cfg)
    assert reason is not None and re.search(match, reason), reason
    assert "TritonPrefillConfig" in reason or "set " in reason or "use " in reason, reason


def test_cache_layouts_the_copies_cannot_read_are_refused() -> None:
    if dispatch.gluon_prefill_available() is not None:
        pytest.skip(dispatch.gluon_prefill_available())
    query, k, v = _cpu_args()
    cfg = gluon_config(8, 2)
    # Channels strided: the heads and channels dims swapped in memory.
    swapped = k.transpose(2, 3).contiguous().transpose(2, 3)
    reason = dispatch.gluon_prefill_unmet(query, swapped, v, "auto", cfg)
    assert "key_cache has channel stride" in reason, reason
    # A token stride of 260 elements (520 bytes): not a multiple of 16 bytes.
    odd = torch.randn(6, 16, 260).to(torch.bfloat16)[..., :256].unflatten(-1, (2, 128))
    reason = dispatch.gluon_prefill_unmet(query, k, odd, "auto", cfg)
    assert "value_cache's stride(1)" in reason and "16 bytes" in reason, reason


def test_the_gluon_config_on_the_cpu_raises_before_any_launch() -> None:
    if dispatch.gluon_prefill_available() is not None:
        pytest.skip(dispatch.gluon_prefill_available())
    batch = make_batch(torch.Generator().manual_seed(3), q_lens=[20], seq_lens=[20],
                       num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                       dtype=torch.bfloat16)
    if batch.query.is_cuda:
        pytest.skip("checks the CPU refusal")
    with pytest.raises(ValueError, match="Hopper|TRITON_INTERPRET"):
        triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                         **batch.kwargs(), plan=gluon_plan(8, 2, 64))


def test_default_config_picks_the_gluon_row_where_the_table_has_one(monkeypatch) -> None:
    row = tables.GluonPrefillTile(block_n=128, num_stages=2)
    monkeypatch.setitem(tables.GLUON_PREFILL_TILES, "sm90", row)
    cpu = torch.device("cpu")

    def config(num_tokens=8192, num_seqs=4, head_size=128, **kw):
        kw = dict(num_sms=132, rocm=False, arch="sm90") | kw
        return dispatch.default_config(num_tokens, num_seqs, 32, 8, head_size, 8192, cpu, **kw)

    cfg = config()
    assert cfg == GluonPrefillConfig(block_q=32, g_pad=4, block_n=128, num_stages=2)
    assert dispatch._gluon_config_unmet(cfg, 128) is None  # the table's row is a valid tile
    for other in (config(head_size=256), config(num_tokens=4), config(rocm=True),
                  config(arch="sm80"), config(gluon=False), config(num_kv_splits=2)):
        assert other.kernel != "gluon_ws_pingpong", other


def test_calls_the_gluon_kernel_cannot_run_fall_back_to_the_triton_row(monkeypatch) -> None:
    """With a Gluon row for this machine's arch, a call the Gluon kernel cannot run (here:
    no Hopper GPU, or the interpreter) runs the Triton prefill kernel with the table's row,
    not an error; an explicit Gluon config is still refused."""
    batch = make_batch(torch.Generator().manual_seed(8), q_lens=[40, 7], seq_lens=[40, 30],
                       num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                       dtype=torch.bfloat16)
    arch = tables.device_arch(batch.query.device)
    monkeypatch.setitem(tables.GLUON_PREFILL_TILES, arch,
                        tables.GluonPrefillTile(block_n=64, num_stages=2))
    if dispatch.gluon_prefill_unmet(batch.query, batch.key_cache, batch.value_cache, "auto",
                                    gluon_config(8, 2, 64)) is None:
        pytest.skip("the Gluon kernel can run here: nothing falls back")
    out = triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                           **batch.kwargs())
    check_against_references(out, batch)
    with pytest.raises(ValueError, match="use a TritonPrefillConfig"):
        triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                         **batch.kwargs(), plan=gluon_plan(8, 2, 64))


_COMPILE = """
import json, re, sys, torch
from kvcore.testing import compile_launches
from kvcore.ops import GluonPrefillConfig, TritonAttentionPlan, triton_attention
block_n, stages = int(sys.argv[1]), int(sys.argv[2])
sinks = torch.empty(32, dtype=torch.bfloat16) if sys.argv[3:] == ["sinks"] else None
query = torch.empty(4096, 32, 128, dtype=torch.bfloat16)
k = torch.empty(300, 16, 8, 128, dtype=torch.bfloat16)
v = torch.empty_like(k)
config = GluonPrefillConfig(block_q=32, g_pad=4, block_n=block_n, num_stages=stages)
(c,) = compile_launches(lambda: triton_attention.paged_attention(
    query, k, v, query_start_loc=torch.tensor([0, 2048, 4096], dtype=torch.int32),
    seq_lens=torch.tensor([2048, 2048], dtype=torch.int32),
    block_table=torch.arange(256, dtype=torch.int32).reshape(2, 128), scale=0.088,
    sinks=sinks, plan=TritonAttentionPlan(config=config)), "sm90")
ptx, ttgir = c.asm["ptx"], c.asm["ttgir"]
# The consumer's key loop, by what it carries (Triton names its values differently from one
# release to the next): its result types, found by the f32 accumulator in the MMA layout.
loops = re.findall(r"scf\\.for %\\w+ = [^\\n]*? iter_args\\([^\\n]*?\\) -> \\(([^\\n]*)\\)", ttgir)
softmax = next((t for t in loops if re.search(r"tensor<\\d+x\\d+xf32, #mma\\d*>", t)), None)
print(json.dumps(dict(
    kernel=c.kernel,
    shared=c.shared,
    wait_one="wgmma.wait_group.sync.aligned 1;" in ptx,
    p_from_registers=bool(re.search(
        r"ttng\\.warp_group_dot .*: tensor<\\d+x%dx\\w+, #ttg\\.dot_op" % block_n, ttgir)),
    copies=len(re.findall(r"cp\\.async\\.cg\\.shared\\.global \\[[^]]+\\], \\[[^]]+\\], "
                          r"0x10, %r\\d+;", ptx)),
    setmaxnreg=sorted(set(re.findall(r"setmaxnreg\\.(?:inc|dec)\\.sync\\.aligned\\.u32\\s+(\\d+);",
                                    ptx))),
    mbarrier_waits=len(re.findall(r"mbarrier\\.try_wait", ptx)),
    mbarrier_arrives=len(re.findall(r"mbarrier\\.arrive\\.shared", ptx)),
    cta_barriers=len(re.findall(r"bar\\.sync\\s+0;|barrier\\.sync\\s+0;", ptx)),
    loop_carries=dict(rows=len(re.findall(r"tensor<\\d+xf32,", softmax)),
                      accumulators=len(re.findall(r"tensor<\\d+x\\d+xf32, #mma\\d*>", softmax)))
                 if softmax else None,
    loops=None if softmax else re.findall(r"scf\\.for [^\\n]{0,200}", ttgir))))
"""


@pytest.mark.parametrize("block_n,stages,sinks", [(64, 3, False), (128, 3, False),
                                                  (128, 3, True)],
                         ids=["n64s3", "n128s3", "n128s3-sinks"])
def test_sm90_compile_overlaps_the_softmax_with_p_times_v(block_n: int, stages: int,
                                                          sinks: bool) -> None:
    """Compiled ahead of time for sm_90a (no GPU; in a subprocess, since Gluon has no
    interpreter and the suite sets ``TRITON_INTERPRET``): P x V takes P from registers, the
    loop waits for the scores alone (``wgmma.wait_group 1``) before their softmax, and K/V
    arrive by 16-byte ``cp.async`` copies whose source size zero-fills masked rows. The
    warpgroups get their registers (``setmaxnreg``: the copy warpgroup few, the consumers the
    rest) and meet only on mbarriers, no CTA-wide barrier; the consumers' turns add a wait and
    an arrive around each of a consumer's three issue sites, and the launch's first turn.
    With sinks (their logits start the softmax's rows) the loop is the same."""
    if dispatch.gluon_prefill_available() is not None:
        pytest.skip(dispatch.gluon_prefill_available())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE, str(block_n), str(stages),
                           *(["sinks"] if sinks else [])],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["wait_one"] and facts["p_from_registers"], facts
    # The shared memory the config check counts (stages, query tile, 1 KiB for barriers) is
    # all the kernel takes: no layout-conversion scratch on top (128 keys x 3 stages fits
    # only so).
    buffers = (2 * stages * block_n + 128) * 128 * 2  # K/V stages and the query tile
    assert buffers <= facts["shared"] <= buffers + 1024, facts
    vectors = 2 * block_n * 128 * 2 // 16  # K and V of a tile, in 16-byte pieces
    from kvcore.ops import gluon_prefill

    assert facts["kernel"] == "_gluon_prefill_ws_kernel"
    # One copy site (the copy warpgroup's 128 threads); its registers and the consumers'.
    assert facts["copies"] == vectors // 128, facts
    assert {str(gluon_prefill.WS_LOADER_REGS.value),
            str(gluon_prefill.WS_CONSUMER_REGS.value)} <= set(facts["setmaxnreg"]), facts
    assert facts["cta_barriers"] == 0, facts
    # Waits: full (prologue, loop) per consumer, empty in the copy loop, and the turns;
    # arrives: empty per consumer, and the turns.
    assert (facts["mbarrier_waits"], facts["mbarrier_arrives"]) == (11, 9), facts
    # The consumer's loop carries the softmax's row max and sum and the f32 accumulator (and
    # P, in registers); the message names the loops found when it was not found.
    assert facts["loop_carries"] == {"rows": 2, "accumulators": 1}, (
        facts["loop_carries"], facts["loops"])


def _gpu_or_skip() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an NVIDIA Hopper GPU (compute capability 9.x)")
    reason = dispatch.gluon_prefill_available()
    if reason is not None:
        pytest.skip(reason)


def test_call_config_keeps_the_gluon_row_only_for_tensors_it_can_run(monkeypatch) -> None:
    """What paged_attention and the compile cases take when given no config: sm90's Gluon row
    for bf16 caches while launches are recorded for an sm90 compile (no device to check), the
    Triton row for an fp8 cache, and for CPU tensors outside a recording."""
    if dispatch.gluon_prefill_available() is not None:
        pytest.skip(dispatch.gluon_prefill_available())
    ta = dispatch
    query, k, v = _cpu_args()
    fp8_k = k.to(torch.float8_e4m3fn)
    triton_row = ta.default_config(40, 1, 8, 2, 128, 96, torch.device("cpu"), arch="sm90",
                                   gluon=False)
    assert ta.call_config(query, k, v, "auto", 1, 96, arch="sm90") == triton_row
    from kvcore.testing.compile_check import capture_launches

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # capture_launches refuses under it
    with capture_launches():
        chosen = ta.call_config(query, k, v, "auto", 1, 96, arch="sm90")
        fp8 = ta.call_config(query, fp8_k, fp8_k.clone(), "fp8_e4m3", 1, 96, arch="sm90")
    assert chosen.kernel == "gluon_ws_pingpong"
    assert chosen.block_n == tables.GLUON_PREFILL_TILES["sm90"].block_n
    assert fp8 == triton_row


@pytest.mark.parametrize("value", ["0", "false"])
def test_kvcore_gluon_0_keeps_default_prefill_on_the_triton_row(kvcore_gluon, value: str) -> None:
    """sm90's default prefill config is its Gluon row, or with ``KVCORE_GLUON=0`` (the
    operator's switch) the Triton row; decode configs are the same either way."""
    ta, cpu = dispatch, torch.device("cpu")
    args = (4096, 2, 32, 8, 128, 4096, cpu)
    decode = ta.default_config(8, 8, 32, 8, 128, 4096, cpu, arch="sm90")
    assert ta.default_config(*args, arch="sm90").kernel == "gluon_ws_pingpong"
    kvcore_gluon(value)
    chosen = ta.default_config(*args, arch="sm90")
    assert chosen == ta.default_config(*args, arch="sm90", gluon=False)
    assert chosen.kernel == "triton_prefill"
    assert ta.default_config(8, 8, 32, 8, 128, 4096, cpu, arch="sm90") == decode


@pytest.mark.parametrize("layout", ["base-offset", "token-stride", "channel-stride"])
def test_caches_the_16_byte_copies_cannot_read_are_refused(layout: str) -> None:
    """The alignment checks (run on every call with a Gluon config) name the cache, what is
    off and the fix."""
    if dispatch.gluon_prefill_available() is not None:
        pytest.skip(dispatch.gluon_prefill_available())
    query, k, _ = _cpu_args()
    if layout == "base-offset":  # one element past a 16-byte boundary
        v = torch.randn(k.numel() + 1).to(k.dtype)[1:].view(k.shape)
        match = r"value_cache's base address 0x[0-9a-f]+ is not a multiple of 16 bytes"
    elif layout == "token-stride":  # 2 bf16 of padding per token row: 260-byte strides
        v = torch.randn(*k.shape[:3], k.shape[3] + 2).to(k.dtype)[..., :k.shape[3]]
        match = r"value_cache's stride\(1\) \(260 x 2 bytes\) and stride\(2\) \(130 x 2 bytes\)"
    else:
        v = torch.randn(*k.shape[:3], 2 * k.shape[3]).to(k.dtype)[..., ::2]
        match = "value_cache has channel stride 2"
    reason = dispatch.gluon_prefill_unmet(query, k, v, "auto", gluon_config(8, 2))
    assert reason is not None and re.search(match, reason), reason
    assert "TritonPrefillConfig" in reason, reason
    # The same call with a well-laid-out cache gets past these checks (to the device's).
    clean = dispatch.gluon_prefill_unmet(query, k, k.clone(), "auto", gluon_config(8, 2))
    assert clean is None or "value_cache" not in clean, clean


# name: (q_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype)
GPU_CASES = {
    "fresh-4-prefills-bs16-gqa4-D128-bf16": ([300, 1, 129, 64], [300, 1, 129, 64], 32, 8, 128,
                                            16, torch.bfloat16),
    "chunked-over-1000-cached-bs16-gqa4-D128-bf16": ([200, 37], [1200, 1037], 32, 8, 128, 16,
                                                     torch.bfloat16),
    "mixed-with-decodes-bs32-gqa8-D64-fp16": ([1, 77, 1, 300], [500, 77, 33, 1300], 16, 2, 64,
                                              32, torch.float16),
    "mha-gqa1-bs64-D128-bf16": ([257, 3], [700, 3], 4, 4, 128, 64, torch.bfloat16),
    "padded-group-gqa5-bs16-D128-bf16": ([150, 40], [150, 400], 10, 2, 128, 16,
                                         torch.bfloat16),
    "odd-block-size-8-gqa4-D64-bf16": ([333], [999], 8, 2, 64, 8, torch.bfloat16),
    # 48 neither divides nor is divided by the copy warpgroup's 32-key chunks.
    "block-size-48-gqa4-D128-bf16": ([260, 9], [700, 9], 32, 8, 128, 48, torch.bfloat16),
}


@pytest.mark.gpu
@pytest.mark.parametrize("tile", list(TILES))
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gluon_prefill_matches_the_references(name: str, tile: str) -> None:
    _gpu_or_skip()
    q_lens, seq_lens, hq, hk, d, bs, dtype = GPU_CASES[name]
    batch = make_batch(torch.Generator().manual_seed(len(name)), q_lens=q_lens,
                       seq_lens=seq_lens, num_heads=hq, num_kv_heads=hk, head_size=d,
                       block_size=bs, dtype=dtype)
    cfg = gluon_config(hq, hk, *TILES[tile])
    out = triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                           **batch.kwargs(), plan=Plan(config=cfg))
    check_against_references(out, batch)


@pytest.mark.gpu
@pytest.mark.parametrize("causal,window", [(True, 100), (True, 1000), (False, None),
                                           (False, 300)],
                         ids=["causal-window100", "causal-window1000", "noncausal",
                              "noncausal-window300"])
def test_gluon_prefill_windows_and_non_causal(causal: bool, window: int | None) -> None:
    _gpu_or_skip()
    batch = make_batch(torch.Generator().manual_seed(5), q_lens=[700, 129, 1],
                       seq_lens=[1500, 129, 900], num_heads=32, num_kv_heads=8,
                       head_size=128, block_size=16, dtype=torch.bfloat16)
    for tile in TILES.values():
        out = triton_attention.paged_attention(
            batch.query, batch.key_cache, batch.value_cache, **batch.kwargs(), causal=causal,
            sliding_window=window, plan=gluon_plan(32, 8, *tile))
        check_against_references(out, batch, causal=causal, sliding_window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 128], ids=["full", "window128"])
def test_gluon_prefill_with_sinks_matches_the_references_and_the_triton_kernel(window) -> None:
    """gpt-oss's layer shape (64 query heads, 8 KV heads of 64): per-head sink logits start
    each row's softmax, full and 128-token window layers, against the references and the
    Triton prefill kernel on the same call."""
    _gpu_or_skip()
    gen = torch.Generator().manual_seed(11)
    batch = make_batch(gen, q_lens=[700, 1, 129], seq_lens=[1500, 900, 129], num_heads=64,
                       num_kv_heads=8, head_size=64, block_size=16, dtype=torch.bfloat16)
    sinks = (torch.rand(64, generator=gen) * 12 - 2).to("cuda", torch.bfloat16)
    triton_row = dispatch.default_config(830, 3, 64, 8, 64, 1504, torch.device("cuda"),
                                         gluon=False)
    assert triton_row.kernel == "triton_prefill"
    outs = {}
    for name, plan in (("gluon", gluon_plan(64, 8)), ("triton", Plan(config=triton_row))):
        outs[name] = triton_attention.paged_attention(
            batch.query, batch.key_cache, batch.value_cache, **batch.kwargs(),
            sliding_window=window, sinks=sinks, plan=plan)
    check_against_references(outs["gluon"], batch, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(outs["gluon"], outs["triton"], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gluon_prefill_on_a_cross_layer_view_is_bit_exact_and_strided_output() -> None:
    """Layer 2 of a 4-layer cross-layer pool: the same bits as on contiguous copies, the pool
    unchanged; the output written in place into a strided view, its other heads untouched."""
    _gpu_or_skip()
    gen = torch.Generator().manual_seed(11)
    num_blocks, layers, bs, hk, d = 600, 4, 16, 8, 128
    pool = torch.randn(num_blocks, layers, 2, bs, hk, d, generator=gen).to(
        torch.bfloat16).cuda()
    k, v = pool[:, 2].unbind(1)
    table = torch.randperm(num_blocks, generator=gen)[:2 * 250].to(torch.int32).reshape(2, 250)
    query = torch.randn(1100, 32, d, generator=gen).to(torch.bfloat16).cuda()
    kwargs = dict(query_start_loc=torch.tensor([0, 1000, 1100], dtype=torch.int32).cuda(),
                  seq_lens=torch.tensor([3000, 1100], dtype=torch.int32).cuda(),
                  block_table=table.cuda(), scale=d ** -0.5, plan=gluon_plan(32, 8))
    before = pool.clone()
    strided = triton_attention.paged_attention(query, k, v, **kwargs)
    flat = triton_attention.paged_attention(query, k.contiguous(), v.contiguous(), **kwargs)
    assert torch.equal(strided, flat)
    assert torch.equal(pool, before)  # attention reads the pool, never writes it
    out = torch.full((1100, 64, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    triton_attention.paged_attention(query, k, v, **kwargs, output=out[:, ::2])
    assert torch.equal(out[:, ::2], flat)
    assert torch.isnan(out[:, 1::2]).all()  # the other heads of the output untouched


@pytest.mark.gpu
def test_gluon_prefill_with_k_and_v_caches_of_different_strides() -> None:
    """A value cache whose blocks are padded (block stride unlike the key cache's): the copy
    warpgroup computes V's offsets on their own; the same bits as on contiguous copies."""
    _gpu_or_skip()
    batch = make_batch(torch.Generator().manual_seed(16), q_lens=[300, 45], seq_lens=[900, 45],
                       num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                       dtype=torch.bfloat16)
    k = batch.key_cache
    padded = torch.full((k.shape[0], k.shape[1] + 2, *k.shape[2:]), float("nan"),
                        dtype=k.dtype, device=k.device)
    v = padded[:, :k.shape[1]]
    v.copy_(batch.value_cache)
    assert v.stride() != k.stride()
    plan = gluon_plan(32, 8)
    strided = triton_attention.paged_attention(batch.query, k, v, **batch.kwargs(), plan=plan)
    flat = triton_attention.paged_attention(batch.query, k, batch.value_cache,
                                            **batch.kwargs(), plan=plan)
    assert torch.equal(strided, flat)
    check_against_references(flat, batch)


@pytest.mark.gpu
def test_gluon_prefill_never_reads_slots_a_request_does_not_own() -> None:
    _gpu_or_skip()
    batch = make_batch(torch.Generator().manual_seed(12), q_lens=[1, 77, 300],
                       seq_lens=[37, 100, 301], num_heads=32, num_kv_heads=8, head_size=128,
                       block_size=16, dtype=torch.bfloat16)
    owned = torch.zeros(batch.key_cache.shape[:2], dtype=torch.bool)
    for blocks, n in zip(batch.block_table.tolist(), batch.seq_lens.tolist(), strict=True):
        for pos in range(n):
            owned[blocks[pos // 16], pos % 16] = True
    plan = gluon_plan(32, 8, 64, 3)
    clean = triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                             **batch.kwargs(), plan=plan)
    for cache in (batch.key_cache, batch.value_cache):
        cache[~owned.cuda()] = float("nan")
    dirty = triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                             **batch.kwargs(), plan=plan)
    assert torch.isfinite(dirty).all()
    assert torch.equal(dirty, clean)
    ref = paged_attention_ref(batch.query, batch.key_cache, batch.value_cache, **batch.kwargs())
    torch.testing.assert_close(dirty, ref, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_gluon_prefill_real_size_against_the_triton_kernel() -> None:
    """4 x 2048 fresh prompts (Llama-3-8B heads): within bf16 rounding of the Triton prefill
    kernel and of the fp32 reference."""
    _gpu_or_skip()
    batch = make_batch(torch.Generator().manual_seed(13), q_lens=[2048] * 4,
                       seq_lens=[2048] * 4, num_heads=32, num_kv_heads=8, head_size=128,
                       block_size=16, dtype=torch.bfloat16)
    gluon = triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                             **batch.kwargs(), plan=gluon_plan(32, 8))
    plain = triton_attention.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, **batch.kwargs(),
        plan=Plan(config=dispatch.default_config(
            8192, 4, 32, 8, 128, 2048, batch.query.device, gluon=False)))
    torch.testing.assert_close(gluon, plain, atol=2e-2, rtol=2e-2)
    check_against_references(gluon, batch)


@pytest.mark.gpu
def test_a_table_row_runs_the_gluon_kernel_and_fp8_falls_back(monkeypatch) -> None:
    """With a :data:`GLUON_PREFILL_TILES` row for this GPU, ``paged_attention`` without a
    config runs the Gluon kernel (the same bits as the explicit config); an fp8 cache, which
    it cannot read, runs the Triton row instead."""
    _gpu_or_skip()
    ta = triton_attention
    monkeypatch.setitem(tables.GLUON_PREFILL_TILES, tables.device_arch(torch.device("cuda")),
                        tables.GluonPrefillTile(block_n=64, num_stages=3))
    batch = make_batch(torch.Generator().manual_seed(14), q_lens=[500, 3], seq_lens=[900, 3],
                       num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                       dtype=torch.bfloat16)
    by_table = ta.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                  **batch.kwargs())
    explicit = ta.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                  **batch.kwargs(), plan=gluon_plan(32, 8, 64, 3))
    assert torch.equal(by_table, explicit)
    fp8 = make_batch(torch.Generator().manual_seed(15), q_lens=[500, 3], seq_lens=[900, 3],
                     num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                     dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn)
    out = ta.paged_attention(fp8.query, fp8.key_cache, fp8.value_cache, **fp8.kwargs(),
                             kv_cache_dtype="fp8_e4m3", k_scale=1.0, v_scale=1.0)
    check_against_references(out, fp8, kv_cache_dtype="fp8_e4m3", k_scale=1.0, v_scale=1.0)
