"""Nothing servprof holds is lost when the server is told to stop: real server processes, a real
SIGTERM (uvicorn shuts down gracefully, then re-raises the signal, so no interpreter-exit hook
runs), spans and metrics read back from the file exporter and from a real OTLP/HTTP receiver."""

from __future__ import annotations

import gzip
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from _process_helpers import (
    COMPLETIONS,
    demo_server_command,
    order_when_ready,
    server_env,
    server_process,
    terminate,
)
from _telemetry_helpers import OtlpHttpReceiver, free_port


def _file_spans(out: Path) -> list[dict[str, Any]]:
    path = out / "spans" / "spans.otlp.jsonl"
    assert path.is_file(), f"no spans file under {out}: {sorted(str(p) for p in out.rglob('*'))}"
    spans = []
    for line in path.read_bytes().splitlines():
        for resource in orjson.loads(line)["resourceSpans"]:
            for scope in resource["scopeSpans"]:
                for span in scope["spans"]:
                    span["attrs"] = {a["key"]: next(iter(a["value"].values())) for a in span.get("attributes", [])}
                    spans.append(span)
    return spans


def _file_metric_names(out: Path) -> set[str]:
    path = out / "metrics" / "metrics.otlp.jsonl"
    assert path.is_file(), "no metrics file"
    names = set()
    for line in path.read_bytes().splitlines():
        for resource in orjson.loads(line)["resourceMetrics"]:
            for scope in resource["scopeMetrics"]:
                names.update(metric["name"] for metric in scope["metrics"])
    return names


def _complete(base: str, count: int) -> list[str]:
    ids = []
    with httpx.Client(base_url=base, timeout=60) as client:
        for i in range(count):
            response = client.post("/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 4},
                                   headers={"x-request-id": f"shutdown-{i}"})
            assert response.status_code == 200, response.text
            ids.append(response.headers["x-request-id"])
    return ids


@pytest.mark.slow
def test_sigterm_flushes_spans_metrics_and_the_session_to_files(tmp_path: Path) -> None:
    """`SERVPROF_OUT_DIR=$d servprof demo-server`, a sample ordered, three completions, SIGTERM at
    once (well inside the batch processor's 5 s delay): every span, the metrics and the running
    session's trace are on disk."""
    out, port, log = tmp_path / "out", free_port(), tmp_path / "server.log"
    with server_process(demo_server_command(port), server_env(out), port, log) as process:
        base = f"http://127.0.0.1:{port}"
        # Four ordered, three sent: the session is still capturing when the signal comes.
        order_when_ready(base, 4)
        ids = _complete(base, COMPLETIONS)
        terminate(process, log)
    spans = _file_spans(out)
    requests = {s["attrs"].get("servprof.request_id"): s for s in spans if s["name"].startswith("POST")}
    assert set(ids) <= set(requests), (ids, sorted(requests))
    assert all(requests[rid]["attrs"]["servprof.sampled"] is True for rid in ids)
    assert "gen_ai.server.request.duration" in _file_metric_names(out)
    # The session the shutdown stopped: trace kept, files final, its analysis span exported too.
    (trace,) = (out / "traces").glob("*.pt.trace.json.gz")
    meta = orjson.loads(gzip.decompress(trace.read_bytes()))["servprof"]
    meta = orjson.loads(meta) if isinstance(meta, str) else meta
    assert meta["stop_reason"].startswith("shutdown") and meta["request_ids"] == ids
    session = orjson.loads(next((out / "traces").glob("*.session.json")).read_bytes())
    assert session["state"] == "done" and [r["request_id"] for r in session["requests"]] == ids
    assert any(s["name"] == "servprof.analysis" for s in spans)


@pytest.mark.slow
def test_sigterm_flushes_spans_and_metrics_over_otlp(tmp_path: Path) -> None:
    receiver = OtlpHttpReceiver()
    receiver.start()
    try:
        out, port, log = tmp_path / "out", free_port(), tmp_path / "server.log"
        env = server_env(out, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.base_url)
        with server_process(demo_server_command(port), env, port, log) as process:
            ids = _complete(f"http://127.0.0.1:{port}", COMPLETIONS)
            terminate(process, log)
        got = {a.value.string_value for s in receiver.spans for a in s.attributes
               if a.key == "servprof.request_id"}
        assert set(ids) <= got, (ids, got)
        assert "gen_ai.server.request.duration" in {m.name for m in receiver.metrics}
        assert not (out / "spans").exists()  # OTLP, not the file exporter
    finally:
        receiver.stop()


NO_LIFESPAN_APP = textwrap.dedent("""
    from servprof.middleware import ServprofMiddleware

    async def plain(scope, receive, send):
        # An ASGI app that knows nothing but HTTP, as many hand-written ones do.
        assert scope["type"] == "http", "only HTTP here"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    app = ServprofMiddleware(plain)
""")


@pytest.mark.slow
@pytest.mark.parametrize("lifespan", ["auto", "on"])
def test_an_app_without_lifespan_support_still_flushes_at_sigterm(tmp_path: Path, lifespan: str) -> None:
    """The app raises on the lifespan scope: servprof answers the lifespan messages for it, so the
    server starts (even with --lifespan on) and servprof still gets its shutdown."""
    (tmp_path / "plain_app.py").write_text(NO_LIFESPAN_APP)
    out, port, log = tmp_path / "out", free_port(), tmp_path / "server.log"
    env = server_env(out, SERVPROF_WARMUP="0", PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "uvicorn", "plain_app:app", "--port", str(port), "--lifespan", lifespan,
               "--log-level", "warning"]
    with server_process(command, env, port, log) as process:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            ids = [client.get("/health", headers={"x-request-id": f"plain-{i}"}).headers["x-request-id"]
                   for i in range(COMPLETIONS)]
        terminate(process, log)
    requests = {s["attrs"].get("servprof.request_id") for s in _file_spans(out)}
    assert set(ids) <= requests
