"""What sampling costs a serving process under concurrent streaming load.

Serves the demo LLM server (tiny model, CPU or GPU) behind ServprofMiddleware with uvicorn
in this process, drives it with the locust harness (its own process: closed loop, N users
streaming completions), and runs a 1 ms ticker inside the serving event loop. It measures
event-loop lag and output tokens/s with no sampling, then for each session budget measures
an unsampled window, orders one on-demand session (``POST /servprof/sample``) and reports
lag per session state (starting, capturing, stopping, exporting, analysing) and the
throughput over the sampled window (session, analysis, and the rest of an equally long
window) as a ratio of the unsampled window just before. Goals (issue 3): max added lag <= 20 ms,
p99 <= 5 ms, throughput >= 0.9 of unsampled.

    .venv/bin/python bench/bench_sampling_lag.py [--users 8] [--baseline-s 8] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import faulthandler
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import uvicorn
from rich.console import Console
from rich.table import Table

from servprof.capture import get_controller
from servprof.demo.app import create_app
from servprof.demo.config import DemoConfig
from servprof.middleware import ServprofMiddleware
from servprof.settings import Settings

TOKEN = "bench-token"
TICK_S = 0.001
# (label, overrides): the budgets compared; overrides accumulate from row to row. The first session runs on the assumed event rate
# (Settings.assumed_events_per_s); later ones on the rate the previous session measured.
BUDGETS: list[tuple[str, dict[str, Any]]] = [
    ("events=2000 (default)", {}),
    ("events=2000, analysis off", {"analysis": False}),
    ("events=1000", {"max_session_events": 1000, "analysis": True}),
    ("events=2000", {"max_session_events": 2000}),
    ("events=4000", {"max_session_events": 4000}),
    ("events=8000", {"max_session_events": 8000}),
    ("events=16000", {"max_session_events": 16000}),
    ("steps=32, no event budget", {"max_session_events": 10**9}),
]


class TickerApp:
    """Wraps the served app; at lifespan start-up runs a 1 ms ticker on the serving loop."""

    def __init__(self, app: Any):
        self.app = app
        self.samples: list[tuple[int, int, str]] = []  # (perf ns, lag ns, session state)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            asyncio.get_running_loop().create_task(self._tick())
        await self.app(scope, receive, send)

    async def _tick(self) -> None:
        controller = get_controller()
        interval = int(TICK_S * 1e9)
        while True:
            before = time.perf_counter_ns()
            await asyncio.sleep(TICK_S)
            now = time.perf_counter_ns()
            session = controller.session
            self.samples.append((now, max(0, now - before - interval), session.state if session else "none"))


class TickedServer:
    """`app` under uvicorn on a free loopback port with a TickerApp around it; returns once the
    server is up and servprof's process-wide profiler is warm. stop() ends it."""

    def __init__(self, app: Any) -> None:
        self.ticker = TickerApp(app)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self.ticker, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        while not self._server.started or not get_controller().warm:
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)


def lag_stats(lags_ns: list[int]) -> tuple[float, float, float]:
    if not lags_ns:
        return float("nan"), float("nan"), float("nan")
    values = np.asarray(lags_ns) / 1e6
    return float(np.median(values)), float(np.percentile(values, 99)), float(values.max())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=8, help="concurrent streaming clients")
    parser.add_argument("--baseline-s", type=float, default=8.0, help="seconds of unsampled load measured")
    parser.add_argument("--window-s", type=float, default=4.0, help="unsampled seconds measured before each session")
    parser.add_argument("--requests", type=int, default=4, help="requests per ordered session")
    parser.add_argument("--repeat", type=int, default=3, help="sessions per budget (medians are reported)")
    parser.add_argument("--details", action="store_true", help="also print lag per session state")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--size", default="tiny", help="demo model size (tiny, small, 1b)")
    parser.add_argument("--budgets", type=int, nargs="+", default=None,
                        help=f"indexes of the budgets to run (0..{len(BUDGETS) - 1}; default all)")
    parser.add_argument("--status-out", type=Path, default=None,
                        help="write the server's /servprof/status at the end here (per-event stop cost, timings)")
    args = parser.parse_args(argv)
    if args.users < 1 or args.baseline_s <= 0 or args.requests < 1 or args.repeat < 1:
        parser.error("--users, --baseline-s, --requests and --repeat must be positive")
    console = Console(width=130)

    out_dir = Path(tempfile.mkdtemp(prefix="servprof-bench-"))
    budgets = [BUDGETS[i] for i in args.budgets] if args.budgets else BUDGETS
    demo = create_app(DemoConfig(size=args.size, device=args.device, servprof=False, max_batch=max(16, args.users)))
    demo_server = demo.state.demo
    middleware = ServprofMiddleware(demo, Settings(out_dir=out_dir, telemetry=False, control_token=TOKEN,
                                                   on_demand_min_interval_s=0.1, max_on_demand=64))
    served = TickedServer(middleware)
    url, ticker = served.url, served.ticker

    total_s = args.baseline_s + 5 + len(budgets) * args.repeat * (40 + args.window_s)
    locust = subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", "servprof/harness/locustfile.py", "-H", url, "--headless",
         "-u", str(args.users), "-r", str(args.users), "-t", f"{int(total_s)}s", "--only-summary",
         "--max-output-tokens", str(args.max_tokens), "--loglevel", "ERROR"],
        cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, "KINETO_LOG_LEVEL": "6"})
    rows = []
    try:
        time.sleep(3)  # users ramp up
        tokens_0, t0 = demo_server.engine.stats.output_tokens, time.perf_counter_ns()
        time.sleep(args.baseline_s)
        tokens_1, t1 = demo_server.engine.stats.output_tokens, time.perf_counter_ns()
        base_tps = (tokens_1 - tokens_0) / ((t1 - t0) / 1e9)
        base_lags = [lag for ts, lag, state in ticker.samples if t0 <= ts <= t1 and state == "none"]
        rows.append(("no sampling", "-", base_lags, base_tps, base_tps, base_lags))
        with httpx.Client(timeout=30) as client:
            for label, overrides in budgets:
                middleware.runtime.settings = dataclasses.replace(middleware.runtime.settings, **overrides)
                for _ in range(args.repeat):
                    rows.append(_one_session(args, url, client, middleware, demo_server, ticker, label))
                    console.print(f"{label}: session {rows[-1][1].get('stop_reason')}")
            if args.status_out:
                args.status_out.write_bytes(orjson.dumps(client.get(f"{url}/servprof/status", headers={
                    "Authorization": f"Bearer {TOKEN}"}).json(), option=orjson.OPT_INDENT_2))
    finally:
        locust.terminate()
        try:
            locust.wait(10)
        except subprocess.TimeoutExpired:
            locust.kill()
            locust.wait(10)
        served.stop()
    if args.details:
        _report(console, rows, base_tps, base_lags)
    _summary(console, rows)
    return 0


def _one_session(args: argparse.Namespace, url: str, client: httpx.Client, middleware: ServprofMiddleware,
                 demo_server: Any, ticker: TickerApp, label: str) -> tuple[Any, ...]:
    """An unsampled window, then one ordered session and the rest of an equally long window."""
    # An unsampled window right before each session: the machine's load drifts.
    tokens_p, tp = demo_server.engine.stats.output_tokens, time.perf_counter_ns()
    time.sleep(args.window_s)
    counters = middleware.runtime.counters

    def finished() -> int:  # the history keeps only the last 10 sessions; the counters count all
        return counters["sessions_done"] + counters["sessions_failed"]

    done_before = finished()
    tokens_a, ta = demo_server.engine.stats.output_tokens, time.perf_counter_ns()
    pre_tps = (tokens_a - tokens_p) / ((ta - tp) / 1e9)
    pre_lags = [lag for ts, lag, state in ticker.samples if tp <= ts <= ta and state == "none"]
    response = client.post(f"{url}/servprof/sample?n={args.requests}",
                           headers={"Authorization": f"Bearer {TOKEN}"})
    response.raise_for_status()
    deadline = time.monotonic() + 120
    while finished() == done_before and time.monotonic() < deadline:
        time.sleep(0.02)
    if finished() == done_before:
        current = get_controller().session
        print(f"no session finished within 120 s: current {current.description() if current else None}, "
              f"sampler {middleware.runtime.sampler.status()}, skipped {middleware.runtime.skipped_by_reason}",
              file=sys.stderr)
        faulthandler.dump_traceback(all_threads=True)
    # The sampled window is at least as long as the unsampled one, so both average alike.
    time.sleep(max(0.0, args.window_s - (time.perf_counter_ns() - ta) / 1e9))
    tokens_b, tb = demo_server.engine.stats.output_tokens, time.perf_counter_ns()
    session = dict(middleware.runtime.history[-1]) if finished() > done_before else {}
    session["events"] = _event_count(session)  # read now: retention may delete the file later
    window = [(lag, state) for ts, lag, state in ticker.samples if ta <= ts <= tb]
    return label, session, window, (tokens_b - tokens_a) / ((tb - ta) / 1e9), pre_tps, pre_lags


def _report(console: Console, rows: list[Any], base_tps: float, base_lags: list[int]) -> None:
    base_median, base_p99, base_max = lag_stats(base_lags)
    table = Table(title="event-loop lag (ms, 1 ms ticker) and output tokens/s under streaming load")
    for column in ("budget", "stop reason", "events", "capture s", "state", "ticks", "median", "p99", "max",
                   "tok/s", "vs unsampled before"):
        table.add_column(column, justify="left" if column in ("budget", "stop reason", "state") else "right")
    table.add_row("no sampling", "-", "-", "-", "none", str(len(base_lags)), f"{base_median:.2f}",
                  f"{base_p99:.2f}", f"{base_max:.2f}", f"{base_tps:.0f}", "1.00")
    verdicts = []
    for label, session, window, tps, pre_tps, pre_lags in rows[1:]:
        events = session.get("events", "-")
        all_lags = [lag for lag, _ in window]
        span_s = session.get("duration_s") or 0.0
        for state in ("starting", "capturing", "stopping", "exporting", "analysing"):
            lags = [lag for lag, s in window if s == state]
            if lags:
                median, p99, worst = lag_stats(lags)
                table.add_row(label, str(session.get("stop_reason")), str(events), f"{span_s:.2f}", state,
                              str(len(lags)), f"{median:.2f}", f"{p99:.2f}", f"{worst:.2f}", "", "")
        pre_median, pre_p99, pre_max = lag_stats(pre_lags)
        table.add_row(label, "(unsampled, just before)", "", "", "none", str(len(pre_lags)), f"{pre_median:.2f}",
                      f"{pre_p99:.2f}", f"{pre_max:.2f}", f"{pre_tps:.0f}", "")
        median, p99, worst = lag_stats(all_lags)
        ratio = tps / pre_tps if pre_tps else float("nan")
        table.add_row(label, str(session.get("stop_reason")), str(events), f"{span_s:.2f}", "whole window",
                      str(len(all_lags)), f"{median:.2f}", f"{p99:.2f}", f"{worst:.2f}", f"{tps:.0f}", f"{ratio:.2f}")
        # servprof's own stalls: stop() and export hold the GIL (the analysis runs in another process).
        stall = max((lag for lag, s in window if s in ("starting", "stopping", "exporting")), default=0) / 1e6
        ok = stall <= 20 and p99 - pre_p99 <= 5 and ratio >= 0.9
        verdicts.append(f"{label}: worst stall at start/stop/export {stall:.1f} ms; whole-window max {worst:.1f} ms "
                        f"(unsampled before: {pre_max:.1f}), p99 {p99:.2f} ms (before: {pre_p99:.2f}), "
                        f"throughput {ratio:.2f} of unsampled -> {'meets' if ok else 'misses'} the goals")
    console.print(table)
    for line in verdicts:
        console.print(line)


def _summary(console: Console, rows: list[Any]) -> None:
    """Per budget, medians over its sessions (single sessions are noisy on a shared machine)."""
    table = Table(title="per budget: medians over its sessions (min..max)")
    for column in ("budget", "sessions", "events", "stall at start/stop/export ms", "p99 ms sampled / before",
                   "max ms sampled / before", "throughput vs before", "goals (on medians)"):
        table.add_column(column, justify="left" if column in ("budget", "goals (on medians)") else "right")
    by_label: dict[str, list[Any]] = {}
    for row in rows[1:]:
        by_label.setdefault(row[0], []).append(row)
    for label, group in by_label.items():
        events, stalls, p99s, pre_p99s, maxes, pre_maxes, ratios = [], [], [], [], [], [], []
        for _label, session, window, tps, pre_tps, pre_lags in group:
            count = session.get("events")
            if isinstance(count, (int, float)):
                events.append(count)
            stalls.append(max((lag for lag, s in window if s in ("starting", "stopping", "exporting")),
                              default=0) / 1e6)
            _, p99, worst = lag_stats([lag for lag, _ in window])
            _, pre_p99, pre_max = lag_stats(pre_lags)
            p99s.append(p99)
            pre_p99s.append(pre_p99)
            maxes.append(worst)
            pre_maxes.append(pre_max)
            ratios.append(tps / pre_tps if pre_tps else float("nan"))
        med = statistics.median
        stall, p99, pre_p99, ratio = med(stalls), med(p99s), med(pre_p99s), med(ratios)
        ok = stall <= 20 and p99 - pre_p99 <= 5 and ratio >= 0.9
        table.add_row(label, str(len(group)), f"{med(events):.0f}" if events else "-",
                      f"{stall:.1f} ({min(stalls):.1f}..{max(stalls):.1f})", f"{p99:.2f} / {pre_p99:.2f}",
                      f"{med(maxes):.1f} / {med(pre_maxes):.1f}",
                      f"{ratio:.2f} ({min(ratios):.2f}..{max(ratios):.2f})", "meets" if ok else "misses")
    console.print(table)
    console.print("goals: stall <= 20 ms (servprof's own GIL holds), p99 no more than 5 ms above the unsampled "
                  "window before, throughput >= 0.9 of it")


def _event_count(session: dict[str, Any]) -> Any:
    controller = get_controller()
    del controller  # counts live in the analysis result, read from the session file
    path = session.get("trace_file")
    if not path:
        return "-"
    result_path = Path(path.replace(".pt.trace.json.gz", ".analysis.json"))
    try:
        return orjson.loads(result_path.read_bytes())["summary"].get("event_count", "-")
    except (OSError, ValueError, KeyError):
        return "-"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    raise SystemExit(main())
