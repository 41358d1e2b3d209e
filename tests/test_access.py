"""Access control and what servprof records, over real uvicorn servers on loopback.

* no token or a wrong one: 401 on the control endpoints, and the sampling header samples nothing;
* every token comparison goes through hmac.compare_digest (constant time);
* on-demand sampling is rate-limited for everyone at once, so no client keeps the profiler on;
* no prompt or completion text in spans, reports, traces or session/analysis files unless
  SERVPROF_CAPTURE_CONTENT=1 (the real demo server, real profiler, real analysis, file exporter);
* file names never come from request input; files are readable by the server's user only.
"""

from __future__ import annotations

import gzip
import hmac
import os
import re
import stat
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from _demo_helpers import start_sampled_demo_server
from _fuzz_helpers import analyze_in_process
from _middleware_helpers import AUTH, TOKEN, tiny_server, wait_idle, wait_sessions

from servprof.capture import get_controller

BAD_CREDENTIALS = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {TOKEN}x"},
                   {"Authorization": f"Bearer {TOKEN[:-1]}"}, {"Authorization": f"Basic {TOKEN}"},
                   {"x-servprof-token": "wrong"}, {"x-servprof-token": ""}, {"x-servprof-token": TOKEN * 40}]


def _all_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_without_the_token_nothing_is_sampled(tmp_path: Path) -> None:
    wait_idle()
    controller = get_controller()
    started_before = controller.sessions_started
    with tiny_server(tmp_path, control_token=TOKEN, on_demand_min_interval_s=0.001,
                     requests_per_session=1) as (url, mw, _e), \
            httpx.Client(timeout=30) as client:
        for headers in BAD_CREDENTIALS:
            assert client.post(url + "/servprof/sample?n=4", headers=headers).status_code == 401, headers
            assert client.get(url + "/servprof/status", headers=headers).status_code == 401, headers
            asked = {**headers, "x-servprof-sample": "1"}
            served = client.post(url + "/v1/generate", json={"max_tokens": 2, "stream": False}, headers=asked)
            assert served.status_code == 200  # served as usual, just not sampled
        counts = mw.runtime.sampler.status()["candidates"]
        assert counts["header"] == 0 and counts["on_demand"] == 0
        assert counts["header_rejected"] == len(BAD_CREDENTIALS)
        assert mw.runtime.sampler.on_demand_pending == 0
        assert mw.runtime.counters["sampled"] == 0 and not mw.runtime.history
        assert controller.sessions_started == started_before
        assert not (tmp_path / "out" / "traces").exists() or not list((tmp_path / "out" / "traces").iterdir())

        # The same request with the right token is sampled: the checks above can fail.
        right = {"x-servprof-sample": "1", "x-servprof-token": TOKEN}
        assert client.post(url + "/v1/generate", json={"max_tokens": 2, "stream": False},
                           headers=right).status_code == 200
        (session,) = wait_sessions(mw, 1)
    assert session["reason"] == "header" and controller.sessions_started == started_before + 1


def test_every_token_check_is_a_constant_time_comparison(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []
    real_compare = hmac.compare_digest

    def counting_compare(a: Any, b: Any) -> bool:
        calls.append((len(a), len(b)))
        return real_compare(a, b)

    # control.py and sampling.py call hmac.compare_digest through the module at call time.
    monkeypatch.setattr(hmac, "compare_digest", counting_compare)
    wait_idle()
    with tiny_server(tmp_path, control_token=TOKEN, requests_per_session=1) as (url, mw, _e), \
            httpx.Client(timeout=30) as client:
        presented = ["x", "wrong-token-of-any-length" * 20, TOKEN[:-1] + "Z", TOKEN]
        for token in presented:
            expected = 200 if token == TOKEN else 401
            response = client.get(url + "/servprof/status", headers={"Authorization": f"Bearer {token}"})
            assert response.status_code == expected
        control_calls = list(calls)
        # Every presented token was compared, whatever its length (no early exit on a length mismatch).
        assert [a for a, _b in control_calls] == [len(t) for t in presented]
        assert all(b == len(TOKEN) for _a, b in control_calls)
        for token in ("x", TOKEN):
            client.get(url + "/hello", headers={"x-servprof-sample": "1", "x-servprof-token": token})
        assert [a for a, _b in calls[len(control_calls):]] == [1, len(TOKEN)]
        wait_sessions(mw, 1)


def test_on_demand_orders_are_rate_limited_so_the_profiler_cannot_be_kept_on(tmp_path: Path) -> None:
    wait_idle()
    interval_s, max_session_s = 1.5, 0.3
    controller = get_controller()
    started_before = controller.sessions_started
    with tiny_server(tmp_path, control_token=TOKEN, on_demand_min_interval_s=interval_s,
                     max_session_s=max_session_s, requests_per_session=64,
                     max_session_steps=10**6) as (url, mw, _e):
        stop = threading.Event()

        def traffic() -> None:
            # Paced so a session's 64 requests cannot all arrive within its 0.3 s time bound
            # (unpaced, a fast machine serves 64 tiny requests in under 0.3 s).
            with httpx.Client(timeout=30) as client:
                while not stop.wait(0.02):
                    client.post(url + "/v1/generate", json={"max_tokens": 2, "stream": False})

        thread = threading.Thread(target=traffic, daemon=True)
        thread.start()
        statuses: dict[int, int] = {}
        hammer_started = time.monotonic()
        # Two clients (connections) hammering: the limit is for the server, not per client.
        with httpx.Client(timeout=30) as first, httpx.Client(timeout=30) as second:
            while time.monotonic() - hammer_started < 4.0:
                for client in (first, second):
                    code = client.post(url + "/servprof/sample?n=64", headers=AUTH).status_code
                    statuses[code] = statuses.get(code, 0) + 1
                time.sleep(0.02)
        hammered_s = time.monotonic() - hammer_started
        stop.set()
        thread.join(30)
        mw.runtime.sampler.cancel_order()
        wait_idle()
        sessions = list(mw.runtime.history)
    accepted = statuses.get(202, 0)
    assert set(statuses) == {202, 429}
    assert 1 <= accepted <= int(hammered_s / interval_s) + 1, statuses
    assert statuses[429] > 10 * accepted
    assert controller.sessions_started - started_before == len(sessions) <= accepted
    # Each session ended at its time bound: 64 paced requests never arrive in 0.3 s, the step and
    # event bounds are set out of reach.
    assert sessions and all(s["stop_reason"] == "max_session_s" for s in sessions), \
        [(s["stop_reason"], len(s["requests"])) for s in sessions]
    profiler_on_s = sum(s["duration_s"] for s in sessions)
    # On at most about max_session_s per accepted order: a small share of the time it was hammered.
    assert profiler_on_s < hammered_s / 2, (profiler_on_s, hammered_s, sessions)


HOSTILE_IDS = ["../../etc/x", "..%2F..%2Fetc%2Fx", "a" * 5000, "x/../../y", "$(touch pwned)", "a b"]
ODD_BUT_VALID_IDS = ["..", "a:b..json.gz", "con.json.gz"]  # accepted as request ids; still never in a file name


def test_request_ids_never_name_files_and_files_are_private(tmp_path: Path) -> None:
    wait_idle()
    # No analysis child here (the content test below covers .analysis.json): 9 sessions stay quick.
    with tiny_server(tmp_path, control_token=TOKEN, sample_every=1, requests_per_session=1,
                     analysis=False) as (url, mw, _e), \
            httpx.Client(timeout=30) as client:
        returned = []
        for rid in HOSTILE_IDS + ODD_BUT_VALID_IDS:
            response = client.post(url + "/v1/generate", json={"max_tokens": 2, "stream": False},
                                   headers={"x-request-id": rid})
            assert response.status_code == 200
            returned.append(response.headers["x-request-id"])
            wait_idle()
        sessions = wait_sessions(mw, len(HOSTILE_IDS + ODD_BUT_VALID_IDS))
    # Unsafe ids are replaced by servprof's own; safe ones are kept (and land in trace metadata).
    assert not set(returned) & set(HOSTILE_IDS)
    assert returned[len(HOSTILE_IDS):] == ODD_BUT_VALID_IDS
    recorded = {rid for s in sessions for r in s["requests"] for rid in [r["request_id"]]}
    assert set(ODD_BUT_VALID_IDS) <= recorded
    files = _all_files(tmp_path / "out")
    session_ids = {s["session_id"] for s in sessions}
    assert {f.name.split(".")[0] for f in files} == session_ids
    for path in files:
        assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}(\.[a-z]+)+", path.name), path.name
        assert not any(rid in str(path.relative_to(tmp_path)) for rid in HOSTILE_IDS + returned)
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == 0o600, (path, oct(mode))


MARKER = "zq7-servprof-secret-prompt-8841"


def _stream_completion(client: httpx.Client, url: str, request_id: str) -> str:
    body = {"prompt": f"please repeat {MARKER} twice", "max_tokens": 12, "stream": True}
    text = []
    with client.stream("POST", url + "/v1/completions", json=body, headers={"x-request-id": request_id}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += [choice.get("text") or "" for choice in orjson.loads(line[6:])["choices"]]
    return "".join(text)


def _chat(client: httpx.Client, url: str, request_id: str) -> str:
    body = {"messages": [{"role": "system", "content": f"system {MARKER}"}, {"role": "user", "content": MARKER}],
            "max_tokens": 12}
    response = client.post(url + "/v1/chat/completions", json=body, headers={"x-request-id": request_id})
    assert response.status_code == 200
    return str(response.json()["choices"][0]["message"]["content"])


def _readable(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


@pytest.mark.parametrize("capture_content", [False, True])
def test_no_prompt_or_completion_text_is_recorded_unless_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capture_content: bool
) -> None:
    wait_idle()
    out = tmp_path / "out"
    settings = {"OUT_DIR": str(out), "CONTROL_TOKEN": TOKEN, "TELEMETRY": "1", "TELEMETRY_EXPORTER": "file",
                "CAPTURE_CONTENT": "1" if capture_content else "0", "RECORD_SHAPES": "1"}
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    with start_sampled_demo_server(monkeypatch, settings, size="tiny") as url, \
            httpx.Client(timeout=60) as client:
        assert client.post(url + "/servprof/sample?n=2", headers=AUTH).status_code == 202
        completions = [_stream_completion(client, url, "content-a"), _chat(client, url, "content-b")]
        deadline = time.monotonic() + 90
        while not (status := client.get(url + "/servprof/status", headers=AUTH).json())["last_sessions"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # The file exporter batches: wait until both request spans are on disk.
        spans_file = out / "spans" / "spans.otlp.jsonl"
        while not (spans_file.exists() and all(rid.encode() in spans_file.read_bytes()
                                                for rid in ("content-a", "content-b"))):
            assert time.monotonic() < deadline, "request spans never reached the span file"
            time.sleep(0.1)
    (session,) = status["last_sessions"]
    assert session["error"] is None and {r["request_id"] for r in session["requests"]} == {"content-a", "content-b"}
    trace_file = Path(session["trace_file"])
    assert analyze_in_process(trace_file, out)[0] == 0  # report.json and report.html beside the trace

    files = _all_files(out)
    names = {f.name for f in files}
    assert {"report.json", "report.html", "spans.otlp.jsonl", trace_file.name} <= names
    assert any(n.endswith(".session.json") for n in names) and any(n.endswith(".analysis.json") for n in names)
    secrets = [MARKER.encode()] + [c.encode() for c in completions if len(c) >= 12]
    assert len(secrets) >= 2, completions  # the completion texts are long enough to be searched for
    for path in files:
        content = _readable(path)
        found = [s for s in secrets if s in content]
        if capture_content and path == spans_file:
            assert MARKER.encode() in content  # the opt-in does record the prompt
        else:
            assert not found, (path.name, found)
    for path in files:
        if path.name not in ("report.json", "report.html"):  # written by the CLI, not the server
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, (path, oct(path.stat().st_mode))
    assert os.access(trace_file, os.R_OK)
