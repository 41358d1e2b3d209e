"""ServprofMiddleware: a pure ASGI middleware, in the manner of Starlette's gzip and CORS.

Per HTTP request a small responder object wraps ``receive`` and ``send``, fills a
RequestRecord (O(1) work per body chunk), asks the sampler, and for a sampled request
joins a profiler session. Unsampled requests never touch the profiler, never wait,
and never allocate more than the record and the responder.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
from collections.abc import Awaitable
from typing import Any

import anyio.to_thread
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servprof import control
from servprof.capture import SHUTDOWN_FLUSH_S, CaptureController, Session
from servprof.observers import RequestRecord
from servprof.request_context import accept_request_id, request_id_var, request_record_var
from servprof.runtime import ServprofRuntime, create_observers
from servprof.sampling import SERVPROF_RANDOM, bearer_token, route_path
from servprof.settings import Settings

_perf_ns = time.perf_counter_ns
_wall_ns = time.time_ns
_TOKEN_HEADER = b"x-servprof-token"
SHUTDOWN_WAIT_S = 30.0
logger = logging.getLogger("servprof")


class ServprofMiddleware:
    """``app.add_middleware(ServprofMiddleware)``; settings from SERVPROF_* unless given.

    ``ServprofMiddleware(app, settings=Settings(...), sample_every=10)``: keyword
    arguments override single settings.
    """

    def __init__(self, app: ASGIApp, settings: Settings | None = None, *,
                 controller: CaptureController | None = None, **overrides: Any) -> None:
        if settings is None:
            settings = Settings.from_env(**overrides)
        elif overrides:
            settings = dataclasses.replace(settings, **overrides)
            settings.validate()
        self.app = app
        self.settings = settings
        observers, problem = create_observers(settings) if settings.enabled else ([], None)
        self.runtime = ServprofRuntime(settings, observers, problem, controller)
        self._enabled = settings.enabled
        self._control_prefix = settings.control_prefix if settings.control_token else None
        self._control_prefix_slash = f"{settings.control_prefix}/"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan" and self._enabled:
                await _lifespan(self.app, self.runtime, scope, receive, send)
                return
            if scope["type"] == "websocket":  # passed through; status says so (runtime.missing)
                self.runtime.counters["websocket_connections"] += 1
            await self.app(scope, receive, send)
            return
        routed = None  # the path the app routes on (route_path), read once for both uses
        if self._control_prefix is not None:
            routed = route_path(scope)
            endpoint = self._control_endpoint(scope, routed)
            if endpoint is not None:
                # Served even when servprof is disabled, so status can say so.
                await control.handle(self.runtime, scope, receive, send, endpoint)
                return
        if not self._enabled:
            await self.app(scope, receive, send)
            return
        if self.runtime.warmup_deferred:  # served with no lifespan startup before
            self.runtime.start_deferred_warmup()
        await _RequestResponder(self, scope, receive, send).run(routed)

    def _control_endpoint(self, scope: Scope, routed: str) -> str | None:
        """The part of the path after the control prefix ("/status"; "" for the prefix alone), or None
        when the request is not for servprof. The prefix sits under the app's root path like its own
        routes; a prefix configured with the root path in it (as the path was matched before) still
        works."""
        prefix, slash = self._control_prefix, self._control_prefix_slash
        assert prefix is not None
        if routed.startswith(slash) or routed == prefix:
            return routed[len(prefix):]
        full = scope["path"]  # (the same object as routed without a root path: not tested twice)
        if full is not routed and (full.startswith(slash) or full == prefix):
            return full[len(prefix):]
        return None


async def _lifespan(app: ASGIApp, runtime: ServprofRuntime, scope: Scope, receive: Receive, send: Send) -> None:
    """The app's lifespan, with servprof's shutdown around it: a running session is stopped (trace
    kept) before the app shuts down, and spans and metrics still queued are exported (bounded in
    time) once it has. uvicorn re-raises SIGTERM after its graceful shutdown, so interpreter-exit
    hooks never run: this is the last moment servprof is sure to get."""
    app_read = False

    async def lifespan_receive() -> Message:
        nonlocal app_read
        app_read = True
        message = await receive()
        if message["type"] == "lifespan.shutdown":
            await _stop_session(runtime)
        return message

    async def lifespan_send(message: Message) -> None:
        if message["type"] == "lifespan.startup.complete":
            runtime.warm_up_at_startup()
        elif message["type"] in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
            await _flush(runtime)
        await send(message)

    try:
        await app(scope, lifespan_receive, lifespan_send)
    except Exception as exc:
        if app_read:
            raise
        logger.info("servprof: the app does not handle ASGI lifespan (%s); servprof answers it, so that it "
                    "can export its spans at shutdown", type(exc).__name__)
    if not app_read:  # an app without lifespan support: servprof answers for it
        await _answer_lifespan(runtime, receive, send)


async def _answer_lifespan(runtime: ServprofRuntime, receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            runtime.warm_up_at_startup()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await _stop_session(runtime)
            await _flush(runtime)
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _stop_session(runtime: ServprofRuntime) -> None:
    started = _perf_ns()
    await anyio.to_thread.run_sync(runtime.controller.stop_now, "lifespan shutdown", SHUTDOWN_WAIT_S)
    runtime.shutdown_report = {"session_stop_ms": (_perf_ns() - started) / 1e6}


async def _flush(runtime: ServprofRuntime) -> None:
    stopped = runtime.shutdown_report or {}
    await anyio.to_thread.run_sync(runtime.controller.flush_observers, SHUTDOWN_FLUSH_S)
    report = runtime.shutdown_report = {**stopped, **(runtime.shutdown_report or {})}
    logger.info("servprof: shutdown: session stopped in %.0f ms, spans and metrics flushed in %.0f ms",
                report.get("session_stop_ms", 0.0), report.get("flush_ms", 0.0))


def _marked_async(function: Any) -> Any:
    """Mark a plain function that returns an awaitable as a coroutine function for introspection
    (inspect.markcoroutinefunction, 3.12+; asyncio's marker before): adapters that check how the
    ASGI ``send`` they are given is defined (asgiref's WsgiToAsgi under a Flask app) would otherwise
    warn "async_to_sync was passed a non-async-marked callable" about servprof's."""
    mark = getattr(inspect, "markcoroutinefunction", None)
    if mark is not None:
        return mark(function)
    function._is_coroutine = asyncio.coroutines._is_coroutine  # type: ignore[attr-defined]
    return function


class _RequestResponder:
    __slots__ = ("middleware", "scope", "_receive", "_send", "record", "request_id_bytes", "body_head_left")

    def __init__(self, middleware: ServprofMiddleware, scope: Scope, receive: Receive, send: Send) -> None:
        self.middleware = middleware
        self.scope = scope
        self._receive = receive
        self._send = send

    async def run(self, routed: str | None = None) -> None:
        """``routed``: route_path(scope), when the caller has read it."""
        scope = self.scope
        middleware = self.middleware
        runtime = middleware.runtime
        arrival_perf = _perf_ns()
        raw_request_id = user_agent = authorization = servprof_token = None
        sample_asked = False
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                raw_request_id = value
            elif name == b"user-agent":
                user_agent = value
            elif name == b"x-servprof-sample":
                sample_asked = value.strip() == b"1"
            elif name == _TOKEN_HEADER:
                servprof_token = value
            elif name == b"authorization":
                authorization = value
        presented_token = None
        if servprof_token is not None:
            # The servprof token is for servprof only: the app never sees it.
            presented_token = servprof_token
            scope = self.scope = {**scope, "headers": [(n, v) for n, v in scope["headers"] if n != _TOKEN_HEADER]}
        elif sample_asked:  # read only then: OpenAI clients send Authorization with every request
            presented_token = bearer_token(authorization)
        request_id = accept_request_id(raw_request_id.decode("latin-1")) if raw_request_id else _new_request_id()
        self.request_id_bytes = request_id.encode()
        if raw_request_id is None:
            # The app sees the id servprof gave the request, so that a request-id middleware inside
            # (asgi-correlation-id) and the app's logs use the same id as servprof's records and spans.
            scope = self.scope = {**scope, "headers": [*scope["headers"], (b"x-request-id", self.request_id_bytes)]}
        client = scope.get("client")
        method = scope["method"]
        record = self.record = RequestRecord(
            request_id, method, scope["path"], None, scope.get("scheme", "http"),
            client[0] if client else None, user_agent.decode("latin-1") if user_agent else None,
            _wall_ns(), arrival_perf,
        )
        # Only observers (telemetry's GenAI attributes) read the body head.
        self.body_head_left = middleware.settings.body_head_bytes if method == "POST" and runtime.observers else 0
        runtime.counters["requests"] += 1

        session: Session | None = None
        reason = runtime.sampler.decide(sample_asked, presented_token, method,
                                        route_path(scope) if routed is None else routed, scope["path"])
        if reason is not None:
            session = await runtime.join_session(record, reason)

        observers = runtime.observers
        states: list[Any] | None = None
        if observers:
            states = []
            for observer in observers:
                try:
                    states.append(observer.on_request_start(record, scope))
                except Exception:  # noqa: BLE001 - observers never break serving
                    states.append(None)
                    runtime.counters["observer_errors"] += 1

        controller = runtime.controller
        controller.in_flight += 1
        if controller.first_model_request_ns is None and method == "POST":
            controller.first_model_request_ns = record.arrival_ns
        id_token = request_id_var.set(request_id)
        record_token = request_record_var.set(record)
        root_path = scope.get("root_path", "")
        try:
            await middleware.app(scope, self.receive, self.send)
        except BaseException as exc:
            record.error_type = type(exc).__qualname__
            if isinstance(exc, OSError):  # the client left mid-response
                record.disconnected = True
            raise
        finally:
            record.end_ns = _perf_ns()
            controller.in_flight -= 1
            if method == "POST":  # a model call, in OpenAI-style APIs: memory growth per request
                controller.model_requests_done += 1
            route = scope.get("route")
            if route is not None:
                record.route = _route_template(route, root_path, scope)
            if record.disconnected:
                runtime.counters["disconnects"] += 1
            if states is not None:
                for observer, state in zip(observers, states, strict=True):
                    try:
                        observer.on_request_end(record, state)
                    except Exception:  # noqa: BLE001
                        runtime.counters["observer_errors"] += 1
            if session is not None:  # after the observers: the session may end with this request
                runtime.request_finished(session, record)
            request_record_var.reset(record_token)
            request_id_var.reset(id_token)

    async def receive(self) -> Message:
        message = await self._receive()
        message_type = message["type"]
        if message_type == "http.request":
            if self.body_head_left > 0:
                body = message.get("body", b"")[: self.body_head_left]
                self.record.request_body_head += body
                self.body_head_left = self.body_head_left - len(body) if message.get("more_body") else 0
        elif message_type == "http.disconnect" and self.record.last_byte_ns is None:
            # Servers also say "disconnect" after a complete response (Starlette's streaming
            # responses listen for it): only one before the last byte is a client that left.
            self.record.disconnected = True
        return message

    @_marked_async
    def send(self, message: Message) -> Awaitable[None]:
        # A plain function handing back the server's own awaitable: no extra coroutine per
        # chunk. A failed send (uvicorn's ClientDisconnected is an OSError) surfaces in run().
        message_type = message["type"]
        if message_type == "http.response.body":
            # The per-chunk path: counters only; the clock is read for the first and the last chunk.
            record = self.record
            body = message.get("body")
            if body:
                record.chunks += 1
                record.bytes_sent += len(body)
                if record.first_byte_ns is None:
                    record.first_byte_ns = _perf_ns()
            if not message.get("more_body", False):
                record.last_byte_ns = _perf_ns()
        elif message_type == "http.response.start":
            self.record.status = message["status"]
            self.record.response_start_ns = _perf_ns()
            headers = message.get("headers", ())
            # An app (or a middleware inside) that answers with its own x-request-id keeps it alone.
            if not any(name.lower() == b"x-request-id" for name, _value in headers):
                message = dict(message)
                message["headers"] = [*headers, (b"x-request-id", self.request_id_bytes)]
        return self._send(message)


def _route_template(route: Any, root_path: str, scope: Scope) -> str | None:
    """The matched route's template from the app's root: Starlette's mounts (``app.mount("/v1", sub)``)
    put their prefix in the scope's root_path on the way in, and the route names only the rest. A
    mount's own path parameters (``/tenant/{tid}``) are named back from ``path_params``: a template,
    never the values, goes into span names."""
    template = getattr(route, "path", None)
    mounted: str = scope.get("root_path", "")
    if not isinstance(template, str) or len(mounted) <= len(root_path) or not mounted.startswith(root_path):
        return template
    prefix = mounted[len(root_path):]
    params = scope.get("path_params")
    if params:
        names = {str(value): name for name, value in params.items()}
        prefix = "/".join(f"{{{names[part]}}}" if part in names else part for part in prefix.split("/"))
    return prefix + template


def _new_request_id() -> str:
    """A random UUID4 in hex (as vLLM's ids and most request-id middlewares, which check for a
    UUID4, take it). Drawn from servprof's own generator: os.urandom (uuid4's source) releases the
    GIL, so that a request arriving while another thread runs Python could wait for that thread's
    switch interval (5 ms) to get it back; and the app's global `random` (seeded for reproducible
    sampling) must not be drawn from. An id needs to be unique, not secret. ~140 ns."""
    return (_random_bits(128) & _UUID4_MASK | _UUID4_BITS).to_bytes(16, "big").hex()


_random_bits = SERVPROF_RANDOM.getrandbits  # (re-seeded in each forked worker: its ids differ)
_UUID4_BITS = 0x4 << 76 | 0x8 << 60  # version 4, RFC 4122 variant
_UUID4_MASK = ~(0xF << 76 | 0xC << 60) & (1 << 128) - 1
