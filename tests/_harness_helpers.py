"""Helpers for the harness tests: a tiny but real OpenAI-compatible streaming server
(Starlette on uvicorn, loopback, ephemeral port) whose chunk timing the test sets,
and which records server-side when each request arrived and each chunk was sent.
It stands in for an LLM server only in what it generates (fixed words, no model):
the harness is measured against it, so its timing must be known, not realistic.

Also: run locust as its own process (gevent and this pytest process do not mix).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

REPO_ROOT = Path(__file__).resolve().parents[1]
LOCUSTFILE = REPO_ROOT / "bench" / "locustfile.py"
REQUEST_ID_HEADER = "x-request-id"


@dataclass
class ServedRequest:
    request_id: str | None
    received_unix: float
    chunk_unix: list[float] = field(default_factory=list)
    completed: bool = False
    max_tokens: int = 0
    body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class TimedServer:
    """Knobs (seconds) the test may change while the server runs."""

    ttft_s: float = 0.03
    itl_s: float = 0.01
    max_chunks: int = 8  # cap on tokens per request, whatever max_tokens asks
    requests: list[ServedRequest] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    url: str = ""
    api_key: str | None = None  # when set, /v1 answers 401 without "Authorization: Bearer <key>" (vllm serve --api-key)
    refused: int = 0

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/v1/completions", self.generate, methods=["POST"]),
                Route("/v1/chat/completions", self.generate, methods=["POST"]),
                Route("/generate", self.custom, methods=["POST"]),  # an API of its own (TGI's shape)
                Route("/generate_text", self.custom, methods=["POST"]),  # plain text as it is made
                Route("/api/generate", self.custom, methods=["POST"]),  # JSON lines (Ollama's shape)
                Route("/health", lambda request: Response("ok")),
            ]
        )

    def _unauthorized(self, request: Request) -> Response | None:
        if self.api_key is None or request.headers.get("authorization") == f"Bearer {self.api_key}":
            return None
        self.refused += 1
        return JSONResponse({"error": "Unauthorized"}, status_code=401)

    async def models(self, request: Request) -> Response:
        if (refused := self._unauthorized(request)) is not None:
            return refused
        return JSONResponse({"object": "list", "data": [{"id": "timed-test-model", "object": "model"}]})

    async def generate(self, request: Request) -> Response:
        if (refused := self._unauthorized(request)) is not None:
            return refused
        record = ServedRequest(request.headers.get(REQUEST_ID_HEADER), time.time(), headers=dict(request.headers))
        body = orjson.loads(await request.body())
        record.max_tokens = int(body.get("max_tokens", 16))
        record.body = body
        tokens = max(1, min(record.max_tokens, self.max_chunks))
        chat = request.url.path.endswith("chat/completions")
        self.requests.append(record)

        def chunk(index: int) -> bytes:
            choice = {"index": 0, "delta": {"content": f" w{index}"}} if chat else {"index": 0, "text": f" w{index}"}
            return b"data: " + orjson.dumps({"id": "x", "choices": [choice]}) + b"\n\n"

        if not body.get("stream"):
            await asyncio.sleep(self.ttft_s + self.itl_s * (tokens - 1))
            record.completed = True
            message = {"text": " w" * tokens} if not chat else {"message": {"content": " w" * tokens}}
            usage = {"prompt_tokens": 3, "completion_tokens": tokens}
            return JSONResponse({"id": "x", "choices": [{"index": 0, **message}], "usage": usage})

        async def stream() -> Any:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(self.ttft_s)
                for index in range(tokens):
                    if index:
                        await asyncio.sleep(self.itl_s)
                    record.chunk_unix.append(time.time())
                    yield chunk(index)
                if (body.get("stream_options") or {}).get("include_usage"):
                    usage = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": tokens + 3}
                    yield b"data: " + orjson.dumps({"id": "x", "choices": [], "usage": usage}) + b"\n\n"
                yield b"data: [DONE]\n\n"
                record.completed = True
            finally:
                self.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")


    async def custom(self, request: Request) -> Response:
        """TGI's shape: {"inputs", "parameters": {"max_new_tokens"}, "stream"} -> one JSON answer, or
        SSE events {"token": {"text"}, "details"} (the last with the count); /generate_text streams
        the bare text, piece by piece, with no newline; /api/generate JSON lines as Ollama's API
        streams them ({"response", "done": false} per token, then {"response": "", "done": true,
        "eval_count"})."""
        record = ServedRequest(request.headers.get(REQUEST_ID_HEADER), time.time())
        body = orjson.loads(await request.body())
        record.body, record.max_tokens = body, int(body["parameters"]["max_new_tokens"])
        tokens = max(1, min(record.max_tokens, self.max_chunks))
        self.requests.append(record)
        text, lines = request.url.path == "/generate_text", request.url.path == "/api/generate"
        if not body.get("stream") and not text and not lines:
            await asyncio.sleep(self.ttft_s + self.itl_s * (tokens - 1))
            record.completed = True
            return JSONResponse({"generated_text": " w" * tokens, "details": {"generated_tokens": tokens}})

        def piece(index: int) -> bytes:
            if text:
                return f" w{index}".encode()
            if lines:
                return orjson.dumps({"model": "m", "response": f" w{index}", "done": False}) + b"\n"
            details = {"generated_tokens": tokens} if index == tokens - 1 else None
            return b"data: " + orjson.dumps({"token": {"text": f" w{index}"}, "details": details}) + b"\n\n"

        async def stream() -> Any:
            await asyncio.sleep(self.ttft_s)
            for index in range(tokens):
                if index:
                    await asyncio.sleep(self.itl_s)
                record.chunk_unix.append(time.time())
                yield piece(index)
            if lines:
                yield orjson.dumps({"model": "m", "response": "", "done": True, "eval_count": tokens}) + b"\n"
            record.completed = True

        media = "text/plain" if text else "application/x-ndjson" if lines else "text/event-stream"
        return StreamingResponse(stream(), media_type=media)


@contextmanager
def running_server(server: TimedServer) -> Iterator[TimedServer]:
    """Serve on 127.0.0.1 on a free port in a thread; stopped on exit."""
    config = uvicorn.Config(server.app(), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    port = uv.servers[0].sockets[0].getsockname()[1]
    server.url = f"http://127.0.0.1:{port}"
    try:
        yield server
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def locust_command(host: str, *args: str, locustfile: Path = LOCUSTFILE) -> list[str]:
    return [sys.executable, "-m", "locust", "-f", str(locustfile), "-H", host, *args]


def run_locust(
    host: str, *args: str, timeout: float = 120, cwd: Path | None = None, locustfile: Path = LOCUSTFILE,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}, "PYTHONUNBUFFERED": "1", **(env or {})}
    command = locust_command(host, *args, locustfile=locustfile)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO_ROOT, env=env)


def read_summary(path: Path) -> dict[str, Any]:
    return orjson.loads(path.read_bytes())
