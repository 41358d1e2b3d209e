"""Requests that wait for their first model step while the model runs nothing: a hand-written
engine thread that polls its queue with a 20 ms sleep (tests/servers/polling_engine.py). The
wait is measured per request, split into other requests' steps and time no step ran, and checked
against the requests' own records and step phases. A server that starts each request's model
call at once (tests/servers/thread_pool.py) gets no such finding.

Real parts: uvicorn on loopback, the real profiler and analysis child, a real tiny transformers
Llama; synthetic traces only for the rules' edges (a wait on the request's own thread).
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from _kineto_builder import KinetoTrace
from _server_session import session_on

from servprof.auto.emit import auto_phase_name
from servprof.cli import main
from servprof.detect.analysis import analyse
from servprof.trace import load_trace

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
    assert len(session["auto"]["threads_without_request"]) == 1  # the engine thread: no request of its own
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


def test_a_batching_window_keeps_each_request_waiting_with_the_model_idle(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """tests/servers/dynamic_batching.py: requests queue for a batcher that holds a 10 ms window
    open for more before it runs a batch on a worker thread. Each request here arrives alone,
    so it waits the whole window with the model idle, then its batch's prefill names it."""
    from servers.dynamic_batching import BATCH_WAIT_S

    observed = observe("servers.dynamic_batching", tmp_path_factory, spaced_s=0.05)
    result, session = observed["result"], observed["session"]
    assert result["error"] is None, result["error"]
    (finding,) = [f for f in result["findings"] if f["kind"] == "queue_wait"]
    assert session["auto"]["threads_without_request"]  # the batch's thread: every request in flight
    waits = result["summary"]["detect"]["queue_wait"]["waits"]
    assert len(waits) >= REQUESTS - 1
    measured_from = result["summary"]["detect"]["queue_wait"]["measured_from_us"]
    for wait in waits:
        assert wait["first_step"] == "prefill" and wait["other_steps_ms"] == 0.0 and wait["own_phases_ms"] == 0.0
        # Nothing of its own and no step ran: all of its wait that the trace can judge was idle. (A
        # session's first request may have arrived before that: a step already running when the
        # profiler started is not recorded, so the wait counts from the trace's start plus its
        # longest step.)
        judged_ms = (wait["first_step_us"] - max(wait["arrival_us"], measured_from)) / 1e3
        assert wait["idle_ms"] == pytest.approx(judged_ms, abs=1e-3), wait
        if wait["arrival_us"] >= measured_from:
            # The window is a timed wait after the request came: a lower bound the server sets.
            assert wait["idle_ms"] >= BATCH_WAIT_S * 1e3, wait
    assert finding["evidence"]["cause"] == "model_idle_while_waiting"
    assert finding["evidence"]["waited"] == len([w for w in waits if w["idle_ms"] >= 1.0])  # (MIN_IDLE_US)
    assert finding["evidence"]["waited"] >= len(waits) - 1 and "batching window" in finding["fix"]


def test_a_server_that_starts_each_request_at_once_has_no_queue_wait(tmp_path_factory: pytest.TempPathFactory) -> None:
    observed = observe("servers.thread_pool", tmp_path_factory, spaced_s=None)
    result = observed["result"]
    assert result["error"] is None, result["error"]
    summary = result["summary"]["detect"]["queue_wait"]
    assert len(summary["waits"]) + len(summary["unmeasured"]) == REQUESTS and len(summary["waits"]) >= REQUESTS - 1
    assert not [f for f in result["findings"] if f["kind"] == "queue_wait"], \
        result["summary"]["detect"]["queue_wait"]["waits"]


BASE_NS = 1_700_000_000_000_000_000


def queued_trace(tmp_path: Any, step_thread: int, engine: bool = False, said_engine: bool = False,
                 said_own: bool = False, prefill_us: float = 21_000.0) -> tuple[Any, list[dict[str, Any]]]:
    """A request tokenized on thread 1 at 1 ms, its prefill on ``step_thread`` at 21 ms (``prefill_us``),
    nothing recorded between; then four decode steps. Its record: arrival 0.5 ms, first byte 1 ms after
    the prefill began.
    ``engine``: the step thread ran another request's steps before (0.2-0.6 ms); ``said_engine``:
    the session's metadata lists the step thread among those with no request of their own;
    ``said_own``: the metadata lists no such thread (every step ran in its request's context)."""
    metadata: dict[str, Any] = {"baseTimeNanoseconds": BASE_NS}
    if said_engine or said_own:
        metadata["servprof"] = {"auto": {"threads_without_request": [step_thread] if said_engine else []}}
    built = KinetoTrace(metadata=metadata)
    if engine:
        built.annotation(auto_phase_name("decode_step", ["earlier"]), 200.0, 400.0, tid=step_thread)
    built.annotation(auto_phase_name("tokenize", ["req"]), 1000.0, 300.0, tid=1)
    start = prefill_us
    for kind in ("prefill", "decode_step", "decode_step", "decode_step", "decode_step"):
        built.annotation(auto_phase_name(kind, ["req"]), start, 400.0, tid=step_thread)
        start += 500.0
    record = {"request_id": "req", "arrival_ns": BASE_NS + 500_000, "arrival_perf_ns": 7_000_000 + 500_000,
              "first_byte_ns": 7_000_000 + int(prefill_us * 1000) + 1_000_000,
              "end_ns": 7_000_000 + int(prefill_us * 1000) + 3_000_000}
    name = f"queued{step_thread}{engine}{said_engine}{said_own}{prefill_us}.json"
    return load_trace(built.write(tmp_path / name, device_name="CPU")), [record]


@pytest.mark.parametrize(("step_thread", "engine", "said_engine"),
                         [(1, False, False), (2, False, False), (2, True, False), (2, False, True)])
def test_a_wait_on_the_requests_own_thread_is_its_work_a_hand_off_to_an_engine_is_a_queue(
        tmp_path: Any, step_thread: int, engine: bool, said_engine: bool) -> None:
    """Tokenized on the thread that then runs its prefill (generate() on a pool thread), or handed to
    a thread that runs its steps only (one started for it): the 20 ms before the prefill are the
    request's own way there. Handed to an engine thread — seen serving other requests too, or said
    by the session to have no request of its own — the same 20 ms with no step running are the wait
    this finds."""
    trace, records = queued_trace(tmp_path, step_thread, engine, said_engine)
    analysis = analyse(trace, records)
    (wait,) = analysis.summary["queue_wait"]["waits"]
    assert wait["wait_ms"] == pytest.approx(20.5, abs=0.01)
    findings = [f for f in analysis.findings if f.kind == "queue_wait"]
    if engine:  # arrival (0.5 ms) to prefill (21 ms), less its tokenize (0.3 ms) and the earlier step's last 0.1 ms
        assert wait["idle_ms"] == pytest.approx(21.0 - 0.5 - 0.3 - 0.1, abs=0.01) and len(findings) == 1
    elif said_engine:  # from the trace's start plus its longest step (1.0 + 0.4 ms), less nothing of its own
        assert wait["idle_ms"] == pytest.approx(21.0 - 1.4, abs=0.01) and len(findings) == 1
    else:
        assert wait["idle_ms"] == 0 and not findings


def test_a_wait_before_a_model_call_made_in_the_requests_own_context_is_its_handlers(tmp_path: Any) -> None:
    """The engine case's trace (the step thread served another request before), but the session
    says every automatic step ran in its request's context (to_thread, a pool): nothing queued the
    request, and the same 20.1 ms are its handler's before its model call, with that fix."""
    trace, records = queued_trace(tmp_path, 2, engine=True, said_own=True)
    analysis = analyse(trace, records)
    (wait,) = analysis.summary["queue_wait"]["waits"]
    assert wait["own_model_call"] and wait["idle_ms"] == pytest.approx(21.0 - 0.5 - 0.3 - 0.1, abs=0.01)
    (finding,) = [f for f in analysis.findings if f.kind == "queue_wait"]
    assert finding.evidence["cause"] == "before_model_call" and finding.severity == "warning"
    assert finding.title.startswith("1 of 1 sampled requests spent 20.1 ms") and "in their handlers before" in finding.title
    assert finding.fix.startswith("Each of these requests called the model from its own handler")
    # A step thread that served this request alone (a pool thread it happened to get to itself, a thread
    # started for it): the same handler's way there, reported the same (it was not, and a RAG server's
    # 50 ms retrieval went unreported whenever a session sampled one request).
    alone = analyse(*queued_trace(tmp_path, 2, said_own=True))
    (wait,) = alone.summary["queue_wait"]["waits"]
    # (no step before it: measured from the trace's start plus its longest step, 1.0 + 0.4 ms)
    assert wait["own_model_call"] and wait["idle_ms"] == pytest.approx(21.0 - 1.4, abs=0.01)
    assert [f.evidence["cause"] for f in alone.findings if f.kind == "queue_wait"] == ["before_model_call"]


def test_a_few_ms_of_a_handler_before_its_own_model_call_is_the_ordinary_hand_off(tmp_path: Any) -> None:
    """The same, its prefill 8 ms after arrival: 7 ms of a handler's way to its own model call (a
    pool's hand-off, preparing the input) is no finding, where the same wait for an engine is one.
    (The thread-pool server under load on 2 cores waited 6-9 ms so: a warning before.)"""
    own = analyse(*queued_trace(tmp_path, 2, engine=True, said_own=True, prefill_us=8_000.0))
    (wait,) = own.summary["queue_wait"]["waits"]
    assert wait["own_model_call"] and wait["idle_ms"] == pytest.approx(8.0 - 0.5 - 0.3 - 0.1, abs=0.01)
    assert "queue_wait" not in [f.kind for f in own.findings]
    queued = analyse(*queued_trace(tmp_path, 2, engine=True, prefill_us=8_000.0))
    (finding,) = [f for f in queued.findings if f.kind == "queue_wait"]
    assert finding.evidence["cause"] == "model_idle_while_waiting"


def test_a_rag_handler_awaiting_its_retrieval_is_not_a_queue(tmp_path_factory: pytest.TempPathFactory) -> None:
    """tests/servers/rag.py: each request first awaits a search over HTTP (30 ms), then runs
    generate() on a worker thread. The model sits idle meanwhile, but no queue held the requests:
    servprof names that time as the handlers' own before their model call, never a queue's."""
    from servers.rag import SEARCH_LATENCY_S

    observed = session_on("servers.rag", tmp_path_factory.mktemp("rag"), ["/v1/generate"] * REQUESTS, MAX_TOKENS,
                          spaced_s=0.05, skip_routes="/search*")
    result = observed["result"]
    assert [status for _, status, _ in observed["responses"]] == [200] * REQUESTS
    assert result["error"] is None, result["error"]
    waits = result["summary"]["detect"]["queue_wait"]["waits"]
    assert len(waits) >= REQUESTS - 1 and all(w["own_model_call"] for w in waits), waits
    # Each waited at least its search (the server's own sleep: a lower bound), and no step of its own ran.
    assert all(w["wait_ms"] >= SEARCH_LATENCY_S * 1e3 and w["idle_ms"] <= w["wait_ms"] for w in waits), waits
    causes = [f["evidence"]["cause"] for f in result["findings"] if f["kind"] == "queue_wait"]
    assert causes == ["before_model_call"], causes
