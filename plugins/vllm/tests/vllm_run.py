"""Serve a random-weight Llama through vLLM's own engine and print the greedy tokens as JSON.

``python vllm_run.py MODEL_DIR '[{"block_size": 16, ...}, ...]'`` runs each configuration of
the list in turn, each with its own ``LLM`` (vLLM's engine, its config and its distributed
state torn down between them, vLLM's cached environment variables re-read), and prints one
``RESULT {...}`` line per configuration, in order. Anything that must differ for the whole
process runs in a process of its own: the backend (``VLLM_PLUGINS=`` (empty) runs vLLM's own
CPU_ATTN, the plugin installed and allowed runs kvcore's through it) and the other environment
the caller sets. The options:

- ``block_size``, ``enable_prefix_caching``, ``max_num_batched_tokens`` (small: chunked
  prefill), ``multiprocessing`` (vLLM's engine core in its own process), ``layout`` (vLLM's
  ``VLLM_KV_CACHE_LAYOUT``), ``break_mask`` (the negative control: kvcore's causal flag turned
  off in every step of this configuration, which must change the tokens), ``dtype`` (default
  float32), ``gaps`` (also print each token's top-two log-probability gap), ``max_tokens``.
"""

from __future__ import annotations

import json
import os
import sys


def prompts() -> list[list[int]]:
    """Token-id prompts; the later ones share the first's 40-token prefix (prefix caching)."""
    shared = [(7 * j + 3) % 500 + 1 for j in range(40)]
    own = [[(11 * j + 5 * i) % 500 + 1 for j in range(6 + 13 * i)] for i in range(4)]
    return [shared + own[0], shared + own[1], own[2], shared + own[3]]


def main() -> None:
    model_dir, runs = sys.argv[1], json.loads(sys.argv[2])
    for options in [runs] if isinstance(runs, dict) else runs:
        print("RESULT " + json.dumps(run(model_dir, options)), flush=True)


def run(model_dir: str, options: dict) -> dict:
    """One configuration on a fresh ``LLM``: its tokens, attention impl, backend and layout."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if options.get("multiprocessing") else "0"
    if options.get("layout"):
        os.environ["VLLM_KV_CACHE_LAYOUT"] = options["layout"]
    else:
        os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    import kvcore

    build = kvcore.AttentionMetadataBuilder.build  # CPU_ATTN's builder
    if options.get("break_mask"):
        import dataclasses

        def broken(self, common, **kwargs):  # every query sees its whole request: no mask
            return build(self, dataclasses.replace(common, causal=False), **kwargs)

        kvcore.AttentionMetadataBuilder.build = broken
    try:
        llm = LLM(model=model_dir, skip_tokenizer_init=True,
                  dtype=options.get("dtype", "float32"), enforce_eager=True,
                  block_size=options.get("block_size", 32), max_model_len=256, max_num_seqs=4,
                  seed=0, kv_cache_memory_bytes=32 << 20,
                  enable_prefix_caching=options.get("enable_prefix_caching", False),
                  max_num_batched_tokens=options.get("max_num_batched_tokens", 256),
                  enable_chunked_prefill=True)
        params = SamplingParams(max_tokens=options.get("max_tokens", 32), temperature=0.0,
                                detokenize=False, logprobs=2 if options.get("gaps") else None)
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts()]
        if options.get("enable_prefix_caching"):  # the first request fills the cache first
            first = llm.generate(batch[:1], params, use_tqdm=False)
            rest = llm.generate(batch[1:], params, use_tqdm=False)
            outputs = first + rest
        else:
            outputs = llm.generate(batch, params, use_tqdm=False)
        impl, backend, layout = _attention_impl(llm)
        result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "impl": impl,
                  "kvcore_backend": backend, "layout": layout}
        if options.get("gaps"):
            result["gaps"] = [_gaps(o.outputs[0].logprobs) for o in outputs]
        llm.llm_engine.engine_core.shutdown()
        del llm
    finally:
        kvcore.AttentionMetadataBuilder.build = build
        # The next configuration's engine starts from nothing: no process groups, the
        # environment (VLLM_KV_CACHE_LAYOUT) read again.
        cleanup_dist_env_and_memory()
    return result


def _gaps(logprobs: list[dict]) -> list[float]:
    """Per generated token, the log-probability gap between the best and the second-best
    token (a logit gap: how near the greedy choice was to a tie)."""
    gaps = []
    for position in logprobs:
        best = sorted((lp.logprob for lp in position.values()), reverse=True)
        gaps.append(best[0] - best[1] if len(best) > 1 else float("inf"))
    return gaps


def _attention_impl(llm) -> tuple[str, str | None, str | None]:
    """The class name of the first layer's attention impl, the kvcore backend it runs (None
    for vLLM's own) and the KV-cache layout vLLM resolved (in-process engines only)."""
    try:
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        layers = runner.vllm_config.compilation_config.static_forward_context
        impl = next(iter(layers.values())).impl
        backend = getattr(impl, "kvcore_backend", None)
        return (type(impl).__name__, backend and backend.get_name(),
                runner.vllm_config.cache_config.kv_cache_layout)
    except AttributeError:
        return "unknown (engine in another process)", None, None


if __name__ == "__main__":
    main()
