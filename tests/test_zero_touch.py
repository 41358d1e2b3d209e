"""Zero-touch: servers written without a single servprof marker (tests/servers: FastAPI +
transformers ``generate`` with a ``TextIteratorStreamer``, and FastAPI + a hand-written torch
decode loop) get their model steps, tokenization and loop stalls found, never have /health
sampled, and every session stays inside its event budget, the first one in a process included.

Real parts throughout: uvicorn on loopback, the real profiler, the real analysis child, a real
tiny Llama (random weights from a config) and real BPE tokenizers trained at start-up.
"""

from __future__ import annotations

import gzip
import importlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from _middleware_helpers import serve, wait_idle, wait_sessions
from _server_session import servprof_middleware

from servprof.middleware import ServprofMiddleware

TOKEN = "zero-touch-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SERVERS = {"hf": "servers.hf_streaming", "loop": "servers.handwritten_loop"}
PROSE = ("The harbour master counted the boats twice before the storm, and the baker sold warm bread to the "
         "sailors at dawn while the old clock on the pier kept its own slow time. ")
# Long enough that the servers' slow helpers (screen_prompt, slow_normalize) block the loop for tens of ms.
PROMPTS = {"hf": PROSE * 40, "loop": PROSE * 250}
# (kind, the server's parts that block the loop: {function the stall is named by: the part's own call})
BLOCKERS = {"hf": ("loop_stall", {"screen_prompt": "screen_prompt"}),
            "loop": ("tokenization_stall", {"slow_normalize": "slow_normalize", "tokenize_prompt": "tokenizer"})}
MAX_TOKENS = 12
SAMPLED = 4  # requests in the session: three one after another, then one with others beside it


def stream_completion(url: str, prompt: str, max_tokens: int, timeout: float = 120.0,
                      first_chunk: threading.Event | None = None) -> tuple[str, int]:
    """(request id, completion tokens the server reported) of one streamed completion."""
    with httpx.Client(timeout=timeout) as client, \
            client.stream("POST", url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}) as r:
        assert r.status_code == 200
        usage = None
        for line in r.iter_lines():
            if first_chunk is not None and line:
                first_chunk.set()
            if line.startswith("data: {") and '"usage"' in line:
                usage = orjson.loads(line[len("data: "):])["usage"]["completion_tokens"]
        assert usage is not None
        return r.headers["x-request-id"], usage


def reference_tokenize_ms(name: str, server: Any, prompt: str, repeats: int = 7) -> list[float]:
    """The same tokenizer calls as the server makes, timed with no profiler running."""
    if name == "hf":
        def call() -> Any:
            return server.tokenizer(prompt, return_tensors="pt")
    else:
        normalized = server.slow_normalize(prompt)

        def call() -> Any:
            return server.tokenizer.encode(normalized)
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return times


class SessionResults:
    """An observer keeping each session's analysis result by session id."""

    def __init__(self) -> None:
        self.by_session: dict[str, dict[str, Any]] = {}

    def on_request_start(self, record: Any, scope: Any) -> None:
        return None

    def on_request_end(self, record: Any, state: Any) -> None:
        pass

    def on_analysis(self, result: dict[str, Any], records: list[Any]) -> None:
        self.by_session[result["session_id"]] = result


@pytest.fixture(scope="module", params=sorted(SERVERS))
def observed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One session on an unmarked server under concurrent streaming load and /health probes."""
    name = request.param
    server = importlib.import_module(SERVERS[name])
    app = server.create_app()
    # The one line a user adds. sample_every=1 would sample /health too without the route filter.
    app.add_middleware(ServprofMiddleware, out_dir=tmp_path_factory.mktemp(name), telemetry=False,
                       control_token=TOKEN, sample_every=1, requests_per_session=SAMPLED,
                       max_session_events=10**9)  # whole requests here: the budget has its own tests
    wait_idle()
    prompt = PROMPTS[name]
    with serve(app) as (url, _server):
        middleware = servprof_middleware(app)
        results = SessionResults()
        middleware.runtime.observers.append(results)
        while not middleware.runtime.controller.warm:
            time.sleep(0.05)
        health = {"count": 0, "stop": False}

        def probe() -> None:
            with httpx.Client(timeout=30) as client:
                while not health["stop"]:
                    assert client.get(url + "/health").status_code == 200
                    health["count"] += 1
                    time.sleep(0.02)

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        time.sleep(0.1)  # probes first: with every=1 they would take the session
        tokens: dict[str, int] = {}
        order: list[str] = []
        errors: list[BaseException] = []
        first_chunk = threading.Event()

        def one(signal: threading.Event | None = None) -> None:
            try:
                rid, count = stream_completion(url, prompt, MAX_TOKENS, first_chunk=signal)
                tokens[rid] = count
                order.append(rid)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                first_chunk.set()

        # The session's requests tokenize with no other request's load on the CPUs, as the reference
        # timings do: each once the one before is done; while the last streams, two more arrive
        # (the session is full: they run unsampled).
        reference = reference_tokenize_ms(name, server, prompt)
        for _ in range(SAMPLED - 1):
            # Interleaved with the requests: the machine's load drifts (it is shared).
            reference += reference_tokenize_ms(name, server, prompt, repeats=3)
            one()
        clients = [threading.Thread(target=one, args=(first_chunk,))]
        clients[0].start()
        first_chunk.wait(120)
        clients += [threading.Thread(target=one) for _ in range(2)]
        for thread in clients[1:]:
            thread.start()
        for thread in clients:
            thread.join(300)
        (session, *_rest) = wait_sessions(middleware, 1, timeout_s=120)
        health["stop"] = True
        prober.join(10)
        assert not errors, errors
        wait_idle()
        with httpx.Client(timeout=30) as client:
            status = client.get(url + "/servprof/status", headers=AUTH).json()
        sessions = list(middleware.runtime.history)
    # (The first session's: on a loaded machine the last two requests can arrive after it ended and
    # start a second session.)
    deadline = time.monotonic() + 30  # (observers hear of a session just after it joins the history)
    while session["session_id"] not in results.by_session and time.monotonic() < deadline:
        time.sleep(0.02)
    result = results.by_session[session["session_id"]]
    reference += reference_tokenize_ms(name, server, prompt)
    blocker_ms = blocker_times_ms(name, server, prompt)
    sampled = [r["request_id"] for r in session["requests"]]
    return {"name": name, "session": session, "sessions": sessions, "result": result, "status": status,
            "tokens": tokens, "sampled": sampled, "health": health["count"],
            "reference_ms": reference, "blocker_ms": blocker_ms}


def test_model_steps_found_and_prefill_told_from_decode(observed: dict[str, Any]) -> None:
    result, tokens = observed["result"], observed["tokens"]
    assert result["error"] is None, result["error"]
    assert len(observed["sampled"]) == SAMPLED
    for rid in observed["sampled"]:
        phases = sorted(result["requests"][rid]["phases"], key=lambda p: p["start_us"])
        steps = [p["name"] for p in phases if p["name"] in ("prefill", "decode_step")]
        # Every token comes from one forward: within one of the tokens this request generated.
        assert abs(len(steps) - tokens[rid]) <= 1, (rid, len(steps), tokens[rid])
        assert steps[0] == "prefill" and steps.count("prefill") == 1, steps
    detect = result["summary"]["detect"]
    assert detect["steps"]["count"] > 0 and detect["steps"]["source"] == ["servprof_auto"]  # no markers: automatic


def test_tokenization_found_on_the_loop_with_its_time(observed: dict[str, Any]) -> None:
    result = observed["result"]
    per_request = result["summary"]["detect"]["tokenization"]["per_request"]
    measured = []
    for rid in observed["sampled"]:
        spans = [p for p in result["requests"][rid]["phases"] if p["name"] == "tokenize"]
        assert len(spans) == 1, spans
        assert per_request[rid]["on_event_loop"] is True
        measured.append((spans[0]["end_us"] - spans[0]["start_us"]) / 1e3)
    # The same call timed without the profiler, interleaved with the requests (23 runs). On this
    # shared machine single timings swing by 2x and the load shifts within a run, so the comparison
    # is between distributions: the fastest sampled call within 1.5x the reference's upper quartile,
    # and none faster than half the fastest reference call (a phase cut short; at 0.8x a quiet
    # moment during the requests against a loaded one during the reference failed it: 12.9 ms
    # against 17.7 ms, once in many runs). The servers' slow helpers that run
    # just before the tokenizer (several times its time) must not be in the phase: with one, the
    # fastest sampled call would be several times the typical one.
    reference = sorted(observed["reference_ms"])
    upper_quartile = reference[(3 * len(reference)) // 4]
    assert min(measured) <= 1.5 * upper_quartile, (measured, reference)
    assert min(measured) >= 0.5 * reference[0], (measured, reference)


def blocker_times_ms(name: str, server: Any, prompt: str, repeats: int = 5) -> dict[str, float]:
    """The median time of each part of the server that blocks its loop, timed without the profiler.
    The loop server's tokenizer call is named by its caller, tokenize_prompt (the innermost frame
    of the server's own: the tokenizer is native code)."""
    kind, parts = BLOCKERS[name]
    calls: dict[str, Any] = {"screen_prompt": lambda: server.screen_prompt(prompt),
                             "slow_normalize": lambda: server.slow_normalize(prompt)}
    if name == "loop":
        normalized = server.slow_normalize(prompt)
        calls["tokenizer"] = lambda: server.tokenizer.encode(normalized)
    medians = {}
    for function, part in parts.items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            calls[part]()
            times.append((time.perf_counter() - start) * 1e3)
        medians[function] = float(np.median(times))
    return medians


def test_the_loop_stall_is_named_by_the_blocking_function(observed: dict[str, Any]) -> None:
    """The stall is named by one of the server's own blocking parts (not its handler, a framework's
    frame or a wait). Which part is not asserted: the parts timed again alone afterwards
    (``blocker_ms``, shown when it fails) predicted it in isolated runs, but in the full suite's
    process 2 runs in 4 named no part that re-timing predicted (2026-11-29)."""
    kind, parts = BLOCKERS[observed["name"]]
    times = observed["blocker_ms"]
    findings = observed["result"]["findings"]
    named = [f for f in findings if f["evidence"].get("source") == "event-loop watchdog"
             and f["evidence"].get("function") in parts]
    merged = [f for f in findings if (f["evidence"].get("loop_stall") or {}).get("function") in parts]
    seen = [(f["kind"], f["evidence"].get("function"), f["evidence"].get("functions"),
             (f["evidence"].get("loop_stall") or {}).get("function")) for f in findings
            if f["kind"] in ("loop_stall", kind) and (f["evidence"].get("source") or f["evidence"].get("loop_stall"))]
    assert named or merged, (times, seen)
    for finding in named:
        function = finding["evidence"]["function"]
        assert finding["kind"] == kind
        assert function in finding["title"] and finding["fix"]
        assert any(frame["function"] == function for frame in finding["evidence"]["frames"])
        assert finding["request_ids"], "the stall names the requests it delayed"
        assert finding["cost_ms"] >= 10.0


def test_a_model_run_in_threads_is_not_called_on_the_loop(observed: dict[str, Any]) -> None:
    """Both servers run the model in a thread per request: no step is on the loop's thread
    (tests/test_model_on_loop.py has the server that runs it there)."""
    detect = observed["result"]["summary"]["detect"]
    assert detect["loop_stalls"]["model_on_loop"] == {"loop_tid": observed["session"]["watchdog"]["loop_tid"],
                                                      "steps_on_loop": 0}
    assert not [f for f in observed["result"]["findings"] if f["evidence"].get("cause") == "model_on_event_loop"]


def test_health_probes_are_never_sampled(observed: dict[str, Any]) -> None:
    assert observed["health"] >= 5
    for session in observed["sessions"]:
        assert all(r["path"] != "/health" for r in session["requests"]), session["requests"]
    sampler = observed["status"]["sampler"]
    assert sampler["not_eligible"] >= observed["health"]


def test_status_shows_what_is_missing(observed: dict[str, Any]) -> None:
    missing = observed["status"]["missing"]
    assert isinstance(missing, list)
    # These servers have both a model and a tokenizer library: nothing of that is missing.
    assert not [m for m in missing if m["what"] in ("automatic model steps", "tokenizer library",
                                                    "automatic phases")], missing
    auto = observed["session"]["auto"]
    assert auto["steps"] > 0 and auto["prefill"] >= 2 and auto["tokenizer_libraries"]
    assert observed["session"]["watchdog"]["attached"] is True


def test_no_finding_from_an_assumed_device_above_info(observed: dict[str, Any]) -> None:
    """Needs branch i19b (issue 12 item 5): on CPU servprof identifies no device peak, so a
    bandwidth finding can only be an assumption."""
    for finding in observed["result"]["findings"]:
        if finding["kind"] == "bandwidth_bound_decode":
            assert finding["severity"] == "info", finding["title"]


def test_with_auto_instrumentation_off_status_says_so(tmp_path: Path) -> None:
    server = importlib.import_module(SERVERS["loop"])
    app = server.create_app()
    app.add_middleware(ServprofMiddleware, out_dir=tmp_path, telemetry=False, control_token=TOKEN,
                       sample_every=1, requests_per_session=1, auto_instrument=False)
    wait_idle()
    with serve(app) as (url, _server):
        middleware = servprof_middleware(app)
        stream_completion(url, "a short prompt", 4)
        (session,) = wait_sessions(middleware, 1, timeout_s=120)
        wait_idle()
        with httpx.Client(timeout=30) as client:
            status = client.get(url + "/servprof/status", headers=AUTH).json()
    assert session["auto"] == {"enabled": False}
    whats = [m["what"] for m in status["missing"]]
    assert "automatic phases" in whats, status["missing"]
    assert all(m["message"] for m in status["missing"])
    # Nothing marked the steps: the analysis found none from servprof's markers.
    assert "servprof" not in status["last_analysis"]["summary"]["detect"]["steps"]["source"]


# --- the event budget, from the first session of a fresh process -----------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _trace_event_count(path: Path) -> int:
    with gzip.open(path, "rb") as file:
        return len(orjson.loads(file.read())["traceEvents"])


def _report_death(server: subprocess.Popen[bytes]) -> None:
    """Print how the server died: faulthandler's dump starts with the fatal error and the thread
    that crashed, and ends with the rest. (Deep sessions crashed torch 2.13 servers here until
    servprof drained their ops before the stop: docs/middleware.md, servprof.tiers.drain_ops.)"""
    text = (server.stderr.read() if server.stderr else b"").decode(errors="replace")
    print(f"server exit status {server.returncode}\n{text[:3000]}\n[...]\n{text[-3000:]}", file=sys.stderr)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "record_shapes", "tier"),
                         [("hf", False, "deep"), ("loop", False, "deep"), ("loop", True, "deep"), ("hf", False, "light")])
def test_every_session_stays_within_its_event_budget(tmp_path: Path, name: str, record_shapes: bool, tier: str) -> None:
    """A fresh process (its first session included, no rate known), a load that jumps 10x while
    the first session captures, then sessions under steady load: every stored trace holds at
    most 1.5x the session's event budget. Deep sessions (every op) are ended by the budget; light
    ones (annotations only) take whole requests within it."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "SERVPROF_OUT_DIR": str(tmp_path), "SERVPROF_CONTROL_TOKEN": TOKEN,
           "SERVPROF_TELEMETRY": "0", "SERVPROF_REQUESTS_PER_SESSION": "1", "SERVPROF_ON_DEMAND_MIN_INTERVAL_S": "0.1",
           "SERVPROF_RECORD_SHAPES": "1" if record_shapes else "0", "KINETO_LOG_LEVEL": "6",
           "SERVPROF_TIER": tier, "SERVPROF_DEEP_EVERY": "0",
           "PYTHONFAULTHANDLER": "1"}
    if tier == "deep":
        # The event budget is the bound under test, not the step cap: with the default 32 steps, a
        # loaded run's first session once took its 32 steps of the one stream (173 events of 400)
        # before the ten streams of the jump joined, and ended by steps.
        env["SERVPROF_MAX_SESSION_STEPS"] = "100000"
    server = subprocess.Popen([sys.executable, str(Path(__file__).parent / "servers" / "run_with_servprof.py"),
                               SERVERS[name], str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    load_stop = threading.Event()
    try:
        with httpx.Client(timeout=30) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if client.get(url + "/servprof/status", headers=AUTH).json()["profiler"]["warm"]:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline and server.poll() is None, "server did not start"
                time.sleep(0.2)

            def done() -> int:
                counters = client.get(url + "/servprof/status", headers=AUTH).json()["counters"]
                return counters["sessions_done"] + counters["sessions_failed"]

            def load(max_tokens: int) -> None:
                while not load_stop.is_set():
                    try:
                        stream_completion(url, PROSE * 4, max_tokens)
                    except (httpx.HTTPError, AssertionError):
                        return

            def wait_session(before: int) -> None:
                deadline = time.monotonic() + 180
                while done() == before:
                    assert time.monotonic() < deadline, "no session finished"
                    time.sleep(0.1)

            # The first session in the process: one stream sampled, then ten more join mid-session.
            assert client.post(url + "/servprof/sample?n=1", headers=AUTH).status_code == 202
            first = threading.Thread(target=stream_completion, args=(url, PROSE * 4, 400), daemon=True)
            first.start()
            deadline = time.monotonic() + 60
            # Until it captures (a first session bounded by a few steps may also be over between two
            # polls: the load below then joins the next one, and every session is still checked).
            while (client.get(url + "/servprof/status", headers=AUTH).json()["current_session"] or {}).get(
                    "state") != "capturing" and done() == 0:
                assert time.monotonic() < deadline, "the first session never started"
                time.sleep(0.01)
            jump = [threading.Thread(target=load, args=(40,), daemon=True) for _ in range(10)]
            for thread in jump:
                thread.start()
            wait_session(0)
            load_stop.set()
            for thread in jump:
                thread.join(300)
            # Then steady load (3 streams) and four more ordered sessions.
            load_stop.clear()
            steady = [threading.Thread(target=load, args=(64,), daemon=True) for _ in range(3)]
            for thread in steady:
                thread.start()
            for _ in range(4):
                before = done()
                time.sleep(0.3)
                assert client.post(url + "/servprof/sample?n=1", headers=AUTH).status_code == 202
                wait_session(before)
            load_stop.set()
            for thread in steady:
                thread.join(300)
    except BaseException:
        if server.poll() is not None:  # say how the server died
            _report_death(server)
        raise
    finally:
        load_stop.set()
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(30)
    sessions = sorted((orjson.loads(p.read_bytes()) for p in (tmp_path / "traces").glob("*.session.json")),
                      key=lambda s: s["wall_start_ns"])
    assert len(sessions) >= 5, [s.get("stop_reason") for s in sessions]
    ratios = []
    for session in sessions:
        trace = Path(session["trace_file"])
        events = _trace_event_count(trace)
        ratios.append((session["stop_reason"], events, session["event_budget"]))
        assert events <= 1.5 * session["event_budget"], (ratios, session)
    assert {s["tier"] for s in sessions} == {tier}
    for session in sessions:  # what the budget learns from (EventBudget.learn_session), as it reads it
        analysis = orjson.loads((tmp_path / "traces" / f"{session['session_id']}.analysis.json").read_bytes())
        steps = analysis["summary"]["detect"]["steps"]
        assert isinstance(steps["whole_before_stop"], int) and 0 <= steps["whole_before_stop"] <= steps["count"]
    if tier == "light":
        return
    # The bound is what ended them: the first session with its 10x load jump above all.
    assert ratios[0][0] == "max_session_events", ratios
    assert sum(1 for reason, _e, _b in ratios if reason == "max_session_events") >= 3, ratios
    if record_shapes:
        assert sessions[0]["event_budget"] < 2000  # stop() costs ~3x per event with shapes
