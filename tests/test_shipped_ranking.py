"""A platform's shipped ranking: the order ``kvcore tune`` measured on its devices, which
leads its priority list for the nearest measured config and gives ``select --explain`` its
per-phase speed tiers (kvcore.ranking.shipped_order, Platform.SHIPPED_RANKING)."""

from __future__ import annotations

from importlib import resources

import pytest

import kvcore
from kvcore import ranking
from kvcore.platforms.cuda import CudaPlatform
from kvcore.ranking import (
    DeviceIdentity,
    MeasuredCase,
    Ranking,
    nearest_cases,
    ranking_config_key,
    ranking_shape_class,
    shipped_order,
)

Config = kvcore.AttentionSelectorConfig
H100 = DeviceIdentity("cuda", "NVIDIA H100 80GB HBM3", "9.0")
H200 = DeviceIdentity("cuda", "NVIDIA H200", "9.0")


def case(config: Config, phase: str, times: dict[str, float]) -> MeasuredCase:
    return MeasuredCase(phase, ranking_shape_class(config), f"{phase} 8x1024",
                        ranking_config_key(config), dict(times))


def measured(device: DeviceIdentity, *cases: MeasuredCase, date: str = "2026-01-02") -> Ranking:
    return Ranking(date, device, {"torch": "0"}, tuple(cases))


LLAMA = Config(head_size=128, block_size=16)
GPT_OSS = Config(head_size=64, block_size=16, has_sink=True)
FP8 = Config(head_size=128, block_size=16, kv_cache_dtype="fp8_e4m3")
MLA = Config(head_size=576, block_size=64, use_mla=True)


def test_reorder_puts_the_measured_backends_in_their_slots_and_keeps_the_rest():
    order = shipped_order([measured(H100, case(LLAMA, "decode", {"C": 1.0, "A": 2.0, "X": 1.5}))],
                          LLAMA, kvcore.DeviceCapability(9, 0))
    assert order.order == ("C", "X", "A")
    assert order.reorder(["A", "B", "C", "D"]) == ["C", "B", "A", "D"]  # X: not offered
    assert order.reorder(["B", "D"]) == ["B", "D"]


def test_nearest_cases_narrow_field_by_field_and_never_cross_the_kind():
    cases = [case(LLAMA, "decode", {"A": 1.0}), case(FP8, "decode", {"B": 1.0}),
             case(GPT_OSS, "decode", {"C": 1.0}), case(MLA, "decode", {"M": 1.0})]
    assert nearest_cases(cases, LLAMA) == [cases[0]]
    # Block 64 and head size 96 were not measured: the bf16-cache, no-sink cases speak.
    assert nearest_cases(cases, Config(head_size=96, block_size=64)) == [cases[0]]
    assert nearest_cases(cases, Config(head_size=128, kv_cache_dtype="fp8_e4m3")) == [cases[1]]
    assert nearest_cases(cases, Config(head_size=128, has_sink=True)) == [cases[2]]
    assert nearest_cases(cases, Config(head_size=512, use_mla=True)) == [cases[3]]
    assert nearest_cases(cases[:3], MLA) == []


def test_head_counts_narrow_to_the_cases_of_the_same_heads_where_measured():
    eight = Config(head_size=128, kv_cache_dtype="fp8_e4m3", num_heads=32, num_kv_heads=8)
    one = Config(head_size=128, kv_cache_dtype="fp8_e4m3", num_heads=8, num_kv_heads=1)
    cases = [case(eight, "decode", {"A": 1.0, "B": 2.0}), case(one, "decode", {"A": 2.0, "B": 1.0}),
             case(FP8, "decode", {"A": 1.0})]  # measured without head counts
    assert nearest_cases(cases, one) == [cases[1]]
    assert nearest_cases(cases, eight) == [cases[0]]
    # KV heads first: 64 query heads over one KV head were not measured, one KV head was.
    assert nearest_cases(cases, Config(head_size=128, kv_cache_dtype="fp8_e4m3", num_heads=64,
                                       num_kv_heads=1)) == [cases[1]]
    # Heads not given, or not measured: every case of the class speaks.
    assert nearest_cases(cases, FP8) == cases
    assert nearest_cases(cases, Config(head_size=128, kv_cache_dtype="fp8_e4m3", num_heads=4,
                                       num_kv_heads=4)) == cases
    nine = kvcore.DeviceCapability(9, 0)
    order = shipped_order([measured(H100, *cases)], one, nine)
    assert order.order == ("B", "A")
    assert order.describe().endswith("1 case of D128 bfloat16 kv=fp8_e4m3 bs16 Hq=8 Hk=1")
    assert shipped_order([measured(H100, *cases)], FP8, nine).describe().endswith(
        "3 cases of D128 bfloat16 kv=fp8_e4m3 bs16 (heads not given; Hq=32 Hk=8; Hq=8 Hk=1)")


def test_shipped_order_ranks_the_nearest_cases_and_groups_speeds_into_tiers():
    rankings = [measured(H100,
                         case(LLAMA, "decode", {"A": 100.0, "B": 103.0, "C": 150.0}),
                         case(LLAMA, "prefill", {"A": 200.0, "B": 100.0, "C": 104.0}),
                         case(MLA, "decode", {"M": 10.0, "N": 9.0}))]
    order = shipped_order(rankings, Config(head_size=128, block_size=64),
                          kvcore.DeviceCapability(9, 0))
    assert order.order == ("B", "C", "A")  # geometric means 1.01, 1.25, 1.41
    assert [(p.phase, p.tiers) for p in order.phases] == [
        ("decode", (("A", "B"), ("C",))), ("prefill", (("B", "C"), ("A",)))]
    assert order.cases == 2 and order.shape_classes == ("D128 bfloat16 kv=auto bs16",)
    assert order.describe() == ("kvcore tune on NVIDIA H100 80GB HBM3 (cuda, capability 9.0) on "
                                "2026-01-02, 2 cases of D128 bfloat16 kv=auto bs16")
    assert "by kvcore tune on 2026-01-02" in order.phases[0].measured
    assert shipped_order(rankings, MLA, kvcore.DeviceCapability(9, 0)).order == ("N", "M")


def test_shipped_order_takes_the_devices_own_ranking_else_the_latest_of_its_capability():
    old = measured(H100, case(LLAMA, "decode", {"A": 1.0, "B": 2.0}), date="2026-01-01")
    new = measured(H200, case(LLAMA, "decode", {"A": 2.0, "B": 1.0}), date="2026-02-01")
    nine = kvcore.DeviceCapability(9, 0)
    assert shipped_order([old, new], LLAMA, nine, "NVIDIA H100 80GB HBM3").order == ("A", "B")
    assert shipped_order([old, new], LLAMA, nine, "NVIDIA H200").order == ("B", "A")
    assert shipped_order([old, new], LLAMA, nine, "NVIDIA GH200").order == ("B", "A")
    assert shipped_order([old, new], LLAMA, nine).order == ("B", "A")
    assert shipped_order([old, new], LLAMA, kvcore.DeviceCapability(10, 0)) is None
    assert shipped_order([old, new], LLAMA, None) is None


def test_a_devices_ranking_of_some_kinds_leaves_the_others_to_its_capabilitys_rankings():
    """An H200 ranking that measured bf16 caches only: on an H200 an fp8 config takes the
    H100's order (the latest other ranking of capability 9.0 that measured fp8), not none."""
    h100 = measured(H100, case(LLAMA, "decode", {"A": 1.0, "B": 2.0}),
                    case(FP8, "decode", {"A": 2.0, "B": 1.0}), date="2026-01-01")
    h200 = measured(H200, case(LLAMA, "decode", {"A": 3.0, "B": 1.0}), date="2026-02-01")
    nine = kvcore.DeviceCapability(9, 0)
    assert shipped_order([h100, h200], LLAMA, nine, "NVIDIA H200").order == ("B", "A")
    fp8 = shipped_order([h100, h200], FP8, nine, "NVIDIA H200")
    assert fp8.order == ("B", "A") and fp8.device == H100
    assert shipped_order([h100, h200], LLAMA, nine, "NVIDIA H100 80GB HBM3").order == ("A", "B")
    assert shipped_order([h100, h200], MLA, nine, "NVIDIA H200") is None  # nobody measured it


def test_the_shipped_order_leads_cudas_priority_list_where_it_was_measured(
        kvcore_shipped_ranking):
    kvcore_shipped_ranking("cuda", measured(
        H100, case(LLAMA, "decode", {"TRITON_ATTN": 1.0, "FLASHINFER": 1.5}),
        case(LLAMA, "prefill", {"TRITON_ATTN": 1.2, "FLASHINFER": 1.0})))
    cuda = kvcore.get_platform("cuda")
    # TRITON_ATTN and FLASHINFER swap slots; FLASH_ATTN and FLEX_ATTENTION were not timed.
    assert cuda.get_backend_priorities(LLAMA, kvcore.DeviceCapability(9, 0)) == [
        "TRITON_ATTN", "FLASH_ATTN", "FLASHINFER", "FLEX_ATTENTION"]
    decode, prefill = cuda.phase_rankings(LLAMA, kvcore.DeviceCapability(9, 0))
    assert decode.describe() == "TRITON_ATTN > FLASHINFER"
    assert prefill.describe() == "FLASHINFER > TRITON_ATTN"
    # Unmeasured: another capability, or MLA where only K/V layers were timed.
    assert cuda.get_backend_priorities(LLAMA, kvcore.DeviceCapability(10, 0)) == [
        "FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"]
    assert cuda.phase_rankings(LLAMA, kvcore.DeviceCapability(8, 0)) == ()
    assert cuda.get_backend_priorities(MLA, kvcore.DeviceCapability(9, 0)) == [
        "FLASHINFER_MLA", "TRITON_MLA"]
    assert cuda.get_backend_priorities(MLA, kvcore.DeviceCapability(8, 0)) == [
        "TRITON_MLA", "FLASHINFER_MLA"]


def test_a_broken_shipped_file_is_logged_and_the_unmeasured_order_used(
        kvcore_shipped_ranking, caplog):
    kvcore_shipped_ranking("cuda", measured(H100, case(LLAMA, "decode", {"TRITON_ATTN": 1.0})))
    cuda = kvcore.get_platform("cuda")
    package, name = type(cuda).SHIPPED_RANKING
    (resources.files(package) / name).write_text("{")
    ranking.load_shipped_rankings.cache_clear()
    with pytest.raises(ranking.RankingFileError,
                       match=f"shipped ranking {package}/{name} cannot be read .*reinstall the "
                             "package"):
        ranking.load_shipped_rankings(package, name)
    with caplog.at_level("WARNING", logger="kvcore.platform"):
        assert cuda.shipped_order(LLAMA, kvcore.DeviceCapability(9, 0)) is None
        assert cuda.get_backend_priorities(LLAMA, kvcore.DeviceCapability(9, 0))[0] == (
            "FLASHINFER")
    assert "cannot be read" in caplog.text and "unmeasured order is used" in caplog.text


def test_cudas_shipped_ranking_is_a_tune_ranking_of_its_own_backends_on_hopper():
    """The shipped file: kvcore tune's format, CUDA's own backends only, a 9.0 ranking whose
    nearest cases speak for every K/V kind of config (the presets' head sizes, fp8, sinks,
    soft-cap); CUDA's list follows it there."""
    rankings = ranking.load_shipped_rankings(*CudaPlatform.SHIPPED_RANKING)
    assert rankings and {r.device.capability for r in rankings} >= {"9.0"}
    cuda = kvcore.get_platform("cuda")
    offered = set(CudaPlatform.BACKEND_PROVIDERS) | {"TRITON_ATTN"}
    for r in rankings:
        assert r.device.platform == "cuda"
        assert {b for c in r.cases for b in (*c.times_us, *c.errors)} <= offered, r.device
    nine = kvcore.DeviceCapability(9, 0)
    for config in (LLAMA, FP8, GPT_OSS, Config(head_size=256, has_logits_soft_cap=True),
                   Config(head_size=128, block_size=64)):
        order = cuda.shipped_order(config, nine)
        assert order is not None and order.phases, config
        assert cuda.get_backend_priorities(config, nine) == order.reorder(
            ["FLASHINFER", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"])
        assert cuda.phase_rankings(config, nine) == order.phases
    # Every case records the per-rank head counts it was measured with, so a config that
    # gives them is ranked by those cases alone (Llama-3-70B at TP 8: one KV head per rank).
    cases = [c for r in rankings for c in r.cases]
    assert all(isinstance(c.config.get("num_kv_heads"), int) for c in cases)
    tp8 = Config(head_size=128, kv_cache_dtype="fp8_e4m3", num_heads=8, num_kv_heads=1)
    assert cuda.shipped_order(tp8, nine).cases == sum(
        1 for c in nearest_cases(cases, FP8) if c.config["num_kv_heads"] == 1)


def test_a_config_s_shipped_order_is_computed_once_per_loaded_file(kvcore_shipped_ranking,
                                                                    monkeypatch):
    """Selection asks for the order several times per config (priorities, phase tiers,
    explain); a new file (another test's, or a reinstall) is a new answer."""
    calls = []
    real = ranking.shipped_order
    monkeypatch.setattr(ranking, "shipped_order", lambda *a: calls.append(a) or real(*a))
    kvcore_shipped_ranking("cuda", measured(H100, case(LLAMA, "decode", {"TRITON_ATTN": 1.0,
                                                                          "FLASHINFER": 2.0})))
    cuda, cap = kvcore.get_platform("cuda"), kvcore.DeviceCapability(9, 0)
    cuda.get_backend_priorities(LLAMA, cap)
    cuda.phase_rankings(LLAMA, cap)
    first = cuda.shipped_order(LLAMA, cap)
    assert len(calls) == 1 and first.order[0] == "TRITON_ATTN"
    kvcore_shipped_ranking("cuda", measured(H100, case(LLAMA, "decode", {"TRITON_ATTN": 2.0,
                                                                          "FLASHINFER": 1.0})))
    assert cuda.shipped_order(LLAMA, cap).order[0] == "FLASHINFER" and len(calls) == 2


def test_faster_cases_name_the_shapes_where_another_backend_beats_the_pick():
    phase = kvcore.PhaseRanking("decode", (("A",), ("B",)), "test", (
        ("eight KV heads", (("A", 100.0), ("B", 120.0))),
        ("one KV head", (("A", 100.0), ("B", 80.0), ("C", 50.0))),
        ("within the tolerance", (("A", 100.0), ("B", 96.0))),
        ("A not timed", (("B", 10.0),))))
    assert phase.faster_cases("A", {"A", "B"}, 0.05) == [("one KV head", "B", 1.25)]
    # Only the backends asked about count (C is not valid here); and the largest gap first.
    assert phase.faster_cases("A", {"B", "C"}, 0.05) == [("one KV head", "C", 2.0)]
    assert phase.faster_cases("A", {"B"}, 0.01) == [("one KV head", "B", 1.25),
                                                    ("within the tolerance", "B", 100 / 96)]
    assert phase.faster_cases("B", {"A", "B"}, 0.05) == [("eight KV heads", "A", 1.2)]


def test_explain_names_the_measured_shapes_where_a_valid_backend_beats_the_pick(
        kvcore_shipped_ranking, fresh_kvcore, monkeypatch):
    """The tiers average over shapes a selector config cannot tell apart (one KV head a rank
    or eight): --explain lists the cases where another valid backend was faster."""
    monkeypatch.setenv("KVCORE_PLATFORM", "cuda")
    monkeypatch.setenv("KVCORE_DEVICE_CAPABILITY", "9.0")

    def timed(preset: str, times: dict[str, float]) -> MeasuredCase:
        return MeasuredCase("decode", ranking_shape_class(LLAMA), f"decode 8x32768, {preset}",
                            ranking_config_key(LLAMA), times, preset=preset, layer="full")

    kvcore_shipped_ranking("cuda", measured(
        H100, timed("Hk=8", {"TRITON_ATTN": 100.0, "FLEX_ATTENTION": 300.0}),
        timed("Hk=4", {"TRITON_ATTN": 100.0, "FLEX_ATTENTION": 250.0}),
        timed("Hk=1", {"TRITON_ATTN": 100.0, "FLEX_ATTENTION": 50.0})))
    report = kvcore.explain_selection(LLAMA)
    assert report.selected.name == "TRITON_ATTN"
    text = report.format()
    assert ("decode (measured): TRITON_ATTN > FLEX_ATTENTION; selected TRITON_ATTN is among "
            "the fastest\n  FLEX_ATTENTION 2.00x faster than TRITON_ATTN on Hk=1 full, "
            "decode 8x32768, Hk=1\n") in text
    assert "Hk=8 full" not in text and "Hk=4 full" not in text
    assert "--num-heads/--num-kv-heads narrow it to the model's" in text  # LLAMA gives none
    (decode,) = report.to_dict()["phase_rankings"]
    assert decode["faster_than_selected"] == [
        {"case": "Hk=1 full, decode 8x32768, Hk=1", "backend": "FLEX_ATTENTION", "speedup": 2.0}]
