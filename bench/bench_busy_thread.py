"""What an unsampled request costs through the middleware while another thread runs Python.

A call on the request's path that releases the GIL (a syscall: os.urandom, file or socket I/O)
lets a thread running Python take it, and the request then waits for that thread's switch
interval (5 ms by default) to get it back. A model loop, a tokenizer or an exporter thread beside
the event loop is the usual case. Drives the real Starlette app in one asyncio loop (no network),
alone, behind ServprofMiddleware, and behind it with its telemetry observer (no-op exporter),
each in turn for --rounds rounds, with a thread that spins in pure Python beside it; prints, per
set-up, the median microseconds per request and how often the busy thread ran between two
requests (each time: the serving thread gave the GIL up on a request's path, or was made to at
the switch interval). The app alone is the baseline of the same run.

    .venv/bin/python bench/bench_busy_thread.py [--rounds 5] [--requests 500] [--switch-ms 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from rich.console import Console
from rich.table import Table
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from servprof.middleware import ServprofMiddleware
from servprof.settings import Settings
from servprof.telemetry import create_observer


class _NoExport(SpanExporter):
    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class BusyThread:
    """Spins in pure Python, counting the times it ran between two requests."""

    def __init__(self) -> None:
        self.requests_done = 0
        self.ran_between = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = -1
        while not self._stop:
            if self.requests_done != last:
                self.ran_between += 1
                last = self.requests_done

    def __enter__(self) -> BusyThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop = True
        self._thread.join(timeout=30)


async def drive(app: Any, busy: BusyThread, count: int) -> float:
    """Microseconds per request over ``count`` GET requests."""
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    start = time.perf_counter_ns()
    for _ in range(count):
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                 "scheme": "http", "path": "/", "raw_path": b"/", "query_string": b"", "root_path": "",
                 "headers": [(b"host", b"bench")], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        await app(scope, receive, send)
        busy.requests_done += 1
    return (time.perf_counter_ns() - start) / count / 1000


def set_ups(out_dir: str) -> dict[str, Any]:
    async def hello(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/", hello)])
    settings = Settings(out_dir=out_dir, telemetry=False, warmup=False)
    with_telemetry = ServprofMiddleware(app, settings)
    observer = create_observer(Settings(out_dir=out_dir), environ={"OTEL_METRICS_EXPORTER": "none"},
                               span_exporter=_NoExport())
    if observer is not None:
        with_telemetry.runtime.observers.append(observer)
    return {"app alone": app, "servprof": ServprofMiddleware(app, settings), "servprof + telemetry": with_telemetry}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--switch-ms", type=float, default=5.0, help="sys.setswitchinterval, in ms")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out_dir:
        apps = set_ups(out_dir)
        for app in apps.values():  # first calls import and warm what they use
            asyncio.run(drive(app, BusyThread(), 50))
        times: dict[str, list[float]] = {name: [] for name in apps}
        handoffs: dict[str, int] = dict.fromkeys(apps, 0)
        previous = sys.getswitchinterval()
        sys.setswitchinterval(args.switch_ms / 1000)
        try:
            with BusyThread() as busy:
                for _ in range(args.rounds):
                    for name, app in apps.items():  # in turn: drift hits every set-up alike
                        busy.ran_between = 0
                        times[name].append(asyncio.run(drive(app, busy, args.requests)))
                        handoffs[name] += busy.ran_between
        finally:
            sys.setswitchinterval(previous)
    table = Table(title=f"{args.requests} requests x {args.rounds} rounds, a busy thread beside, "
                        f"switch interval {args.switch_ms:g} ms")
    for column in ("set-up", "median us/request", "x app alone", "busy thread ran between requests"):
        table.add_column(column, justify="left" if column == "set-up" else "right")
    base = statistics.median(times["app alone"])
    for name in apps:
        median = statistics.median(times[name])
        table.add_row(name, f"{median:.1f}", f"{median / base:.2f}", str(handoffs[name]))
    Console(width=120).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
