"""An OTLP backend that is down, hung, or restarting never costs a request: every request
through the real ServprofMiddleware succeeds, and what telemetry could not deliver is
counted for /servprof/status."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from _telemetry_helpers import OtlpHttpReceiver, behind_middleware, chat_body, free_port, make_app, serve

from servprof import telemetry
from servprof.settings import Settings


def _load(url: str, requests: int, workers: int = 8) -> list[int]:
    """Streamed completions and plain requests from several clients at once; the status codes."""

    def one(index: int) -> int:
        with httpx.Client(timeout=30) as client:
            if index % 2:
                return client.get(url + "/hello").status_code
            with client.stream(
                "POST", url + "/v1/chat/completions", content=chat_body(max_tokens=4)
            ) as response:
                for _ in response.iter_lines():
                    pass
                return response.status_code

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, range(requests)))


def _wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout_s} s; telemetry status: {telemetry.status()}")
        time.sleep(0.05)


def _observer(
    tmp_path: Path,
    monkeypatch: Any,
    endpoint: str,
    protocol: str = "http/protobuf",
    timeout_s: str = "1",
    **bsp: str,
) -> Any:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the SDK's batch processor reads OTEL_BSP_*
    for name, value in bsp.items():
        monkeypatch.setenv(name, value)
    environ = {
        "SERVPROF_TELEMETRY_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": timeout_s,
    }
    return telemetry.create_observer(Settings(out_dir=tmp_path), environ=environ)


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_connection_refused_costs_no_request(tmp_path: Path, monkeypatch: Any, protocol: str) -> None:
    port = free_port()  # nothing listens there
    endpoint = f"http://127.0.0.1:{port}" + ("/v1/traces" if protocol == "http/protobuf" else "")
    observer = _observer(tmp_path, monkeypatch, endpoint, protocol)
    app, keeper = behind_middleware(make_app(), observer, tmp_path)
    try:
        with serve(app) as url:
            statuses = _load(url, 40)
            assert statuses == [200] * 40
            keeper.wait_records(40)
            _wait_until(lambda: _settled(telemetry.status()) == 40)  # every span tried
        status = telemetry.status()
        assert status["spans_exported"] == 0
        assert status["spans_dropped"] >= status["spans_export_failed"] > 0
        assert observer.dropped_spans == status["spans_dropped"]
        assert (
            app.runtime.status()["observers"]["dropped_spans"] == status["spans_dropped"]
        )  # /servprof/status
    finally:
        telemetry.shutdown()


def test_hung_backend_fills_the_bounded_queue_and_drops_are_counted(
    tmp_path: Path, monkeypatch: Any, caplog: Any
) -> None:
    # A backend that accepts connections and never answers: every export waits out its timeout.
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)
        endpoint = f"http://127.0.0.1:{hung.getsockname()[1]}/v1/traces"
        observer = _observer(
            tmp_path,
            monkeypatch,
            endpoint,
            timeout_s="0.3",
            OTEL_BSP_MAX_QUEUE_SIZE="8",
            OTEL_BSP_MAX_EXPORT_BATCH_SIZE="4",
        )
        app, keeper = behind_middleware(make_app(), observer, tmp_path)
        try:
            with serve(app) as url:
                statuses = _load(url, 80)
            assert statuses == [200] * 80
            status = telemetry.status()
            assert status["spans_ended"] == 80
            assert status["spans_dropped_queue_full"] > 0
            assert status["spans_exported"] == 0
            # Dropping is quiet: one line from servprof, not one SDK warning per span.
            full = [r.getMessage() for r in caplog.records if "queue full" in r.getMessage().lower()]
            assert len(full) == 1 and full[0].startswith("servprof: span queue full (8)"), full
        finally:
            telemetry.shutdown()


def test_backend_restart_mid_load(tmp_path: Path, monkeypatch: Any) -> None:
    receiver = OtlpHttpReceiver()
    receiver.start()
    observer = _observer(tmp_path, monkeypatch, receiver.endpoint)
    app, keeper = behind_middleware(make_app(), observer, tmp_path)
    try:
        with serve(app) as url:
            assert _load(url, 20) == [200] * 20
            _wait_until(lambda: len(receiver.spans) == 20)

            receiver.stop()
            assert _load(url, 20) == [200] * 20
            # Every span of that load has been tried (and failed) before the backend returns.
            _wait_until(
                lambda: _settled(telemetry.status()) == 40 and telemetry.status()["spans_export_failed"] > 0
            )

            receiver.start()  # same port, as a restarted collector
            failed_before = telemetry.status()["spans_export_failed"]
            assert _load(url, 20) == [200] * 20
            last_ids = {record.request_id for record in keeper.wait_records(60)[-20:]}
            _wait_until(lambda: last_ids <= _received_request_ids(receiver))
            _wait_until(lambda: _settled(telemetry.status()) == 60)  # counted once export returned
        status = telemetry.status()
        assert status["spans_export_failed"] == failed_before > 0
        assert status["spans_exported"] == len(receiver.spans) >= 40
        assert status["spans_exported"] + status["spans_dropped"] == status["spans_ended"] == 60
    finally:
        receiver.stop()
        telemetry.shutdown()


def _received_request_ids(receiver: OtlpHttpReceiver) -> set[str]:
    return {
        a.value.string_value
        for span in list(receiver.spans)
        for a in span.attributes
        if a.key == "servprof.request_id"
    }


def test_spans_and_genai_metrics_reach_an_otlp_http_receiver(tmp_path: Path, monkeypatch: Any) -> None:
    receiver = OtlpHttpReceiver()
    receiver.start()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    # One base endpoint: the SDK exporters add /v1/traces and /v1/metrics to it.
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.base_url}
    observer = telemetry.create_observer(Settings(out_dir=tmp_path), environ=environ)
    app, keeper = behind_middleware(make_app(), observer, tmp_path)
    try:
        with serve(app) as url:
            assert _load(url, 6) == [200] * 6  # 3 streamed completions, 3 plain requests
            keeper.wait_records(6)
    finally:
        telemetry.shutdown()  # exports what the metric reader collected
        receiver.stop()
    assert len(receiver.spans) == 6
    histograms = {m.name: m.histogram for m in receiver.metrics}
    assert set(histograms) == {
        "gen_ai.server.request.duration",
        "gen_ai.server.time_to_first_token",
        "gen_ai.server.time_per_output_token",
    }
    assert sum(p.count for p in histograms["gen_ai.server.request.duration"].data_points) == 3
    assert list(histograms["gen_ai.server.time_to_first_token"].data_points[0].explicit_bounds)[:3] == [
        0.001,
        0.005,
        0.01,
    ]


def _settled(status: dict[str, Any]) -> int:
    return status["spans_exported"] + status["spans_export_failed"] + status["spans_dropped_queue_full"]
