"""servprof inside vLLM's real API server (`build_app` with `--middleware`), on CPU.

vLLM's engine needs a GPU build, so the engine client is the thin stand-in of
tests/_vllm_standin.py; everything else is vLLM's real code, and its worker
processes write real trace files through vLLM's TorchProfilerWrapper.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

vllm = pytest.importorskip("vllm", reason="vLLM tier: install with scripts/install-vllm-cpu (scripts/dev test does)")

from _vllm_standin import build_vllm_app, make_tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.vllm
TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MIDDLEWARE = "servprof.integrations.vllm.VLLMMiddleware"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def vllm_server(tmp: Path, extra_args: list[str], ranks: int = 1,
                extra_env: dict[str, str] | None = None) -> Iterator[tuple[str, object, Path]]:
    """vLLM's real app with servprof's middleware, served by uvicorn on loopback."""
    import uvicorn

    model = make_tiny_model_dir(tmp.parent / "tiny-llama")
    out = tmp / "servprof-out"
    env = {"SERVPROF_CONTROL_TOKEN": TOKEN, "SERVPROF_OUT_DIR": str(out), "SERVPROF_TELEMETRY_EXPORTER": "file",
           "SERVPROF_ON_DEMAND_MIN_INTERVAL_S": "0", "SERVPROF_MAX_SESSION_S": "20", **(extra_env or {})}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    app, engine = build_vllm_app(["--model", str(model), "--served-model-name", "tiny", "--max-model-len", "512",
                                  "--middleware", MIDDLEWARE,
                                  *extra_args], ranks=ranks)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield base, engine, out
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _completion(client: httpx.Client, request_id: str, stream: bool = True, max_tokens: int = 12) -> httpx.Response:
    body = {"model": "tiny", "prompt": "the quick brown fox " * 8, "max_tokens": max_tokens, "stream": stream}
    return client.post("/v1/completions", json=body, headers={"X-Request-Id": request_id}, timeout=60)


def _wait_for_session(client: httpx.Client, timeout_s: float = 90) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = client.get("/servprof/status", headers=AUTH).json()
        if status["last_sessions"] and status["current_session"] is None:
            return status
        time.sleep(0.25)
    raise AssertionError(f"no finished session within {timeout_s} s: {status}")


@pytest.fixture(scope="module")
def profiled_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, object, Path, Path]]:
    tmp = tmp_path_factory.mktemp("vllm-profiled")
    profile_dir = tmp / "vllm-profiles"
    args = ["--profiler-config.profiler", "torch", "--profiler-config.torch_profiler_dir", str(profile_dir),
            "--otlp-traces-endpoint", "http://127.0.0.1:9"]
    with vllm_server(tmp, args, ranks=2) as (base, engine, out):
        yield base, engine, out, profile_dir


def test_sampled_requests_profile_every_rank_and_tie_findings(profiled_server) -> None:
    base, engine, out, profile_dir = profiled_server
    with httpx.Client(base_url=base) as client:
        assert client.post("/servprof/sample?n=2", headers=AUTH).status_code in (200, 202)
        responses: list[httpx.Response] = []
        # 32 tokens: decoding goes on well after vLLM's workers have started their profilers.
        threads = [threading.Thread(target=lambda i=i: responses.append(_completion(client, f"req-{i}", max_tokens=32)))
                   for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [r.status_code for r in responses] == [200, 200]
        assert all(r.text.rstrip().endswith("data: [DONE]") for r in responses)
        status = _wait_for_session(client)
    session = status["last_sessions"][-1]
    assert session["error"] is None, session
    assert sorted(r["request_id"] for r in session["requests"]) == ["req-0", "req-1"]
    # Busy time is counted from the session's start (it read ~ the machine's uptime before).
    assert 0 <= session["busy_s"] <= session["duration_s"], session
    # vLLM's own worker profiler wrote one trace per rank, named with servprof's session prefix.
    rank_files = sorted(p.name for p in profile_dir.glob("servprof_*.pt.trace.json.gz"))
    assert len(rank_files) == 2 and any("rank0" in n for n in rank_files) and any("rank1" in n for n in rank_files)
    analysis = status["last_analysis"]
    assert analysis["error"] is None
    assert len(analysis["summary"]["rank_files"]) == 2
    # The rank files hold vLLM's own step annotations, which the detectors read as model steps
    # (vLLM writes "execute_context_N(tokens)_generation_M(tokens)" in this mode).
    from servprof.detect.steps import find_steps
    from servprof.trace import load_trace

    steps = find_steps(load_trace(Path(session["trace_file"])))
    assert {s.source for s in steps} == {"vllm"}
    assert {s.rank for s in steps} == {0, 1}
    # (prefills may come before vLLM's workers have started profiling: requests do not wait for it)
    assert any(s.kind == "decode" for s in steps)
    # Each sampled request gets the model steps it was in flight for (spans are made from these).
    import orjson

    result = orjson.loads((out / "traces" / f"{session['session_id']}.analysis.json").read_bytes())
    assert set(result["requests"]) == {"req-0", "req-1"}
    for info in result["requests"].values():
        assert info["phases_from"] == "time window"
        assert any(p["name"] == "decode_step" for p in info["phases"]), info
    # Tokenization was timed in the API process for each sampled request.
    api = status["last_api_process"]
    assert set(api["tokenize"]) == {"req-0", "req-1"}
    assert api["loop_lag_ms"]["count"] > 0
    for finding in status["last_findings"]:
        assert set(finding["request_ids"]) <= {"req-0", "req-1"}


def test_unsampled_requests_never_start_vllms_profiler(profiled_server) -> None:
    base, engine, out, profile_dir = profiled_server
    before = set(profile_dir.glob("*.pt.trace.json.gz")) if profile_dir.exists() else set()
    with httpx.Client(base_url=base) as client:
        for i in range(3):
            assert _completion(client, f"plain-{i}", stream=False).status_code == 200
    after = set(profile_dir.glob("*.pt.trace.json.gz")) if profile_dir.exists() else set()
    assert after == before


def test_users_own_profile_session_is_skipped_not_an_error(profiled_server) -> None:
    base, engine, out, profile_dir = profiled_server
    with httpx.Client(base_url=base) as client:
        # The operator's own /start_profile (vLLM's endpoint) holds the profiler.
        assert client.post("/start_profile", json={"profile_prefix": "operator"}).status_code == 200
        try:
            before = len(client.get("/servprof/status", headers=AUTH).json()["last_sessions"])
            assert client.post("/servprof/sample?n=1", headers=AUTH).status_code in (200, 202)
            response = _completion(client, "during-user-profile", stream=False)
            assert response.status_code == 200
            status = _wait_for_session(client)
            assert len(status["last_sessions"]) == before + 1
            assert "already running" in status["last_sessions"][-1]["error"]
        finally:
            assert client.post("/stop_profile").status_code == 200


def test_traceparent_reaches_vllm_under_servprofs_span(profiled_server) -> None:
    base, engine, out, profile_dir = profiled_server
    incoming_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    with httpx.Client(base_url=base) as client:
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3},
                               headers={"traceparent": f"00-{incoming_trace}-00f067aa0ba902b7-01",
                                        "X-Request-Id": "traced-1"})
    assert response.status_code == 200
    seen = [h for rid, h in engine.trace_headers.items() if "traced-1" in rid]
    assert seen and seen[0], "vLLM passed no trace headers to the engine"
    version, trace_id, parent_span, flags = seen[0]["traceparent"].split("-")
    assert trace_id == incoming_trace  # same trace as the caller's
    assert parent_span != "00f067aa0ba902b7"  # but re-parented under servprof's SERVER span


def test_a_request_without_an_id_gets_servprofs_id_in_vllms_request_ids(profiled_server) -> None:
    """vLLM's serving layer takes its request ids from the X-Request-Id header: servprof puts the id
    it gave the request there, so vLLM's ids, the response's header and servprof's records agree."""
    base, engine, _out, _profile_dir = profiled_server
    with httpx.Client(base_url=base, timeout=60) as client:
        response = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3})
    assert response.status_code == 200
    (request_id,) = response.headers.get_list("x-request-id")
    assert [rid for rid in engine.trace_headers if request_id in rid], (request_id, list(engine.trace_headers))


def test_missing_profiler_config_is_reported_and_serving_goes_on(tmp_path: Path) -> None:
    with vllm_server(tmp_path, []) as (base, engine, out), httpx.Client(base_url=base) as client:
        assert client.post("/servprof/sample?n=1", headers=AUTH).status_code in (200, 202)
        assert _completion(client, "no-config", stream=False).status_code == 200
        status = client.get("/servprof/status", headers=AUTH).json()
        assert "--profiler-config" in (status["paused"] or "")
        assert status["counters"]["sampled"] == 0


def test_retention_counts_and_removes_vllms_rank_files_with_their_session(tmp_path: Path) -> None:
    """Each session under vLLM is a <session>.vllm folder of links plus the rank files vLLM's
    workers wrote in its torch_profiler_dir: SERVPROF_TRACE_MAX_FILES counts the folder as one
    session, and removing the session removes its rank files too."""
    profile_dir = tmp_path / "vllm-profiles"
    args = ["--profiler-config.profiler", "torch", "--profiler-config.torch_profiler_dir", str(profile_dir)]
    sessions = []
    with vllm_server(tmp_path, args, ranks=2, extra_env={"SERVPROF_TRACE_MAX_FILES": "2"}) as (base, _e, out), \
            httpx.Client(base_url=base) as client:
        # Someone else's trace in the same folder is never touched.
        profile_dir.mkdir(parents=True, exist_ok=True)
        (profile_dir / "operator_dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz").write_bytes(b"not servprof's")
        for i in range(3):
            assert client.post("/servprof/sample?n=1", headers=AUTH).status_code in (200, 202)
            assert _completion(client, f"kept-{i}", max_tokens=24).status_code == 200
            deadline = time.monotonic() + 90
            while True:
                status = client.get("/servprof/status", headers=AUTH).json()
                if len(status["last_sessions"]) > i and status["current_session"] is None:
                    break
                assert time.monotonic() < deadline, status
                time.sleep(0.25)
            session = status["last_sessions"][-1]
            assert session["error"] is None, session
            sessions.append(session["session_id"])
    folders = sorted(p.name for p in (out / "traces").glob("*.vllm"))
    assert folders == sorted(f"{sid}.vllm" for sid in sessions[1:])
    servprofs = sorted(p.name for p in profile_dir.iterdir() if p.name.startswith("servprof_"))
    assert len([name for name in servprofs if name.endswith(".pt.trace.json.gz")]) == 4, servprofs
    # The rank traces and vLLM's tables beside them (*.profiler_out.txt) of the two sessions kept only.
    assert all(any(name.startswith(f"servprof_{sid}_") for sid in sessions[1:]) for name in servprofs), servprofs
    assert not list((out / "traces").glob(f"{sessions[0]}.*"))
    assert (profile_dir / "operator_dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz").exists()


SIGTERM_SERVER = """
import asyncio, socket, sys
from _vllm_standin import build_vllm_app
from vllm.entrypoints.launchers.launcher import serve_http

model, profile_dir, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
app, engine = build_vllm_app(["--model", model, "--served-model-name", "tiny", "--max-model-len", "512",
                              "--middleware", "servprof.integrations.vllm.VLLMMiddleware",
                              "--profiler-config.profiler", "torch",
                              "--profiler-config.torch_profiler_dir", profile_dir], ranks=2)
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", port))


async def main():
    # vLLM's own server: its SIGTERM handler stops the engine first, then the HTTP server.
    shutdown = await serve_http(app, sock=sock, host="127.0.0.1", port=port, log_level="warning")
    await shutdown

asyncio.run(main())
print("EXITED CLEANLY", flush=True)
"""


@pytest.mark.slow
def test_sigterm_under_vllms_server_keeps_the_running_session_and_flushes_spans(tmp_path: Path) -> None:
    """vLLM's shutdown path (its SIGTERM handler: engine shutdown, then the HTTP server): the
    session running at the signal is stopped while vLLM's workers still live, so their rank files
    are collected, and the spans are exported before the process ends."""
    import orjson

    model = make_tiny_model_dir(tmp_path.parent / "tiny-llama")
    out, profile_dir, port = tmp_path / "servprof-out", tmp_path / "vllm-profiles", _free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SERVPROF_"))},
           "SERVPROF_CONTROL_TOKEN": TOKEN, "SERVPROF_OUT_DIR": str(out), "SERVPROF_TELEMETRY_EXPORTER": "file",
           "SERVPROF_ON_DEMAND_MIN_INTERVAL_S": "0", "SERVPROF_MAX_SESSION_S": "120",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / "server.log"
    with log.open("wb") as sink:
        process = subprocess.Popen([sys.executable, "-c", SIGTERM_SERVER, str(model), str(profile_dir), str(port)],
                                   env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        with httpx.Client(base_url=base) as client:
            assert client.post("/servprof/sample?n=4", headers=AUTH).status_code in (200, 202)
            ids = [f"term-{i}" for i in range(2)]
            for rid in ids:  # two of the four: the session is still open at the signal
                assert _completion(client, rid, max_tokens=16).status_code == 200
            current = client.get("/servprof/status", headers=AUTH).json()["current_session"]
            assert current is not None and current["state"] == "capturing", current
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log.read_text()
    assert process.returncode == 0 and "EXITED CLEANLY" in text, text[-3000:]
    (folder,) = (out / "traces").glob("*.vllm")
    assert sorted(p.name.rsplit("rank", 1)[1][0] for p in folder.iterdir()) == ["0", "1"]
    session = orjson.loads(next((out / "traces").glob("*.session.json")).read_bytes())
    assert session["stop_reason"] == "shutdown: vLLM engine shutdown" and session["state"] == "done"
    assert sorted(r["request_id"] for r in session["requests"]) == ids
    spans = (out / "spans" / "spans.otlp.jsonl").read_text()
    assert all(f'"stringValue":"{rid}"' in spans.replace(" ", "") for rid in ids)
