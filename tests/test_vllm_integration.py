"""servprof inside vLLM's real API server (`build_app` with `--middleware`), on CPU.

vLLM's engine needs a GPU build, so the engine client is the thin stand-in of
tests/_vllm_standin.py; everything else is vLLM's real code, and its worker
processes write real trace files through vLLM's TorchProfilerWrapper.
"""

from __future__ import annotations

import contextlib
import os
import socket
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
def vllm_server(tmp: Path, extra_args: list[str], ranks: int = 1) -> Iterator[tuple[str, object, Path]]:
    """vLLM's real app with servprof's middleware, served by uvicorn on loopback."""
    import uvicorn

    model = make_tiny_model_dir(tmp.parent / "tiny-llama")
    out = tmp / "servprof-out"
    env = {"SERVPROF_CONTROL_TOKEN": TOKEN, "SERVPROF_OUT_DIR": str(out), "SERVPROF_TELEMETRY_EXPORTER": "file",
           "SERVPROF_ON_DEMAND_MIN_INTERVAL_S": "0", "SERVPROF_MAX_SESSION_S": "20"}
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


def test_missing_profiler_config_is_reported_and_serving_goes_on(tmp_path: Path) -> None:
    with vllm_server(tmp_path, []) as (base, engine, out), httpx.Client(base_url=base) as client:
        assert client.post("/servprof/sample?n=1", headers=AUTH).status_code in (200, 202)
        assert _completion(client, "no-config", stream=False).status_code == 200
        status = client.get("/servprof/status", headers=AUTH).json()
        assert "--profiler-config" in (status["paused"] or "")
        assert status["counters"]["sampled"] == 0
