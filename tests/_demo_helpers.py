"""Helpers for tests that need the real demo LLM server (servprof.demo) on loopback.

    from _demo_helpers import start_demo_server
    with start_demo_server(size="tiny", step_delay_ms=5) as base_url:
        httpx.post(f"{base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 4})

The server is the real app (model, tokenizer, engine thread) under a real uvicorn,
run in a thread of the test process on an ephemeral port. Keyword arguments are
DemoConfig fields (knobs included); servprof defaults to False so a test of the
demo does not depend on the middleware; pass servprof=True to put it in front.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import orjson
import uvicorn

from servprof.demo.app import create_app
from servprof.demo.config import DemoConfig


@contextmanager
def start_demo_server(**config: Any) -> Iterator[str]:
    """Serve the demo app on 127.0.0.1:<free port>; yields the base URL, stops on exit."""
    config.setdefault("servprof", False)
    with serve_app(create_app(DemoConfig(**config))) as url:
        yield url


# Sessions in these tests end with their requests, not at a budget a rate learned from
# earlier tests' sessions (the controller is process-wide) would make them hit first.
SESSION_BOUNDED_BY_REQUESTS = {"MAX_SESSION_EVENTS": "1000000", "MAX_SESSION_STEPS": "1000"}


@contextmanager
def start_sampled_demo_server(monkeypatch: Any, settings: dict[str, str], **config: Any) -> Iterator[str]:
    """The demo server behind ServprofMiddleware configured as a deployment would be, from
    SERVPROF_<NAME>=value for each of `settings` (on top of SESSION_BOUNDED_BY_REQUESTS);
    yields its URL once the process-wide profiler is warm, as requests arriving during the
    warm-up are never sampled."""
    from _middleware_helpers import wait_warm

    for name, value in {**SESSION_BOUNDED_BY_REQUESTS, **settings}.items():
        monkeypatch.setenv("SERVPROF_" + name, value)
    with start_demo_server(servprof=True, **config) as url:
        wait_warm()
        yield url


@contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """Serve any ASGI app (e.g. one from create_app) on a free loopback port; yields its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="demo-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the demo server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def get_stats(base_url: str, steps: int | None = None) -> dict[str, Any]:
    params = {"steps": steps} if steps is not None else None
    response = httpx.get(f"{base_url}/demo/stats", params=params, timeout=30)
    response.raise_for_status()
    return response.json()


def parse_sse(body: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded; the final `[DONE]` stays a string."""
    events: list[Any] = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), f"not an SSE data event: {block!r}"
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


def wait_for(predicate: Any, timeout: float = 20.0, interval: float = 0.02) -> Any:
    """Poll `predicate()` until it returns something truthy (returned) or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)
