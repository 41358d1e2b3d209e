"""Helpers for tests that run a server as its own process (as a user does) and stop it with a
real signal: the environment, start-up until it answers, SIGTERM and the exit."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

TOKEN = "shutdown-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
COMPLETIONS = 3


def server_env(out: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SERVPROF_"))}
    env.update({"SERVPROF_OUT_DIR": str(out), "SERVPROF_CONTROL_TOKEN": TOKEN,
                "SERVPROF_ON_DEMAND_MIN_INTERVAL_S": "0", "SERVPROF_MAX_SESSION_S": "60",
                "SERVPROF_MAX_SESSION_EVENTS": "1000000000", "SERVPROF_MAX_SESSION_STEPS": "100000", **extra})
    return env


@contextmanager
def server_process(command: list[str], env: dict[str, str], port: int, log: Path, group: bool = False
                   ) -> Iterator[subprocess.Popen]:
    """The server, answering /health. ``group``: in a process group of its own, all of it killed at
    the end (a pre-fork master's workers outlive a kill of the master alone)."""
    with log.open("wb") as sink:
        process = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=group)
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise AssertionError(f"server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code < 500:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"server did not answer:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield process
    finally:
        if group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        if process.poll() is None:
            process.kill()
        process.wait()


def terminate(process: subprocess.Popen, log: Path) -> float:
    """SIGTERM; the seconds until the process was gone."""
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"no exit within 60 s of SIGTERM:\n{log.read_text()[-3000:]}") from None
    # uvicorn re-raises the signal after its graceful shutdown: the process dies by it.
    assert process.returncode == -signal.SIGTERM, (process.returncode, log.read_text()[-3000:])
    return time.monotonic() - sent


def demo_server_command(port: int) -> list[str]:
    return [sys.executable, "-m", "servprof.cli", "demo-server", "--port", str(port), "--log-level", "warning"]


def order_when_ready(base: str, n: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """POST /servprof/sample?n=N once the server's profiler is warm (sampling is paused until then);
    the 202's body."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(base + "/servprof/status", headers=AUTH).json()["paused"] is not None:
        assert time.monotonic() < deadline, "the profiler never warmed up"
        time.sleep(0.2)
    response = httpx.post(f"{base}/servprof/sample?n={n}", headers=AUTH)
    assert response.status_code == 202, response.text
    return response.json()  # type: ignore[no-any-return]
