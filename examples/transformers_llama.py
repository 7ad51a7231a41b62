"""A Hugging Face ``transformers`` Llama served through kvcore's paged KV cache.

The model is built from a ``LlamaConfig`` with random weights (``from_config``: nothing is
downloaded). Its attention is routed through kvcore by registering an attention function with
transformers' ``AttentionInterface`` under the name ``"kvcore"``: for each layer it writes the
step's K/V into kvcore's paged cache with the selected backend's ``do_kv_cache_update`` and
attends with its ``forward``. Everything else (embeddings, rotary embeddings, norms, MLPs,
the LM head) is transformers' own code.

The engine loop packs the new tokens of every running request into one sequence (batch
dimension 1, ``position_ids`` per request), the varlen layout of :class:`kvcore.AttentionMetadata`,
and requests arrive one per step, so steps mix a prefill with decodes. The result must equal,
token for token, greedy ``generate`` with transformers' own attention (``sdpa``)::

    python examples/transformers_llama.py                      # CPU, CPU_ATTN
    python examples/transformers_llama.py --device cuda        # best backend on the GPU
    python examples/transformers_llama.py --device cuda --backend TRITON_ATTN

Only kvcore's public API is used (``kvcore``): this is the code an engine copies. It is the
minimal form with kvcore's own cache and a hand-written batching loop; to keep transformers'
own serving loop (``generate_batch``: its scheduler, cache, prefix sharing and forks) and run
only attention on kvcore, use ``kvcore.integrations.transformers.use_kvcore(model)``.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import torch
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedModel,
)

import kvcore

ATTENTION_NAME = "kvcore"
_UNIT_SCALES = kvcore.LayerScales()  # the cache is unquantised


@dataclass
class PagedStep:
    """What the attention function needs for one forward pass, passed as ``kvcore_step=``.

    Attributes:
        caches: the model's KV caches (one logical view per layer).
        impls: one backend ``AttentionImpl`` per layer.
        metadata: the packed batch of this step.
    """

    caches: kvcore.KVCaches
    impls: list[kvcore.AttentionImpl]
    metadata: kvcore.AttentionMetadata


def kvcore_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    kvcore_step: PagedStep | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """An attention function for transformers' ``AttentionInterface``.

    ``query`` is ``(1, num_heads, num_tokens, head_dim)`` and ``key``/``value`` ``(1,
    num_kv_heads, num_tokens, head_dim)``: the packed new tokens, after rotary embeddings.
    Returns ``(1, num_tokens, num_heads, head_dim)`` as transformers expects. The mask is
    ignored: causality and request boundaries come from ``kvcore_step.metadata``.
    """
    if kvcore_step is None:
        raise ValueError("attn_implementation='kvcore' needs kvcore_step=PagedStep(...) in the "
                         "model's forward call")
    if query.shape[0] != 1:
        raise ValueError(f"query has batch size {query.shape[0]}; pack every request's tokens "
                         "into batch dimension 1")
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    layer = module.layer_idx
    cache = kvcore_step.caches.layers[layer]
    impl = kvcore_step.impls[layer]
    meta = kvcore_step.metadata
    impl.do_kv_cache_update(_UNIT_SCALES, k, v, cache, meta.slot_mapping)
    return impl.forward(_UNIT_SCALES, q, k, v, cache, meta).unsqueeze(0), None


def _no_mask(*args: object, **kwargs: object) -> None:
    """kvcore's metadata replaces the 4-D mask, so transformers need not build one."""
    return None


def register() -> None:
    """Make ``attn_implementation="kvcore"`` available to transformers models."""
    AttentionInterface.register(ATTENTION_NAME, kvcore_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


def tiny_llama(*, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> PreTrainedModel:
    """A 2-layer GQA Llama with random weights (``initializer_range`` large enough that
    attention is peaked, so a wrong cache changes the tokens)."""
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=512, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,  # generate exactly n tokens
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device).eval()


@torch.inference_mode()
def generate_paged(
    model: PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    backend: str | None = None,
    block_size: int = 16,
) -> tuple[list[list[int]], type[kvcore.AttentionBackend]]:
    """Greedy generation through kvcore; returns the new tokens per prompt and the backend.

    Request ``i`` joins at step ``i``, so most steps run a prefill and decodes together.
    """
    register()
    cfg = model.config
    head_dim = cfg.head_dim
    selector_config = kvcore.AttentionSelectorConfig(
        head_size=head_dim, dtype=model.dtype, block_size=block_size)
    # A model on the CPU gets a CPU backend even on a GPU machine; else the detected platform.
    platform = "cpu" if model.device.type == "cpu" else None
    chosen = kvcore.get_attn_backend(selector_config, backend=backend, platform=platform)
    blocks_per_seq = math.ceil((max(map(len, prompts)) + max_new_tokens) / block_size)
    caches = kvcore.allocate_kv_caches(
        chosen, num_layers=cfg.num_hidden_layers, num_blocks=len(prompts) * blocks_per_seq,
        block_size=block_size, num_kv_heads=cfg.num_key_value_heads, head_size=head_dim,
        dtype=model.dtype, device=model.device)
    impls = [chosen.get_impl_cls()(num_heads=cfg.num_attention_heads, head_size=head_dim,
                                   scale=head_dim ** -0.5, num_kv_heads=cfg.num_key_value_heads)
             for _ in range(cfg.num_hidden_layers)]
    # Interleaved block tables: a request's blocks are not consecutive in memory.
    tables = [list(range(i, len(prompts) * blocks_per_seq, len(prompts)))
              for i in range(len(prompts))]
    outputs: list[list[int]] = [[] for _ in prompts]
    computed = [0] * len(prompts)  # tokens of each request whose K/V are in the cache
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        step = 0
        while any(len(out) < max_new_tokens for out in outputs):
            active = [i for i in range(min(step + 1, len(prompts)))
                      if len(outputs[i]) < max_new_tokens]
            new = [(prompts[i] + outputs[i])[computed[i]:] for i in active]
            ids = torch.tensor([[t for toks in new for t in toks]], device=model.device)
            positions = torch.tensor(
                [[p for i, toks in zip(active, new, strict=True)
                  for p in range(computed[i], computed[i] + len(toks))]], device=model.device)
            meta = kvcore.build_attention_metadata(
                query_lens=[len(toks) for toks in new],
                context_lens=[computed[i] for i in active],
                block_tables=[tables[i] for i in active],
                block_size=block_size, device=model.device)
            logits = model(input_ids=ids, position_ids=positions, use_cache=False,
                           kvcore_step=PagedStep(caches, impls, meta)).logits[0]
            last = meta.query_start_loc[1:].long() - 1
            for i, toks, tok in zip(active, new, logits[last].argmax(-1).tolist(), strict=True):
                computed[i] += len(toks)
                outputs[i].append(int(tok))
            step += 1
    finally:
        model.set_attn_implementation(previous)
    return outputs, chosen


@torch.inference_mode()
def generate_reference(model: PreTrainedModel, prompts: list[list[int]],
                       max_new_tokens: int, attn_implementation: str = "sdpa"
                       ) -> list[list[int]]:
    """Greedy ``model.generate`` with transformers' own attention and cache, one prompt at a
    time (no padding)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(attn_implementation)
    try:
        outputs = []
        for prompt in prompts:
            ids = torch.tensor([prompt], device=model.device)
            generated = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
            outputs.append(generated[0, len(prompt):].tolist())
    finally:
        model.set_attn_implementation(previous)
    return outputs


def random_prompts(n: int, vocab_size: int, *, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of 5 to 40 random tokens (some cross a 16-token block boundary)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 41, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab_size, (length,), generator=gen).tolist()
            for length in lengths]


def device_problem(device: str) -> str | None:
    """Why ``--device`` cannot run here (one line: the problem and what to do), or ``None``."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        return f"--device {device} is not a torch device (use cpu, cuda or cuda:N)"
    if kind != "cuda" or torch.cuda.is_available():
        return None
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (f"--device {device}: CUDA is not available in this torch build "
                f"({torch.__version__}, CPU only); install a CUDA build of torch "
                "(https://pytorch.org/get-started/locally/) or run with --device cpu")
    return (f"--device {device}: torch.cuda.is_available() is False (no GPU or driver visible "
            "to this torch); check the driver and CUDA_VISIBLE_DEVICES, or run with --device cpu")


def main(argv: list[str] | None = None) -> int:
    # The docstring's first paragraph, without its reStructuredText literal marks.
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--backend", default=None, help="force a kvcore backend by name")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the model's dtype (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=4,
                        help="prompts generated for (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=16,
                        help="tokens generated per prompt (default: %(default)s)")
    args = parser.parse_args(argv)
    problem = device_problem(args.device)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    model = tiny_llama(dtype=kvcore.parse_dtype(args.dtype), device=args.device)
    prompts = random_prompts(args.requests, model.config.vocab_size)
    paged, backend = generate_paged(model, prompts, args.new_tokens, backend=args.backend)
    reference = generate_reference(model, prompts, args.new_tokens)
    same = sum(a == b for p, r in zip(paged, reference, strict=True)
               for a, b in zip(p, r, strict=True))
    total = sum(map(len, reference))
    print(f"backend {backend.get_name()} on {model.device}: {same}/{total} tokens equal to "
          f"transformers' own attention")
    for i, (p, r) in enumerate(zip(paged, reference, strict=True)):
        if p != r:
            print(f"request {i}: kvcore {p}\n           transformers {r}", file=sys.stderr)
    return 0 if same == total else 1


if __name__ == "__main__":
    sys.exit(main())
