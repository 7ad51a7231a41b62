"""Measured selection: ``kvcore tune`` writes this device's ranking, the selector follows it
(priority and ``select --explain``), and a ranking for another device, with other library
versions or in a malformed file is ignored with a note."""

from __future__ import annotations

import dataclasses
import json

import pytest

import kvcore
from kvcore.cli import main as kvcore_cli
from kvcore.cli.tune import TuneOptions, run_tune
from kvcore.ranking import (
    FORMAT,
    DeviceIdentity,
    MeasuredCase,
    Ranking,
    RankingFileError,
    current_identity,
    library_versions,
    load_rankings,
    ranking_config_key,
    ranking_shape_class,
    write_ranking,
)

CONFIG = kvcore.AttentionSelectorConfig(head_size=128, dtype="float32", block_size=16)


@pytest.fixture
def ranking_file(tmp_path, monkeypatch):
    path = tmp_path / "ranking.json"
    monkeypatch.setenv("KVCORE_RANKING_FILE", str(path))
    kvcore.clear_selection_cache()
    yield path
    kvcore.clear_selection_cache()


def cpu_identity() -> DeviceIdentity:
    cpu = kvcore.get_platform("cpu")
    return current_identity(cpu, cpu.get_device_capability())


def other_valid_backend() -> str:
    """A backend valid for CONFIG on the CPU that the static order does not pick."""
    report = kvcore.explain_selection(CONFIG, "cpu")
    others = [c.name for c in report.candidates if c.valid and not c.selected]
    if not others:
        pytest.skip("only one backend runs on the CPU here (the example plugin and "
                    "kvcore-nvidia's FLEX_ATTENTION are not installed)")
    return others[0]


def ranking_with(times: dict[str, float], *, device: DeviceIdentity | None = None,
                 versions: dict | None = None, config=CONFIG) -> Ranking:
    cases = tuple(MeasuredCase(phase, ranking_shape_class(config), f"{phase} 4x256",
                               ranking_config_key(config), dict(times))
                  for phase in ("decode", "prefill"))
    return Ranking("2026-01-02", device or cpu_identity(),
                   dict(library_versions()) if versions is None else versions, cases)


def test_tune_on_the_cpu_writes_the_ranking_and_the_selector_follows_it(ranking_file, capsys):
    result = run_tune(TuneOptions(models=["llama-3.1-8b"], small=True,
                                  kv_cache_dtypes=("auto",), block_sizes=(16,),
                                  phases=("decode", "mixed"), dtype="float32", reps=1,
                                  platform="cpu", progress=False))
    assert result.path == ranking_file
    data = json.loads(ranking_file.read_text())
    assert (data["format"], data["version"]) == (FORMAT, 1)
    (entry,) = data["rankings"]
    assert entry["device"]["platform"] == "cpu" and entry["device"]["name"]
    assert {"kvcore", "torch", "triton"} <= set(entry["versions"])
    assert {c["phase"] for c in entry["cases"]} == {"decode", "mixed"}
    case = entry["cases"][0]
    # The small preset's layer, with its per-rank head counts (4 query heads over 1 KV head).
    tuned = dataclasses.replace(CONFIG, num_heads=4, num_kv_heads=1)
    assert case["config"] == ranking_config_key(tuned)
    assert case["shape_class"] == "D128 float32 kv=auto bs16 Hq=4 Hk=1"
    assert case["preset"] == "llama-3.1-8b"
    measured = [b for c in entry["cases"] for b in c["times_us"]]
    assert measured and all(t > 0 for c in entry["cases"] for t in c["times_us"].values())
    order = result.orders["D128 float32 kv=auto bs16 Hq=4 Hk=1"]
    fastest = order.order[0]
    assert kvcore.get_attn_backend(CONFIG, platform="cpu").get_name() == fastest
    # The explanation names each phase's own fastest, which on a noisy CPU need not be the
    # backend first over both phases.
    decode_fastest = max(order.speed["decode"], key=order.speed["decode"].get)
    assert kvcore_cli(["select", "--explain", "--platform", "cpu", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert f"measured on this machine on {entry['date']}" in out
    assert f"decode (2 cases): {decode_fastest} fastest" in out


def test_a_ranking_that_puts_a_backend_first_changes_the_pick_and_explain_quotes_it(
        ranking_file):
    static = kvcore.get_attn_backend(CONFIG, platform="cpu").get_name()
    other = other_valid_backend()
    write_ranking(ranking_with({other: 98.0, static: 100.0}), ranking_file)
    assert kvcore.get_attn_backend(CONFIG, platform="cpu").get_name() == other
    report = kvcore.explain_selection(CONFIG, "cpu")
    assert [c.name for c in report.candidates[:2]] == [other, static]
    text = report.format()
    assert "fastest valid backend measured on this machine on 2026-01-02" in text
    assert f"decode (1 case): {other} fastest; {static} 0.98x of {other}" in text
    assert report.to_dict()["measured_ranking"]["order"] == [other, static]
    # Another config (bfloat16) has no case: the static order, with a note.
    bf16 = kvcore.AttentionSelectorConfig(head_size=128, dtype="bfloat16")
    report = kvcore.explain_selection(bf16, "cpu")
    assert report.selected.name == static
    assert any("has no case for this config (D128 bfloat16 kv=auto bs16" in n
               for n in report.ranking_notes)
    # A forced backend stays forced.
    assert kvcore.get_attn_backend(CONFIG, backend=static, platform="cpu").get_name() == static


def test_a_config_with_head_counts_follows_the_cases_of_those_heads(ranking_file):
    static = kvcore.get_attn_backend(CONFIG, platform="cpu").get_name()
    other = other_valid_backend()
    one = dataclasses.replace(CONFIG, num_heads=8, num_kv_heads=1)
    eight = dataclasses.replace(CONFIG, num_heads=32, num_kv_heads=8)
    slow_at_one = ranking_with({other: 300.0, static: 100.0}, config=one)
    fast_at_eight = ranking_with({other: 50.0, static: 400.0}, config=eight)
    write_ranking(Ranking(slow_at_one.date, slow_at_one.device, slow_at_one.versions,
                          slow_at_one.cases + fast_at_eight.cases), ranking_file)
    assert kvcore.get_attn_backend(one, platform="cpu").get_name() == static
    assert kvcore.get_attn_backend(eight, platform="cpu").get_name() == other
    report = kvcore.explain_selection(one, "cpu")
    assert sum(report.measured.cases.values()) == 2  # its own heads' two phases, not all four
    # No head counts, or counts not measured: all four cases (other 1.7x of the fastest in
    # geometric mean, static 2.8x).
    for config in (CONFIG, dataclasses.replace(CONFIG, num_heads=2, num_kv_heads=2)):
        assert sum(kvcore.explain_selection(config, "cpu").measured.cases.values()) == 4
        assert kvcore.get_attn_backend(config, platform="cpu").get_name() == other
    # A ranking measured without head counts still speaks for a config that gives them.
    write_ranking(ranking_with({other: 50.0, static: 100.0}), ranking_file)
    assert kvcore.get_attn_backend(one, platform="cpu").get_name() == other


def test_the_selection_follows_a_rewritten_file(ranking_file):
    static = kvcore.get_attn_backend(CONFIG, platform="cpu").get_name()
    other = other_valid_backend()
    write_ranking(ranking_with({other: 50.0, static: 100.0}), ranking_file)
    assert kvcore.get_attn_backend(CONFIG, platform="cpu").get_name() == other
    write_ranking(ranking_with({other: 200.0, static: 100.0}), ranking_file)
    assert kvcore.get_attn_backend(CONFIG, platform="cpu").get_name() == static
    ranking_file.unlink()
    assert kvcore.get_attn_backend(CONFIG, platform="cpu").get_name() == static


@pytest.mark.parametrize("stale", ["device", "versions"])
def test_a_stale_ranking_is_ignored_with_a_note(ranking_file, stale):
    static = kvcore.get_attn_backend(CONFIG, platform="cpu").get_name()
    other = other_valid_backend()
    if stale == "device":
        ranking = ranking_with({other: 1.0, static: 2.0},
                               device=DeviceIdentity("cpu", "CPU Some Other Processor", None))
        expected = "has rankings for CPU Some Other Processor (cpu), none for this device"
    else:
        versions = {**library_versions(), "torch": "0.0.1"}
        ranking = ranking_with({other: 1.0, static: 2.0}, versions=versions)
        expected = "is stale (versions changed: torch 0.0.1 -> "
    write_ranking(ranking, ranking_file)
    assert kvcore.get_attn_backend(CONFIG, platform="cpu").get_name() == static
    report = kvcore.explain_selection(CONFIG, "cpu")
    assert report.measured is None and report.selected.name == static
    assert expected in report.format()
    assert "static order used" in report.format()


def test_rankings_of_other_devices_stay_in_the_file(ranking_file):
    other_device = DeviceIdentity("cuda", "NVIDIA H200", "9.0")
    write_ranking(ranking_with({"A": 1.0}, device=other_device), ranking_file)
    write_ranking(ranking_with({"B": 1.0}), ranking_file)
    write_ranking(ranking_with({"C": 1.0}), ranking_file)  # replaces this device's
    rankings = load_rankings(ranking_file)
    assert [(r.device.name, list(r.cases[0].times_us)) for r in rankings] == [
        ("NVIDIA H200", ["A"]), (cpu_identity().name, ["C"])]


@pytest.mark.parametrize(("text", "expected"), [
    ("{not json", "is not JSON"),
    (json.dumps({"format": "something else"}), "it is not a kvcore-ranking file"),
    (json.dumps({"format": FORMAT, "version": 99, "rankings": []}), "format version 99"),
    (json.dumps({"format": FORMAT, "version": 1, "rankings": [{"date": "x"}]}),
     "rankings[0]: KeyError"),
], ids=["not-json", "not-a-ranking", "version", "missing-fields"])
def test_a_malformed_file_is_a_note_for_the_selector_and_an_error_for_tune(
        ranking_file, text, expected, capsys):
    ranking_file.write_text(text)
    static = kvcore.explain_selection(CONFIG, "cpu")
    assert static.selected is not None and static.measured is None
    (note,) = static.ranking_notes
    assert str(ranking_file) in note and expected in note and "static order used" in note
    with pytest.raises(RankingFileError, match="delete it or run kvcore tune again"):
        load_rankings(ranking_file)
    with pytest.raises(RankingFileError):
        write_ranking(ranking_with({"A": 1.0}), ranking_file)
    assert ranking_file.read_text() == text  # left as it was
    assert kvcore_cli(["tune", "--model", "llama-3.1-8b", "--small", "--phase", "decode",
                       "--kv-cache-dtype", "auto", "--block-size", "16"]) == 2
    assert expected in capsys.readouterr().err


def test_measured_selection_can_be_turned_off(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCORE_RANKING_FILE", "none")
    kvcore.clear_selection_cache()
    report = kvcore.explain_selection(CONFIG, "cpu")
    assert report.measured is None and report.ranking_notes == []
    with pytest.raises(ValueError, match="KVCORE_RANKING_FILE=none"):
        run_tune(TuneOptions(models=["llama-3.1-8b"], small=True, platform="cpu",
                             progress=False))


def test_a_later_run_keeps_the_earlier_cases_it_did_not_measure_again(ranking_file):
    """`kvcore tune --model A` then `--model B` ranks both: a case of the same step is
    replaced, the others stay; not across library versions, and not with --replace."""
    from kvcore.ranking import merged_ranking

    def case(shape: str, times: dict[str, float]) -> MeasuredCase:
        return MeasuredCase("decode", ranking_shape_class(CONFIG), shape,
                            ranking_config_key(CONFIG), times, preset="a")

    earlier = Ranking("2026-01-01", cpu_identity(), dict(library_versions()),
                      (case("decode 4x256", {"X": 1.0}), case("decode 8x64", {"X": 2.0})))
    later = Ranking("2026-01-02", cpu_identity(), dict(library_versions()),
                    (case("decode 4x256", {"X": 3.0}),))
    merged, kept = merged_ranking(later, earlier)
    assert kept == 1 and merged.date == "2026-01-02"
    assert [(c.shape, c.times_us["X"]) for c in merged.cases] == [
        ("decode 8x64", 2.0), ("decode 4x256", 3.0)]
    stale = dict(library_versions(), torch="0.0.1")
    assert merged_ranking(later, Ranking("2026-01-01", cpu_identity(), stale,
                                         earlier.cases)) == (later, 0)
    other = DeviceIdentity("cuda", "NVIDIA H200", "9.0")
    assert merged_ranking(later, Ranking("2026-01-01", other, dict(library_versions()),
                                         earlier.cases)) == (later, 0)

    write_ranking(earlier, ranking_file)
    result = run_tune(TuneOptions(models=["llama-3.1-8b"], small=True, phases=("prefill",),
                                  block_sizes=(16,), kv_cache_dtypes=("auto",), budget_s=60,
                                  platform="cpu", progress=False, reps=1))
    assert result.kept == 2 and result.kept_from == "2026-01-01"
    shapes = [c.shape for c in load_rankings(ranking_file)[0].cases]
    assert shapes[:2] == ["decode 4x256", "decode 8x64"] and len(shapes) > 2
    replaced = run_tune(TuneOptions(models=["llama-3.1-8b"], small=True, phases=("prefill",),
                                    block_sizes=(16,), kv_cache_dtypes=("auto",), budget_s=60,
                                    platform="cpu", progress=False, reps=1, replace=True))
    assert replaced.kept == 0
    assert "decode 8x64" not in [c.shape for c in load_rankings(ranking_file)[0].cases]
