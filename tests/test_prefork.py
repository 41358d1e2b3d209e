"""A pre-fork server: gunicorn ``--preload`` imports the app, servprof's middleware built around
it, in its master, and forks the workers from there. The capture thread (and any lock another
thread held) does not survive a fork: before servprof forgot its parent's state in the child, each
sampled request waited START_WAIT_S (5 s) for a session that never started, and was then served
unsampled. Now the worker starts its own capture thread with its first sampled request.

Real parts: gunicorn with uvicorn's worker class, in a process group of its own (killed whole at
the end: its workers would outlive their master), on loopback; the real profiler and analysis
child in the forked worker.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx
import pytest
from _harness_helpers import free_port
from _process_helpers import AUTH, order_when_ready, server_env, server_process

pytest.importorskip("gunicorn")
TESTS = Path(__file__).parent
SAMPLED = 2


def test_a_forked_worker_samples_without_making_requests_wait(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "gunicorn", "--preload", "--workers", "1", "--bind", f"127.0.0.1:{port}",
               "--worker-class", "uvicorn.workers.UvicornWorker", "--chdir", str(TESTS), "servers.prefork:app"]
    env = server_env(tmp_path / "out", PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    with server_process(command, env, port, tmp_path / "server.log", group=True) as master:
        status = httpx.get(base + "/servprof/status", headers=AUTH).json()
        worker = status["process"]
        assert worker["parent_pid"] == master.pid and worker["pid"] != master.pid  # a fork of the master
        order = order_when_ready(base, SAMPLED)  # (a warm-up the fork cut short is done again in the worker)
        assert order["pid"] == worker["pid"]
        for _ in range(2 * SAMPLED):
            assert httpx.post(base + "/v1/generate", json={"max_tokens": 8}, timeout=60).status_code == 200
        deadline = time.monotonic() + 60
        while True:
            status = httpx.get(base + "/servprof/status", headers=AUTH).json()
            if status["counters"]["sessions_done"] + status["counters"]["sessions_failed"] >= 1 \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        master.terminate()  # gunicorn stops its workers on SIGTERM (the group is killed after, whatever happens)
        master.wait(60)
    assert status["skipped_by_reason"] == {}, status["skipped_by_reason"]  # no request waited out its start
    assert status["counters"]["sampled"] == SAMPLED and status["counters"]["sessions_done"] == 1, status["counters"]
    (session,) = status["last_sessions"]
    assert session["state"] == "done" and Path(session["trace_file"]).is_file()
    assert status["last_analysis"]["error"] is None
    assert status["last_analysis"]["summary"]["model_steps"] == SAMPLED * 8  # each request's 8 forwards
