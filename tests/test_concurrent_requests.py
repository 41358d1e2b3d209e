"""Concurrent requests each running their own ``generate()`` on FastAPI's thread pool
(tests/servers/thread_pool.py): the gaps between one request's steps are judged against that
request's thread, never over 100%, and where other requests' steps filled them they are named for
those, which the requests' own step phases confirm. The model is off the loop: no finding says
otherwise.

Real parts: uvicorn on loopback, a light session of the real profiler and the real analysis
child, a real tiny transformers Llama behind a real ``pipeline``.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

import httpx
import pytest
from _kineto_builder import covered_in, union
from _middleware_helpers import serve, wait_idle, wait_sessions
from test_zero_touch import servprof_middleware

from servprof.middleware import ServprofMiddleware

REQUESTS = 8  # at once, on 2 CPUs here: they run their steps side by side
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    server = importlib.import_module("servers.thread_pool")
    app = server.create_app()
    app.add_middleware(ServprofMiddleware, out_dir=tmp_path_factory.mktemp("thread_pool"), telemetry=False,
                       sample_every=1, requests_per_session=REQUESTS, max_session_events=10**9)
    wait_idle()
    statuses: list[int] = []

    def post(url: str) -> None:
        with httpx.Client(timeout=120) as client:
            response = client.post(url + "/v1/generate", json={"prompt": "The harbour master counted the boats",
                                                                "max_tokens": MAX_TOKENS})
            statuses.append(response.status_code)

    with serve(app) as (url, _server):
        middleware = servprof_middleware(app)
        clients = [threading.Thread(target=post, args=(url,)) for _ in range(REQUESTS)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join(300)
        (session,) = wait_sessions(middleware, 1, timeout_s=120)
        wait_idle()
        result = middleware.runtime.last_result
    return {"session": session, "result": result, "statuses": statuses}


def test_gaps_between_concurrent_requests_steps_are_theirs_and_within_each_thread(observed: dict[str, Any]) -> None:
    result = observed["result"]
    assert observed["statuses"] == [200] * REQUESTS
    assert result["error"] is None, result["error"]
    assert result["summary"]["detect"]["tier"] == "light"
    # Each request's steps, as its own phases record them (one thread per request).
    steps = {rid: [(p["start_us"], p["end_us"]) for p in record["phases"] if p["name"] in ("prefill", "decode_step")]
             for rid, record in result["requests"].items()}
    assert len(steps) == REQUESTS and all(len(s) == MAX_TOKENS for s in steps.values()), steps
    gaps = [f for f in result["findings"] if f["kind"] == "decode_gap"]
    for finding in gaps:
        assert 0 < finding["evidence"]["share_of_step_time"] <= 1.0, finding["title"]
    named = [g for f in gaps if f["evidence"]["cause"] == "concurrent_steps" for g in f["evidence"]["worst_gaps"]]
    assert named, [f["title"] for f in gaps]
    for gap in named:
        mine = next(rid for rid in steps if rid in gap["request_ids"])
        others = union([s for rid, spans in steps.items() if rid != mine for s in spans])
        covered = covered_in(others, gap["start_us"], gap["end_us"])
        assert covered >= 0.5 * (gap["end_us"] - gap["start_us"]), gap
        assert gap["other_steps"]["us"] == pytest.approx(covered, abs=1.0)
    assert not [f for f in result["findings"] if f["evidence"].get("cause") == "model_on_event_loop"]
