"""Light sessions and deep windows (servprof.tiers): the real profiler on the installed torch,
a real uvicorn server with a tiny torch model stepped by an engine thread (tests/_middleware_helpers)."""

from __future__ import annotations

import gzip
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import torch
from _middleware_helpers import AUTH, TOKEN, concurrent_sse, sse_post, tiny_server, wait_idle, wait_sessions
from torch._C._profiler import _ExperimentalConfig, _RecordFunctionFast
from torch.profiler import ProfilerActivity, profile, record_function

from servprof import tiers
from servprof.budget import LIGHT_EVENTS_PER_STEP, LIGHT_MIN_COST_FACTOR, EventBudget, LiveSignals
from servprof.phases import phase
from servprof.settings import Settings, SettingsError

SAMPLE = {"x-servprof-sample": "1", "x-servprof-token": TOKEN}


def _document(session: dict[str, Any]) -> dict[str, Any]:
    document = orjson.loads(gzip.decompress(Path(session["trace_file"]).read_bytes()))
    meta = document["servprof"]
    document["servprof"] = orjson.loads(meta) if isinstance(meta, str) else meta
    return document


def _categories(document: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for event in document["traceEvents"]:
        counts[event.get("cat")] = counts.get(event.get("cat"), 0) + 1
    return counts


def _model_loop(steps: int) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
    with torch.no_grad():
        for step in range(steps):
            with phase("decode_step", request_ids=[f"r{step}"]):
                model(torch.randn(2, 32))


def _one_session_each(client: httpx.Client, url: str, middleware: Any, count: int, tokens: int) -> list[dict[str, Any]]:
    """``count`` sampled requests one after another, each in a session of its own."""
    for i in range(count):
        assert sse_post(client, url, tokens, {**SAMPLE, "x-request-id": f"one-{i}"})[0] == 200
        wait_sessions(middleware, i + 1)
        wait_idle()
    return wait_sessions(middleware, count)


def test_the_installed_torch_takes_user_scope_capture(tmp_path: Path) -> None:
    """Pins the private API on this torch: user-scope ranges (servprof's phases and
    torch.profiler.record_function) are kept, ops and _RecordFunctionFast ranges are not."""
    assert tiers.light_problem() is None
    cls, tier, note = tiers.profiler_class(tiers.LIGHT)
    assert (cls, tier, note) == (tiers.LightProfile, tiers.LIGHT, None)
    for light in (True, False):
        prof = (tiers.LightProfile if light else profile)(
            activities=[ProfilerActivity.CPU], experimental_config=_ExperimentalConfig(profile_all_threads=True))
        prof.start()
        _model_loop(20)
        with record_function("engine_range"):
            fast = _RecordFunctionFast("fast_range", (), {})
            fast.__enter__()
            fast.__exit__(None, None, None)
        prof.stop()
        path = tmp_path / f"{light}.json"
        prof.export_chrome_trace(str(path))
        document = orjson.loads(path.read_bytes())
        names = {e.get("name") for e in document["traceEvents"]}
        phases = [n for n in names if n and n.startswith("servprof:decode_step|")]
        assert len(phases) == 20 and "engine_range" in names
        cpu_ops = _categories(document).get("cpu_op", 0)
        if light:
            assert cpu_ops == 0 and "fast_range" not in names
        else:
            assert cpu_ops >= 20 * 3 and "fast_range" in names
    # The patched entry point is torch's own again once started.
    assert not hasattr(torch.autograd.profiler._enable_profiler, "keywords")


def test_a_phase_open_across_a_profiler_restart_is_safe(tmp_path: Path) -> None:
    """A range opened under one session and closed under the next (a long request) neither crashes
    nor corrupts the second trace."""
    first = tiers.LightProfile(activities=[ProfilerActivity.CPU])
    first.start()
    outer = phase("prefill", request_id="long")
    outer.__enter__()
    first.stop()
    second = tiers.LightProfile(activities=[ProfilerActivity.CPU])
    second.start()
    with phase("decode_step", request_id="other"):
        pass
    outer.__exit__(None, None, None)
    second.stop()
    path = tmp_path / "second.json"
    second.export_chrome_trace(str(path))
    names = [e.get("name") for e in orjson.loads(path.read_bytes())["traceEvents"]]
    assert "servprof:decode_step|other" in names


def test_a_light_session_has_phases_and_steps_and_no_op(tmp_path: Path) -> None:
    wait_idle()
    with tiny_server(tmp_path, control_token=TOKEN, requests_per_session=2, deep_every=0) as (url, middleware, _e), \
            httpx.Client(timeout=30) as client:
        concurrent_sse(client, url, 8, [{**SAMPLE, "x-request-id": f"light-{i}"} for i in range(2)])
        (session,) = wait_sessions(middleware, 1)
        status = client.get(url + "/servprof/status", headers=AUTH).json()
    assert session["error"] is None and session["tier"] == "light" and session["tier_note"] is None, session
    assert session["max_steps"] == Settings().light_max_steps
    document = _document(session)
    assert document["servprof"]["tier"] == "light"
    assert _categories(document).get("cpu_op", 0) == 0
    names = {e.get("name") for e in document["traceEvents"]}
    for rid in ("light-0", "light-1"):
        assert f"servprof:tokenize|{rid}" in names
        assert any(n and n.startswith("servprof:decode_step|") and rid in n for n in names)
    result = middleware.runtime.last_result
    assert result["error"] is None
    for rid in ("light-0", "light-1"):
        assert {"tokenize", "decode_step"} <= {p["name"] for p in result["requests"][rid]["phases"]}
    tier_status = status["profiler"]["tiers"]
    assert tier_status["light_available"] is True and tier_status["next"] == "light"
    assert status["last_sessions"][-1]["tier"] == "light"
    on_disk = orjson.loads(Path(session["trace_file"].replace(".pt.trace.json.gz", ".session.json")).read_bytes())
    assert on_disk["tier"] == "light"


def test_a_deep_window_follows_every_k_light_sessions_and_stops_at_its_steps(tmp_path: Path) -> None:
    wait_idle()
    with tiny_server(tmp_path, control_token=TOKEN, requests_per_session=1, deep_every=2, deep_steps=2) as (
            url, middleware, _e), httpx.Client(timeout=30) as client:
        sessions = _one_session_each(client, url, middleware, 4, tokens=12)
    assert [s["tier"] for s in sessions] == ["light", "light", "deep", "light"], sessions
    deep = sessions[2]
    assert deep["max_steps"] == 2 and deep["stop_reason"] == "max_session_steps", deep
    assert deep["steps_streamed_at_stop"] >= 2
    assert _categories(_document(deep)).get("cpu_op", 0) > 0
    for light in (sessions[0], sessions[1], sessions[3]):
        assert light["stop_reason"] == "requests_done" and _categories(_document(light)).get("cpu_op", 0) == 0


def test_an_order_can_ask_for_a_deep_window(tmp_path: Path) -> None:
    wait_idle()
    with tiny_server(tmp_path, control_token=TOKEN, deep_every=0, deep_steps=3, on_demand_min_interval_s=0.01) as (
            url, middleware, _e), httpx.Client(timeout=30) as client:
        for bad in ("tier=heavy", "tier=deep&tier=light", "n=1&depth=2"):
            response = client.post(url + f"/servprof/sample?{bad}", headers=AUTH)
            assert response.status_code == 400 and "tier" in response.json()["error"], (bad, response.text)
        response = client.post(url + "/servprof/sample?n=1&tier=deep", headers=AUTH)
        assert response.status_code == 202 and response.json()["tier"] == "deep"
        assert sse_post(client, url, 10)[0] == 200
        (session,) = wait_sessions(middleware, 1)
        wait_idle()
        response = client.post(url + "/servprof/sample?n=1", headers=AUTH)
        assert response.status_code == 202 and response.json()["tier"] == "light"
        assert sse_post(client, url, 4)[0] == 200
        sessions = wait_sessions(middleware, 2)
    assert session["tier"] == "deep" and session["max_steps"] == 3 and session["reason"] == "on_demand"
    assert sessions[1]["tier"] == "light"


def test_tier_deep_makes_every_session_a_full_capture(tmp_path: Path) -> None:
    wait_idle()
    with tiny_server(tmp_path, control_token=TOKEN, requests_per_session=1, tier="deep") as (url, middleware, _e), \
            httpx.Client(timeout=30) as client:
        sessions = _one_session_each(client, url, middleware, 2, tokens=6)
        status = client.get(url + "/servprof/status", headers=AUTH).json()
    assert [s["tier"] for s in sessions] == ["deep", "deep"]
    assert all(s["max_steps"] == Settings().max_session_steps for s in sessions)
    assert all(_categories(_document(s)).get("cpu_op", 0) > 0 for s in sessions)
    assert status["profiler"]["tiers"]["next"] == "deep"


def test_without_the_private_api_sessions_fall_back_to_full_capture(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    wait_idle()
    monkeypatch.setattr(tiers, "_checked", False)
    monkeypatch.setattr(tiers, "_problem", None)  # restored after the test with the others: later tests see light
    monkeypatch.setattr(tiers, "_check", lambda: "torch's _enable_profiler takes no scopes")
    caplog.set_level(logging.WARNING, logger="servprof")
    with tiny_server(tmp_path, control_token=TOKEN, requests_per_session=1, deep_every=0) as (url, middleware, _e), \
            httpx.Client(timeout=30) as client:
        sessions = _one_session_each(client, url, middleware, 2, tokens=6)
        status = client.get(url + "/servprof/status", headers=AUTH).json()
    for session in sessions:
        assert session["tier"] == "deep" and "light capture not possible" in session["tier_note"]
        assert session["max_steps"] == Settings().max_session_steps  # the deep bound, not 256 steps
        assert _categories(_document(session)).get("cpu_op", 0) > 0
    assert status["profiler"]["tiers"]["light_available"] is False
    assert "no scopes" in status["profiler"]["tiers"]["light_problem"]
    said = [r for r in caplog.records if "light sessions are not possible" in r.getMessage()]
    assert len(said) == 1  # once per process, not per session


def test_tier_settings_are_checked() -> None:
    assert Settings.from_env({"SERVPROF_TIER": "deep", "SERVPROF_DEEP_EVERY": "0"}).tier == "deep"
    for env in ({"SERVPROF_TIER": "heavy"}, {"SERVPROF_DEEP_STEPS": "0"}, {"SERVPROF_LIGHT_MAX_STEPS": "0"},
                {"SERVPROF_DEEP_EVERY": "-1"}):
        with pytest.raises(SettingsError, match="SERVPROF_"):
            Settings.from_env(env)


def test_the_light_budget_counts_steps_not_module_calls() -> None:
    settings = Settings()
    light, deep = EventBudget(light=True), EventBudget()
    live = LiveSignals(hooks_active=True, steps=10, module_calls=400, calls_per_step=40)
    if torch.cuda.is_available():  # pragma: no cover - the device timeline is counted per call
        pytest.skip("on CUDA a light session records kernels per module call")
    assert light.call_limit(settings, live) is None  # module calls record nothing in a light session
    assert light.estimate(0.0, 0, live, 0.0) == pytest.approx(10 * LIGHT_EVENTS_PER_STEP)
    assert deep.estimate(0.0, 0, live, 0.0) > 50 * light.estimate(0.0, 0, live, 0.0)
    assert light.step_limit(settings, live) > 30 * deep.step_limit(settings, live)
    assert light.assumed_per_s(settings) < deep.assumed_per_s(settings)
    light.learn(600, settings, busy_s=2.0, steps=200, chunks=200)
    assert light.per_step == pytest.approx(3.0) and deep.per_step is None  # each tier learns its own


def test_a_light_budget_holds_more_ranges_once_their_stop_is_measured_cheaper() -> None:
    """The budget is a stop() time: ranges that stop at 2 µs each fit 3x the nominal count (at
    most 1 / LIGHT_MIN_COST_FACTOR); a deep budget never grows past its nominal count, and
    shapes, which a light session does not record, do not shrink a light one."""
    settings = Settings(record_shapes=True)
    light, deep = EventBudget(light=True), EventBudget()
    assert light.budget(settings) == settings.max_session_events
    assert deep.budget(settings) < settings.max_session_events  # shapes: dearer ops until measured
    for budget in (light, deep):
        budget.learn(5000, settings, busy_s=2.0, steps=250, chunks=250, stop_s=5000 * 2e-6)
    assert light.budget(settings) == pytest.approx(settings.max_session_events / LIGHT_MIN_COST_FACTOR)
    assert deep.budget(settings) == settings.max_session_events
    light.learn(5000, settings, busy_s=2.0, steps=250, chunks=250, stop_s=5000 * 12e-6)  # a dear stop: shrinks
    assert light.budget(settings) == pytest.approx(settings.max_session_events / 2)


def test_on_cuda_the_drain_stops_recording_the_device_after_the_queued_work_ran(monkeypatch) -> None:
    """Before its stop, a session switches op collection off and waits for the GPU work queued so
    far (recorded: the ops before the cut launched it); then the device timeline goes off too. Left
    on, CUPTI recorded every kernel serving launched during the drain and the wait for open ranges,
    with its launch and flow: on an H100 a 2,000-event session stored 18,946 and stopped in 122 ms.
    No GPU here: torch.cuda's state and the toggle are stood in for, the order is what is checked."""
    calls: list[Any] = []
    monkeypatch.setattr(tiers.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tiers.torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(tiers.torch.cuda, "synchronize", lambda: calls.append("synchronize"))
    monkeypatch.setattr(tiers, "_toggle_collection_dynamic",
                        lambda enable, activities: calls.append((enable, sorted(a.name for a in activities))))
    tiers.drain_ops(tiers.DEEP)
    assert calls == [(False, ["CPU"]), "synchronize", (False, ["CPU", "CUDA"])]
    # Cut by the step hooks already (both off): the drain still turns the device off after the sync.
    calls.clear()
    tiers.drain_ops(tiers.LIGHT, cut_perf_ns=time.perf_counter_ns())
    assert calls == ["synchronize", (False, ["CPU", "CUDA"])]


@pytest.mark.parametrize("tier", [tiers.LIGHT, tiers.DEEP])
def test_the_stop_waits_for_servprofs_ranges_open_when_collection_went_off(tier: str, monkeypatch) -> None:
    """A range's end callback that runs during torch 2.13's stop() writes into freed memory (a
    transformers server under load crashed about once in 90 light sessions; docs/middleware.md):
    the drain before the stop waits for servprof's ranges open at the cut, and gives up after
    RANGE_WAIT_S on one that never ends."""
    import threading

    from servprof.auto.emit import close_range, open_range

    prof, got, _note = tiers.new_profiler(None, tier)
    prof.start()
    try:
        handle = open_range("servprof:auto.decode_step|r1")
        drained = threading.Event()
        thread = threading.Thread(target=lambda: (tiers.drain_ops(got), drained.set()))
        thread.start()
        assert not drained.wait(3 * tiers.DRAIN_S), "the drain ended with a range still open"
        close_range(handle)
        assert drained.wait(10)
        thread.join()
        monkeypatch.setattr(tiers, "RANGE_WAIT_S", 0.1)
        forgotten = open_range("servprof:auto.decode_step|r2")  # never closed before the stop
        tiers.drain_ops(got)  # returns: bounded
    finally:
        prof.stop()
    close_range(forgotten)
