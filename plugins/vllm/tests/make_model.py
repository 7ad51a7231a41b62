"""A random-weight Llama saved for vLLM (nothing downloaded): ``make_model.py DIR``."""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def make_model(path: str, *, seed: int = 0) -> None:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=512, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger logits gaps: fewer near-ties between the top two tokens
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(path)


if __name__ == "__main__":
    make_model(sys.argv[1])
