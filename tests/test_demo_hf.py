"""`--model-path`: a local Hugging Face Llama checkpoint served through the demo's batched model.

The checkpoint is made here (transformers' LlamaForCausalLM with random weights, saved
to a temp dir, with the demo's BPE as tokenizer.json), so nothing is downloaded.
Needs the optional `transformers` (extra 'hf'); skipped without it.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from _demo_helpers import start_demo_server

from servprof.demo.config import DemoConfig
from servprof.demo.hf import load_hf
from servprof.demo.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    directory = tmp_path_factory.mktemp("hf-llama")
    tokenizer = load_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        eos_token_id=0,
        bos_token_id=0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    hf_model.save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory, hf_model


def test_loaded_weights_compute_what_transformers_computes(checkpoint):
    directory, hf_model = checkpoint
    model, tokenizer = load_hf(str(directory), slots=2, context=128, device="cpu", dtype=torch.float32)
    ids = tokenizer.encode("The engineer measured the latency graph near the station, twice.")
    prompt = torch.tensor(ids)
    with torch.no_grad():
        expected = hf_model(prompt[None]).logits[0]
        expected_short = hf_model(prompt[None, :4]).logits[0, -1]
    torch.testing.assert_close(model.prefill(0, prompt[:-1]), expected[-2], rtol=1e-4, atol=1e-4)
    # The next token through the KV cache, batched with another request.
    model.prefill(1, prompt[:3])
    step = model.decode(
        torch.tensor([int(prompt[-1]), int(prompt[3])]),
        torch.tensor([0, 1]),
        torch.tensor([len(ids) - 1, 3]),
        len(ids),
    )
    torch.testing.assert_close(step[0], expected[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step[1], expected_short, rtol=1e-4, atol=1e-4)


def test_server_serves_the_checkpoint(checkpoint):
    directory, _ = checkpoint
    with start_demo_server(model_path=str(directory), max_batch=2, context=256, max_tokens_limit=32) as url:
        models = httpx.get(f"{url}/v1/models").json()
        assert models["data"][0]["id"] == directory.name
        body = httpx.post(
            f"{url}/v1/completions", json={"prompt": "Notes on bread:", "max_tokens": 6, "ignore_eos": True}, timeout=60
        ).json()
        assert body["model"] == directory.name and 1 <= body["usage"]["completion_tokens"] <= 6


def test_bad_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_hf(str(tmp_path), slots=1, context=64, device="cpu", dtype=torch.float32)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="not supported"):
        load_hf(str(tmp_path), slots=1, context=64, device="cpu", dtype=torch.float32)
    assert DemoConfig(model_path=str(tmp_path)).served_model_name == tmp_path.name
