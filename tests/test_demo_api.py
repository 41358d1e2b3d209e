"""The demo LLM server's OpenAI-compatible API, against the real app on a loopback uvicorn."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from _demo_helpers import get_stats, parse_sse, start_demo_server, wait_for

MAX_BATCH = 16


@pytest.fixture(scope="module")
def base_url():
    with start_demo_server(size="tiny", max_batch=MAX_BATCH) as url:
        yield url


def _check_usage(usage: dict, max_tokens: int, finish_reason: str) -> None:
    # Callers ask ignore_eos: random weights may sample end-of-text first (0 tokens, by chance).
    assert usage["prompt_tokens"] > 0
    assert 1 <= usage["completion_tokens"] <= max_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if finish_reason == "length":
        assert usage["completion_tokens"] == max_tokens


def test_health_and_models(base_url):
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    models = httpx.get(f"{base_url}/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "servprof-demo-tiny"


def test_completion_not_streamed(base_url):
    response = httpx.post(
        f"{base_url}/v1/completions", json={"prompt": "The engineer measured", "max_tokens": 7, "ignore_eos": True},
        timeout=30
    )
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("length", "stop")
    assert isinstance(choice["text"], str)
    _check_usage(body["usage"], 7, choice["finish_reason"])


def test_completion_streamed_with_usage(base_url):
    payload = {
        "prompt": "Notes on batching:",
        "max_tokens": 9,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = httpx.post(f"{base_url}/v1/completions", json=payload, timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    # One id for the whole stream, usage chunk included (as OpenAI and vLLM do).
    assert {e["id"] for e in events[:-1]} == {events[0]["id"]} and events[0]["id"].startswith("cmpl-")
    text_chunks = events[:-2]
    assert all(chunk["object"] == "text_completion" for chunk in text_chunks)
    finish = text_chunks[-1]["choices"][0]["finish_reason"]
    assert finish in ("length", "stop")
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in text_chunks[:-1])
    _check_usage(usage_chunk["usage"], 9, finish)
    # One chunk per token (at most; a token whose text is incomplete waits for the next).
    assert len(text_chunks) <= usage_chunk["usage"]["completion_tokens"] + 1


def test_chat_completion_not_streamed(base_url):
    payload = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
        "max_tokens": 5,
        "ignore_eos": True,
    }
    body = httpx.post(f"{base_url}/v1/chat/completions", json=payload, timeout=30).json()
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    _check_usage(body["usage"], 5, body["choices"][0]["finish_reason"])


def test_chat_completion_streamed(base_url):
    payload = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Tell me about trains."}]}],
        "max_tokens": 6,
        "stream": True,
    }
    events = parse_sse(httpx.post(f"{base_url}/v1/chat/completions", json=payload, timeout=30).text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert "usage" not in chunks[-1]  # only with stream_options.include_usage


def test_seed_makes_sampling_reproducible(base_url):
    def generate(seed: int) -> str:
        payload = {
            "prompt": "A quiet village",
            "max_tokens": 12,
            "temperature": 1.0,
            "top_p": 0.9,
            "seed": seed,
        }
        return httpx.post(f"{base_url}/v1/completions", json=payload, timeout=30).json()["choices"][0]["text"]

    first, again, other = generate(7), generate(7), generate(8)
    assert first == again
    assert first != other


def test_stop_string_ends_generation(base_url):
    payload = {"prompt": "The market", "max_tokens": 24, "temperature": 0.0}
    full = httpx.post(f"{base_url}/v1/completions", json=payload, timeout=30).json()["choices"][0]["text"]
    assert len(full) > 8, full
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.index(stop)]
    for stream in (False, True):
        response = httpx.post(
            f"{base_url}/v1/completions", json={**payload, "stop": [stop], "stream": stream}, timeout=30
        )
        if stream:
            chunks = [e for e in parse_sse(response.text) if e != "[DONE]"]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            text, finish = (
                response.json()["choices"][0]["text"],
                response.json()["choices"][0]["finish_reason"],
            )
        assert (text, finish) == (expected, "stop")


def test_sixteen_concurrent_streams_all_complete_in_one_batch(base_url):
    steps_before = get_stats(base_url)["decode_steps"]

    async def one(client: httpx.AsyncClient, index: int) -> tuple[str, int]:
        payload = {
            "prompt": f"Request {index}: " + "the scheduler counted tokens " * (1 + index % 4),
            "max_tokens": 24,
            "ignore_eos": True,  # random weights may pick EOS first; every stream runs its 24 steps
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with client.stream("POST", f"{base_url}/v1/completions", json=payload) as response:
            assert response.status_code == 200
            body = (await response.aread()).decode()
        events = parse_sse(body)
        return events[-1], events[-2]["usage"]["completion_tokens"]

    async def main() -> list[tuple[str, int]]:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(main())
    assert [done for done, _ in results] == ["[DONE]"] * 16
    assert [tokens for _, tokens in results] == [24] * 16
    stats = get_stats(base_url)
    new_steps = stats["steps"][-(stats["decode_steps"] - steps_before) :]
    # Continuous batching: decode steps served many requests at once.
    assert max(step["batch_size"] for step in new_steps) >= 8
    assert stats["batch_size"] == 0 and stats["free_slots"] == MAX_BATCH
    # Each request's own timeline: queued, then admitted (prefill), then its first token.
    for record in stats["recent_requests"][-16:]:
        assert record["enqueued_ns"] <= record["admitted_ns"] <= record["first_token_ns"]


def test_disconnect_frees_the_slot_and_the_batch_shrinks():
    # A host delay per step keeps the streams alive long enough to disconnect one.
    with start_demo_server(size="tiny", max_batch=4, step_delay_ms=5, max_tokens_limit=400) as url:

        async def main() -> None:
            payload = {
                "prompt": "Keep talking about bridges",
                "max_tokens": 400,
                "stream": True,
                "temperature": 0,
            }
            async with (
                httpx.AsyncClient(timeout=60) as client,
                client.stream("POST", f"{url}/v1/completions", json=payload) as kept,
            ):
                kept_lines = kept.aiter_lines()
                async with client.stream("POST", f"{url}/v1/completions", json=payload) as dropped:
                    dropped_lines = dropped.aiter_lines()
                    for _ in range(6):  # both are streaming now
                        await anext(dropped_lines)
                        await anext(kept_lines)
                    assert get_stats(url)["batch_size"] == 2
                # Leaving the block closed `dropped`'s connection mid-stream.
                stats = await asyncio.to_thread(
                    wait_for, lambda: (s := get_stats(url))["requests_finished"].get("cancelled") and s
                )
                assert stats["free_slots"] == 3
                # `kept` still streams, now alone in the batch.
                for _ in range(6):
                    await anext(kept_lines)
                stats = get_stats(url, steps=3)
                assert stats["batch_size"] == 1
                assert [step["batch_size"] for step in stats["steps"]] == [1, 1, 1]

        asyncio.run(main())
        final = wait_for(lambda: (s := get_stats(url))["free_slots"] == 4 and s)
        assert final["batch_size"] == 0
        cancelled = [r for r in final["recent_requests"] if r["finish_reason"] == "cancelled"]
        assert len(cancelled) == 2 and all(r["output_tokens"] < 400 for r in cancelled)


def test_disconnect_of_a_non_streamed_request_frees_the_slot():
    with start_demo_server(size="tiny", max_batch=2, step_delay_ms=5, max_tokens_limit=400) as url:
        payload = {"prompt": "Keep talking about maps", "max_tokens": 400, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            httpx.post(f"{url}/v1/completions", json=payload, timeout=httpx.Timeout(30, read=0.5))
        stats = wait_for(lambda: (s := get_stats(url))["requests_finished"].get("cancelled") and s)
        assert stats["free_slots"] == 2 and stats["batch_size"] == 0
        assert stats["recent_requests"][-1]["output_tokens"] < 400


def test_requests_beyond_the_slots_queue_and_all_complete():
    with start_demo_server(size="tiny", max_batch=2) as url:

        async def main() -> list[str]:
            async with httpx.AsyncClient(timeout=60) as client:

                async def one(index: int) -> str:
                    payload = {"prompt": f"Queue {index}", "max_tokens": 12, "temperature": 0, "stream": True}
                    response = await client.post(f"{url}/v1/completions", json=payload)
                    return parse_sse(response.text)[-1]

                return await asyncio.gather(*(one(i) for i in range(6)))

        assert asyncio.run(main()) == ["[DONE]"] * 6
        stats = get_stats(url)
    assert stats["requests_finished"] == {"length": 6}
    # Never more in a step than there are slots; the rest waited in the queue.
    assert max(step["batch_size"] for step in stats["steps"]) == 2
    records = stats["recent_requests"]
    for record in records:  # at each admission, at most 2 requests hold a slot (this one included)
        holding = [r for r in records if r["admitted_ns"] <= record["admitted_ns"] < r["finished_ns"]]
        assert len(holding) <= 2
    # At least 4 of the 6 were admitted only once an earlier request had left.
    first_exit = min(r["finished_ns"] for r in records)
    assert sum(r["admitted_ns"] >= first_exit for r in records) >= 4
