"""servprof's own stop() is never blamed on the app (issue 18 item 3, the detector side).

A real session: the demo server behind the middleware, one request sampled while other
(unsampled) requests keep the engine stepping, so the profiler's stop() lands while a
decode step is running and holds the GIL for its whole length. Everything after the
session's ``stop_wall_ns`` is servprof's: the analysis cuts the steps there, shows the
time as servprof's overhead, and reports no finding in it.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import time
from pathlib import Path

import httpx
import orjson
import pytest
from _demo_helpers import start_sampled_demo_server
from _middleware_helpers import AUTH, TOKEN, wait_idle

from servprof.detect.analysis import analyse
from servprof.detect.overhead import stop_cutoffs
from servprof.trace import load_trace
from servprof.trace.phases import phase_events


def _stream(url: str, request_id: str, tokens: int) -> int:
    body = {"prompt": "the profiler must not blame its own stop on the app " * 4, "max_tokens": tokens,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"x-request-id": request_id},
                      timeout=120) as response:
        for _ in response.iter_lines():
            pass
        return response.status_code


@pytest.mark.slow
def test_a_real_sessions_stop_is_servprofs_overhead_not_a_finding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    wait_idle()
    # record_shapes makes stop() long (it holds the GIL ~3x longer): the stall to keep out of the findings.
    settings = {"OUT_DIR": str(tmp_path / "out"), "CONTROL_TOKEN": TOKEN, "TELEMETRY": "0", "RECORD_SHAPES": "1"}
    with start_sampled_demo_server(monkeypatch, settings, size="tiny") as url, httpx.Client(timeout=30) as client, \
            concurrent.futures.ThreadPoolExecutor(4) as pool:
        # Unsampled load first, long enough to outlive the sampled request and the stop.
        background = [pool.submit(_stream, url, f"bg-{i}", 160) for i in range(3)]
        time.sleep(0.3)
        assert client.post(url + "/servprof/sample?n=1", headers=AUTH).status_code == 202
        assert pool.submit(_stream, url, "sampled", 12).result() == 200
        deadline = time.monotonic() + 120
        # A fresh connection per poll: the stop held the GIL for seconds, past uvicorn's keep-alive.
        while not (status := httpx.get(url + "/servprof/status", headers=AUTH, timeout=30).json())["last_sessions"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert all(f.result() == 200 for f in background)
    (session,) = status["last_sessions"]
    assert session["error"] is None, session
    path = Path(session["trace_file"])
    raw = orjson.loads(gzip.decompress(path.read_bytes()))
    assert isinstance(raw["servprof"]["stop_wall_ns"], int)

    trace = load_trace(path)
    (cutoff,) = stop_cutoffs(trace).values()
    # The engine was mid-step when stop() began: the raw trace has a step range running past it.
    raw_steps = [e for e in phase_events(trace) if e.phase in ("decode_step", "prefill")]
    straddling = [e for e in raw_steps if e.start_us < cutoff < e.end_us]
    trace_end = float(trace.end.max())
    assert trace_end > cutoff  # stop() itself leaves events behind it

    analysis = analyse(trace)
    overhead = analysis.summary["servprof_overhead"]
    assert overhead["stop_us"] == pytest.approx(cutoff, abs=1e-3)
    assert overhead["after_stop_ms"] == pytest.approx((trace_end - cutoff) / 1000, abs=1e-2)
    assert overhead["steps_cut"] == len(straddling)
    assert all(s.end_us <= cutoff for s in analysis.steps)
    for finding in analysis.findings:
        assert finding.start_us < cutoff and finding.end_us <= cutoff + 1e-6, finding.to_dict()
        for gap in finding.evidence.get("worst_gaps", []):
            assert gap["end_us"] <= cutoff + 1e-6
    for gap in analysis.gaps:
        assert gap.end_us <= cutoff + 1e-6
    # The session's live analysis (the child process) says the same, at the contract's top level.
    live = orjson.loads(Path(str(path).replace(".pt.trace.json.gz", ".analysis.json")).read_bytes())
    assert live["summary"]["servprof_overhead"]["stop_us"] == pytest.approx(cutoff, abs=1e-3)
    assert live["summary"]["missing"] == analysis.summary["missing"]
    assert all(f["end_us"] <= cutoff + 1e-6 for f in live["findings"])
    # A clean run: nothing in the app needs fixing, so nothing above info.
    assert [f.to_dict() for f in analysis.findings if f.kind != "bandwidth_bound_decode"
            and f.severity != "info"] == []
