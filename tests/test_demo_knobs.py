"""Each fault knob of the demo server changes what it should, measured from the server's
own timestamps and counters in /demo/stats, knob on against knob off in the same test."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from _demo_helpers import get_stats, parse_sse, start_demo_server

pytestmark = pytest.mark.slow

LONG_PROMPT = "The scheduler counted forty small tokens near the station. " * 150  # ~1.7k tokens


@pytest.fixture(scope="module")
def baseline_url() -> Iterator[str]:
    with start_demo_server(size="tiny", max_batch=4, context=2048) as url:
        yield url


@contextmanager
def knob_server(**knobs: object) -> Iterator[str]:
    with start_demo_server(size="tiny", max_batch=4, context=2048, **knobs) as url:
        yield url


def stream_one(url: str, prompt: str = "Notes on latency:", max_tokens: int = 20) -> None:
    payload = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    assert parse_sse(response.text)[-1] == "[DONE]"


def median_gap_ms(url: str) -> float:
    before = get_stats(url)["decode_steps"]
    stream_one(url, max_tokens=30)
    stats = get_stats(url)
    steps = stats["steps"][-(stats["decode_steps"] - before) :]
    gaps = [s["gap_ns"] / 1e6 for s in steps[1:]]  # the first step's gap spans the idle time before it
    assert len(gaps) >= 20
    return statistics.median(gaps)


def test_step_delay_lengthens_host_gap_between_steps_by_about_d(baseline_url):
    delay_ms = 15.0
    off = median_gap_ms(baseline_url)
    with knob_server(step_delay_ms=delay_ms) as url:
        on = median_gap_ms(url)
    # The knob busy-waits D ms inside the gap, so the gap grows by at least ~D
    # (0.9: timer granularity) and by not much more than D.
    assert 0.9 * delay_ms <= on - off <= 3 * delay_ms, (on, off)


def test_sync_per_step_blocks_on_every_step(baseline_url):
    before = get_stats(baseline_url)
    stream_one(baseline_url)
    after = get_stats(baseline_url)
    assert after["blocking_syncs"] == before["blocking_syncs"] == 0
    assert not any(step["synced"] for step in after["steps"])
    with knob_server(sync_per_step=True) as url:
        stream_one(url)
        stream_one(url)
        stats = get_stats(url)
    # One blocking read per prefill and per decode step: the host waits on every step's tokens.
    assert stats["decode_steps"] > 0
    assert stats["blocking_syncs"] == stats["prefills"] + stats["decode_steps"]
    assert all(step["synced"] for step in stats["steps"])


def _tokenize_ns_per_request(url: str, prompt: str) -> tuple[float, int]:
    before = get_stats(url)["tokenize"]
    stream_one(url, prompt=prompt, max_tokens=2)
    after = get_stats(url)
    assert after["tokenize"]["count"] == before["count"] + 1
    prompt_tokens = after["recent_requests"][-1]["prompt_tokens"]
    return after["tokenize"]["ns_total"] - before["ns_total"], prompt_tokens


def test_slow_tokenizer_raises_tokenize_time(baseline_url):
    us_per_token = 40.0
    off_ns, tokens = _tokenize_ns_per_request(baseline_url, LONG_PROMPT)
    with knob_server(slow_tokenizer_us_per_token=us_per_token) as url:
        on_ns, tokens_on = _tokenize_ns_per_request(url, LONG_PROMPT)
    assert tokens == tokens_on > 1000
    extra_ns = tokens * us_per_token * 1000
    # The knob is a busy loop of tokens x U inside the measured tokenize time; the real
    # tokenizer's own time (off) varies with load on shared cores, so only order is compared.
    assert on_ns >= extra_ns, (on_ns, extra_ns)
    assert on_ns > off_ns, (on_ns, off_ns)


def test_tokenize_on_loop_blocks_the_event_loop(baseline_url):
    # A slow tokenizer on both sides makes tokenization long enough for the loop probe to see.
    slow = {"slow_tokenizer_us_per_token": 40.0}
    with knob_server(**slow) as url:
        stream_one(url, prompt=LONG_PROMPT, max_tokens=2)
        off = get_stats(url)
    with knob_server(tokenize_on_loop=True, **slow) as url:
        stream_one(url, prompt=LONG_PROMPT, max_tokens=2)
        on = get_stats(url)
    assert off["tokenize"]["on_loop_ns"] == 0
    assert on["tokenize"]["on_loop_ns"] == on["tokenize"]["ns_total"] > 0
    # While tokenization held the loop, the loop-lag probe woke up that much late
    # (minus at most one probe interval of 10 ms).
    assert on["loop_lag"]["ns_max"] >= on["tokenize"]["ns_max"] - 15_000_000
