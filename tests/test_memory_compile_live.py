"""Live: the demo server (its own process, the real middleware, profiler and analysis child)
with the memory-leak and recompile knobs on and off; the detectors must name each knob with
its size, measured here independently, and stay quiet without it.

- memory: `--leak-mb-per-request M` keeps M MiB per admitted request. The test reads the
  server process's resident memory itself (/proc/PID/statm) around the requests it sends.
- recompile: `--compile --unpadded-batches` (Dynamo, eager backend: a recompile takes ~1 s
  here instead of ~10 s with Inductor) runs each batch at its own size; three concurrent
  requests make a batch of 3, outside the warmed-up sizes 1, 2, 4. The demo reports torch's
  own compile records in /demo/stats; padded batches (the knob off) never recompile.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from _fault_helpers import demo_server_process

pytestmark = pytest.mark.slow

TOKEN = "live-memory-compile"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SESSION_ENV = {"SERVPROF_MAX_SESSION_EVENTS": "1000000", "SERVPROF_MAX_SESSION_STEPS": "1000"}
LEAK_MIB = 8


def _rss(pid: int) -> int:
    import os

    with open(f"/proc/{pid}/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _status(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/servprof/status", headers=AUTH, timeout=30).json()


def _wait(predicate: Any, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)
    return value


def _generate(url: str, index: int, max_tokens: int = 8) -> None:
    payload = {"prompt": f"request {index}: the quick brown fox " * 3, "max_tokens": max_tokens, "stream": True,
               "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=payload, timeout=120)
    assert response.status_code == 200, response.text


def _sampled_session(url: str, n: int, send: Any) -> dict[str, Any]:
    """Order n samples, `send()` the requests, return the finished session's analysis."""
    before = _status(url)["counters"]["sessions_done"]
    assert httpx.post(f"{url}/servprof/sample", params={"n": n}, headers=AUTH, timeout=30).status_code == 202
    send()
    status = _wait(lambda: (s := _status(url))["counters"]["sessions_done"] > before and s)
    assert status["counters"]["sessions_failed"] == 0, status["last_error"]
    return status


def _memory_run(tmp_path: Path, *flags: str) -> tuple[dict[str, Any], float]:
    """Sixteen requests one after another (the memory history reads once a second meanwhile),
    then a sampled session; returns (status, RSS growth per request measured here)."""
    with demo_server_process(tmp_path, TOKEN, "--max-batch", "4", *flags, **SESSION_ENV) as (process, url, _):
        _wait(lambda: _status(url)["profiler"]["warm"])
        _generate(url, -1)  # first-request allocations (thread arenas, tokenizer caches) before the count
        time.sleep(1.5)
        # The history reads once a second on the capture thread: 16 requests 0.35 s apart give it
        # 5-6 readings (3 rises are needed) even when a busy machine delays some of them.
        rss_before, requests = _rss(process.pid), 16
        for index in range(requests):
            _generate(url, index)
            time.sleep(0.35)
        rss_per_request = (_rss(process.pid) - rss_before) / requests
        time.sleep(1.2)  # a reading after the last request, before the session
        status = _sampled_session(url, 1, lambda: _generate(url, 99))
        stats = httpx.get(f"{url}/demo/stats", timeout=30).json()
    status["demo_stats"] = stats
    return status, rss_per_request


def _growth(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in status["last_findings"] if f["kind"] == "memory_growth"]


def test_a_memory_leak_per_request_is_found_between_sessions_with_its_size(tmp_path: Path):
    status, rss_per_request = _memory_run(tmp_path, "--leak-mb-per-request", str(LEAK_MIB))
    knob = LEAK_MIB * 1024**2
    stats = status["demo_stats"]
    assert stats["leaked_bytes"] == knob * stats["leaked_requests"]
    assert rss_per_request == pytest.approx(knob, rel=0.2)  # the process really kept it
    (finding,) = _growth(status)
    evidence = finding["evidence"]
    assert evidence["device"] == "process" and evidence["where"] == "between_sessions"
    assert evidence["model_requests"] >= 5
    assert evidence["per_request_bytes"] == pytest.approx(rss_per_request, rel=0.2)
    assert evidence["per_request_bytes"] == pytest.approx(knob, rel=0.2)
    assert finding["fix"] and finding["severity"] in ("warning", "critical")


def test_the_same_traffic_without_the_leak_shows_no_memory_growth(tmp_path: Path):
    status, rss_per_request = _memory_run(tmp_path)
    assert rss_per_request < 0.1 * LEAK_MIB * 1024**2
    assert not _growth(status), _growth(status)
    summary = status["last_analysis"]["summary"]["detect"]["memory"]
    assert summary["devices"]["process"]["source"] == "process_rss"
    assert summary["between_sessions"]["process"]["model_requests"] >= 5


def _compile_run(tmp_path: Path, *flags: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Three concurrent requests in a sampled session; returns (status, /demo/stats)."""
    with demo_server_process(tmp_path, TOKEN, "--max-batch", "4", "--compile", "--compile-backend", "eager",
                             *flags, **SESSION_ENV) as (_, url, _):
        _wait(lambda: _status(url)["profiler"]["warm"])
        before = httpx.get(f"{url}/demo/stats", timeout=30).json()["compile"]

        def three_at_once() -> None:
            threads = [threading.Thread(target=_generate, args=(url, i, 128)) for i in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        status = _sampled_session(url, 3, three_at_once)
        stats = httpx.get(f"{url}/demo/stats", timeout=30).json()
    assert before["buckets"] == [1, 2, 4]
    stats["compiles_before_requests"] = len(before["torch_compiles"])
    return status, stats


def test_a_batch_size_outside_the_warmed_up_buckets_recompiles_and_is_named(tmp_path: Path):
    status, stats = _compile_run(tmp_path, "--unpadded-batches")
    assert 3 in {step["batch_size"] for step in stats["steps"]}
    serving = stats["compile"]["torch_compiles"][stats["compiles_before_requests"]:]
    assert serving, "torch compiled nothing while serving"
    findings = [f for f in status["last_findings"] if f["kind"] == "recompilation"]
    assert findings
    evidence = findings[0]["evidence"]
    assert evidence["cause"] == "batch_size" and evidence["detail"]["actual"] == 3
    # torch's own timing of the compiles it did while serving (from the server's /demo/stats).
    measured_ms = sum(c["duration_ms"] for c in serving)
    found_ms = sum(f["evidence"]["stall_ms"] for f in findings)
    assert found_ms == pytest.approx(measured_ms, rel=0.2)
    assert set(findings[0]["request_ids"]) <= {r["request_id"] for r in status["last_sessions"][-1]["requests"]}
    assert "bucket" in findings[0]["fix"]


def test_padded_batches_never_recompile_while_serving(tmp_path: Path):
    status, stats = _compile_run(tmp_path)
    assert stats["compile"]["torch_compiles"][stats["compiles_before_requests"]:] == []
    assert not [f for f in status["last_findings"] if f["kind"] in ("recompilation", "graph_break")]
    compile_summary = status["last_analysis"]["summary"]["detect"]["compile"]
    assert compile_summary["compiles"] == 0
    if status["last_sessions"][-1]["tier"] == "light":  # no compiled region is recorded: it says so
        assert compile_summary["steps_with_compiled_code"] is None
        missing = status["last_analysis"]["summary"]["missing"]
        assert any("deep window" in m["message"] for m in missing if m["what"] == "compiled regions and graph breaks")
    else:
        assert compile_summary["steps_with_compiled_code"] > 0
