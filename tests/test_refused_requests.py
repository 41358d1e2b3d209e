"""Sampled requests the app refuses (a 4xx before any model work: an API key check, as vLLM's
``--api-key`` middleware does, inside servprof's) neither spend a session nor pass for a server
without steps. Before: a session's sampled requests answered 401, the session ended with them, and
its analysis said only "no model step was found: mark each step with servprof.phase(...)".

The hand-written loop server (tests/servers, written without servprof) on real uvicorn, with a
bearer-token check in front of its routes, behind the one-line middleware; every request sampled."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import httpx
import pytest
from _middleware_helpers import serve, wait_idle, wait_sessions, wait_warm
from _server_session import PROMPT, servprof_middleware
from starlette.requests import Request
from starlette.responses import JSONResponse

from servprof.detect.refused import FAILED_WHAT, REFUSED_WHAT, refused_missing
from servprof.middleware import ServprofMiddleware

KEY = "sk-test"


class ApiKeyCheck:
    """What vLLM's AuthenticationMiddleware does: /v1 routes need ``Authorization: Bearer <key>``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and \
                (b"authorization", f"Bearer {KEY}".encode()) not in scope["headers"]:
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _run(tmp_path: Path, keys: list[str | None], order: int = 0,
         **settings: Any) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """POST one completion per entry of ``keys`` (None: no key), one after another, every request
    sampled (``order``: none but an on-demand order for that many); returns the one session, its
    analysis and the runtime."""
    app = importlib.import_module("servers.handwritten_loop").create_app()
    app.add_middleware(ApiKeyCheck)
    app.add_middleware(ServprofMiddleware, out_dir=tmp_path, telemetry=False, sample_every=0 if order else 1,
                       requests_per_session=2, max_session_events=10**9, control_token="servprof-token", **settings)
    wait_idle()
    with serve(app) as (url, _server), httpx.Client(timeout=120) as client:
        middleware = servprof_middleware(app)
        wait_warm()
        if order:
            ordered = client.post(url + f"/servprof/sample?n={order}", headers={"Authorization": "Bearer servprof-token"})
            assert ordered.status_code == 202
        for key in keys:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            response = client.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8}, headers=headers)
            assert response.status_code == (200 if key == KEY else 401)
        (session,) = wait_sessions(middleware, 1, timeout_s=120)
        wait_idle()
        return session, middleware.runtime.last_result, middleware.runtime


@pytest.mark.parametrize("order", [0, 2], ids=["every_request", "on_demand_order_of_2"])
def test_a_refused_request_leaves_its_place_to_one_that_runs_the_model(tmp_path: Path, order: int) -> None:
    """(An on-demand order's slot stays owed to the next request: the order gets two that ran.)"""
    session, result, runtime = _run(tmp_path, [None, KEY, KEY], order=order)
    assert [r["status"] for r in session["requests"]] == [401, 200, 200]  # one session took all three
    assert session["stop_reason"] == "requests_done"
    assert runtime.counters["refused"] == 1 and runtime.counters["sampled"] == 3
    steps = result["summary"]["detect"]["steps"]["by_kind"]
    assert steps["prefill"] == 2 and steps["decode"] >= 14
    first = result["summary"]["missing"][0]
    assert first["what"] == REFUSED_WHAT
    assert first["message"].startswith("1 of the 3 sampled request(s) were answered 401 by the app (/v1/completions)")


def test_a_session_of_refused_requests_says_so_first(tmp_path: Path) -> None:
    session, result, runtime = _run(tmp_path, [None, None], max_session_s=1.5)
    assert [r["status"] for r in session["requests"]] == [401, 401]
    assert session["stop_reason"] == "max_session_s"  # it waited for requests that run the model
    assert runtime.counters["refused"] == 2
    assert result["summary"]["detect"]["steps"]["count"] == 0 and not result["findings"]
    first = result["summary"]["missing"][0]
    assert first["what"] == REFUSED_WHAT and first["message"].startswith("2 of the 2 sampled request(s)")
    assert "its lack of model steps and tokenization says nothing about the server" in first["message"]


@pytest.mark.parametrize(("statuses", "starts"), [
    ([200, 500], []),  # a server error is model work gone wrong: not a refusal, and not all failed
    ([401, 422, 422], ["3 of the 3 sampled request(s) were answered 401 (1), 422 (2) by the app"]),
    ([429, 200, None], ["1 of the 3 sampled request(s) were answered 429 by the app"]),
    ([500, 503], ["The 2 sampled request(s) failed: answered 500 (1), 503 (1) by the app (/v1/chat/completions)"]),
    ([200, True], []),  # (a status that is not an integer is no status)
])
def test_the_entries_name_the_refusals_and_failures(statuses: list[Any], starts: list[str]) -> None:
    records = [{"status": s, "route": "/v1/chat/completions", "path": "/v1/chat/completions"} for s in statuses]
    entries = refused_missing(records)
    assert [e["message"][:len(start)] for e, start in zip(entries, starts, strict=False)] == starts
    assert len(entries) == len(starts)


def test_a_session_of_requests_the_app_raised_on_says_they_failed(tmp_path: Path) -> None:
    """A route that raises (a model error after the prompt's forward, as an out-of-memory does) is
    answered 500 by the server below servprof's middleware (Starlette's ServerErrorMiddleware), so
    servprof never sees a status: the record names the exception, and the session says its sampled
    requests failed rather than only that no step was found."""
    module = importlib.import_module("servers.handwritten_loop")
    app = module.create_app()

    @app.post("/v1/fail")
    async def fail(request: Request) -> None:
        ids = module.tokenize_prompt((await request.json())["prompt"])
        with module.torch.inference_mode():
            module.model(module.torch.tensor([ids], device=module.DEVICE))
        raise RuntimeError("CUDA out of memory (a stand-in for the model's own failure)")

    app.add_middleware(ServprofMiddleware, out_dir=tmp_path, telemetry=False, sample_every=1,
                       requests_per_session=2, max_session_events=10**9)
    wait_idle()
    with serve(app) as (url, _server), httpx.Client(timeout=120) as client:
        middleware = servprof_middleware(app)
        wait_warm()
        for _ in range(2):  # (uvicorn closes a connection whose request raised: one each)
            assert client.post(url + "/v1/fail", json={"prompt": PROMPT}, headers={"Connection": "close"}).status_code == 500
        (session,) = wait_sessions(middleware, 1, timeout_s=120)
        wait_idle()
        result, runtime = middleware.runtime.last_result, middleware.runtime
    assert [(r["status"], r["error"]) for r in session["requests"]] == [(None, "RuntimeError")] * 2
    assert runtime.counters["refused"] == 0  # it may have done model work: its place is not given back
    first = result["summary"]["missing"][0]
    assert first["what"] == FAILED_WHAT
    assert first["message"].startswith("The 2 sampled request(s) failed: raised RuntimeError (/v1/fail)")


def test_raised_and_answered_failures_are_named_together() -> None:
    records = [{"status": 500, "route": "/v1/a"}, {"status": None, "error": "ValueError", "route": "/v1/b"},
               {"status": None, "error": "OSError", "disconnected": True, "route": "/v1/a"}]
    assert refused_missing(records[:2])[0]["message"].startswith(
        "The 2 sampled request(s) failed: answered 500 by the app; raised ValueError (/v1/a, /v1/b)")
    assert refused_missing(records) == []  # a client that hung up is no failure of the app's
