"""Small transformers models built from a config (random weights, no download) and a greedy
generate() on the CPU, for tests that profile a real model the way users do."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 6
PROMPT = torch.arange(3, 15).unsqueeze(0)  # one sequence of 12 token ids


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


def tiny_gpt2() -> torch.nn.Module:  # learned positions: two lookups per forward, back to back
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, bos_token_id=1,
                                     eos_token_id=2, pad_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def generate(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
