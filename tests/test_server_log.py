"""What a user of `servprof demo-server` reads in its log: no alarming line from torch's profiler
library (Kineto), across the warm-up and a real sampled session."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest
from _process_helpers import (
    AUTH,
    demo_server_command,
    order_when_ready,
    server_env,
    server_process,
    terminate,
)
from _telemetry_helpers import free_port


def _one_sampled_session(command: list[str], out: Path, log: Path, port: int, **env: str) -> bool:
    """Serve, sample one completion, wait for its session, stop the server; whether the profiler was
    warm when the server first answered. The log is in ``log``."""
    with server_process(command, server_env(out, **env), port, log) as process:
        base = f"http://127.0.0.1:{port}"
        warm_at_first_answer = httpx.get(base + "/servprof/status", headers=AUTH).json()["profiler"]["warm"]
        order_when_ready(base, 1)
        deadline = time.monotonic() + 120
        response = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        assert response.status_code == 200
        while not httpx.get(base + "/servprof/status", headers=AUTH).json()["last_sessions"]:
            assert time.monotonic() < deadline, "no session finished"
            time.sleep(0.2)
        terminate(process, log)
    assert list((out / "traces").glob("*.pt.trace.json.gz")), "the profiler never ran"
    return bool(warm_at_first_answer)


@pytest.mark.slow
def test_demo_server_log_has_no_kineto_error_or_usdt_lines(tmp_path: Path) -> None:
    out, port, log = tmp_path / "out", free_port(), tmp_path / "server.log"
    _one_sampled_session(demo_server_command(port), out, log, port)
    text = log.read_text()
    assert "External init callback" not in text, text
    assert "USDT" not in text and "profiler_start" not in text, text


@pytest.mark.parametrize("lifespan", ["auto", "off"])
def test_a_users_server_warms_up_on_the_main_thread_at_startup(tmp_path: Path, lifespan: str) -> None:
    """A server written without servprof, the one-line middleware added, run by uvicorn: Kineto's
    one-time init runs on the thread that imported torch, at lifespan startup (before the server
    serves), so its "External init callback" ERROR is not in the log and the first requests can be
    sampled (before: warmed on the capture thread, the ERROR in every server's log). With lifespan
    off there is no such moment: the capture thread warms up at the first request, as before."""
    out, port, log = tmp_path / "out", free_port(), tmp_path / "server.log"
    command = [sys.executable, str(Path(__file__).parent / "servers" / "run_with_servprof.py"),
               "servers.handwritten_loop", str(port), lifespan]
    warm_at_first_answer = _one_sampled_session(command, out, log, port, SERVPROF_SAMPLE_EVERY="0")
    assert warm_at_first_answer is (lifespan == "auto")
    assert ("External init callback" in log.read_text()) is (lifespan == "off"), log.read_text()
