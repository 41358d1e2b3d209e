"""Helpers for the telemetry tests: a small real LLM-style app, a loopback uvicorn server,
a pure-ASGI wrapper that calls an observer the way ServprofMiddleware does, a minimal
OTLP/HTTP receiver, and readers for spans."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import orjson
import torch
import uvicorn
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

import servprof
from servprof.observers import RequestObserver, RequestRecord
from servprof.request_context import accept_request_id, request_id_var, request_record_var

# --- a small real model served OpenAI-style --------------------------------------------------


class TinyLM(torch.nn.Module):
    """A byte-level model: small, but real tensors through real torch ops per step."""

    def __init__(self, vocab: int = 256, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, width)
        self.mix = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab)

    @torch.no_grad()
    def next_token(self, ids: torch.Tensor) -> int:
        hidden = torch.tanh(self.mix(self.embed(ids).mean(dim=0)))
        return int(self.head(hidden).argmax())


def _generate(model: TinyLM, prompt: str, max_tokens: int) -> Iterator[str]:
    """Tokenize, prefill, decode steps, detokenize, each marked as a servprof phase."""
    rid = servprof.current_request_id()
    ids_for = [rid] if rid else None
    with servprof.phase("tokenize", request_ids=ids_for):
        ids = torch.tensor(list(prompt.encode()[:512]) or [0], dtype=torch.long)
    with servprof.phase("prefill", request_ids=ids_for):
        token = model.next_token(ids)
    for _ in range(max_tokens):
        with servprof.phase("decode_step", request_ids=ids_for):
            ids = torch.cat([ids, torch.tensor([token])])
            token = model.next_token(ids)
        with servprof.phase("detokenize", request_ids=ids_for):
            text = chr(32 + token % 90)
        yield text


def make_app() -> Starlette:
    model = TinyLM()

    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        prompt = " ".join(str(m.get("content", "")) for m in body.get("messages", []))
        max_tokens = int(body.get("max_tokens", 8))
        servprof.annotate_request(**{"gen_ai.usage.input_tokens": len(prompt.encode())})
        if body.get("stream"):

            async def events() -> Any:
                for count, piece in enumerate(_generate(model, prompt, max_tokens), start=1):
                    servprof.annotate_request(**{"gen_ai.usage.output_tokens": count})
                    yield b"data: " + orjson.dumps({"choices": [{"delta": {"content": piece}}]}) + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        text = "".join(_generate(model, prompt, max_tokens))
        servprof.annotate_request(**{"gen_ai.usage.output_tokens": max_tokens})
        return JSONResponse({"choices": [{"message": {"role": "assistant", "content": text}}]})

    async def hello(request: Request) -> Response:
        return PlainTextResponse("hello")

    async def headers(request: Request) -> Response:
        return JSONResponse({"traceparent": request.headers.get("traceparent")})

    async def fail(request: Request) -> Response:
        raise RuntimeError("the app failed on purpose")

    async def unavailable(request: Request) -> Response:
        return PlainTextResponse("busy", status_code=503)

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/hello", hello),
            Route("/items/{item_id}", hello),
            Route("/headers", headers),
            Route("/fail", fail),
            Route("/unavailable", unavailable),
        ]
    )


# --- the middleware's side of the observer contract -------------------------------------------


def _wait_records(holder: Any, count: int, timeout_s: float) -> list[RequestRecord]:
    """The server finishes a request just after the client has read it: wait for that."""
    deadline = time.monotonic() + timeout_s
    while len(holder.records) < count and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(holder.records) >= count, f"{len(holder.records)} of {count} requests finished"
    return holder.records


class KeepingObserver:
    """Passes every call on to `inner` and keeps the finished records for the test."""

    def __init__(self, inner: RequestObserver) -> None:
        self.inner = inner
        self.records: list[RequestRecord] = []
        self.requests_seen = 0

    def on_request_start(self, record: RequestRecord, scope: dict[str, Any]) -> Any:
        self.requests_seen += 1
        return self.inner.on_request_start(record, scope)

    def on_request_end(self, record: RequestRecord, state: Any) -> None:
        self.inner.on_request_end(record, state)
        self.records.append(record)

    def on_analysis(self, result: dict[str, Any], records: list[RequestRecord]) -> None:
        self.inner.on_analysis(result, records)

    def wait_records(self, count: int, timeout_s: float = 10.0) -> list[RequestRecord]:
        return _wait_records(self, count, timeout_s)

    @property
    def dropped_spans(self) -> int | None:
        return getattr(self.inner, "dropped_spans", None)


def behind_middleware(app: Any, observer: RequestObserver, out_dir: Path) -> tuple[Any, KeepingObserver]:
    """The real ServprofMiddleware (no sampling) in front of `app`, calling `observer` as it
    calls telemetry's; the observer is added the way the middleware's own tests add one."""
    from servprof.middleware import ServprofMiddleware
    from servprof.settings import Settings

    middleware = ServprofMiddleware(app, Settings(out_dir=out_dir, telemetry=False, warmup=False))
    keeper = KeepingObserver(observer)
    middleware.runtime.observers.append(keeper)
    return middleware, keeper


class ObserverProbe:
    """A thin stand-in for ServprofMiddleware, for tests that need a request marked sampled
    without a profiler session (the real middleware marks a request sampled only once a real
    session started, and then runs its own analysis): fills a RequestRecord and calls the
    observer at the same points and in the same way. The `x-sample` header marks a request
    sampled; `records` keeps every finished record for the test."""

    def __init__(
        self,
        app: Any,
        observer: RequestObserver,
        sample_header: bytes = b"x-sample",
        body_head_bytes: int = 4096,
    ) -> None:
        self.app = app
        self.observer = observer
        self.sample_header = sample_header
        self.body_head_bytes = body_head_bytes
        self.records: list[RequestRecord] = []
        self.requests_seen = 0

    def wait_records(self, count: int, timeout_s: float = 10.0) -> list[RequestRecord]:
        return _wait_records(self, count, timeout_s)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.requests_seen += 1
        headers = dict(scope.get("headers") or [])
        client = scope.get("client")
        record = RequestRecord(
            request_id=accept_request_id(headers.get(b"x-request-id", b"").decode("latin-1") or None),
            method=scope["method"],
            path=scope["path"],
            scheme=scope.get("scheme", "http"),
            client_address=client[0] if client else None,
            user_agent=headers.get(b"user-agent", b"").decode("latin-1") or None,
            arrival_ns=time.time_ns(),
            arrival_perf_ns=time.perf_counter_ns(),
            sampled=self.sample_header in headers,
        )
        if record.sampled:
            record.session_id = "probe-session"
        state = self.observer.on_request_start(record, scope)
        head = bytearray()

        async def receive_wrapper() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.request" and len(head) < self.body_head_bytes:
                head.extend(message.get("body", b"")[: self.body_head_bytes - len(head)])
            elif message["type"] == "http.disconnect":
                record.disconnected = True
            return message

        async def send_wrapper(message: dict[str, Any]) -> None:
            now = time.perf_counter_ns()
            if message["type"] == "http.response.start":
                record.status = message["status"]
                record.response_start_ns = now
            elif message["type"] == "http.response.body" and message.get("body"):
                record.chunks += 1
                record.bytes_sent += len(message["body"])
                record.first_byte_ns = record.first_byte_ns or now
                record.last_byte_ns = now
            await send(message)

        id_token, record_token = request_id_var.set(record.request_id), request_record_var.set(record)
        try:
            await self.app(scope, receive_wrapper, send_wrapper)
        except Exception as exc:
            record.error_type = type(exc).__qualname__
            record.status = record.status or 500
            raise
        finally:
            request_id_var.reset(id_token)
            request_record_var.reset(record_token)
            record.end_ns = time.perf_counter_ns()
            route = scope.get("route")
            record.route = getattr(route, "path", None)
            record.request_body_head = bytes(head)
            self.records.append(record)
            self.observer.on_request_end(record, state)


# --- loopback servers --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve(app: Any) -> Iterator[str]:
    """Run app under uvicorn on an ephemeral loopback port; yields its base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


class OtlpHttpReceiver:
    """A minimal real OTLP/HTTP receiver (protobuf bodies on /v1/traces and /v1/metrics) that can be
    stopped and started again on the same port, to play a backend that restarts."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.spans: list[Any] = []
        self.metrics: list[Any] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"{self.base_url}/v1/traces"

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path == "/v1/metrics":
                    metrics = ExportMetricsServiceRequest.FromString(body)
                    for resource_metrics in metrics.resource_metrics:
                        for scope_metrics in resource_metrics.scope_metrics:
                            receiver.metrics.extend(scope_metrics.metrics)
                else:
                    message = ExportTraceServiceRequest.FromString(body)
                    for resource_spans in message.resource_spans:
                        for scope_spans in resource_spans.scope_spans:
                            receiver.spans.extend(scope_spans.spans)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def chat_body(prompt: str = "Say hello", max_tokens: int = 6, stream: bool = True, **extra: Any) -> bytes:
    return orjson.dumps(
        {
            "model": "tiny-lm",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0.5,
            "stream": stream,
            **extra,
        }
    )


def span_attributes(span: Any) -> dict[str, Any]:
    return dict(span.attributes or {})
