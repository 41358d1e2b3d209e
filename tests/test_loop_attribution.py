"""Live path, end to end: the demo server tokenizing on its event loop (fault knob a, with a
slow tokenizer so it matters), sampled through ServprofMiddleware; the session metadata names
the loop's thread, so the analysis says the stall ran on the event loop."""

from __future__ import annotations

import concurrent.futures
import gzip
import time
from pathlib import Path

import httpx
import orjson
import pytest
from _demo_helpers import get_stats, start_sampled_demo_server
from _middleware_helpers import AUTH, TOKEN, wait_idle


def _stream(url: str, request_id: str) -> int:
    body = {"prompt": "a long prompt about slow tokenizers " * 40, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"x-request-id": request_id},
                      timeout=60) as response:
        for _ in response.iter_lines():
            pass
        return response.status_code


def test_tokenization_on_the_loop_is_attributed_to_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wait_idle()
    settings = {"OUT_DIR": str(tmp_path / "out"), "CONTROL_TOKEN": TOKEN, "TELEMETRY": "0"}
    with start_sampled_demo_server(monkeypatch, settings, size="tiny", tokenize_on_loop=True,
                                   slow_tokenizer_us_per_token=100) as url, httpx.Client(timeout=30) as client:
        loop_tid = get_stats(url)["event_loop_thread_native_id"]
        assert client.post(url + "/servprof/sample?n=2", headers=AUTH).status_code == 202
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            assert list(pool.map(lambda rid: _stream(url, rid), ["loop-a", "loop-b"])) == [200, 200]
        deadline = time.monotonic() + 90
        while not (status := client.get(url + "/servprof/status", headers=AUTH).json())["last_sessions"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    (session,) = status["last_sessions"]
    assert session["error"] is None, session
    trace = orjson.loads(gzip.decompress(Path(session["trace_file"]).read_bytes()))
    assert trace["servprof"]["event_loop_tid"] == loop_tid
    stalls = [f for f in status["last_findings"] if f["kind"] == "tokenization_stall"]
    assert {rid for f in stalls for rid in f["request_ids"]} == {"loop-a", "loop-b"}
    assert all(f["evidence"]["on_event_loop"] is True for f in stalls)
