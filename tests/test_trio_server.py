"""A FastAPI server on trio's event loop (Hypercorn's trio worker), with the one-line middleware.

servprof's loop watchdog watches asyncio loops; it used to call asyncio.get_running_loop() on each
sampled request's arrival, which raises on trio, and every sampled request answered 500. Now the
requests are served, the session marks the model's steps, and the session says that loop stalls
were not watched and why. Real parts: Hypercorn on loopback, trio, the transformers pipeline
server of tests/servers/thread_pool.py (plain ``def`` endpoint: runs on any anyio backend)."""

from __future__ import annotations

import contextlib
import importlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _middleware_helpers import wait_idle, wait_sessions, wait_warm
from _server_session import servprof_middleware

from servprof.middleware import ServprofMiddleware

trio = pytest.importorskip("trio")
hypercorn_trio = pytest.importorskip("hypercorn.trio")
from hypercorn.config import Config  # noqa: E402 - after the skip

REQUESTS = 2
MAX_TOKENS = 6


@contextlib.contextmanager
def serve_on_trio(app: Any) -> Iterator[str]:
    """Run ``app`` under Hypercorn on trio in a thread, on a free loopback port; yields its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.loglevel = "WARNING"
    state: dict[str, Any] = {}

    async def main() -> None:
        state["token"] = trio.lowlevel.current_trio_token()
        state["stop"] = trio.Event()
        await hypercorn_trio.serve(app, config, shutdown_trigger=state["stop"].wait)

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url + "/docs", timeout=2)
            break
        except httpx.TransportError:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("hypercorn did not start") from None
            time.sleep(0.05)
    try:
        yield url
    finally:
        trio.from_thread.run_sync(state["stop"].set, trio_token=state["token"])
        thread.join(30)


def test_a_server_on_trio_is_served_and_told_its_loop_is_not_watched(tmp_path: Path) -> None:
    server = importlib.import_module("servers.thread_pool")
    app = server.create_app()
    app.add_middleware(ServprofMiddleware, out_dir=tmp_path, telemetry=False, sample_every=1,
                       requests_per_session=REQUESTS, max_session_events=10**9)
    wait_idle()
    statuses: list[int] = []

    def post(url: str) -> None:
        response = httpx.post(url + "/v1/generate", json={"prompt": "The harbour master", "max_tokens": MAX_TOKENS},
                              timeout=120)
        statuses.append(response.status_code)

    with serve_on_trio(app) as url:
        middleware = servprof_middleware(app)
        wait_warm()
        clients = [threading.Thread(target=post, args=(url,)) for _ in range(REQUESTS)]
        for client in clients:
            client.start()
        for client in clients:
            client.join(120)
        (session,) = wait_sessions(middleware, 1, timeout_s=120)
        wait_idle()
        status_error = middleware.runtime.last_error
    assert statuses == [200] * REQUESTS
    assert status_error is None
    assert session["state"] == "done" and len(session["requests"]) == REQUESTS
    (loop,) = [m for m in session["missing"] if m["what"] == "event-loop stalls"]
    assert "not asyncio's (its library: trio)" in loop["message"]
    assert session["auto"]["prefill"] == REQUESTS and session["auto"]["decode"] >= REQUESTS * (MAX_TOKENS - 1)
