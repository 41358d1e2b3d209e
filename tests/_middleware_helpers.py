"""Helpers for the middleware/capture/control tests: a real uvicorn server on a loopback
port, and a small real LLM-shaped app (a tiny torch model stepped by an engine thread,
batched decode steps marked with servprof phases, SSE streaming)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from servprof.capture import get_controller
from servprof.middleware import ServprofMiddleware
from servprof.phases import phase
from servprof.request_context import current_request_id, request_record_var

TOKEN = "test-token-123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class TinyEngine:
    """A background thread that steps every active request through a tiny torch model at once."""

    def __init__(self, width: int = 64, step_sleep_s: float = 0.002):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width))
        self.width = width
        self.step_sleep_s = step_sleep_s
        self.incoming: queue.Queue[tuple[str, int, Any, asyncio.AbstractEventLoop]] = queue.Queue()
        self.steps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiny-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        active: list[list[Any]] = []  # [request_id, tokens_left, asyncio.Queue, loop]
        while not self._stop.is_set():
            try:
                while True:
                    rid, n, out, loop = self.incoming.get(block=not active, timeout=0.05)
                    active.append([rid, n, out, loop])
            except queue.Empty:
                pass
            if not active:
                continue
            ids = [a[0] for a in active]
            with phase("decode_step", request_ids=ids), torch.no_grad():
                self.model(torch.randn(len(active), self.width))
            self.steps += 1
            for entry in active:
                entry[1] -= 1
                try:
                    entry[3].call_soon_threadsafe(entry[2].put_nowait, entry[1] <= 0)
                except RuntimeError:  # its loop is closed (the server stopped): nobody waits for the tokens
                    entry[1] = 0
            active = [a for a in active if a[1] > 0]
            time.sleep(self.step_sleep_s)


def make_app(engine: TinyEngine, seen: dict[str, Any] | None = None) -> Starlette:
    seen = {} if seen is None else seen

    async def hello(request: Request) -> JSONResponse:
        seen["request_id"] = current_request_id()
        seen["record"] = request_record_var.get()
        return JSONResponse({"hello": "world"})

    async def item(request: Request) -> PlainTextResponse:
        return PlainTextResponse(f"item {request.path_params['item_id']}")

    async def generate(request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        tokens = int(body.get("max_tokens", 8))
        with phase("tokenize"):
            prompt = torch.tensor([ord(c) for c in str(body.get("prompt", "hi"))], dtype=torch.float32)
            prompt.sum()
        out: asyncio.Queue[bool] = asyncio.Queue()
        rid = current_request_id() or "none"
        engine.incoming.put((rid, tokens, out, asyncio.get_running_loop()))
        if not body.get("stream", True):
            while not await out.get():
                pass
            return JSONResponse({"tokens": tokens})

        async def events() -> Any:
            index = 0
            while True:
                done = await out.get()
                with phase("detokenize"):
                    chunk = f"data: {{\"index\": {index}}}\n\n"
                index += 1
                yield chunk
                if done:
                    break
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/hello", hello), Route("/items/{item_id}", item),
                             Route("/v1/generate", generate, methods=["POST"])])


@contextlib.contextmanager
def serve(app: Any, root_path: str = "") -> Iterator[tuple[str, uvicorn.Server]]:
    """Run ``app`` under uvicorn on an ephemeral loopback port in a thread; yields (base_url, server).
    ``root_path``: uvicorn's --root-path, as behind a proxy that strips that prefix."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # SERVPROF_TEST_LOOP: uvicorn's --loop (auto: uvloop where installed, as here; asyncio: the standard loop).
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5,
                            loop=os.environ.get("SERVPROF_TEST_LOOP", "auto"), root_path=root_path)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextlib.contextmanager
def tiny_server(tmp_path: Any, seen: dict[str, Any] | None = None, root_path: str = "",
                **settings: Any) -> Iterator[tuple[str, ServprofMiddleware, TinyEngine]]:
    """The tiny app behind ServprofMiddleware (telemetry off), served on loopback."""
    settings.setdefault("out_dir", tmp_path / "out")
    settings.setdefault("telemetry", False)
    # Sessions here are bounded by requests or steps unless a test sets an event budget itself.
    settings.setdefault("max_session_events", 10**9)
    engine = TinyEngine()
    engine.start()
    middleware = ServprofMiddleware(make_app(engine, seen), **settings)
    wait_warm()
    try:
        with serve(middleware, root_path) as (url, _server):
            yield url, middleware, engine
    finally:
        engine.stop()


def wait_warm(timeout_s: float = 30.0) -> None:
    controller = get_controller()
    deadline = time.monotonic() + timeout_s
    while controller.warmup_wanted and not controller.warm:
        if time.monotonic() > deadline:
            raise RuntimeError("profiler warm-up did not finish")
        time.sleep(0.02)


def wait_idle(timeout_s: float = 60.0) -> None:
    """Until the process-wide controller has no session (its analysis included)."""
    controller = get_controller()
    deadline = time.monotonic() + timeout_s
    while controller.session is not None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"session still {controller.session.state}")
        time.sleep(0.02)


def wait_sessions(middleware: ServprofMiddleware, count: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Until the middleware has ``count`` finished sessions; returns their descriptions."""
    runtime = middleware.runtime
    deadline = time.monotonic() + timeout_s
    while len(runtime.history) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(runtime.history)} sessions finished, wanted {count}")
        time.sleep(0.02)
    return list(runtime.history)


def sse_post(client: Any, url: str, tokens: int = 8, headers: dict[str, str] | None = None) -> tuple[int, list[str], Any]:
    with client.stream("POST", url + "/v1/generate", json={"prompt": "hello", "max_tokens": tokens},
                       headers=headers or {}) as response:
        lines = [line for line in response.iter_lines() if line]
        return response.status_code, lines, response.headers


def concurrent_sse(client: Any, url: str, tokens: int, headers: list[dict[str, str]]) -> None:
    """One SSE request per headers dict, all at once (each on its own thread); waits for them all."""
    threads = [threading.Thread(target=sse_post, args=(client, url, tokens, h)) for h in headers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
