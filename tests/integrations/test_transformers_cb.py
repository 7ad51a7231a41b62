"""kvcore.integrations.transformers: transformers' continuous batching (``generate_batch``) on a
kvcore backend that views transformers' own paged cache.

A random-weight Llama (``LlamaConfig``, nothing downloaded) serves 8 prompts of mixed lengths,
two of them sharing a 40-token prefix, with 32-token batches (chunked prefill) and 16-token
pages. Tokens must equal transformers' own continuous batching with ``sdpa`` and plain
``model.generate``; a wrong block mapping must change them.
"""

from __future__ import annotations

import dataclasses
import gc
import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

import kvcore.builder
import kvcore.ops

transformers = pytest.importorskip("transformers", reason="transformers is a test extra")

from kvcore.integrations import transformers as kvt  # noqa: E402
from kvcore.integrations.transformers_internals import (  # noqa: E402
    check_internals,
    version_problem,
)

PAGE = 16
NEW_TOKENS = 10


def tiny_llama(dtype: torch.dtype = torch.float32):
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=512, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.set_attn_implementation("sdpa")
    return model


def prompts() -> list[list[int]]:
    """6 prompts of 5 to 60 tokens (some longer than a 32-token batch: chunked prefill), then
    two that share a 40-token prefix (2 full pages: shared blocks)."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 61, (6,), generator=gen).tolist()
    out = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]
    prefix = torch.randint(0, 512, (40,), generator=gen).tolist()
    return [*out, [*prefix, 1, 2, 3], [*prefix, 4, 5, 6, 7, 8]]


def cb_config(**overrides) -> transformers.ContinuousBatchingConfig:
    kwargs = dict(page_size=PAGE, num_blocks=64, max_batch_tokens=32, use_cuda_graph=False,
                  return_logprobs=True)
    return transformers.ContinuousBatchingConfig(**{**kwargs, **overrides})


def greedy(**overrides) -> transformers.GenerationConfig:
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                  pad_token_id=None)
    return transformers.GenerationConfig(**{**kwargs, **overrides})


def run(model, gen_config=None, **cb_overrides) -> dict:
    out = model.generate_batch(prompts(), gen_config or greedy(),
                               continuous_batching_config=cb_config(**cb_overrides))
    errors = {k: r.error for k, r in out.items() if r.error is not None}
    assert not errors, errors
    return out


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def reference(model):
    return run(model)


def tokens(out: dict) -> list[list[int]]:
    return [out[k].generated_tokens for k in sorted(out)]


class Adoptions:
    """What kvcore adopted, seen from inside the steps (after ``generate_batch`` transformers
    has dropped its cache and kvcore with it): per step, the adopted record's facts."""

    def __init__(self, model, state) -> None:
        self.state = state
        self.seen: list[dict] = []
        first = next(m for m in model.modules() if getattr(m, "layer_idx", None) == 0)
        self.handle = first.register_forward_hook(self.record)

    def record(self, *_) -> None:
        a = self.state.adopted
        cache = a.cache()
        group = a.groups[0]
        layers = list(group.layers.values())
        self.seen.append({
            "tensor": weakref.ref(cache.cache_tensor), "ptr": cache.cache_tensor.data_ptr(),
            "numel": cache.cache_tensor.numel(), "layer_ptrs": [x.data_ptr() for x in layers],
            "views": weakref.ref(layers[0]), "dtype": layers[0].dtype,
            "page_size": a.page_size, "max_tokens_read": int(cache.max_tokens_read),
            "builder": (group.builder.max_num_seqs, group.builder.max_model_len)})

    def __enter__(self) -> Adoptions:
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def test_tokens_and_logprobs_equal_transformers_sdpa_and_the_cache_is_aliased(model, reference):
    with kvt.use_kvcore(model, page_size=PAGE) as state, Adoptions(model, state) as seen:
        assert model.config._attn_implementation == kvt.ATTENTION_NAME
        out = run(model)
        step = seen.seen[-1]
        # kvcore's caches are views of transformers' tensor: no second cache exists.
        first = step["ptr"]
        assert step["layer_ptrs"][0] == first
        assert all(first <= ptr < first + step["numel"] for ptr in step["layer_ptrs"])
        assert state.backend.get_name() == "CPU_ATTN"
        assert state.steps > NEW_TOKENS  # chunked prefill took extra steps
        # transformers dropped its cache when generate_batch returned: kvcore did too, so
        # the next batch's cache is sized from memory that is really free.
        assert state.adopted is None
        assert step["views"]() is None and step["tensor"]() is None
    assert model.config._attn_implementation == "sdpa"  # restored
    assert tokens(out) == tokens(reference)
    diff = max(abs(a - b) for k in out
               for a, b in zip(out[k].logprobs, reference[k].logprobs, strict=True))
    assert diff <= 1e-4


def test_builder_buffers_follow_the_steps_not_the_whole_cache(model):
    # 8 requests of at most 60 + 10 tokens: the step buffers hold 8 requests of 128 tokens,
    # not transformers' max_batch_tokens requests of every cache token.
    with kvt.use_kvcore(model, page_size=PAGE) as state, Adoptions(model, state) as seen:
        run(model)
        run(model)  # a second batch: a new cache, adopted afresh
    assert seen.seen[-1]["builder"] == (8, 128)
    assert seen.seen[-1]["max_tokens_read"] == 64 * PAGE
    gc.collect()
    assert all(step["tensor"]() is None for step in seen.seen)


def test_tokens_equal_plain_generate(model, reference):
    with torch.inference_mode():
        plain = []
        for prompt in prompts():
            ids = torch.tensor([prompt])
            plain.append(model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                        eos_token_id=None, pad_token_id=None)[0, len(prompt):]
                         .tolist())
    with kvt.use_kvcore(model, page_size=PAGE):
        out = run(model)
    assert [out[f"req_{i}"].generated_tokens for i in range(len(plain))] == plain


def test_forks_copy_blocks_in_transformers_tensor(model):
    # num_return_sequences=2 forks each request after its prefill: full blocks are shared and
    # the partial one is copied inside transformers' tensor; top_k=1 keeps sampling greedy.
    forking = greedy(do_sample=True, top_k=1, num_return_sequences=2)
    expected = run(model, forking)
    with kvt.use_kvcore(model, page_size=PAGE):
        out = run(model, forking)
    assert len(out) == 2 * len(prompts())
    assert tokens(out) == tokens(expected)


#: Largest bfloat16 logit gap counted as a tie: 2 units in the last place of logits in
#: [4, 8) (bfloat16 keeps 8 significant bits). Different summation orders flip such ties.
BF16_TIE = 2 * 2.0 ** -5


def test_bfloat16_under_inference_mode():
    model = tiny_llama(torch.bfloat16)
    with torch.inference_mode():
        expected = run(model)
        with kvt.use_kvcore(model, page_size=PAGE) as state, Adoptions(model, state) as seen:
            out = run(model)
        assert seen.seen[0]["dtype"] == torch.bfloat16
        identical = 0
        for key, prompt in zip(sorted(out, key=lambda k: int(k[4:])), prompts(), strict=True):
            got, want = out[key].generated_tokens, expected[key].generated_tokens
            if got == want:
                identical += 1
                continue
            # Tokens may part only at a near-tie of transformers' own logits.
            split = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
            logits = model(torch.tensor([prompt + want[:split]])).logits[0, -1].float()
            assert abs(logits[got[split]] - logits[want[split]]) <= BF16_TIE, key
    assert identical >= len(prompts()) // 2


def shift_block_tables(monkeypatch) -> None:
    """Make every step read each request's pages from the next block (a wrong mapping)."""
    build = kvt.full_metadata

    def shifted(group, *args):
        meta = build(group, *args)
        return dataclasses.replace(meta, block_table=(meta.block_table + 1) % group.num_blocks)

    monkeypatch.setattr(kvt, "full_metadata", shifted)


def test_a_wrong_block_mapping_changes_the_tokens(model, reference, monkeypatch):
    # Negative control: with kvcore's value checks off, reading the wrong blocks must be seen
    # in the tokens, or equality above would prove nothing about the mapping.
    shift_block_tables(monkeypatch)
    kvcore.ops.set_value_checks(False)
    try:
        with kvt.use_kvcore(model, page_size=PAGE):
            out = run(model)
    finally:
        kvcore.ops.set_value_checks(True)
    assert tokens(out) != tokens(reference)


def test_kvcore_refuses_a_mapping_that_writes_what_the_step_reads(model, monkeypatch):
    shift_block_tables(monkeypatch)
    with kvt.use_kvcore(model, page_size=PAGE):
        out = model.generate_batch(prompts(), greedy(), continuous_batching_config=cb_config())
    errors = [r.error for r in out.values() if r.error is not None]
    assert errors and "the write would replace what it attends to" in errors[0]


def test_another_page_size_reselects_at_the_first_step(model, reference):
    # checked for transformers' default page size
    with kvt.use_kvcore(model) as state, Adoptions(model, state) as seen:
        out = run(model)
    assert seen.seen[0]["page_size"] == PAGE
    assert tokens(out) == tokens(reference)


@pytest.mark.parametrize("name", ["FLEX_ATTENTION", "SDPA_GATHER"])
def test_backends_that_cannot_view_the_cache_are_refused(model, name):
    with pytest.raises(ValueError, match=rf"backend='{name}' cannot serve transformers' "
                                         r"continuous batching: .*does not read the per-layer "
                                         r"order \(0, 1, 2, 3, 4\)"):
        kvt.use_kvcore(model, name, page_size=PAGE).__enter__()
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize(("attr", "value", "reason"), [
    ("layer_types", ["full_attention", "chunked_attention"], "layers of type chunked_attention"),
    ("kv_lora_rank", 16, "uses MLA"),
])
def test_models_it_cannot_serve_are_refused_with_reasons(attr, value, reason):
    model = tiny_llama()
    setattr(model.config, attr, value)
    with pytest.raises(ValueError, match=reason):
        kvt.use_kvcore(model, page_size=PAGE).__enter__()


def test_plain_generate_inside_the_block_says_what_to_do(model):
    with kvt.use_kvcore(model, page_size=PAGE), pytest.raises(
            RuntimeError, match="serves transformers' continuous batching.*generate_batch"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
    assert model.config._attn_implementation == "sdpa"


def test_the_installed_transformers_has_every_internal_used():
    assert version_problem() is None
    assert check_internals() == []


def test_a_changed_internal_is_reported(monkeypatch):
    from transformers.generation.continuous_batching.cache_allocators import (
        FullAttentionCacheAllocator,
    )

    monkeypatch.delattr(FullAttentionCacheAllocator, "layer_type")
    problems = check_internals()
    assert len(problems) == 1 and "FullAttentionCacheAllocator lacks layer_type" \
        in problems[0]
    with pytest.raises(RuntimeError, match="changed what kvcore's integration relies on"):
        kvt.use_kvcore(tiny_llama(), page_size=PAGE).__enter__()


def test_a_version_outside_the_range_is_refused():
    assert version_problem("5.25.0") is None
    for version in ("5.24.1", "5.26.0", "6.0.0.dev0"):
        problem = version_problem(version)
        assert f"transformers {version} is installed but" in problem
        assert "supports transformers>=5.25,<5.26" in problem and "kvcore[transformers]" in problem


def test_importable_without_transformers_and_says_which_extra(tmp_path):
    # kvcore and the integration module import without transformers; using it names the extra.
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import kvcore, kvcore.integrations.transformers as t\n"
            "try:\n    t.use_kvcore(None).__enter__()\n"
            "except ImportError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=True)
    assert "pip install 'kvcore[transformers]'" in result.stdout


def test_the_readme_example_runs(capsys):
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    text = readme.split("\n## Use it in transformers\n", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", text, re.DOTALL).group(1)
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.startswith("CPU_ATTN [[")


def test_a_modules_soft_cap_and_sinks_reach_the_selection_and_its_impls():
    from kvcore.integrations.transformers import _attention_modules, _layer_features

    model = tiny_llama()
    modules = list(_attention_modules(model).values())
    assert _layer_features(modules[0]) == {}  # llama's attention has neither
    modules[0].attn_logit_softcapping = 30.0
    modules[0].sinks = torch.nn.Parameter(torch.zeros(model.config.num_attention_heads))
    features = _layer_features(modules[0])
    assert features["logits_soft_cap"] == 30.0
    assert features["sinks"].data_ptr() == modules[0].sinks.data_ptr()
    assert kvt.select_backend(model, page_size=PAGE).SUPPORTS_SINK
    with pytest.raises(kvcore.BackendSelectionError, match="does not support attention sinks"):
        kvt.select_backend(model, "CPU_MLA", page_size=PAGE)


# -- sliding-window layers and hybrid models (two cache groups) --------------------------------

WINDOW = 16
SW_PAGE = 8


def tiny_hybrid(kind: str, **overrides):
    """A random-weight Gemma 2 (soft-cap) or gpt-oss (sinks, MoE) with 4 layers alternating
    16-token sliding windows and full attention: two cache groups in transformers."""
    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                  max_position_embeddings=512, initializer_range=0.2, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    if kind == "gemma2":
        config = transformers.Gemma2Config(intermediate_size=128, query_pre_attn_scalar=16,
                                           **{**common, **overrides})
    else:
        config = transformers.GptOssConfig(intermediate_size=64, num_local_experts=4,
                                           num_experts_per_tok=2, **{**common, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.set_attn_implementation("eager")  # Gemma 2 has no sdpa path
    return model


def run_hybrid(model, lengths=(5, 20, 45, 60), batch_tokens: int = 32) -> dict:
    """Prompts of 5 to 60 tokens (all but one longer than the window: the ring wraps, in
    prefill chunks of a 32-token batch and in decode), 24 new tokens each."""
    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]
    config = cb_config(page_size=SW_PAGE, num_blocks=64, max_batch_tokens=batch_tokens)
    out = model.generate_batch(batch, greedy(max_new_tokens=24),
                               continuous_batching_config=config)
    errors = {k: r.error for k, r in out.items() if r.error is not None}
    assert not errors, errors
    return out


def assert_same(out: dict, expected: dict, tolerance: float = 1e-4) -> None:
    assert tokens(out) == tokens(expected)
    diff = max(abs(a - b) for k in out
               for a, b in zip(out[k].logprobs, expected[k].logprobs, strict=True))
    assert diff <= tolerance


def test_gpt_oss_sinks_and_windows_equal_transformers_eager():
    model = tiny_hybrid("gpt_oss")
    expected = run_hybrid(model)
    with kvt.use_kvcore(model, page_size=SW_PAGE) as state, Adoptions(model, state) as seen:
        out = run_hybrid(model)
    assert_same(out, expected)
    assert state.backend.get_name() == "CPU_ATTN"
    assert seen.seen[-1]["layer_ptrs"][0] == seen.seen[-1]["ptr"]  # full group: in place


def test_gemma2_windows_equal_transformers_eager_without_soft_cap():
    # transformers' paged eager attention drops attn_logit_softcapping: compare without it.
    model = tiny_hybrid("gemma2", attn_logit_softcapping=None)
    expected = run_hybrid(model)
    with kvt.use_kvcore(model, page_size=SW_PAGE):
        out = run_hybrid(model)
    assert_same(out, expected)


def test_gemma2_soft_cap_and_windows_equal_plain_generate():
    model = tiny_hybrid("gemma2", attn_logit_softcapping=50.0)
    with kvt.use_kvcore(model, page_size=SW_PAGE):
        out = run_hybrid(model)
    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 20, 45, 60)]
    with torch.inference_mode():
        for i, prompt in enumerate(batch):
            plain = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                   eos_token_id=None, pad_token_id=None)[0, len(prompt):]
            assert out[f"req_{i}"].generated_tokens == plain.tolist()


def test_a_wrong_ring_gather_changes_the_tokens(monkeypatch):
    # Negative control: gathering each request's window from the next ring block must show.
    model = tiny_hybrid("gpt_oss")
    expected = run_hybrid(model)
    build = kvt.sliding_metadata

    def shifted(group, *args):
        common, staging = build(group, *args)
        if staging.src_blocks is not None:
            staging.src_blocks = (staging.src_blocks + 1) % group.num_blocks
        return common, staging

    monkeypatch.setattr(kvt, "sliding_metadata", shifted)
    with kvt.use_kvcore(model, page_size=SW_PAGE):
        out = run_hybrid(model)
    assert tokens(out) != tokens(expected)


class RingSteps:
    """Spies on a run: the sliding group's in-place steps (their longest query) and the
    windows kvcore's step check ran with (it reads the step when its tensors cannot be marked,
    as under ``torch.inference_mode``)."""

    def __init__(self, monkeypatch) -> None:
        self.queries: list[int] = []
        self.windows: list[int | None] = []
        ring, check = kvt.ring_metadata, kvcore.builder.step_facts_from_tensors

        def ring_metadata(*args):
            meta = ring(*args)
            self.queries.append(meta.max_query_len)
            return meta

        def checked(*args, **kwargs):
            self.windows.append(kwargs.get("sliding_window"))
            return check(*args, **kwargs)

        monkeypatch.setattr(kvt, "ring_metadata", ring_metadata)
        monkeypatch.setattr(kvcore.builder, "step_facts_from_tensors", checked)


@pytest.mark.parametrize(("lengths", "batch_tokens"), [
    ((5, 20, 45, 60), 32),  # decodes past the window in place, wrapping prefill chunks gathered
    ((3, 9, 14), 8),  # prefill chunks within the window (past and new tokens) in place too
], ids=["wrapping", "within-window"])
def test_sliding_layers_attend_on_the_ring_in_place(monkeypatch, lengths, batch_tokens):
    # Under inference mode kvcore's step check reads every step, with the sliding group's
    # window: a decode replaces the ring slot of the key that just left the window, which
    # the window-aware check allows and a full-attention check would refuse.
    model = tiny_hybrid("gpt_oss")
    spy = RingSteps(monkeypatch)
    with torch.inference_mode():
        expected = run_hybrid(model, lengths, batch_tokens)
        with kvt.use_kvcore(model, page_size=SW_PAGE) as state:
            out = run_hybrid(model, lengths, batch_tokens)
    assert_same(out, expected)
    assert state.in_place_steps == len(spy.queries) > state.steps // 2
    assert set(spy.windows) == {None, WINDOW}  # full group, sliding group
    assert len(spy.windows) == 2 * state.steps
    if max(lengths) > WINDOW:
        assert state.gathered_steps > 0 and max(spy.queries) == 1
    else:
        assert state.gathered_steps == 0 and max(spy.queries) > 1


def test_a_ring_of_partial_pages_is_gathered():
    # A 12-token window over 8-token pages: a page's offsets do not follow the positions.
    model = tiny_hybrid("gpt_oss", sliding_window=12)
    expected = run_hybrid(model)
    with kvt.use_kvcore(model, page_size=SW_PAGE) as state:
        out = run_hybrid(model)
    assert_same(out, expected)
    assert state.in_place_steps == 0 and state.gathered_steps == state.steps


def test_a_wrong_ring_mapping_changes_the_tokens(monkeypatch):
    # Negative control of the in-place path: each block-table column one ring page on (value
    # checks off, which would refuse some of it) must show in the tokens.
    model = tiny_hybrid("gpt_oss")
    expected = run_hybrid(model)
    ring = kvt.ring_metadata

    def shifted(group, *args):
        meta = ring(group, *args)
        return dataclasses.replace(meta, block_table=meta.block_table.roll(1, dims=1))

    monkeypatch.setattr(kvt, "ring_metadata", shifted)
    kvcore.ops.set_value_checks(False)
    try:
        with kvt.use_kvcore(model, page_size=SW_PAGE) as state:
            out = run_hybrid(model)
    finally:
        kvcore.ops.set_value_checks(True)
    assert state.in_place_steps > 0
    assert tokens(out) != tokens(expected)


@pytest.mark.gpu
@pytest.mark.parametrize(("kind", "backend"), [
    ("gpt_oss", "TRITON_ATTN"), ("gemma2", "TRITON_ATTN"), ("gemma2", None),
], ids=["gpt_oss-TRITON_ATTN", "gemma2-TRITON_ATTN", "gemma2-selected"])
def test_on_the_gpu_the_ring_in_place_equals_the_gather_and_transformers(monkeypatch, kind,
                                                                        backend):
    # The GPU kernels on the in-place block tables (first column mid-page, a ring page twice
    # in one table) against the gather path and transformers' eager attention, float32
    # within kvcore's conformance tolerance.
    overrides = {"attn_logit_softcapping": None} if kind == "gemma2" else {}
    model = tiny_hybrid(kind, **overrides).cuda()
    adopt = kvt.KVCoreAttention._adopt

    def gathering(self, cache):
        adopted = adopt(self, cache)
        for group in adopted.groups:
            group.in_place = False
        return adopted

    with torch.inference_mode():
        expected = run_hybrid(model)
        with kvt.use_kvcore(model, backend, page_size=SW_PAGE) as state:
            in_place = run_hybrid(model)
        monkeypatch.setattr(kvt.KVCoreAttention, "_adopt", gathering)
        with kvt.use_kvcore(model, backend, page_size=SW_PAGE) as staged:
            gathered = run_hybrid(model)
    assert state.in_place_steps > state.steps // 2 and staged.in_place_steps == 0
    assert_same(in_place, gathered, tolerance=2e-3)
    assert_same(in_place, expected, tolerance=2e-3)
