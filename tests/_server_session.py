"""One servprof session on one of tests/servers, in this process: the app with the one-line
middleware (every request sampled), some POSTs at once or one after another, and what came back."""

from __future__ import annotations

import importlib
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from _middleware_helpers import serve, wait_idle, wait_sessions, wait_warm

from servprof.middleware import ServprofMiddleware

PROMPT = "The harbour master counted the boats"


def servprof_middleware(app: Any) -> ServprofMiddleware:
    """The ServprofMiddleware instance inside a started Starlette/FastAPI app's stack."""
    node = app.middleware_stack
    while node is not None and not isinstance(node, ServprofMiddleware):
        node = getattr(node, "app", None)
    assert node is not None, "ServprofMiddleware not in the app's middleware stack"
    return node


def session_on(module: str, out_dir: Path, paths: list[str], max_tokens: int, spaced_s: float | None = None,
               body: dict[str, Any] | list[dict[str, Any]] | None = None, start_at_s: list[float] | None = None,
               **settings: Any) -> dict[str, Any]:
    """POST {"prompt", "max_tokens"} (or ``body``) to each of ``paths``, all at once (``spaced_s``
    None), each after the last answered plus ``spaced_s``, or each ``start_at_s[i]`` seconds after
    the first was sent; one session samples them all (``body``: a list gives each path its own). Returns the session, the analysis result and
    (path, status, request id) per request. ``settings``: more of the middleware's settings
    (``tier="deep"``)."""
    app = importlib.import_module(module).create_app()
    app.add_middleware(ServprofMiddleware, out_dir=out_dir, telemetry=False, sample_every=1,
                       requests_per_session=len(paths), max_session_events=10**9, **settings)
    wait_idle()
    responses: list[tuple[str, int, str | None]] = []

    bodies = body if isinstance(body, list) else [body or {"prompt": PROMPT, "max_tokens": max_tokens}] * len(paths)

    def post(url: str, path: str, sent: dict[str, Any]) -> None:
        with httpx.Client(timeout=120) as client:
            response = client.post(url + path, json=sent)
            responses.append((path, response.status_code, response.headers.get("x-request-id")))

    with serve(app) as (url, _server):
        middleware = servprof_middleware(app)
        wait_warm()  # (the first test in a process: requests during the profiler's warm-up are not sampled)
        clients, first = [], time.monotonic()
        for index, path in enumerate(paths):
            if start_at_s is not None:
                time.sleep(max(0.0, first + start_at_s[index] - time.monotonic()))
            clients.append(threading.Thread(target=post, args=(url, path, bodies[index])))
            clients[-1].start()
            if spaced_s is not None:
                clients[-1].join(120)
                time.sleep(spaced_s)
        for thread in clients:
            thread.join(300)
        (session,) = wait_sessions(middleware, 1, timeout_s=120)
        wait_idle()
        result = middleware.runtime.last_result
    return {"session": session, "result": result, "responses": responses}
