"""Spans in a real OTLP trace store: Arize Phoenix started on loopback by this module.

The demo LLM server runs behind ServprofMiddleware with a fault knob on (a host delay
before every decode step), samples every second request under torch.profiler, analyses
the trace in a subprocess, and exports over OTLP HTTP or gRPC. The spans are read back
through Phoenix's REST API. Phoenix runs as its own server process, so it may live in
its own environment: `scripts/dev test` puts it in `.venv-phoenix` (vLLM's tier pins a
FastAPI older than Phoenix accepts); `SERVPROF_PHOENIX=/path/to/phoenix` names another,
and a `phoenix` next to this Python (the 'phoenix' extra) is used too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _telemetry_helpers import chat_body, free_port


def _phoenix_executable() -> str | None:
    candidates = [os.environ.get("SERVPROF_PHOENIX"),
                  str(Path(__file__).resolve().parents[1] / ".venv-phoenix" / "bin" / "phoenix"),
                  str(Path(sys.executable).parent / "phoenix")]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("phoenix")


PHOENIX = _phoenix_executable()
pytestmark = [
    pytest.mark.phoenix,
    pytest.mark.slow,
    pytest.mark.skipif(
        PHOENIX is None,
        reason="arize-phoenix is not installed (scripts/dev test installs it in .venv-phoenix; "
               "or pip install -e '.[phoenix]'; SERVPROF_SKIP_PHOENIX=1 skips it)",
    ),
]

START_TIMEOUT_S = 120


class Phoenix:
    def __init__(self, http_port: int, grpc_port: int) -> None:
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.url = f"http://127.0.0.1:{http_port}"

    def spans(self) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.url}/v1/projects/default/spans", params={"limit": 1000}, timeout=30)
        response.raise_for_status()
        return response.json()["data"]


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Phoenix]:
    workdir = tmp_path_factory.mktemp("phoenix")
    server = Phoenix(free_port(), free_port())
    env = {
        **os.environ,
        "PHOENIX_WORKING_DIR": str(workdir),
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(server.http_port),
        "PHOENIX_GRPC_PORT": str(server.grpc_port),
    }
    log_path = workdir / "phoenix.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(PHOENIX), "serve"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"phoenix did not start:\n{log_path.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(f"{server.url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_for(
    phoenix: Phoenix, ids: set[str], analysed: int, timeout_s: float = 120.0
) -> list[dict[str, Any]]:
    """All spans of the traces whose request span carries one of `ids`, once every request span
    and `analysed` analysis spans have arrived."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = phoenix.spans()
        traces = {
            s["context"]["trace_id"]
            for s in spans
            if s["name"].startswith("POST") and s["attributes"].get("servprof.request_id") in ids
        }
        mine = [s for s in spans if s["context"]["trace_id"] in traces]
        requests = [s for s in mine if s["name"].startswith("POST")]
        analyses = [s for s in mine if s["name"] == "servprof.analysis"]
        if len(requests) == len(ids) and len(analyses) >= analysed:
            return mine
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{len(requests)} request and {len(analyses)} analysis spans in {timeout_s} s"
            )
        time.sleep(0.5)


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_demo_server_spans_in_phoenix(
    phoenix: Phoenix, protocol: str, tmp_path: Path, monkeypatch: Any
) -> None:
    from _demo_helpers import start_sampled_demo_server

    from servprof import telemetry

    port = phoenix.grpc_port if protocol == "grpc" else phoenix.http_port
    for name, value in {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_SERVICE_NAME": "servprof-phoenix-test",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }.items():
        monkeypatch.setenv(name, value)
    settings = {"OUT_DIR": str(tmp_path), "SAMPLE_EVERY": "2", "REQUESTS_PER_SESSION": "1",
                "TELEMETRY_EXPORTER": "otlp"}
    tag = protocol.replace("/", "-")
    ids = {f"{tag}-{index}" for index in range(4)}
    client_trace, client_span = os.urandom(16).hex(), os.urandom(8).hex()
    try:
        with (
            start_sampled_demo_server(monkeypatch, settings, size="tiny", step_delay_ms=15) as url,
            httpx.Client(timeout=60) as client,
        ):
            for index in range(4):
                headers = {"x-request-id": f"{tag}-{index}"}
                if index == 0:
                    headers["traceparent"] = f"00-{client_trace}-{client_span}-01"
                response = client.post(
                    url + "/v1/chat/completions",
                    headers=headers,
                    content=chat_body(max_tokens=8, stream=index % 2 == 0, model="ignored", ignore_eos=True),
                )
                assert response.status_code == 200
            spans = _wait_for(phoenix, ids, analysed=1)
    finally:
        telemetry.shutdown()
    status = telemetry.status()  # final counts: shutdown flushed what was still queued
    assert status["exporter"] == "otlp" and status["protocol"] == protocol
    assert status["spans_dropped"] == 0 and status["spans_exported"] == status["spans_ended"]

    requests = {
        s["attributes"]["servprof.request_id"]: s for s in spans if s["name"] == "POST /v1/chat/completions"
    }
    assert set(requests) == ids
    for request_id, span in requests.items():
        attributes = span["attributes"]
        assert span["span_kind"] == "LLM"  # Phoenix's own view of a span with gen_ai.* attributes
        assert (
            attributes["http.request.method"] == "POST" and attributes["http.route"] == "/v1/chat/completions"
        )
        assert attributes["http.response.status_code"] == 200 and span["status_code"] != "ERROR"
        assert attributes["gen_ai.operation.name"] == "chat" and attributes["gen_ai.request.max_tokens"] == 8
        assert attributes["gen_ai.request.stream"] is (request_id.endswith(("-0", "-2")))
        assert attributes["gen_ai.usage.output_tokens"] > 0 and attributes["servprof.ttft_ms"] > 0
    first = requests[f"{tag}-0"]
    assert first["context"]["trace_id"] == client_trace and first["parent_id"] == client_span

    analysed = [s for s in spans if s["name"] == "servprof.analysis"]
    for analysis in analysed:
        request = next(s for s in requests.values() if s["context"]["span_id"] == analysis["parent_id"])
        assert request["attributes"]["servprof.sampled"] is True
        children = [s for s in spans if s["parent_id"] == request["context"]["span_id"]]
        # One span (or a decode span) for every phase the analysis found in the trace; how many
        # steps a session captures is capture's business (its event budget can end it early).
        counts = {
            key.split(".")[2]: value
            for key, value in analysis["attributes"].items()
            if key.startswith("servprof.phase.") and key.endswith(".count")
        }
        assert {"tokenize", "prefill"} <= set(counts), counts
        expected = {"decode" if name == "decode_step" else name for name in counts} | {"servprof.analysis"}
        assert {s["name"] for s in children} == expected
        if "decode_step" in counts:
            decode = next(s for s in children if s["name"] == "decode")
            steps = [s for s in spans if s["parent_id"] == decode["context"]["span_id"]]
            assert len(steps) == decode["attributes"]["servprof.decode_steps"] == counts["decode_step"]
        assert Path(analysis["attributes"]["servprof.trace_file"]).exists()
        findings = [e for e in analysis["events"] if e["name"] == "servprof.finding"]
        assert len(findings) == analysis["attributes"]["servprof.findings"]
        for event in findings:
            assert event["attributes"]["servprof.finding.kind"] in KINDS
            assert event["attributes"]["servprof.finding.severity"] in {"info", "warning", "critical"}
            assert event["attributes"]["servprof.finding.cost_ms"] > 0


from servprof.detect.finding import KINDS  # noqa: E402  (every kind a finding event may carry)


def test_finding_events_in_phoenix(phoenix: Phoenix, tmp_path: Path) -> None:
    """Finding events exactly as the analysis contract hands them over (the demo test above
    sees whatever the detectors found in that run)."""
    from _telemetry_helpers import ObserverProbe, make_app, serve

    from servprof import telemetry
    from servprof.settings import Settings

    environ = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{phoenix.url}/v1/traces"}
    observer = telemetry.create_observer(Settings(out_dir=tmp_path), environ=environ)
    probe = ObserverProbe(make_app(), observer)
    try:
        with serve(probe) as url, httpx.Client() as client:
            headers = {"x-sample": "1", "x-request-id": "phoenix-findings"}
            assert (
                client.post(
                    url + "/v1/chat/completions", content=chat_body(stream=False), headers=headers
                ).status_code
                == 200
            )
            (record,) = probe.wait_records(1)
        findings = [
            {
                "kind": "tokenization_stall",
                "severity": "critical",
                "cost_ms": 12.5,
                "start_us": 10.0,
                "end_us": 40.0,
                "request_ids": ["phoenix-findings"],
                "title": "tokenizer held the event loop",
                "evidence": {"ms": 12.5},
            },
            {
                "kind": "bandwidth_bound_decode",
                "severity": "info",
                "cost_ms": 0.5,
                "start_us": 60.0,
                "end_us": 90.0,
                # A finding that names no request goes on the session's own span, not this one.
                "request_ids": ["phoenix-findings"],
                "title": "decode reads weights at 80% of peak bandwidth",
                "evidence": {},
            },
        ]
        observer.on_analysis(
            {
                "session_id": "s-phoenix",
                "trace_file": "s-phoenix.pt.trace.json.gz",
                "error": None,
                "requests": {
                    "phoenix-findings": {
                        "phases": [
                            {"name": "tokenize", "start_us": 10.0, "end_us": 40.0},
                            {"name": "decode_step", "start_us": 60.0, "end_us": 90.0},
                        ]
                    }
                },
                "findings": findings,
                "clock": {"trace_us_to_unix_ns_offset": record.arrival_ns},
            },
            probe.records,
        )
        spans = _wait_for(phoenix, {"phoenix-findings"}, analysed=1)
    finally:
        telemetry.shutdown()
    request = next(s for s in spans if s["name"] == "POST /v1/chat/completions")
    analysis = next(s for s in spans if s["name"] == "servprof.analysis")
    assert analysis["parent_id"] == request["context"]["span_id"]
    assert {s["name"] for s in spans if s["parent_id"] == request["context"]["span_id"]} == {
        "tokenize",
        "decode",
        "servprof.analysis",
    }
    events = sorted(analysis["events"], key=lambda e: e["timestamp"])
    assert [e["attributes"]["servprof.finding.kind"] for e in events] == [
        "tokenization_stall",
        "bandwidth_bound_decode",
    ]
    assert events[0]["attributes"]["servprof.finding.cost_ms"] == 12.5
    assert events[0]["attributes"]["servprof.finding.severity"] == "critical"
    assert (
        events[1]["attributes"]["servprof.finding.title"] == "decode reads weights at 80% of peak bandwidth"
    )
