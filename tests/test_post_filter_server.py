"""A server whose handler works on each answer after the model is done (tests/servers/post_filter.py:
a slow safety filter over the text): the ``after_last_step`` finding names the time between each
request's last model step and its response, on a light session; the same server with the filter
off gets no such finding. Real parts: uvicorn on loopback, the real profiler, the analysis child."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _server_session import PROMPT, session_on

REQUESTS = 2
MAX_TOKENS = 12


def _findings(tmp_path: Path, filtered: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "filter": filtered}
    out = session_on("servers.post_filter", tmp_path, ["/v1/completions"] * REQUESTS, MAX_TOKENS, spaced_s=0.05,
                     body=body)
    assert [status for _path, status, _rid in out["responses"]] == [200] * REQUESTS
    return out, [f for f in out["result"]["findings"] if f["kind"] == "after_last_step"]


def test_work_after_the_last_step_is_named_and_its_absence_is_quiet(tmp_path: Path) -> None:
    out, (finding,) = _findings(tmp_path / "filtered", True)
    request_ids = sorted(rid for _path, _status, rid in out["responses"])
    assert sorted(finding["request_ids"]) == request_ids
    tails = finding["evidence"]["tails"]
    assert len(tails) == REQUESTS
    for tail in tails:
        # The tail lies inside the request, after its own last step, and holds the filter's time.
        assert 10.0 <= tail["tail_ms"] < tail["request_ms"], tail
        assert tail["last_step_end_us"] < tail["last_byte_us"]
    summary = out["result"]["summary"]["detect"]["after_last_step"]
    assert {t["request_id"] for t in summary["tails"]} == set(request_ids)
    assert "light" in finding["fix"] or "deep window" in finding["fix"]  # what a light trace cannot show

    _out, quiet = _findings(tmp_path / "unfiltered", False)
    assert quiet == []


def deep_sessions(tmp_path: Path, route: str) -> list[dict[str, Any]]:
    """Two deep sessions with stacks, one after the other, on one server: each one's after_last_step
    finding."""
    import importlib
    import threading

    import httpx
    from _middleware_helpers import serve, wait_idle, wait_sessions, wait_warm
    from _server_session import servprof_middleware

    from servprof.middleware import ServprofMiddleware

    app = importlib.import_module("servers.post_filter").create_app()
    app.add_middleware(ServprofMiddleware, out_dir=tmp_path, telemetry=False, sample_every=1,
                       requests_per_session=REQUESTS, max_session_events=10**9, tier="deep", with_stack=True)
    wait_idle()
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS}
    findings = []
    with serve(app) as (url, _server):
        middleware = servprof_middleware(app)
        wait_warm()
        for sessions in (1, 2):
            clients = [threading.Thread(target=httpx.post, args=(url + route,),
                                        kwargs={"json": body, "timeout": 120}) for _ in range(REQUESTS)]
            for client in clients:
                client.start()
            for client in clients:
                client.join(120)
            wait_sessions(middleware, sessions, timeout_s=120)
            wait_idle()
            findings.append([f for f in middleware.runtime.last_result["findings"] if f["kind"] == "after_last_step"])
    (first,), (second,) = findings
    return [first, second]


def test_a_deep_window_with_stacks_names_the_handlers_work(tmp_path: Path) -> None:
    """With Python stacks on a deep window, the work after the model is named by its frames: the
    filter's function and the regex calls inside it. torch's Python tracer follows only the threads
    alive when it starts: an ``async def`` endpoint's ``asyncio.to_thread`` starts the loop's executor
    threads on first use, so the first session's handler threads have no frames, and the finding
    says so (not "take a deep window with stacks", which it was); the executor keeps them, so the
    second session's are recorded."""
    first, second = deep_sessions(tmp_path, "/v1/async/completions")
    assert first["evidence"]["handler_threads"]["seen"] == "started_after_the_profiler", first["evidence"]
    assert "began later" in first["fix"] and "SERVPROF_WITH_STACK=1 names" not in first["fix"]
    assert "computing outside the model" not in first["title"]
    work = second["evidence"]["handler_threads"]
    assert work["seen"] == "computing", work
    names = [frame["name"] for frame in work["top_frames"]]
    assert any("safety_filter" in name for name in names) and any("re.Pattern" in name for name in names), names
    assert work["busy_ms"] <= work["window_ms"]
    assert "safety_filter" in second["title"] or "re.Pattern" in second["title"]


def test_work_on_the_event_loop_after_the_model_is_named_on_its_thread(tmp_path: Path) -> None:
    """An ``async def`` handler that runs the model in ``asyncio.to_thread`` and filters the text on
    the event loop: the executor thread that ran the model is idle after it (in its queue's get: a
    wait, not computing), and the finding names the thread that computed meanwhile, with the
    filter's frames, in both sessions (the first one's executor threads have no frames at all; the
    second one's usually do, but the executor may start another thread for it)."""
    for finding in deep_sessions(tmp_path, "/v1/loop-filter/completions"):
        work = finding["evidence"]["handler_threads"]
        assert work["seen"] in ("started_after_the_profiler", "waited"), work  # never "computing" in a queue's get
        if work["seen"] == "waited":
            assert any("SimpleQueue" in frame["name"] for frame in work["wait_frames"]), work
        (loop_thread, *_), = [work["computing_elsewhere"]]
        names = [frame["name"] for frame in loop_thread["top_frames"]]
        assert any("safety_filter" in name for name in names), names
        assert loop_thread["busy_ms"] <= loop_thread["window_ms"]
        assert "safety_filter" in finding["title"] and "event loop" in finding["fix"]
        assert "SERVPROF_WITH_STACK=1 names" not in finding["fix"] and "computing outside the model" not in finding["title"]
