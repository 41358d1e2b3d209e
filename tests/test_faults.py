"""Faults not covered elsewhere (see test_capture.py, test_capture_analysis.py and
test_telemetry_backend_down.py for the others): a full trace filesystem, SIGTERM/SIGINT
while a session captures, and an OTLP backend that is down while sessions are analysed.

Each checks the same promise: serving keeps answering with no servprof-caused error, the
profiler is never left running, /servprof/status says what happened, and traces already
captured are kept.
"""

from __future__ import annotations

import errno
import gzip
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch.autograd.profiler as autograd_profiler
from _fault_helpers import demo_server_process, fill, free_bytes, mount_error, small_tmpfs, trace_metadata
from _middleware_helpers import AUTH, TOKEN, sse_post, tiny_server, wait_idle, wait_sessions
from _telemetry_helpers import free_port

from servprof import runtime as servprof_runtime
from servprof import telemetry
from servprof.store import TRACE_SUFFIX, StoreError, TraceStore

SAMPLE = {"x-servprof-sample": "1", "x-servprof-token": TOKEN}
_KIB = 1024
PAUSE_S = 2.0  # the paused store's recheck interval in the full-filesystem test


def _sessions_after(middleware: Any, count: int) -> list[dict[str, Any]]:
    return wait_sessions(middleware, count, timeout_s=60)[:count]


def test_full_trace_filesystem_pauses_sampling_keeps_old_traces_and_resumes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trace dir on a real 2 MiB tmpfs (mounted here; skipped where mounting is not allowed,
    as an unprivileged CI runner: no other real way to make a filesystem full).

    First the store's own free-space check trips (2 MiB < its 50 MiB floor) before anything is
    written. Then, with the floor lowered to 8 KiB (the one reach into servprof's internals:
    without it the check always pauses first), the filesystem is filled so that the export
    itself meets ENOSPC mid-write. Last, space comes back and sampling resumes by itself.
    """
    why_not = mount_error(tmp_path)
    if why_not:
        pytest.skip(why_not)
    # Retry a paused store sooner than in production, yet late enough that the checks made
    # while paused (a status call, one sampled request) fit in the pause on a slow machine.
    monkeypatch.setattr(servprof_runtime, "PAUSE_RECHECK_S", PAUSE_S)
    wait_idle()
    with small_tmpfs(tmp_path / "small", "2m") as small, \
            tiny_server(tmp_path, control_token=TOKEN, out_dir=small, analysis=False, requests_per_session=1,
                        tier="deep",  # every op: a trace big enough to meet the full filesystem
                        max_session_steps=8) as (url, mw, _engine), httpx.Client(timeout=30) as client:
        statuses: list[int] = []

        def sampled_and_plain() -> None:
            status, lines, _ = sse_post(client, url, tokens=8, headers=SAMPLE)
            assert lines[-1] == "data: [DONE]"
            statuses.extend([status, client.get(url + "/hello").status_code])

        # 1. The free-space floor: nothing is started, the reason is shown.
        sampled_and_plain()
        (first,) = _sessions_after(mw, 1)
        assert "MiB free (< 50)" in first["error"] and first["trace_file"] is None
        assert "MiB free" in client.get(url + "/servprof/status", headers=AUTH).json()["paused"]
        assert not autograd_profiler._is_profiler_enabled

        # 2. Lower the floor: a trace fits, and is kept through what follows.
        mw.runtime.store.min_free_bytes = 8 * _KIB
        time.sleep(PAUSE_S + 0.1)
        sampled_and_plain()
        kept = _sessions_after(mw, 2)[1]
        assert kept["error"] is None, kept
        kept_trace = Path(kept["trace_file"])
        kept_meta = trace_metadata(kept_trace)
        with gzip.open(kept_trace, "rb") as file:
            raw_size = len(file.read())
        assert raw_size > 32 * _KIB  # what the next export writes before gzip: more than will be free

        # 3. Fill the filesystem: the export meets ENOSPC and leaves no partial file behind.
        filler = fill(small, leave_free=16 * _KIB)
        assert 8 * _KIB <= free_bytes(small) <= 32 * _KIB  # above the floor: the check passes
        time.sleep(PAUSE_S + 0.1)
        sampled_and_plain()
        full = _sessions_after(mw, 3)[2]
        assert "No space left on device" in full["error"], full
        assert not autograd_profiler._is_profiler_enabled
        status = client.get(url + "/servprof/status", headers=AUTH).json()
        assert "No space left on device" in status["paused"]
        # While paused, sampled requests are served unsampled at once.
        sampled_and_plain()
        status = client.get(url + "/servprof/status", headers=AUTH).json()
        assert status["skipped_by_reason"].get("paused", 0) >= 1
        left = sorted(p.name for p in (small / "traces").iterdir())
        assert all(name.startswith(kept["session_id"]) for name in left), f"partial files left: {left}"
        assert trace_metadata(kept_trace) == kept_meta  # the earlier trace is intact

        # 4. Space comes back: the next sampled request is captured again.
        filler.unlink()
        time.sleep(PAUSE_S + 0.1)
        sampled_and_plain()
        resumed = wait_sessions(mw, 4)[-1]
        status = client.get(url + "/servprof/status", headers=AUTH).json()
    assert resumed["error"] is None and resumed["stop_reason"] in {"requests_done", "max_session_steps"}, resumed
    assert status["paused"] is None and status["counters"]["sessions_failed"] == 2
    assert statuses == [200] * len(statuses) and len(statuses) == 10
    assert not autograd_profiler._is_profiler_enabled


def _stream(url: str, max_tokens: int) -> tuple[int, list[str]]:
    body = {"model": "demo", "prompt": "the signal test", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=body) as response:
        return response.status_code, [line for line in response.iter_lines() if line]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_during_a_session_exits_cleanly_and_keeps_the_trace(tmp_path: Path, signum: int) -> None:
    """`servprof demo-server` in its own process, an on-demand session capturing two streams
    that are still in flight when the signal comes: uvicorn finishes them, lifespan shutdown
    stops the session, and the trace is on disk before the process exits."""
    out = tmp_path / "out"
    budget = {"SERVPROF_MAX_SESSION_EVENTS": "1000000000", "SERVPROF_MAX_SESSION_S": "120",
              "SERVPROF_MAX_SESSION_STEPS": "100000", "SERVPROF_LIGHT_MAX_STEPS": "100000"}
    with demo_server_process(out, TOKEN, "--step-delay-ms", "10", **budget) as (process, url, log):
        with httpx.Client(base_url=url, headers=AUTH, timeout=30) as control:
            deadline = time.monotonic() + 60
            while not control.get("/servprof/status").json()["profiler"]["warm"]:
                assert time.monotonic() < deadline, "profiler warm-up did not finish"
                time.sleep(0.1)
            assert control.post("/servprof/sample", params={"n": 3}).status_code == 202
            with ThreadPoolExecutor(2) as pool:
                streams = [pool.submit(_stream, url, 300) for _ in range(2)]
                # Both streams are in the session, which still waits for a third request.
                deadline = time.monotonic() + 30
                while True:
                    current = control.get("/servprof/status").json()["current_session"]
                    if current and current["state"] == "capturing" and len(current["requests"]) == 2:
                        break
                    assert time.monotonic() < deadline, current
                    time.sleep(0.05)
                in_flight = [r["request_id"] for r in current["requests"]]
                process.send_signal(signum)
                results = [future.result(timeout=60) for future in streams]
        exit_code = process.wait(60)
    stderr = log.read_text(errors="replace")
    # uvicorn re-raises the signal after its graceful shutdown: killed-by-signal is the clean exit.
    assert exit_code in (0, -signum, 128 + signum), (exit_code, stderr[-3000:])
    for bad in ("Traceback", "Segmentation fault", "core dumped", "Fatal Python error"):
        assert bad not in stderr, stderr[-3000:]
    # The streams in flight were served to the end.
    for status, lines in results:
        assert status == 200 and lines[-1] == "data: [DONE]", (status, lines[-3:])
        assert '"finish_reason":"length"' in lines[-2], lines[-2]  # all 300 tokens, not cut short
    (trace,) = (out / "traces").glob(f"*{TRACE_SUFFIX}")
    meta = trace_metadata(trace)
    assert meta["stop_reason"] == "shutdown: lifespan shutdown", meta  # graceful path, not the atexit net
    assert meta["request_ids"] == in_flight and meta["reason"] == "on_demand"
    assert not list((out / "traces").glob("*.pt.trace.json"))  # no raw export left behind


def test_otlp_backend_down_while_sessions_are_analysed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling sessions, their analysis and its spans, all while nothing listens at the OTLP
    endpoint: every request answers, sessions finish with their traces, the lost spans are
    counted in status, and no session waits on the exporter."""
    monkeypatch.setenv("SERVPROF_TELEMETRY_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{free_port()}/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    wait_idle()
    codes: list[int] = []
    lock = threading.Lock()
    try:
        with tiny_server(tmp_path, control_token=TOKEN, telemetry=True, requests_per_session=1,
                         max_session_steps=16) as (url, mw, _engine):

            def one(index: int) -> None:
                with httpx.Client(timeout=30) as client:
                    status, lines, _ = sse_post(client, url, tokens=6, headers=SAMPLE if index % 3 == 0 else {})
                    code = status if lines[-1] == "data: [DONE]" else -1
                    with lock:
                        codes.extend([code, client.get(url + "/hello").status_code])

            with ThreadPoolExecutor(6) as pool:
                list(pool.map(one, range(12)))
            wait_sessions(mw, 1)
            wait_idle()  # every session analysed and its spans handed to the exporter
            with httpx.Client(timeout=30) as client:
                # A sampled request after the analyses: the pipeline still takes new work.
                assert sse_post(client, url, tokens=4, headers=SAMPLE)[0] == 200
                wait_sessions(mw, len(mw.runtime.history) + 1)
                wait_idle()
                deadline = time.monotonic() + 30
                while (status := client.get(url + "/servprof/status", headers=AUTH).json())[
                        "telemetry"]["spans_export_failed"] == 0:
                    assert time.monotonic() < deadline, status["telemetry"]
                    time.sleep(0.1)
            sessions = list(mw.runtime.history)
        assert codes == [200] * 24
        assert sessions and all(s["error"] is None and Path(s["trace_file"]).is_file() for s in sessions), sessions
        tele = status["telemetry"]
        assert tele["analyses"] == len(sessions) >= 2 and tele["analysis_errors"] == 0, tele
        assert tele["spans_exported"] == 0 and tele["spans_dropped"] >= tele["spans_export_failed"] > 0, tele
        assert status["observers"]["dropped_spans"] == tele["spans_dropped"]
        assert status["counters"]["sessions_failed"] == 0 and status["counters"]["observer_errors"] == 0
        assert not autograd_profiler._is_profiler_enabled
    finally:
        telemetry.shutdown()


def test_failed_export_leaves_no_partial_files(tmp_path: Path) -> None:
    """The disk-full leftover found with the tmpfs above, checked where no tmpfs can be mounted:
    a stand-in for torch's exporter that does what it did on the full disk (wrote `<raw>.tmp`,
    then failed with ENOSPC)."""

    class ExporterOnAFullDisk:
        def export_chrome_trace(self, path: str) -> None:
            Path(path + ".tmp").write_bytes(b'{"traceEvents": [')
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    store = TraceStore(tmp_path, max_files=5, max_mb=10)
    store.traces_dir.mkdir(parents=True)
    with pytest.raises(StoreError, match="No space left on device"):
        store.export(ExporterOnAFullDisk(), "20260101T000000-abcdef12")
    assert list(store.traces_dir.iterdir()) == []
