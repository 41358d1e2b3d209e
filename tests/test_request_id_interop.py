"""The request id, with a request-id middleware of the kind users add (asgi-correlation-id, real)
and with an app that answers with its own ``x-request-id``: one id end to end, one header.

servprof used to keep its 16-hex id to itself: a request-id middleware inside it (which accepts a
UUID4 only) made another, the app's logs carried that one, and the response carried both ids in
two ``x-request-id`` headers. Now servprof gives the request a UUID4 id in its headers when the
client sent none, and adds no header to a response that has one. uvicorn on loopback."""

from __future__ import annotations

import os
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


def test_fresh_ids_are_uuid4s_drawn_apart_from_the_apps_random() -> None:
    """servprof's ids come from its own generator: an app that seeds Python's global `random` (for
    reproducible sampling) draws the same numbers with servprof in front as without; and every id
    is a distinct UUID4 in hex."""
    import random

    app = FastAPI()

    @app.get("/draw")
    def draw() -> dict[str, float]:
        return {"x": random.random()}

    app.add_middleware(ServprofMiddleware, out_dir=tempfile.mkdtemp(), telemetry=False)
    with serve(app) as (url, _server), httpx.Client(timeout=30) as client:
        client.get(url + "/draw")  # (the server's first request, before the seed)
        random.seed(1234)
        responses = [client.get(url + "/draw") for _ in range(5)]
    random.seed(1234)
    assert [r.json()["x"] for r in responses] == [random.random() for _ in range(5)]
    ids = [r.headers["x-request-id"] for r in responses]
    assert len(set(ids)) == 5
    assert all(uuid.UUID(i).version == 4 and uuid.UUID(i).variant == uuid.RFC_4122 and uuid.UUID(i).hex == i
               for i in ids)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_worker_draws_ids_of_its_own() -> None:
    """A pre-fork server that loads the app first (gunicorn --preload) forks workers that share
    the parent's generator state: each must draw other ids than its siblings."""
    from servprof.middleware import _new_request_id

    _new_request_id()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the worker: its next ids, to the parent
        try:
            os.write(write, "".join(_new_request_id() for _ in range(3)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        theirs = pipe.read().decode()
    os.waitpid(child, 0)
    mine = "".join(_new_request_id() for _ in range(3))
    assert len(theirs) == len(mine) == 96
    assert {theirs[i:i + 32] for i in range(0, 96, 32)}.isdisjoint(mine[i:i + 32] for i in range(0, 96, 32))
