"""End to end on the real demo LLM server: the middleware added with no arguments (settings
from SERVPROF_* variables, as vLLM adds it), an on-demand order, the demo's own phases
(batched decode steps) in the trace, and the analysis with the detectors."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import httpx
import orjson
import pytest
from _demo_helpers import start_sampled_demo_server
from _middleware_helpers import AUTH, TOKEN, wait_idle


def _stream(url: str, request_id: str) -> tuple[int, str, int]:
    body = {"prompt": "tell me a story about profilers", "max_tokens": 12, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"x-request-id": request_id},
                      timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
        return response.status_code, response.headers["x-request-id"], len(lines)


def test_demo_server_sampled_on_demand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wait_idle()
    settings = {"OUT_DIR": str(tmp_path / "out"), "CONTROL_TOKEN": TOKEN, "TELEMETRY": "0"}
    with start_sampled_demo_server(monkeypatch, settings, size="tiny") as url, httpx.Client(timeout=30) as client:
        assert client.post(url + "/servprof/sample?n=2", headers=AUTH).status_code == 202
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda rid: _stream(url, rid), ["demo-a", "demo-b"]))
        assert [(status, rid) for status, rid, _ in results] == [(200, "demo-a"), (200, "demo-b")]
        assert all(chunks >= 2 for _, _, chunks in results)
        deadline = time.monotonic() + 90
        while True:
            status = client.get(url + "/servprof/status", headers=AUTH).json()
            if status["last_sessions"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    (session,) = status["last_sessions"]
    assert session["error"] is None and session["stop_reason"] == "requests_done", session
    assert sorted(r["request_id"] for r in session["requests"]) == ["demo-a", "demo-b"]
    assert status["counters"]["sampled"] == 2
    analysis = status["last_analysis"]
    assert analysis["session_id"] == session["session_id"] and analysis["error"] is None
    assert analysis["summary"]["detectors"] == "servprof.detect"
    assert isinstance(status["last_findings"], list)
    result_path = Path(session["trace_file"].replace(".pt.trace.json.gz", ".analysis.json"))
    result = orjson.loads(result_path.read_bytes())
    for rid in ("demo-a", "demo-b"):
        names = {p["name"] for p in result["requests"][rid]["phases"]}
        assert {"tokenize", "prefill", "decode_step"} <= names, (rid, names)
