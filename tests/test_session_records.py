"""What a session lists, its files and /servprof/status agree: real uvicorn, the tiny engine, the
real profiler and the real analysis child (issue 18 items 2-4)."""

from __future__ import annotations

import gzip
import threading
import time
from pathlib import Path
from typing import Any

import anyio.to_thread
import httpx
import orjson
import pytest
from _middleware_helpers import (
    AUTH,
    TOKEN,
    TinyEngine,
    concurrent_sse,
    make_app,
    serve,
    sse_post,
    wait_idle,
    wait_sessions,
    wait_warm,
)
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from servprof.capture import get_controller
from servprof.middleware import ServprofMiddleware

SAMPLE = {"x-servprof-sample": "1", "x-servprof-token": TOKEN}


def _spans(out: Path) -> dict[str, dict[str, Any]]:
    """Request spans from the OTLP JSON-lines file, by servprof.request_id."""
    spans = {}
    for line in (out / "spans" / "spans.otlp.jsonl").read_bytes().splitlines():
        for resource in orjson.loads(line)["resourceSpans"]:
            for scope in resource["scopeSpans"]:
                for span in scope["spans"]:
                    attrs = {a["key"]: next(iter(a["value"].values())) for a in span.get("attributes", [])}
                    if "servprof.request_id" in attrs and span["name"].startswith(("GET", "POST")):
                        spans[attrs["servprof.request_id"]] = attrs
    return spans


def _trace_request_ids(trace_file: str) -> list[str]:
    meta = orjson.loads(gzip.decompress(Path(trace_file).read_bytes()))["servprof"]
    return (orjson.loads(meta) if isinstance(meta, str) else meta)["request_ids"]


def test_a_request_that_runs_only_after_its_session_stopped_is_not_the_sessions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ordered request waits (off the loop, on the server's thread pool) for its session to
    start. With the pool busy, the session starts, reaches its time bound and stops before that
    request's wait even ran: the request must then be neither listed by the session (status, trace,
    files) nor marked sampled on its span; before, it was listed and counted `start_failed`."""
    wait_idle()
    monkeypatch.setenv("SERVPROF_TELEMETRY_EXPORTER", "file")
    release = threading.Event()
    held = threading.Event()

    async def hold(request: Request) -> PlainTextResponse:
        # The app's thread pool has one thread (as a server tuned for a small box might), and
        # this request holds it, as a slow tokenization in a worker thread would.
        anyio.to_thread.current_default_thread_limiter().total_tokens = 1
        held.set()
        await anyio.to_thread.run_sync(release.wait, 30)
        return PlainTextResponse("released")

    engine = TinyEngine()
    engine.start()
    app = make_app(engine)
    app.router.routes.append(Route("/hold", hold))
    out = tmp_path / "out"
    middleware = ServprofMiddleware(app, out_dir=out, control_token=TOKEN, on_demand_min_interval_s=0,
                                    max_session_s=0.3, max_session_events=10**9, max_session_steps=10**6,
                                    analysis=False)
    wait_warm()
    controller = get_controller()
    results: dict[str, Any] = {}
    try:
        with serve(middleware) as (url, _server), httpx.Client(timeout=60) as client:
            holder = threading.Thread(target=lambda: results.update(hold=client.get(url + "/hold")))
            holder.start()
            assert held.wait(30)
            assert client.post(url + "/servprof/sample?n=2", headers=AUTH).status_code == 202
            ordered = threading.Thread(target=lambda: results.update(
                ordered=sse_post(client, url, tokens=3, headers={"x-request-id": "ordered-1"})))
            ordered.start()
            # The session starts for the ordered request and stops at max_session_s while that
            # request still waits for a thread to wait in.
            deadline = time.monotonic() + 30
            while not (len(middleware.runtime.history) == 1 and controller.session is None):
                assert time.monotonic() < deadline, controller.session and controller.session.state
                time.sleep(0.01)
            release.set()
            holder.join(30)
            ordered.join(30)
            assert results["ordered"][0] == 200 and results["hold"].status_code == 200
            status = client.get(url + "/servprof/status", headers=AUTH).json()
    finally:
        release.set()
        engine.stop()
    (session,) = status["last_sessions"]
    assert session["stop_reason"] == "max_session_s"
    assert session["requests"] == [] and _trace_request_ids(session["trace_file"]) == []
    assert status["counters"]["sampled"] == 0
    assert status["skipped_by_reason"] == {"session_stopped": 1}
    assert _spans(out)["ordered-1"]["servprof.sampled"] is False
    files = orjson.loads(Path(session["trace_file"].replace(".pt.trace.json.gz", ".session.json")).read_bytes())
    assert files["requests"] == []


def test_every_request_a_session_lists_is_sampled_with_its_spans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """POST /servprof/sample?n=4 with four concurrent streams: the session, its trace and its
    spans name the same four requests, each sampled with the session's id."""
    wait_idle()
    monkeypatch.setenv("SERVPROF_TELEMETRY_EXPORTER", "file")
    engine = TinyEngine()
    engine.start()
    out = tmp_path / "out"
    middleware = ServprofMiddleware(make_app(engine), out_dir=out, control_token=TOKEN, max_session_s=30,
                                    max_session_events=10**9, max_session_steps=10**6)
    wait_warm()
    try:
        with serve(middleware) as (url, _server), httpx.Client(timeout=60) as client:
            assert client.post(url + "/servprof/sample?n=4", headers=AUTH).status_code == 202
            concurrent_sse(client, url, 6, [{"x-request-id": f"n4-{i}"} for i in range(4)])
            (session,) = wait_sessions(middleware, 1)
    finally:
        engine.stop()
    listed = sorted(r["request_id"] for r in session["requests"])
    assert listed == [f"n4-{i}" for i in range(4)]
    assert sorted(_trace_request_ids(session["trace_file"])) == listed
    spans = _spans(out)
    for rid in listed:
        assert spans[rid]["servprof.sampled"] is True and spans[rid]["servprof.session_id"] == session["session_id"]


def test_session_files_and_status_agree_once_the_streams_end(tmp_path: Path) -> None:
    """A session stopped by its step bound while its request still streams: the .session.json the
    analysis child read is a snapshot at the stop; once the session is done and the stream ends, the
    file is rewritten final (state, route, chunks, last byte) and equal to what status shows."""
    wait_idle()
    engine = TinyEngine()
    engine.start()
    out = tmp_path / "out"
    middleware = ServprofMiddleware(make_app(engine), out_dir=out, control_token=TOKEN, light_max_steps=5,
                                    max_session_events=10**9, requests_per_session=1)
    wait_warm()
    try:
        with serve(middleware) as (url, _server), httpx.Client(timeout=60) as client:
            status_code, lines, _ = sse_post(client, url, tokens=60, headers=SAMPLE)
            assert status_code == 200 and len(lines) == 61
            (session,) = wait_sessions(middleware, 1)
            session_file = out / "traces" / f"{session['session_id']}.session.json"
            deadline = time.monotonic() + 30
            while orjson.loads(session_file.read_bytes())["open_requests"]:  # the capture thread rewrites it
                assert time.monotonic() < deadline, session_file.read_text()
                time.sleep(0.02)
            status = client.get(url + "/servprof/status", headers=AUTH).json()
    finally:
        engine.stop()
    (shown,) = status["last_sessions"]
    written = orjson.loads(session_file.read_bytes())
    assert shown["state"] == written["state"] == "done"
    assert shown["stop_reason"] == "max_session_steps"
    (record,) = written["requests"]
    assert record == shown["requests"][0]
    assert record["route"] == "/v1/generate" and record["chunks"] == 61 and record["last_byte_ns"] is not None
    # Streamed chunks are named as such, apart from the model steps the analysis counted.
    assert written["steps_streamed"] == 61 and 5 <= written["steps_streamed_at_stop"] < 61
    analysis = middleware.runtime.last_result["summary"]
    assert analysis["steps_streamed_at_stop"] == written["steps_streamed_at_stop"]
    assert analysis["model_steps"] >= 1
    # servprof's own time per session, in status and in the files.
    for part in ("start", "stop", "export", "analysis"):
        assert written["servprof_overhead_ms"][part] > 0, written["servprof_overhead_ms"]
    assert status["servprof_overhead_ms"]["sessions"] == 1
    assert status["servprof_overhead_ms"]["stop"] == written["servprof_overhead_ms"]["stop"]


def test_status_keeps_the_findings_of_the_last_sessions(tmp_path: Path) -> None:
    """/servprof/status findings_by_session: one entry per finished session, newest last, bounded."""
    from servprof import runtime as runtime_module

    wait_idle()
    engine = TinyEngine()
    engine.start()
    middleware = ServprofMiddleware(make_app(engine), out_dir=tmp_path / "out", control_token=TOKEN,
                                    requests_per_session=1, max_session_events=10**9)
    wait_warm()
    sessions = runtime_module.HISTORY + 1
    try:
        with serve(middleware) as (url, _server), httpx.Client(timeout=60) as client:
            for _ in range(sessions):
                assert sse_post(client, url, tokens=3, headers=SAMPLE)[0] == 200
                wait_idle()
            status = client.get(url + "/servprof/status", headers=AUTH).json()
    finally:
        engine.stop()
    history = status["findings_by_session"]
    assert len(history) == runtime_module.HISTORY
    assert [h["session_id"] for h in history] == [s["session_id"] for s in status["last_sessions"]]
    assert all(isinstance(h["findings"], list) and h["state"] == "done" for h in history)
    assert history[-1]["findings"] == status["last_findings"]

