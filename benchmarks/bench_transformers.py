"""transformers' continuous batching (``generate_batch``) on kvcore's backends against
transformers' own paged attention, with identical batching settings.

The model is Llama-3-8B-shaped with random weights (32 layers, hidden 4096, 32 query / 8 KV
heads of 128, bfloat16; built from ``LlamaConfig``, nothing downloaded). Two workloads:

- ``decode``: 64 requests of 512-token prompts, 256 new tokens each;
- ``prefill``: 16 requests of 4096-token prompts, 16 new tokens each.

Paths: transformers' ``sdpa`` (CUDA graphs off and on), ``flash_attention_2``/``_3`` where
their package imports, and ``use_kvcore`` with kvcore's selected backend, TRITON_ATTN and
FLASHINFER (CUDA graphs off: kvcore's step reads ``cu_seq_lens_q`` on the host, which a
captured graph cannot). A path that cannot run says why in its row. Each path first runs a
warm-up (the same requests with at most :data:`WARMUP_NEW_TOKENS` new tokens: every step kind
of the timed run, so every kernel is compiled; one compiled later counts against its path).
Per path:

- output tokens/s (wall time of ``generate_batch``);
- attention-module time per step (CUDA events around every attention module, projections
  included, summed over layers; not measured when graphs replay), and steps;
- memory: peak allocated, transformers' cache (its ``PagedAttentionCache`` tensor, which
  transformers sizes from ``--max-memory-percent`` of the free memory, and larger for a
  "flash" attention name, kvcore's included, than for ``sdpa``: it reserves no room for
  repeated K/V heads and masks there) and the extra: peak minus weights minus that cache
  (activations, masks, gathered K/V, kvcore's step buffers);
- greedy agreement with the ``sdpa`` path, judged by a referee (``--agreement referee``,
  the default): every path's tokens are fed back through the model (plain forward, ``sdpa``,
  no cache) and the float32 logits of every generated position are computed from its hidden
  states. A random-weight model's logits are flat: the expected gap between the top two of
  n = 128256 logits of spread s is about s / sqrt(2 ln n), s / 4.9, so at many positions it
  is within a rounding step, one rounding difference flips a token and every later token
  differs: positional equality means little. (Scaling the initialisation would not help:
  bfloat16's steps scale with the logits, so the gap measured in steps stays the same.)
  Per request: identical tokens; or the first position where the path chose another token
  than ``sdpa``, where the referee's logits of the two tokens are compared: a *near-tie*
  when they differ by at most the tie bound, a *non-tie* (a bug) otherwise. The tie bound
  is ``--tie-ulps`` units in the last place of the model dtype at the top logit (``sdpa``
  picks the argmax of bfloat16 logits, so two tokens whose logits round to one bfloat16
  value are an exact tie for it), or the largest margin (top logit minus the chosen
  token's) the referee finds among the ``sdpa`` path's own tokens, if larger: that path
  chose each of them as its argmax, so its margins are what a correct path's rounding
  differs from the referee's. Also per path: the largest margin of any token it generated,
  in those units. ``--agreement tokens`` counts identical requests only (no referee).

A table is printed last; JSON goes to ``--json`` (default ``$OUT/bench_transformers.json``
when ``$OUT`` is set).

Needs, on an offline GPU machine (torch 2.11 cu130): kvcore and kvcore-nvidia installed
(``pip install -e . -e plugins/nvidia``), ``transformers`` 5.25.x carried as a wheel (``pip
download 'transformers>=5.25,<5.26'`` elsewhere, with its dependencies huggingface-hub,
tokenizers, safetensors, regex, pyyaml, tqdm, packaging, filelock, requests), and for
FLASHINFER the ``flashinfer-python`` wheel (its JIT modules build on first use, a minute or two
each, unless FlashInfer's cache is carried). About 16 GiB of weights plus the caches; on an
H100, ``--paths sdpa kvcore:TRITON_ATTN`` on both workloads takes about 3 minutes::

    python benchmarks/bench_transformers.py                     # both workloads, every path
    python benchmarks/bench_transformers.py --workload decode --paths sdpa kvcore
    python benchmarks/bench_transformers.py --small             # CPU, seconds: a smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

#: (requests, prompt tokens, new tokens) per workload; ``--small`` shrinks them.
WORKLOADS = {"decode": (64, 512, 256), "prefill": (16, 4096, 16)}
SMALL_WORKLOADS = {"decode": (4, 24, 8), "prefill": (2, 64, 2)}
#: Every path, in table order. ``kvcore`` is kvcore's selected backend.
PATHS = ("sdpa", "sdpa+graphs", "flash_attention_2", "flash_attention_3", "kvcore",
         "kvcore:TRITON_ATTN", "kvcore:FLASHINFER")
#: New tokens of the warm-up run: enough decode-only steps after the prefill chunks and mixed
#: steps that every step kind of the timed run has been compiled.
WARMUP_NEW_TOKENS = 16
#: Tokens per referee forward (several requests of one length at a time).
REFEREE_TOKENS = 8192
GIB = 2**30


@dataclass
class Row:
    """One path on one workload.

    ``extra_mem_gib`` is ``peak_mem_gib`` minus the model's weights minus transformers' cache
    (``cache_gib``). Agreement (see the module docstring): ``identical`` requests, requests
    whose first divergence from ``sdpa`` is a ``near_tie`` or a ``non_tie``, the tie bound
    used (``tie_ulps``, in units in the last place at the top logit) and the largest margin
    of any generated token (``max_margin_ulps``); ``divergences`` has one entry per
    diverging request.
    """

    workload: str
    path: str
    backend: str | None = None
    tokens_per_s: float | None = None
    wall_s: float | None = None
    steps: int | None = None
    attn_ms_per_step: float | None = None
    peak_mem_gib: float | None = None
    cache_gib: float | None = None
    extra_mem_gib: float | None = None
    agreement: str | None = None
    identical: int | None = None
    near_tie: int | None = None
    non_tie: int | None = None
    tie_ulps: float | None = None
    max_margin_ulps: float | None = None
    skipped: str | None = None
    divergences: list[dict] = field(default_factory=list)


def build_model(small: bool, device: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if small:
        config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=32, max_position_embeddings=1024, initializer_range=0.2)
        dtype = torch.float32
    else:
        config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                             rope_theta=500000.0)
        dtype = torch.bfloat16
    config.bos_token_id = config.eos_token_id = config.pad_token_id = None
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.set_attn_implementation("sdpa")
    return model.eval()


def weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size()
               for t in (*model.parameters(), *model.buffers()))


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (n, length), generator=gen).tolist()


def _attention_modules(model) -> list[torch.nn.Module]:
    return [m for m in model.modules()
            if isinstance(getattr(m, "layer_idx", None), int)
            and type(m).__name__.endswith("Attention")]


class AttentionTimer:
    """CUDA events around every attention module's forward (per-step sums on request), and
    the bytes of the paged cache transformers passes to the first one."""

    def __init__(self, model, enabled: bool) -> None:
        self.enabled = enabled
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.steps = 0
        self.cache_bytes: int | None = None
        self.handles = [model.register_forward_pre_hook(self._count)]
        modules = _attention_modules(model)
        # First, so it sees the cache before use_kvcore's hook takes it out of the kwargs.
        self.handles.append(modules[0].register_forward_pre_hook(
            self._cache, with_kwargs=True, prepend=True))
        if enabled:
            for m in modules:
                # First, so the time includes kvcore's per-step metadata build (its pre-hook).
                self.handles.append(m.register_forward_pre_hook(self._start, prepend=True))
                self.handles.append(m.register_forward_hook(self._stop))
        self._open: torch.cuda.Event | None = None

    def _count(self, *_):
        self.steps += 1

    def _cache(self, module, args, kwargs):
        tensor = getattr(kwargs.get("cache"), "cache_tensor", None)
        if tensor is not None:
            self.cache_bytes = tensor.numel() * tensor.element_size()

    def _start(self, *_):
        if torch.cuda.is_current_stream_capturing():
            return
        self._open = torch.cuda.Event(enable_timing=True)
        self._open.record()

    def _stop(self, *_):
        if self._open is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pairs.append((self._open, end))
        self._open = None

    def ms_per_step(self) -> float | None:
        if not self.enabled or not self.pairs or not self.steps:
            return None
        torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in self.pairs) / self.steps

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def run_path(model, path: str, workload: str, shape, args) -> tuple[Row, dict | None]:
    """Warm up and time ``path``; returns its row and its tokens by request id."""
    import transformers
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from kvcore.integrations.transformers import use_kvcore

    row = Row(workload, path)
    n, length, new = shape
    cuda = args.device.startswith("cuda")
    graphs = path.endswith("+graphs")
    if path.startswith("flash_attention"):
        available = getattr(transformers.utils, f"is_flash_attn_{path[-1]}_available")()
        if not available:
            row.skipped = f"{path}: its package is not importable here"
            return row, None
    if graphs and not cuda:
        row.skipped = "CUDA graphs need a CUDA device"
        return row, None
    batch = prompts(n, length, model.config.vocab_size)
    cb_config = ContinuousBatchingConfig(
        page_size=args.page_size, max_batch_tokens=args.max_batch_tokens,
        use_cuda_graph=graphs, max_memory_percent=args.max_memory_percent,
        num_blocks=args.num_blocks, auto_switch_to_flash=False)
    attn = path.split("+")[0]

    def generate(new_tokens: int):
        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=None)
        return model.generate_batch(batch, config, continuous_batching_config=cb_config,
                                    warmup=graphs)

    try:
        if attn.startswith("kvcore"):
            backend = attn.partition(":")[2] or None
            context = use_kvcore(model, backend, page_size=args.page_size)
        else:
            model.set_attn_implementation(attn)
            context = _nothing()
        with context as state:
            row.backend = state.backend.get_name() if state is not None else attn
            generate(min(new, WARMUP_NEW_TOKENS))  # compiles, JIT builds
            _sync(cuda)
            timer = AttentionTimer(model, enabled=cuda and not graphs)
            _free(cuda)  # the warm-up's cache is gone (transformers and kvcore dropped it)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            out = generate(new)
            _sync(cuda)
            row.wall_s = time.perf_counter() - start
            row.attn_ms_per_step = timer.ms_per_step()
            row.steps = None if graphs else timer.steps  # replays call no hooks
            timer.close()
    except (ValueError, RuntimeError, ImportError) as exc:
        row.skipped = f"{type(exc).__name__}: {exc}"
        return row, None
    finally:
        model.set_attn_implementation("sdpa")
        _free(cuda)
    errors = [r.error for r in out.values() if r.error is not None]
    if errors:
        row.skipped = f"generation failed: {errors[0]}"
        return row, None
    if timer.cache_bytes is not None:
        row.cache_gib = timer.cache_bytes / GIB
    if cuda:
        row.peak_mem_gib = torch.cuda.max_memory_allocated() / GIB
        if row.cache_gib is not None:
            row.extra_mem_gib = row.peak_mem_gib - weight_bytes(model) / GIB - row.cache_gib
    tokens = {k: r.generated_tokens for k, r in out.items()}
    row.tokens_per_s = sum(map(len, tokens.values())) / row.wall_s
    return row, tokens


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


# -- agreement ---------------------------------------------------------------------------------


def _ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at ``|values|`` (float32 tensors)."""
    exponent = torch.floor(torch.log2(values.abs().clamp_min(torch.finfo(dtype).tiny)))
    return torch.finfo(dtype).eps * torch.exp2(exponent)


@torch.no_grad()
def referee(model, batch: list[list[int]], streams: dict[str, list[int]],
            reference: dict[str, list[int]]) -> dict[str, dict]:
    """Feed ``prompt + tokens`` of every request back through the model (plain forward, its
    current attention, no cache) and take the float32 logits at each generated position from
    the hidden states. Per request id: ``margins`` (top logit minus the stream token's, per
    position, in units in the last place of the model dtype at the top logit) and, where the
    stream first differs from ``reference``, ``divergence`` (the position, both tokens, their
    logits' difference and the top-two gap in those units, the unit, whether the stream's
    token is the referee's top-2)."""
    head = model.get_output_embeddings().weight
    weight = head.float()
    by_length: dict[tuple[int, int], list[str]] = {}
    for key, tokens in streams.items():
        prompt = batch[int(key.rpartition("_")[2])]
        by_length.setdefault((len(prompt), len(tokens)), []).append(key)
    facts = {}
    for (p_len, n_new), keys in by_length.items():
        per_forward = max(1, REFEREE_TOKENS // (p_len + n_new - 1))
        for i in range(0, len(keys), per_forward):
            group = keys[i:i + per_forward]
            ids = torch.tensor([batch[int(k.rpartition("_")[2])] + streams[k][:-1]
                                for k in group], device=head.device)
            hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
            for j, key in enumerate(group):
                logits = hidden[j, p_len - 1:].float() @ weight.T  # (n_new, vocab)
                got = torch.tensor(streams[key], device=logits.device)
                top = logits.topk(2, dim=-1)
                ulp = _ulp(top.values[:, 0], head.dtype)
                chosen = logits.gather(1, got[:, None])[:, 0]
                fact = {"margins": ((top.values[:, 0] - chosen) / ulp).cpu()}
                want = reference[key]
                pos = next((n for n, (a, b) in enumerate(zip(want, streams[key], strict=False))
                            if a != b), None)
                if pos is None and len(want) != n_new:  # one stopped early: not a tie
                    fact["divergence"] = {"request": key, "position": min(len(want), n_new),
                                          "lengths": [len(want), n_new],
                                          "logit_diff_ulps": float("inf")}
                elif pos is not None:
                    u = float(ulp[pos])
                    fact["divergence"] = {
                        "request": key, "position": pos, "sdpa_token": want[pos],
                        "token": streams[key][pos],
                        "logit_diff_ulps": round(abs(float(
                            logits[pos, want[pos]] - logits[pos, streams[key][pos]])) / u, 2),
                        "top1_top2_ulps": round(float(
                            top.values[pos, 0] - top.values[pos, 1]) / u, 2),
                        "ulp": u, "token_is_top2": streams[key][pos] in
                        top.indices[pos].tolist()}
                facts[key] = fact
    return facts


def judge(row: Row, facts: dict[str, dict], tie_ulps: float) -> None:
    """Fill ``row``'s agreement from its referee ``facts`` (see the module docstring)."""
    row.identical = row.near_tie = row.non_tie = 0
    row.tie_ulps = tie_ulps
    row.max_margin_ulps = max(float(f["margins"].max()) for f in facts.values())
    for key in sorted(facts, key=lambda k: int(k.rpartition("_")[2])):
        divergence = facts[key].get("divergence")
        if divergence is None:
            row.identical += 1
            continue
        divergence["tie"] = divergence["logit_diff_ulps"] <= tie_ulps
        row.near_tie += divergence["tie"]
        row.non_tie += not divergence["tie"]
        row.divergences.append(divergence)


def agreement(model, batch, rows_tokens: list[tuple[Row, dict]], tie_ulps: float,
              mode: str) -> None:
    """Judge every path of one workload against its ``sdpa`` row (the first)."""
    reference = rows_tokens[0][1]
    if reference is None:
        return
    if mode == "tokens":
        for row, tokens in rows_tokens:
            if tokens is not None:
                same = sum(tokens[k] == reference[k] for k in reference)
                row.identical = same
                row.agreement = f"{same}/{len(reference)} identical"
        return
    ref_facts = referee(model, batch, reference, reference)
    # The sdpa path chose each of its tokens as its argmax: their margins are rounding noise.
    bound = max(tie_ulps, max(float(f["margins"].max()) for f in ref_facts.values()))
    judge(rows_tokens[0][0], ref_facts, bound)
    for row, tokens in rows_tokens[1:]:
        if tokens is not None:
            judge(row, referee(model, batch, tokens, reference), bound)
    for row, tokens in rows_tokens:
        if tokens is not None:
            row.agreement = (f"{row.identical} same, {row.near_tie} tie, "
                             f"{row.non_tie} non-tie")


# -- report ------------------------------------------------------------------------------------


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[Row]) -> str:
    head = ("workload", "path", "backend", "tok/s", "attn ms/step", "steps", "peak GiB",
            "cache GiB", "extra GiB", "agreement (requests)", "max margin ulps")
    lines = [head]
    for r in rows:
        if r.skipped:
            lines.append((r.workload, r.path, r.backend or "-", "skipped", r.skipped[:90],
                          *[""] * (len(head) - 5)))
            continue
        lines.append((r.workload, r.path, r.backend or "-", f"{r.tokens_per_s:.1f}",
                      _num(r.attn_ms_per_step, ".2f"), _num(r.steps, "d"),
                      _num(r.peak_mem_gib, ".1f"), _num(r.cache_gib, ".1f"),
                      _num(r.extra_mem_gib, ".1f"), r.agreement or "-",
                      _num(r.max_margin_ulps, ".1f")))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True))
                     for line in lines)
    bounds = {(r.workload, r.tie_ulps) for r in rows if r.tie_ulps is not None}
    notes = [f"{w}: near-tie bound {b:.1f} ulps" for w, b in sorted(bounds)]
    return text + ("\n" + "; ".join(notes) if notes else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--small", action="store_true",
                        help="a 2-layer float32 model and tiny workloads on the CPU (seconds)")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --small")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), nargs="+",
                        default=sorted(WORKLOADS))
    parser.add_argument("--paths", nargs="+", default=list(PATHS),
                        help=f"paths to run (default: all of {', '.join(PATHS)}); sdpa is "
                             "the agreement reference and always runs first")
    parser.add_argument("--page-size", type=int, default=None,
                        help="ContinuousBatchingConfig.page_size (default: 64; 16 with --small)")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="tokens per step (default: 8192; 32 with --small)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="cache blocks (default: transformers sizes it from free memory; "
                             "256 with --small)")
    parser.add_argument("--max-memory-percent", type=float, default=0.5,
                        help="share of free GPU memory for the cache (default: %(default)s)")
    parser.add_argument("--agreement", choices=("referee", "tokens"), default="referee",
                        help="referee: classify divergences from sdpa as near-ties or not "
                             "(a forward per request group, seconds on a GPU); tokens: count "
                             "identical requests only (default: %(default)s)")
    parser.add_argument("--tie-ulps", type=float, default=2.0,
                        help="near-tie bound in units in the last place of the model dtype at "
                             "the top logit, raised to the sdpa path's own largest margin "
                             "(default: %(default)s)")
    parser.add_argument("--json", default=None, help="where to write the results")
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.small else "cuda")
    args.page_size = args.page_size or (16 if args.small else 64)
    args.max_batch_tokens = args.max_batch_tokens or (32 if args.small else 8192)
    if args.small and args.num_blocks is None:
        args.num_blocks = 256
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but torch.cuda.is_available() is False; run with --small "
              "for the CPU smoke test", file=sys.stderr)
        return 2
    model = build_model(args.small, args.device)
    shapes = SMALL_WORKLOADS if args.small else WORKLOADS
    paths = ["sdpa"] + [p for p in args.paths if p != "sdpa"]
    rows = []
    for workload in args.workload:
        results = []
        for path in paths:
            row, tokens = run_path(model, path, workload, shapes[workload], args)
            results.append((row, tokens))
            print(f"{workload:8s} {path:22s} "
                  f"{row.skipped or f'{row.tokens_per_s:.1f} tok/s'}", file=sys.stderr)
        start = time.perf_counter()
        n, length, _ = shapes[workload]
        agreement(model, prompts(n, length, model.config.vocab_size), results, args.tie_ulps,
                  args.agreement)
        _free(args.device.startswith("cuda"))
        print(f"{workload:8s} agreement ({args.agreement}) in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
        rows.extend(row for row, _ in results)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    import transformers

    result = {"device": device, "torch": torch.__version__,
              "transformers": transformers.__version__, "small": args.small,
              "page_size": args.page_size, "max_batch_tokens": args.max_batch_tokens,
              "weights_gib": weight_bytes(model) / GIB, "agreement": args.agreement,
              "rows": [asdict(r) for r in rows]}
    out = args.json or (str(Path(os.environ["OUT"]) / "bench_transformers.json")
                        if os.environ.get("OUT") else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
