"""Capture end to end: real uvicorn, a real torch model on an engine thread, the real profiler,
the real analysis subprocess."""

from __future__ import annotations

import dataclasses
import gzip
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import orjson
import pytest
import torch.autograd.profiler as autograd_profiler
from _middleware_helpers import AUTH, TOKEN, sse_post, tiny_server, wait_idle, wait_sessions

from servprof import analysis, analysis_worker
from servprof.capture import Session, get_controller

SAMPLE = {"x-servprof-sample": "1", "x-servprof-token": TOKEN}


def _trace_events(path: Path) -> dict:
    with gzip.open(path, "rb") as file:
        return orjson.loads(file.read())


def test_sampled_requests_yield_a_trace_with_their_ids_and_phases(tmp_path: Path) -> None:
    wait_idle()
    started_before = get_controller().sessions_started
    with tiny_server(tmp_path, control_token=TOKEN, requests_per_session=2) as (url, middleware, _engine), \
            httpx.Client(timeout=30) as client:
        ids = []
        for i in range(2):
            status, lines, headers = sse_post(client, url, tokens=6, headers={**SAMPLE, "x-request-id": f"req-{i}"})
            assert status == 200 and lines[-1] == "data: [DONE]" and len(lines) == 7
            ids.append(headers["x-request-id"])
        assert ids == ["req-0", "req-1"]
        (session,) = wait_sessions(middleware, 1)
    assert get_controller().sessions_started == started_before + 1
    assert session["stop_reason"] == "requests_done" and session["error"] is None, session
    assert [r["request_id"] for r in session["requests"]] == ids
    trace_path = Path(session["trace_file"])
    assert trace_path.name.endswith(".pt.trace.json.gz") and trace_path.parent == tmp_path / "out" / "traces"
    assert stat.S_IMODE(trace_path.stat().st_mode) == 0o600
    document = _trace_events(trace_path)
    meta = document["servprof"]
    meta = orjson.loads(meta) if isinstance(meta, str) else meta
    assert meta["session_id"] == session["session_id"] and meta["request_ids"] == ids
    assert meta["stop_reason"] == "requests_done" and meta["wall_start_ns"] > 0
    names = {e.get("name") for e in document["traceEvents"]}
    for rid in ids:
        assert f"servprof:tokenize|{rid}" in names
        assert any(n and n.startswith("servprof:decode_step|") and rid in n for n in names)
    # The analysis child's phase timings came back to the serving process.
    result = middleware.runtime.last_result
    assert result["session_id"] == session["session_id"] and result["error"] is None
    for rid in ids:
        phase_names = {p["name"] for p in result["requests"][rid]["phases"]}
        assert {"tokenize", "decode_step", "detokenize"} <= phase_names
    assert result["clock"]["trace_us_to_unix_ns_offset"] > 0


def test_on_demand_order_makes_exactly_one_bounded_session(tmp_path: Path) -> None:
    wait_idle()
    started_before = get_controller().sessions_started
    with tiny_server(tmp_path, control_token=TOKEN, requests_per_session=1, max_session_s=20) as (url, mw, _e), \
            httpx.Client(timeout=30) as client:
        assert client.post(url + "/servprof/sample?n=3", headers=AUTH).status_code == 202
        for _ in range(5):
            assert sse_post(client, url, tokens=4)[0] == 200
        (session,) = wait_sessions(mw, 1)
        for _ in range(3):  # the order is used up: these stay unsampled
            assert client.get(url + "/hello").status_code == 200
        status = client.get(url + "/servprof/status", headers=AUTH).json()
    assert get_controller().sessions_started == started_before + 1
    assert len(session["requests"]) == 3 and session["stop_reason"] == "requests_done"
    assert status["counters"]["sampled"] == 3 and status["counters"]["requests"] == 8
    assert status["sampler"]["on_demand_pending"] == 0
    assert status["last_sessions"][0]["session_id"] == session["session_id"]


def test_no_request_joins_a_new_session_while_the_last_one_is_handed_off(tmp_path: Path) -> None:
    """The hand-off (ending an on-demand order, pausing on a store problem) runs while the
    controller still holds the finished session, so no request can start another in between."""
    wait_idle()
    controller = get_controller()
    with tiny_server(tmp_path, control_token=TOKEN, requests_per_session=1, analysis=False) as (url, mw, _e), \
            httpx.Client(timeout=30) as client:
        runtime = mw.runtime
        finish = runtime._session_finished
        seen_during_hand_off: list[tuple[bool, str | None]] = []

        def observed(session: object) -> None:
            seen_during_hand_off.append((controller.session is session, controller.refusal()[0]
                                         if controller.refusal() else None))
            finish(session)

        runtime._session_finished = observed  # the capture thread calls it through the session
        assert client.post(url + "/servprof/sample?n=1", headers=AUTH).status_code == 202
        assert sse_post(client, url, tokens=3)[0] == 200
        wait_sessions(mw, 1)
    assert seen_during_hand_off == [(True, "busy")]

@pytest.mark.parametrize("bound", [{"tier": "deep", "max_session_steps": 5}, {"tier": "light", "light_max_steps": 5}])
def test_session_is_bounded_by_decode_steps(tmp_path: Path, bound: dict) -> None:
    wait_idle()
    with tiny_server(tmp_path, control_token=TOKEN, analysis=False, **bound) as (url, mw, _e), \
            httpx.Client(timeout=30) as client:
        status, lines, _ = sse_post(client, url, tokens=40, headers=SAMPLE)
        assert status == 200 and len(lines) == 41
        (session,) = wait_sessions(mw, 1)
    assert session["stop_reason"] == "max_session_steps" and session["tier"] == bound["tier"]
    assert session["max_steps"] == 5
    document = _trace_events(Path(session["trace_file"]))
    meta, base_ns = document["servprof"], document["baseTimeNanoseconds"]
    # Collection goes off before the stop, light or deep (servprof.tiers.drain_ops): no op or range
    # starts after the cut, and the analysis reads the trace up to the cut.
    assert meta["collection_cut"] is True and meta["cut_wall_ns"] < meta["stop_wall_ns"]
    cut_us = (meta["cut_wall_ns"] - base_ns) / 1000
    ops = [e for e in document["traceEvents"] if e.get("cat") in ("cpu_op", "user_annotation")]
    assert ops and max(e["ts"] for e in ops) < cut_us


def test_session_is_bounded_by_estimated_events(tmp_path: Path) -> None:
    """What one session measured (events per second and per step) bounds the next one."""
    wait_idle()
    controller = get_controller()
    # First a session bounded by steps, from which the controller learns both rates.
    # Deep sessions: each tier learns its own figures (tests/test_light_sessions.py).
    with tiny_server(tmp_path, control_token=TOKEN, max_session_steps=20, analysis=False, tier="deep") as (url, mw, _e), \
            httpx.Client(timeout=30) as client:
        assert sse_post(client, url, tokens=40, headers=SAMPLE)[0] == 200
        (first,) = wait_sessions(mw, 1)
    assert first["stop_reason"] == "max_session_steps"
    assert controller.events_per_second and controller.events_per_step
    # Then one whose event budget is a few steps' worth, with no assumed rate and the step
    # bound out of reach: only the learned rates can end it before its 200 tokens.
    budget = max(1, int(controller.events_per_step * 5))
    with tiny_server(tmp_path, control_token=TOKEN, max_session_events=budget, max_session_steps=10**6,
                     assumed_events_per_s=0.0, analysis=False, tier="deep") as (url, mw, _e), \
            httpx.Client(timeout=30) as client:
        status, lines, _ = sse_post(client, url, tokens=200, headers=SAMPLE)
        assert status == 200 and len(lines) == 201
        (second,) = wait_sessions(mw, 1)
    assert second["stop_reason"] == "max_session_events", second


def test_client_disconnect_during_a_sampled_stream(tmp_path: Path) -> None:
    wait_idle()
    with tiny_server(tmp_path, control_token=TOKEN, analysis=False, requests_per_session=1) as (url, mw, engine), \
            httpx.Client(timeout=30) as client:
        with client.stream("POST", url + "/v1/generate", json={"max_tokens": 100000}, headers=SAMPLE) as response:
            for index, _line in enumerate(response.iter_lines()):
                if index > 3:
                    break
        (session,) = wait_sessions(mw, 1)
        assert client.get(url + "/hello").status_code == 200  # serving goes on
        engine.incoming.queue.clear()
    assert session["requests"][0]["disconnected"] is True
    assert session["error"] is None and Path(session["trace_file"]).exists()
    assert mw.runtime.counters["disconnects"] >= 1


def test_shutdown_during_a_session_stops_the_profiler_and_keeps_the_trace(tmp_path: Path) -> None:
    wait_idle()
    with tiny_server(tmp_path, control_token=TOKEN, requests_per_session=4, max_session_s=60) as (url, mw, _e), \
            httpx.Client(timeout=30) as client:
        assert sse_post(client, url, tokens=4, headers=SAMPLE)[0] == 200
        assert get_controller().session is not None  # waiting for 3 more sampled requests
    # Leaving the block shut uvicorn down: lifespan shutdown stopped the session.
    (session,) = wait_sessions(mw, 1, timeout_s=5)
    assert session["stop_reason"].startswith("shutdown")
    assert not autograd_profiler._is_profiler_enabled
    document = _trace_events(Path(session["trace_file"]))
    assert any(e.get("name") == f"servprof:tokenize|{session['requests'][0]['request_id']}"
               for e in document["traceEvents"])


def test_unwritable_trace_dir_pauses_sampling_and_serving_goes_on(tmp_path: Path) -> None:
    wait_idle()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the output dir should be")
    with tiny_server(tmp_path, control_token=TOKEN, out_dir=blocker / "out") as (url, mw, _e), \
            httpx.Client(timeout=30) as client:
        assert sse_post(client, url, tokens=3, headers=SAMPLE)[0] == 200
        wait_sessions(mw, 1)
        for _ in range(3):
            status, lines, _ = sse_post(client, url, tokens=3, headers=SAMPLE)
            assert status == 200 and lines[-1] == "data: [DONE]"
        status = client.get(url + "/servprof/status", headers=AUTH).json()
    assert "not writable" in status["paused"]
    assert status["counters"]["sampled"] == 0 and status["skipped_by_reason"]["paused"] == 3
    assert status["counters"]["sessions_failed"] == 1


@pytest.mark.parametrize("fault", ["crash", "hang", "garbage"])
def test_analysis_failure_marks_the_session_failed_and_the_next_one_works(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    wait_idle()
    analysis.kill_running_analyses()  # the next session starts a worker: the faulty one
    real_command = analysis_worker.worker_command
    children = {
        # Stand-ins for a broken analysis worker: the only way to make the real one crash/hang.
        "crash": "import os; os.abort()",
        "hang": "import time; time.sleep(600)",
        # Takes the job and answers that all went well, but wrote garbage as the result.
        "garbage": ("import json, sys; job = json.loads(sys.stdin.readline()); open(job['result'], 'w').write('[1, 2');"
                    " print(json.dumps({'ok': True, 'error': None, 'retire': True}), flush=True)"),
    }
    calls = []

    def faulty_then_real() -> list[str]:
        calls.append(1)
        if len(calls) == 1:
            return [sys.executable, "-c", children[fault]]
        return real_command()

    monkeypatch.setattr(analysis_worker, "worker_command", faulty_then_real)
    with tiny_server(tmp_path, control_token=TOKEN, analysis_timeout_s=2, requests_per_session=1) as (url, mw, _e), \
            httpx.Client(timeout=30) as client:
        assert sse_post(client, url, tokens=3, headers=SAMPLE)[0] == 200
        wait_sessions(mw, 1)
        # The real child needs more than 2 s here (it imports torch): give the next session room.
        mw.runtime.settings = dataclasses.replace(mw.runtime.settings, analysis_timeout_s=60)
        assert sse_post(client, url, tokens=3, headers=SAMPLE)[0] == 200
        first, second = wait_sessions(mw, 2)
    expected = {"crash": "exited with status", "hang": "timed out after 2 s", "garbage": "output unreadable"}[fault]
    assert expected in first["error"], first["error"]
    assert second["error"] is None and mw.runtime.last_result["error"] is None
    assert mw.runtime.counters["sessions_failed"] == 1 and mw.runtime.counters["sessions_done"] == 1


def test_the_capture_thread_survives_a_session_that_fails_even_to_fail(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writing the session file raises (a stand-in for any bug on the failure path): the session
    is dropped with the error, the sampled request is served, and the next session works."""
    wait_idle()
    real_write = Session.write_file
    broken = {"on": True}

    def write_file(self: Session) -> None:
        if broken["on"]:
            raise RuntimeError("session file writer broke")
        real_write(self)

    monkeypatch.setattr(Session, "write_file", write_file)
    with tiny_server(tmp_path, control_token=TOKEN, requests_per_session=1) as (url, mw, _e), \
            httpx.Client(timeout=30) as client:
        status, lines, _ = sse_post(client, url, tokens=3, headers=SAMPLE)
        assert status == 200 and lines[-1] == "data: [DONE]"
        (first,) = wait_sessions(mw, 1)
        broken["on"] = False
        assert sse_post(client, url, tokens=3, headers=SAMPLE)[0] == 200
        _, second = wait_sessions(mw, 2)
        assert get_controller()._thread.is_alive()
    assert first["state"] == "failed" and "session file writer broke" in first["error"], first
    assert second["state"] == "done" and second["error"] is None, second
    assert mw.runtime.counters["sessions_failed"] == 1 and mw.runtime.counters["sessions_done"] == 1


FOREIGN_PROFILER_SCRIPT = textwrap.dedent("""
    import sys, httpx, torch.profiler
    from _middleware_helpers import TOKEN, AUTH, tiny_server, sse_post
    from pathlib import Path
    foreign = torch.profiler.profile()
    foreign.start()
    with tiny_server(Path(sys.argv[1]), control_token=TOKEN) as (url, mw, _e), httpx.Client(timeout=30) as client:
        for _ in range(3):
            status, lines, _ = sse_post(client, url, tokens=3, headers={"x-servprof-sample": "1",
                                                                          "x-servprof-token": TOKEN})
            assert status == 200 and lines[-1] == "data: [DONE]", (status, lines)
        print("STATUS", client.get(url + "/servprof/status", headers=AUTH).text)
    foreign.stop()
    print("SURVIVED")
""")


def test_foreign_profiler_active_skips_sampling_with_a_reason(tmp_path: Path) -> None:
    # In a child process: starting a second profiler can crash the process.
    tests_dir = Path(__file__).parent
    env = {**os.environ, "KINETO_LOG_LEVEL": "6", "PYTHONPATH": str(tests_dir)}
    child = subprocess.run([sys.executable, "-c", FOREIGN_PROFILER_SCRIPT, str(tmp_path)], capture_output=True,
                           timeout=120, cwd=tests_dir, env=env)
    stdout = child.stdout.decode()
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    assert "SURVIVED" in stdout
    status = orjson.loads(stdout.split("STATUS ", 1)[1].splitlines()[0])
    assert "another torch profiler is active" in status["paused"]
    assert status["counters"]["sampled"] == 0 and status["profiler"]["sessions_started_in_process"] == 0
    assert status["skipped_by_reason"]["foreign_profiler"] == 3


EXIT_DURING_SESSION_SCRIPT = textwrap.dedent("""
    import sys, threading, httpx, uvicorn, socket
    from pathlib import Path
    from _middleware_helpers import TOKEN, TinyEngine, make_app, sse_post, wait_warm
    from servprof.capture import Session, get_controller
    from servprof.middleware import ServprofMiddleware
    engine = TinyEngine()
    engine.start()
    app = ServprofMiddleware(make_app(engine), out_dir=Path(sys.argv[1]), telemetry=False, control_token=TOKEN,
                             requests_per_session=4, max_session_s=60, max_session_events=10**9)
    wait_warm()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        pass
    url = "http://127.0.0.1:%d" % sock.getsockname()[1]
    with httpx.Client(timeout=30) as client:
        status, lines, _ = sse_post(client, url, tokens=4, headers={"x-servprof-sample": "1", "x-servprof-token": TOKEN})
    assert status == 200 and get_controller().session is not None
    print("EXITING", flush=True)
    sys.exit(0)  # no server shutdown, no lifespan: only servprof's atexit hook can save the trace
""")


def test_process_exit_during_a_session_keeps_the_trace(tmp_path: Path) -> None:
    tests_dir = Path(__file__).parent
    env = {**os.environ, "KINETO_LOG_LEVEL": "6", "PYTHONPATH": str(tests_dir)}
    child = subprocess.run([sys.executable, "-c", EXIT_DURING_SESSION_SCRIPT, str(tmp_path / "out")],
                           capture_output=True, timeout=120, cwd=tests_dir, env=env)
    assert child.returncode == 0 and b"EXITING" in child.stdout, child.stderr.decode()[-2000:]
    (trace,) = (tmp_path / "out" / "traces").glob("*.pt.trace.json.gz")
    meta = _trace_events(trace)["servprof"]
    meta = orjson.loads(meta) if isinstance(meta, str) else meta
    assert meta["stop_reason"] == "shutdown: process exit" and len(meta["request_ids"]) == 1


def test_the_warm_up_starts_and_stops_a_light_profiler_with_no_cut() -> None:
    """Kineto's one-time init (1-2 s) is the same for either tier; the warm-up's profiler, stopped
    the moment it started, is not drained, so a server's start-up log gets no 'Toggling CPU
    activity' line from torch for a collection cut."""
    code = textwrap.dedent("""
        import threading, torch
        from servprof.capture import get_controller
        stop = threading.Event()
        def work():  # serving threads running ops while the warm-up starts and stops the profiler
            while not stop.is_set():
                torch.mm(torch.ones(64, 64), torch.ones(64, 64))
        thread = threading.Thread(target=work)
        thread.start()
        controller = get_controller()
        controller.warm_up_now()
        stop.set()
        thread.join()
        print(controller.warm, controller.warmup_error)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KINETO_LOG_LEVEL": "6"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "None"]
    assert "Toggling CPU activity" not in done.stderr
