"""Control endpoints over real uvicorn: off without a token, auth, validation, rate limit."""

from __future__ import annotations

from pathlib import Path

import httpx
from _middleware_helpers import AUTH, TOKEN, tiny_server, wait_idle


def test_control_is_off_without_a_token(tmp_path: Path) -> None:
    with tiny_server(tmp_path) as (url, _mw, _e), httpx.Client(timeout=10) as client:
        # Goes to the app, which has no such route.
        assert client.get(url + "/servprof/status", headers=AUTH).status_code == 404
        assert client.post(url + "/servprof/sample?n=2", headers=AUTH).status_code == 404


def test_auth_validation_and_rate_limit(tmp_path: Path) -> None:
    wait_idle()
    with tiny_server(tmp_path, control_token=TOKEN, on_demand_min_interval_s=30) as (url, mw, _e), \
            httpx.Client(timeout=10) as client:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}, {"x-servprof-token": TOKEN}):
            response = client.get(url + "/servprof/status", headers=headers)
            assert response.status_code == 401, headers
            assert response.json()["error"] and response.headers["www-authenticate"].startswith("Bearer")
        assert client.post(url + "/servprof/sample?n=2").status_code == 401

        for query in ("n=0", "n=-1", "n=abc", "n=65", "n=1.5", "n=", "n=1&n=2", "n=2&x=1", "count=3"):
            response = client.post(url + "/servprof/sample?" + query, headers=AUTH)
            assert response.status_code == 400, query
            assert isinstance(response.json()["error"], str)
        assert client.get(url + "/servprof/sample?n=2", headers=AUTH).status_code == 405
        assert client.get(url + "/servprof/nothing", headers=AUTH).status_code == 404

        ordered = client.post(url + "/servprof/sample?n=2", headers=AUTH)
        assert ordered.status_code == 202 and ordered.json()["ordered"] == 2
        limited = client.post(url + "/servprof/sample?n=2", headers=AUTH)
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
        # A bad order never replaced the good one.
        assert mw.runtime.sampler.on_demand_pending == 2

        status = client.get(url + "/servprof/status", headers=AUTH)
        assert status.status_code == 200 and status.headers["content-type"] == "application/json"
        body = status.json()
    assert body["settings"]["control_token"] == "set" and TOKEN not in status.text
    assert body["sampler"]["on_demand_pending"] == 2
    assert body["counters"]["requests"] == 0  # control calls are not served requests
    assert body["counters"]["control_requests"] >= 20
    assert body["profiler"]["warm"] is True
    mw.runtime.sampler.cancel_order()


def test_custom_prefix(tmp_path: Path) -> None:
    with tiny_server(tmp_path, control_token=TOKEN, control_prefix="/_ops/prof") as (url, _mw, _e), \
            httpx.Client(timeout=10) as client:
        assert client.get(url + "/_ops/prof/status", headers=AUTH).status_code == 200
        assert client.get(url + "/servprof/status", headers=AUTH).status_code == 404


def test_disabled_servprof_passes_requests_through_and_says_so(tmp_path: Path) -> None:
    with tiny_server(tmp_path, control_token=TOKEN, enabled=False, sample_every=1) as (url, mw, _e), \
            httpx.Client(timeout=10) as client:
        response = client.get(url + "/hello")
        assert response.status_code == 200 and "x-request-id" not in response.headers
        status = client.get(url + "/servprof/status", headers=AUTH).json()
        assert status["paused"].startswith("servprof is disabled")
        assert client.post(url + "/servprof/sample?n=1", headers=AUTH).status_code == 409
    assert mw.runtime.counters["requests"] == 0
