"""The demo server's parts on their own: model (KV cache, batched decode), sampler,
tokenizer, configuration, and the `servprof demo-server` command."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import pytest
import torch

from servprof.demo.config import DemoConfig
from servprof.demo.model import SIZES, LlamaLikeModel, count_parameters, model_config
from servprof.demo.sampling import SamplingParams, SlotSampler
from servprof.demo.tokenizer import DemoTokenizer


@pytest.fixture(scope="module")
def model() -> LlamaLikeModel:
    return LlamaLikeModel(model_config("tiny"), slots=4, context=64, seed=3)


def test_decode_with_kv_cache_matches_full_prefill(model):
    prompt = torch.tensor([11, 42, 7, 300, 5, 99])
    full = model.prefill(0, prompt)
    model.prefill(1, prompt[:-1])
    step = model.decode(prompt[-1:], torch.tensor([1]), torch.tensor([5]), 6)
    torch.testing.assert_close(step[0], full, rtol=1e-4, atol=1e-4)


def test_batched_decode_of_different_lengths_matches_each_alone(model):
    first, second = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([9, 8, 7])
    alone = [model.prefill(0, first), model.prefill(0, second)]
    model.prefill(2, first[:-1])
    model.prefill(3, second[:-1])
    # One decode step serves both requests, each at its own position.
    batched = model.decode(torch.tensor([5, 7]), torch.tensor([2, 3]), torch.tensor([4, 2]), 5)
    in_place = model.decode(torch.tensor([5, 7]), torch.tensor([2, 3]), torch.tensor([4, 2]), 5, slice(2, 4))
    torch.testing.assert_close(in_place, batched)
    assert batched.shape == (2, model.config.vocab_size)
    torch.testing.assert_close(batched[0], alone[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(batched[1], alone[1], rtol=1e-4, atol=1e-4)


def test_named_sizes_have_llama_like_shapes():
    one_b = SIZES["1b"]
    assert (one_b.dim, one_b.n_layers, one_b.n_heads, one_b.n_kv_heads, one_b.ffn_dim) == (
        2048,
        16,
        32,
        8,
        8192,
    )
    assert 1.0e9 < count_parameters(one_b) < 1.3e9
    assert 10e6 < count_parameters(SIZES["small"]) < 100e6
    tiny = LlamaLikeModel(model_config("tiny"), slots=1, context=8)
    assert sum(p.numel() for p in tiny.module.parameters()) == count_parameters(model_config("tiny"))
    with pytest.raises(ValueError, match="unknown model size"):
        model_config("huge")


def test_sampler_greedy_top_p_and_seeds():
    sampler = SlotSampler(slots=3, vocab_limit=50, device=torch.device("cpu"))
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    logits[:, 50:] = 100.0  # past the tokenizer's vocabulary: never sampled
    sampler.assign(0, SamplingParams(temperature=0.0))
    sampler.assign(1, SamplingParams(temperature=1.0, top_p=1e-6))  # only the most likely token survives
    sampler.assign(2, SamplingParams(temperature=1.0, seed=5))
    index = torch.tensor([0, 1, 2])
    tokens = sampler.sample(logits, [0, 1, 2], index)
    assert tokens[0] == logits[0, :50].argmax() and tokens[1] == logits[1, :50].argmax()
    assert int(tokens.max()) < 50
    replay = SlotSampler(slots=3, vocab_limit=50, device=torch.device("cpu"))
    replay.assign(2, SamplingParams(temperature=1.0, seed=5))
    assert replay.sample(logits[2:], [2], torch.tensor([2]))[0] == tokens[2]


def test_tokenizer_round_trip_streaming_and_cost_grows_with_length():
    tokenizer = DemoTokenizer()
    text = "The engineer measured 4096 tokens — naïve café ✓ 日本語!"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    stream = tokenizer.decode_stream()
    assert "".join(stream.step(i) for i in ids) == text
    short, long = tokenizer.encode("the scheduler " * 10), tokenizer.encode("the scheduler " * 1000)
    assert len(long) >= 90 * len(short)


def test_config_from_env_and_bad_values():
    config = DemoConfig.from_env(
        {
            "SERVPROF_DEMO_STEP_DELAY_MS": "12.5",
            "SERVPROF_DEMO_SYNC_PER_STEP": "true",
            "SERVPROF_DEMO_MAX_BATCH": "8",
        },
        max_batch=4,
    )
    assert (config.step_delay_ms, config.sync_per_step, config.max_batch) == (12.5, True, 4)
    # An empty variable means the default, as for SERVPROF_* settings.
    assert DemoConfig.from_env({"SERVPROF_DEMO_STEP_DELAY_MS": ""}).step_delay_ms == DemoConfig().step_delay_ms
    with pytest.raises(ValueError, match="SERVPROF_DEMO_MAX_BATCH='many' is not a valid int"):
        DemoConfig.from_env({"SERVPROF_DEMO_MAX_BATCH": "many"})
    with pytest.raises(ValueError, match="step_delay_ms"):
        DemoConfig(step_delay_ms=-1)
    with pytest.raises(ValueError, match="max_tokens_limit"):
        DemoConfig(context=64, max_tokens_limit=64)


def test_cli_rejects_bad_flags_with_a_clear_message():
    result = subprocess.run(
        [sys.executable, "-m", "servprof.cli", "demo-server", "--max-batch", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "max_batch must be >= 1" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_cli_serves_on_a_free_port():
    env = {**os.environ, "SERVPROF_DEMO_MAX_BATCH": "2"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "servprof.demo.server",
            "--port",
            "0",
            "--no-servprof",
            "--step-delay-ms",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        url = None
        for line in process.stderr:  # uvicorn logs the port it bound
            match = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
            if match:
                url = match.group(1)
                break
        assert url, "the server did not report its address"
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert response.status_code == 200
        config = httpx.get(f"{url}/demo/stats").json()["config"]
        assert (config["max_batch"], config["step_delay_ms"], config["servprof"]) == (2, 1.0, False)
    finally:
        process.terminate()
        process.wait(30)
        process.stderr.close()


def test_engine_stops_on_end_of_text_unless_ignore_eos():
    import asyncio

    from servprof.demo.engine import Engine, EngineRequest, Output, asyncio_sink

    # Every token counts as end-of-text here, so the rule is exercised on the first token.
    tokenizer = DemoTokenizer()
    tokenizer.eos_ids = set(range(tokenizer.vocab_size))
    engine = Engine(
        LlamaLikeModel(model_config("tiny", tokenizer.vocab_size), slots=2, context=64), tokenizer
    )
    engine.start()

    async def run(ignore_eos: bool) -> tuple[str | None, int]:
        outputs: asyncio.Queue[Output] = asyncio.Queue()
        request = EngineRequest(
            "r",
            tokenizer.encode("hello there"),
            SamplingParams(max_tokens=5, ignore_eos=ignore_eos),
            asyncio_sink(asyncio.get_running_loop(), outputs),
        )
        engine.submit(request)
        while (output := await outputs.get()).finish_reason is None:
            pass
        return output.finish_reason, len(request.output_ids)

    try:
        assert asyncio.run(run(False)) == ("stop", 0)
        assert asyncio.run(run(True)) == ("length", 5)
        assert engine.snapshot()["free_slots"] == 2
    finally:
        engine.stop()
    # A stopped engine answers at once (an error), never leaves the caller waiting.
    assert asyncio.run(run(True)) == ("error", 0)
