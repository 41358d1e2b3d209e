"""ServprofMiddleware on real uvicorn: request records, ids, pass-through, observers, no profiler."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch.autograd.profiler as autograd_profiler
from _middleware_helpers import TOKEN, serve, sse_post, tiny_server, wait_idle, wait_warm
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from servprof.capture import get_controller
from servprof.middleware import ServprofMiddleware
from servprof.observers import RequestRecord
from servprof.settings import SettingsError


class RecordingObserver:
    def __init__(self) -> None:
        self.started: list[RequestRecord] = []
        self.ended: list[RequestRecord] = []

    def on_request_start(self, record: RequestRecord, scope: dict[str, Any]) -> str:
        self.started.append(record)
        return record.request_id

    def on_request_end(self, record: RequestRecord, state: Any) -> None:
        assert state == record.request_id
        self.ended.append(record)

    def on_analysis(self, result: dict[str, Any], records: list[RequestRecord]) -> None:
        pass


class BrokenObserver:
    def on_request_start(self, record: RequestRecord, scope: dict[str, Any]) -> None:
        raise RuntimeError("observer bug")

    def on_request_end(self, record: RequestRecord, state: Any) -> None:
        raise RuntimeError("observer bug")

    def on_analysis(self, result: dict[str, Any], records: list[RequestRecord]) -> None:
        raise RuntimeError("observer bug")


def _wait_for(observer: RecordingObserver, count: int) -> list[RequestRecord]:
    deadline = time.monotonic() + 10
    while len(observer.ended) < count and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(observer.ended) == count
    return observer.ended


def test_plain_request_record_id_route_and_contextvars(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}
    observer = RecordingObserver()
    with tiny_server(tmp_path, seen=seen) as (url, mw, _e), httpx.Client(timeout=10) as client:
        mw.runtime.observers.append(observer)
        response = client.get(url + "/hello", headers={"x-request-id": "client-id.1", "user-agent": "tester/1"})
        assert response.status_code == 200 and response.headers["x-request-id"] == "client-id.1"
        (record,) = _wait_for(observer, 1)
        assert seen["request_id"] == "client-id.1" and seen["record"] is record
        unsafe = client.get(url + "/items/42", headers={"x-request-id": "bad id\u00e9,with,commas".encode()})
        generated = unsafe.headers["x-request-id"]
        assert "," not in generated and len(generated) == 16
        item = _wait_for(observer, 2)[1]
    assert (record.method, record.path, record.route, record.status) == ("GET", "/hello", "/hello", 200)
    assert record.user_agent == "tester/1" and record.client_address == "127.0.0.1"
    assert record.chunks == 1 and record.bytes_sent == len(response.content)
    assert record.arrival_perf_ns <= record.response_start_ns <= record.first_byte_ns <= record.last_byte_ns
    assert record.last_byte_ns <= record.end_ns and record.arrival_ns > 0
    assert not record.sampled and not record.disconnected and record.error_type is None
    assert item.request_id == generated and item.route == "/items/{item_id}" and item.path == "/items/42"


def test_sse_stream_counts_chunks_and_keeps_the_body_head(tmp_path: Path) -> None:
    observer = RecordingObserver()
    with tiny_server(tmp_path, body_head_bytes=20) as (url, mw, _e), httpx.Client(timeout=10) as client:
        mw.runtime.observers.append(observer)
        status, lines, _ = sse_post(client, url, tokens=64)
        (record,) = _wait_for(observer, 1)
    assert status == 200 and len(lines) == 65
    assert record.chunks == 65  # 64 tokens and [DONE]; the closing empty message is not a chunk
    assert record.bytes_sent == sum(len(line) + 2 for line in lines)
    assert record.first_byte_ns < record.last_byte_ns
    assert record.request_body_head == b'{"prompt":"hello","m'  # the first 20 bytes, as sent
    assert record.route == "/v1/generate"


def test_unsampled_requests_never_start_the_profiler(tmp_path: Path) -> None:
    wait_idle()
    controller = get_controller()
    before = controller.sessions_started
    # A token is set (control on) but no policy picks these requests, and a wrong token does not count.
    with tiny_server(tmp_path, control_token=TOKEN) as (url, mw, _e), httpx.Client(timeout=10) as client:
        for _ in range(20):
            assert client.get(url + "/hello").status_code == 200
            assert sse_post(client, url, tokens=3, headers={"x-servprof-sample": "1",
                                                            "x-servprof-token": "wrong"})[0] == 200
            assert not autograd_profiler._is_profiler_enabled
        counters = dict(mw.runtime.counters)
    assert controller.sessions_started == before and controller.session is None
    assert counters["requests"] == 40 and counters["sampled"] == 0 and counters["skipped"] == 0
    assert mw.runtime.sampler.counts["header_rejected"] == 20


def test_observer_errors_are_counted_and_serving_goes_on(tmp_path: Path) -> None:
    with tiny_server(tmp_path) as (url, mw, _e), httpx.Client(timeout=10) as client:
        mw.runtime.observers.append(BrokenObserver())
        for _ in range(3):
            assert client.get(url + "/hello").json() == {"hello": "world"}
        deadline = time.monotonic() + 5
        while mw.runtime.counters["observer_errors"] < 6 and time.monotonic() < deadline:
            time.sleep(0.005)
    assert mw.runtime.counters["observer_errors"] == 6


def test_servprof_token_header_is_not_passed_to_the_app(tmp_path: Path) -> None:
    wait_idle()
    seen_headers: list[list[tuple[bytes, bytes]]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            seen_headers.append(list(scope["headers"]))
            await JSONResponse({})(scope, receive, send)

    middleware = ServprofMiddleware(app, out_dir=tmp_path, telemetry=False, control_token=TOKEN, analysis=False,
                                    requests_per_session=1)
    wait_warm()  # a profiler still warming up refuses samples (the case when this test runs alone)
    with serve(middleware) as (url, _server):
        headers = {"x-servprof-sample": "1", "x-servprof-token": TOKEN}
        assert httpx.get(url + "/", headers=headers).status_code == 200
        wait_idle()
        # The token may also come as a bearer token (then the app sees its own Authorization header).
        bearer = {"x-servprof-sample": "1", "Authorization": f"Bearer {TOKEN}"}
        assert httpx.get(url + "/", headers=bearer).status_code == 200
        wait_idle()
    assert all(name != b"x-servprof-token" for name, _ in seen_headers[0])
    assert (b"x-servprof-sample", b"1") in seen_headers[0]
    assert (b"authorization", f"Bearer {TOKEN}".encode()) in seen_headers[1]
    assert middleware.runtime.counters["sampled"] == 2


def test_lifespan_and_websocket_pass_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []

    async def lifespan(app: Starlette) -> Any:
        events.append("startup")
        yield
        events.append("shutdown")

    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_text("pong:" + await websocket.receive_text())
        await websocket.close()

    async def hello(request: Any) -> JSONResponse:
        return JSONResponse({"ok": True})

    # No arguments at all, as vLLM adds it: settings come from SERVPROF_* variables.
    monkeypatch.setenv("SERVPROF_OUT_DIR", str(tmp_path / "env-out"))
    monkeypatch.setenv("SERVPROF_TELEMETRY", "0")
    monkeypatch.setenv("SERVPROF_SAMPLE_EVERY", "1000")
    app = Starlette(routes=[Route("/", hello), WebSocketRoute("/ws", echo)], lifespan=lifespan)
    app.add_middleware(ServprofMiddleware)
    with serve(app) as (url, _server):
        assert httpx.get(url + "/").json() == {"ok": True}
        import websockets.sync.client

        with websockets.sync.client.connect(url.replace("http", "ws") + "/ws") as ws:
            ws.send("ping")
            assert ws.recv() == "pong:ping"
        middleware = app.middleware_stack.app  # type: ignore[union-attr]
        while not isinstance(middleware, ServprofMiddleware):
            middleware = middleware.app
    assert events == ["startup", "shutdown"]
    assert middleware.settings.sample_every == 1000 and middleware.settings.out_dir == tmp_path / "env-out"
    assert middleware.runtime.counters["requests"] == 1  # the websocket was not an HTTP request
    # ... and status says it went through unsampled, and why.
    assert middleware.runtime.counters["websocket_connections"] == 1
    (entry,) = [m for m in middleware.runtime.status()["missing"] if m["what"] == "websocket connections"]
    assert entry["message"].startswith("1 WebSocket connection(s) passed through unsampled")


def test_bad_settings_are_a_clear_error() -> None:
    with pytest.raises(SettingsError, match="sample_rate"):
        ServprofMiddleware(JSONResponse({}), sample_rate=2.0)
    with pytest.raises(SettingsError, match="unknown servprof setting"):
        ServprofMiddleware(JSONResponse({}), sample_evry=3)


def test_complete_stream_is_not_a_disconnect_but_a_client_leaving_is(tmp_path: Path) -> None:
    # Starlette's streaming responses wait for "http.disconnect", which uvicorn also sends
    # after a complete response: only one that comes before the last byte is a client leaving.
    observer = RecordingObserver()
    with tiny_server(tmp_path) as (url, mw, engine), httpx.Client(timeout=10) as client:
        mw.runtime.observers.append(observer)
        status, lines, _ = sse_post(client, url, tokens=4)
        assert status == 200 and lines[-1] == "data: [DONE]"
        (complete,) = _wait_for(observer, 1)
        with client.stream("POST", url + "/v1/generate", json={"prompt": "hi", "max_tokens": 60}) as response:
            next(response.iter_lines())  # the first token, then hang up
        (_, left) = _wait_for(observer, 2)
        last_step = -1
        while engine.steps != last_step:  # the test engine finishes the abandoned request before shutdown
            last_step = engine.steps
            time.sleep(0.2)
    assert not complete.disconnected and complete.chunks == 5
    assert left.disconnected and left.last_byte_ns is None
    assert mw.runtime.counters["disconnects"] == 1


@pytest.mark.parametrize("prefix", ["/servprof", "/api/servprof"], ids=["prefix", "prefix_with_the_root_path"])
def test_behind_a_proxy_prefix_routes_and_endpoints_match_as_the_apps_do(tmp_path: Path, prefix: str) -> None:
    """uvicorn --root-path /api (a proxy strips /api before the server): ASGI servers put the prefix in
    ``path`` and the app routes on the rest. servprof matched the whole path: its endpoints answered
    the app's 404, sample_routes "/v1/*" sampled nothing and skip_routes skipped nothing. (A control
    prefix configured with the root path in it, which matched before, still does.)"""
    wait_idle()
    with tiny_server(tmp_path, root_path="/api", control_token=TOKEN, control_prefix=prefix, sample_every=1,
                     requests_per_session=1, sample_routes="/v1/*,/hello", skip_routes="/hello",
                     analysis=False) as (url, mw, _e), httpx.Client(timeout=30) as client:
        status = client.get(url + "/servprof/status", headers={"Authorization": f"Bearer {TOKEN}"})
        assert status.status_code == 200 and status.json()["settings"]["control_prefix"] == prefix
        missing = client.get(url + "/servprof/nothing", headers={"Authorization": f"Bearer {TOKEN}"})
        assert missing.status_code == 404 and "no servprof endpoint" in missing.json()["error"]
        assert client.get(url + "/hello").status_code == 200  # skipped: never counted
        response = client.post(url + "/v1/generate", json={"max_tokens": 2, "stream": False})
        assert response.status_code == 200
        wait_idle()
    assert mw.runtime.counters["sampled"] == 1, mw.runtime.counters
    assert mw.runtime.counters["control_requests"] == 2


@pytest.mark.parametrize("root_path", ["", "/api"], ids=["no_root", "proxy_root"])
def test_routes_of_mounted_apps_are_named_from_the_apps_root(tmp_path: Path, root_path: str) -> None:
    """A FastAPI app mounted under another (``app.mount("/v1", api)``): the route the record and the
    span name carry is the template from the app's root, mount prefix included (it was the mounted
    app's part alone: "/chat/completions"), with a mount's own parameters as names, never values."""
    from fastapi import FastAPI

    api, tenant, app = FastAPI(), FastAPI(), FastAPI()

    @api.post("/chat/completions")
    def chat() -> dict[str, Any]:
        return {}

    @api.get("/models/{name}")
    def model(name: str) -> dict[str, Any]:
        return {"name": name}

    @tenant.post("/chat/{model_name}")
    def tenant_chat(model_name: str) -> dict[str, Any]:
        return {}

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {}

    app.mount("/v1", api)
    app.mount("/tenant/{tid}", tenant)
    observer = RecordingObserver()
    middleware = ServprofMiddleware(app, out_dir=tmp_path, telemetry=False, warmup=False)
    middleware.runtime.observers.append(observer)
    with serve(middleware, root_path) as (url, _server), httpx.Client(timeout=10) as client:
        assert client.post(url + "/v1/chat/completions").status_code == 200
        assert client.get(url + "/v1/models/llama").json() == {"name": "llama"}
        assert client.post(url + "/tenant/42/chat/llama").status_code == 200
        assert client.get(url + "/health").status_code == 200
    records = _wait_for(observer, 4)
    assert [r.route for r in records] == ["/v1/chat/completions", "/v1/models/{name}", "/tenant/{tid}/chat/{model_name}",
                                          "/health"]
    assert [r.path for r in records] == [root_path + p for p in ("/v1/chat/completions", "/v1/models/llama",
                                                                 "/tenant/42/chat/llama", "/health")]


def test_a_wsgi_app_under_asgiref_takes_servprofs_send_for_async(tmp_path: Path) -> None:
    """A Flask app under asgiref's WsgiToAsgi (how WSGI apps are served by uvicorn): asgiref checks how
    the ``send`` it is given is defined, and warned "async_to_sync was passed a non-async-marked
    callable" about servprof's (a plain function handing back the server's awaitable, which saves a
    coroutine per body chunk); it is now marked as the coroutine function it acts as."""
    import warnings

    flask = pytest.importorskip("flask")
    wsgi = pytest.importorskip("asgiref.wsgi")
    app = flask.Flask("wsgi_app")

    @app.post("/v1/generate")
    def generate() -> dict[str, str]:
        return {"text": "ok"}

    middleware = ServprofMiddleware(wsgi.WsgiToAsgi(app), out_dir=tmp_path, telemetry=False, warmup=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with serve(middleware) as (url, _server), httpx.Client(timeout=10) as client:
            assert client.post(url + "/v1/generate").json() == {"text": "ok"}
    assert not [w for w in caught if "non-async-marked" in str(w.message)]
    assert middleware.runtime.counters["requests"] == 1
