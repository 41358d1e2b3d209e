"""The request id, with a request-id middleware of the kind users add (asgi-correlation-id, real)
and with an app that answers with its own ``x-request-id``: one id end to end, one header.

servprof used to keep its 16-hex id to itself: a request-id middleware inside it (which accepts a
UUID4 only) made another, the app's logs carried that one, and the response carried both ids in
two ``x-request-id`` headers. Now servprof gives the request a UUID4 id in its headers when the
client sent none, and adds no header to a response that has one. uvicorn on loopback."""

from __future__ import annotations

import tempfile
import uuid
from typing import Any

import httpx
import pytest
from _middleware_helpers import serve
from fastapi import FastAPI
from fastapi.responses import JSONResponse

import servprof
from servprof.middleware import ServprofMiddleware

correlation = pytest.importorskip("asgi_correlation_id")


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/ids")
    def ids() -> dict[str, Any]:
        return {"correlation": correlation.correlation_id.get(), "servprof": servprof.current_request_id()}

    @app.get("/own")
    def own() -> JSONResponse:
        return JSONResponse({}, headers={"X-Request-ID": "app-made-id"})

    return app


def test_one_request_id_through_a_request_id_middleware_inside() -> None:
    app = _app()
    app.add_middleware(correlation.CorrelationIdMiddleware)
    app.add_middleware(ServprofMiddleware, out_dir=tempfile.mkdtemp(), telemetry=False)  # outermost
    with serve(app) as (url, _server), httpx.Client(timeout=30) as client:
        response = client.get(url + "/ids")
        (header,) = response.headers.get_list("x-request-id")
        assert response.json() == {"correlation": header, "servprof": header}
        assert uuid.UUID(header).version == 4 and uuid.UUID(header).hex == header
        sent = client.get(url + "/ids", headers={"X-Request-ID": "0f4c1e2a9b8d4c7e8f6a5b4c3d2e1f00"})
        assert sent.headers.get_list("x-request-id") == ["0f4c1e2a9b8d4c7e8f6a5b4c3d2e1f00"]
        assert sent.json()["servprof"] == "0f4c1e2a9b8d4c7e8f6a5b4c3d2e1f00"


def test_an_apps_own_response_id_is_not_doubled() -> None:
    app = _app()
    app.add_middleware(ServprofMiddleware, out_dir=tempfile.mkdtemp(), telemetry=False)
    with serve(app) as (url, _server), httpx.Client(timeout=30) as client:
        assert client.get(url + "/own").headers.get_list("x-request-id") == ["app-made-id"]
        ids = client.get(url + "/ids")
        assert ids.headers.get_list("x-request-id") == [ids.json()["servprof"]]
