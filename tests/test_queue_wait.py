"""Requests that wait for their first model step while the model runs nothing: a hand-written
engine thread that polls its queue with a 20 ms sleep (tests/servers/polling_engine.py). The
wait is measured per request, split into other requests' steps and time no step ran, and checked
against the requests' own records and step phases. A server that starts each request's model
call at once (tests/servers/thread_pool.py) gets no such finding.

Real parts: uvicorn on loopback, the real profiler and analysis child, a real tiny transformers
Llama; synthetic traces only for the rules' edges.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from _server_session import session_on

from servprof.cli import main

MAX_TOKENS = 6
REQUESTS = 4


def observe(module: str, tmp_path_factory: pytest.TempPathFactory, spaced_s: float | None) -> dict[str, Any]:
    """A session of REQUESTS requests sent one after another, spaced_s apart (the polling engine is
    asleep when each arrives), or all at once (spaced_s None)."""
    observed = session_on(module, tmp_path_factory.mktemp(module.split(".")[-1]), ["/v1/generate"] * REQUESTS,
                          MAX_TOKENS, spaced_s)
    assert [status for _, status, _ in observed["responses"]] == [200] * REQUESTS
    return observed


def test_a_polling_engine_keeps_requests_waiting_with_the_model_idle(tmp_path_factory: pytest.TempPathFactory) -> None:
    observed = observe("servers.polling_engine", tmp_path_factory, spaced_s=0.013)
    result, session = observed["result"], observed["session"]
    assert result["error"] is None, result["error"]
    (finding,) = [f for f in result["findings"] if f["kind"] == "queue_wait"]
    summary = result["summary"]["detect"]["queue_wait"]
    waits = {w["request_id"]: w for w in summary["waits"]}
    records = {r["request_id"]: r for r in session["requests"]}
    # Every sampled request's wait was measured, but for one whose prefill came before the trace
    # could show what the model ran (the session's first: the profiler starts as it arrives), which
    # says so.
    unmeasured = {u["request_id"]: u["why"] for u in summary["unmeasured"]}
    assert set(waits) | set(unmeasured) == set(records) and len(waits) >= REQUESTS - 1, summary
    assert all("before the trace could show" in why for why in unmeasured.values())
    for rid, wait in waits.items():
        # Its prefill is the first step its own phases show, and the wait starts at its arrival.
        phases = sorted(result["requests"][rid]["phases"], key=lambda p: p["start_us"])
        first = next(p for p in phases if p["name"] == "prefill")
        assert wait["first_step_us"] == pytest.approx(first["start_us"])
        assert wait["wait_ms"] == pytest.approx((first["start_us"] - wait["arrival_us"]) / 1e3, abs=1e-3)
        # One request at a time, each after the last was answered: no other step ran meanwhile.
        assert wait["other_steps_ms"] == 0.0
        assert wait["idle_ms"] <= wait["wait_ms"] + 1e-3
    # The engine sleeps 20 ms between looks at its queue: some request arrived while it slept.
    assert finding["evidence"]["waited"] >= 1 and finding["cost_ms"] == pytest.approx(
        sum(w["idle_ms"] for w in waits.values() if w["idle_ms"] >= 1.0), abs=1e-2)
    assert 0 < finding["evidence"]["share_of_time_to_first_byte"] <= 1
    assert "sleep" in finding["fix"] and set(finding["request_ids"]) <= set(records)
    # Offline, `servprof analyze` reads the request records from the trace's .session.json: the same finding.
    offline = tmp_path_factory.mktemp("offline") / "report.json"
    assert main(["analyze", session["trace_file"], "--json", str(offline)]) == 0
    (again,) = [f for f in orjson.loads(offline.read_bytes())["findings"] if f["kind"] == "queue_wait"]
    assert again == finding


def test_a_server_that_starts_each_request_at_once_has_no_queue_wait(tmp_path_factory: pytest.TempPathFactory) -> None:
    observed = observe("servers.thread_pool", tmp_path_factory, spaced_s=None)
    result = observed["result"]
    assert result["error"] is None, result["error"]
    summary = result["summary"]["detect"]["queue_wait"]
    assert len(summary["waits"]) + len(summary["unmeasured"]) == REQUESTS and len(summary["waits"]) >= REQUESTS - 1
    assert not [f for f in result["findings"] if f["kind"] == "queue_wait"], \
        result["summary"]["detect"]["queue_wait"]["waits"]
