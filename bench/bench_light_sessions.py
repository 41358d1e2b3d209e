"""Light sessions against deep windows and full capture: steps captured, loop stall, throughput.

For each server (servprof's demo at batch 16, and the two unmarked test servers of the zero-touch
issue: transformers ``generate`` + ``TextIteratorStreamer``, a hand-written decode loop), in a fresh
process: the server runs under uvicorn with ServprofMiddleware and a 1 ms ticker on its event loop
(bench_sampling_lag.TickedServer); bench/stream_load.py streams completions from its clients in
another process. Each case sets servprof's settings, then, ``--repeat`` times, measures an unsampled
window and orders one session (``POST /servprof/sample?n=1``, ``&tier=deep`` for a deep window):

* light, ``light_max_steps=32``; light at the default 256 (event budget on, as shipped); light at
  256 with the event budget lifted (what 256 steps cost when nothing stops the session earlier);
* a deep window of ``deep_steps=2`` (every op);
* full capture as before light sessions existed: ``tier="deep"``, ``max_session_steps=32``, the
  default event budget.

Per session: stop reason, steps (the sampled request's streamed steps at the stop, the analysis's
``model_steps``, the trace's ``decode_step`` ranges), events / budget, servprof's timed stop and
export, and the loop's longest stall over the stop/export window, over the whole session (start
to analysis done) and over the unsampled window before it. Then throughput: unsampled windows
alternate with windows in which a light session is ordered every ``--every-s`` seconds; output
tokens/s (streamed chunks counted by the load generator) of each sampled window as a ratio of the
mean of the unsampled windows either side. The demo's clients send ``ignore_eos``, so a sampled
request streams its ``--max-tokens`` (320: a session can reach 256 steps).

Goals (issue 17): a light session of >= 32 decode steps with the loop's max stall <= 5 ms, >= 256
steps with <= 20 ms; a deep window of 2 steps <= 20 ms; throughput >= 0.95 of unsampled while
light sessions run every 10 s. The machine may be shared: read the ratios, not the absolutes.

    .venv/bin/python bench/bench_light_sessions.py [--servers demo,hf,loop] [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gzip
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import stream_load  # noqa: E402  (the streaming clients, in their own process)
from bench_sampling_lag import TICK_S, TickedServer  # noqa: E402  (a 1 ms ticker on the serving loop)
from bench_zero_touch import SERVERS, _num, _rate  # noqa: E402  (also puts tests/ on sys.path)

TOKEN = "bench-token"
NO_BUDGET = 10**9
# (key, label, settings overrides on the run's base settings, tier asked for in the order)
CASES: list[tuple[str, str, dict[str, Any], str | None]] = [
    ("light32", "light, light_max_steps=32", {"light_max_steps": 32}, None),
    ("light256", "light, 256 steps (default), event budget on", {}, None),
    ("light256_nobudget", "light, 256 steps, event budget off", {"max_session_events": NO_BUDGET}, None),
    ("deep2", "deep window, deep_steps=2 (?tier=deep)", {}, "deep"),
    ("full32", "full capture: tier=deep, 32 steps, budget on", {"tier": "deep", "max_session_steps": 32}, None),
]
QUICK_CASES = ("light32", "light256", "deep2")
GOALS = {"light32": (32, 5.0), "light256": (256, 20.0), "light256_nobudget": (256, 20.0), "deep2": (None, 20.0)}
CAPTURE_STATES = ("starting", "capturing", "stopping", "exporting")
STOP_MARGIN_NS = 2_000_000  # around the stop/export window: the bookkeeping just before and after


# --- one server, in a fresh process --------------------------------------------------------------------


def _build_app(name: str, args: argparse.Namespace) -> Any:
    if name == "demo":
        from servprof.demo.app import create_app
        from servprof.demo.config import DemoConfig

        return create_app(DemoConfig(size="tiny", device=args.device, servprof=False, max_batch=args.demo_batch))
    return importlib.import_module(SERVERS[name]).create_app()


def _servprof_of(app: Any) -> Any:
    from servprof.middleware import ServprofMiddleware

    middleware = app.middleware_stack  # built at the server's start
    while not isinstance(middleware, ServprofMiddleware):
        middleware = middleware.app
    return middleware


def _stall(samples: list[tuple[int, int, str]], lo_ns: int, hi_ns: int) -> float:
    """The longest loop stall (ms) that overlaps [lo_ns, hi_ns] (perf_counter_ns): a ticker sample
    at t with lag L stands for the loop not running from t - L - tick to t."""
    tick = int(TICK_S * 1e9)
    return max((lag for t, lag, _ in samples if t >= lo_ns and t - lag - tick <= hi_ns), default=0) / 1e6


def _window_max(samples: list[tuple[int, int, str]], lo_ns: int, hi_ns: int) -> float:
    return max((lag for t, lag, _ in samples if lo_ns <= t <= hi_ns), default=0) / 1e6


def _by_state(samples: list[tuple[int, int, str]], lo_ns: int, hi_ns: int) -> dict[str, float]:
    """The longest lag per session state the ticker saw (the state when the loop ran again)."""
    worst: dict[str, float] = {}
    for t, lag, state in samples:
        if lo_ns <= t <= hi_ns:
            worst[state] = max(worst.get(state, 0.0), lag / 1e6)
    return {state: round(ms, 2) for state, ms in worst.items()}


def _trace_counts(path: str | None) -> tuple[int | None, int | None]:
    """(events, decode_step ranges) of a stored trace: the server's own decode_step phases where it
    marks them, else servprof's automatic ones."""
    if not path or not Path(path).exists():
        return None, None
    with gzip.open(path, "rb") as file:
        events = orjson.loads(file.read())["traceEvents"]
    names = [e.get("name", "") for e in events if e.get("cat") == "user_annotation"]
    marked = sum(n.startswith("servprof:decode_step|") for n in names)
    return len(events), marked or sum(n.startswith("servprof:auto.decode_step|") for n in names)


def _analysis_summary(session: dict[str, Any]) -> dict[str, Any]:
    path = session.get("trace_file")
    if not path:
        return {}
    try:
        return orjson.loads(Path(path.replace(".pt.trace.json.gz", ".analysis.json")).read_bytes())["summary"]
    except (OSError, ValueError, KeyError):
        return {}


class Orders:
    """On-demand orders to one server, and waits for the session each one starts."""

    def __init__(self, url: str, middleware: Any):
        self.url, self.middleware = url, middleware
        self.client = httpx.Client(timeout=30)
        self.counters = middleware.runtime.counters

    def finished(self) -> int:  # the history keeps only the last 10 sessions; the counters count all
        return self.counters["sessions_done"] + self.counters["sessions_failed"]

    def order(self, n: int, tier: str | None) -> None:
        query = f"n={n}" + (f"&tier={tier}" if tier else "")
        response = self.client.post(f"{self.url}/servprof/sample?{query}", headers={"Authorization": f"Bearer {TOKEN}"})
        response.raise_for_status()

    def session(self, n: int, tier: str | None, timeout_s: float = 120.0) -> dict[str, Any]:
        """Order one session and return its description once it is done (analysis included)."""
        before = self.finished()
        self.order(n, tier)
        deadline = time.monotonic() + timeout_s
        while self.finished() == before:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no session finished within {timeout_s:.0f} s")
            time.sleep(0.02)
        return dict(self.middleware.runtime.history[-1])


def _measure_session(orders: Orders, ticker: Any, args: argparse.Namespace, tier: str | None) -> dict[str, Any]:
    """An unsampled window, then one ordered session: its figures."""
    u0 = time.perf_counter_ns()
    time.sleep(args.window_s)
    s0 = time.perf_counter_ns()
    session = orders.session(args.requests, tier)
    s1 = time.perf_counter_ns()
    overhead = session.get("servprof_overhead_ms") or {}
    summary = _analysis_summary(session)
    events, decode_ranges = _trace_counts(session.get("trace_file"))  # now: retention may remove it later
    row = {"tier": session.get("tier"), "stop_reason": session.get("stop_reason"), "error": session.get("error"),
           "steps_streamed": session.get("steps_streamed_at_stop"), "model_steps": summary.get("model_steps"),
           "decode_ranges": decode_ranges, "events": summary.get("event_count", events),
           "budget": session.get("event_budget"), "duration_s": session.get("duration_s"),
           "stop_ms": overhead.get("stop"), "export_ms": overhead.get("export"),
           "analysis_ms": overhead.get("analysis"), "collection_cut": session.get("collection_cut"),
           "stop_stall_ms": None, "session_max_ms": _window_max(ticker.samples, s0, s1),
           "before_max_ms": _window_max(ticker.samples, u0, s0), "max_ms_by_state": _by_state(ticker.samples, s0, s1)}
    start, duration = session.get("perf_start_ns"), session.get("duration_s")
    if start is not None and duration is not None and row["stop_ms"] is not None:
        end = start + int(duration * 1e9)  # stop() returned
        lo = end - int(row["stop_ms"] * 1e6) - STOP_MARGIN_NS
        hi = end + int((row["export_ms"] or 0.0) * 1e6) + STOP_MARGIN_NS
        row["stop_stall_ms"] = _stall(ticker.samples, lo, hi)
    return row


def _throughput(orders: Orders, args: argparse.Namespace) -> list[tuple[float, float]]:
    """Unsampled and sampled windows of --throughput-s, alternating (U S U ... S U), a light session
    ordered every --every-s seconds in each sampled one: (from, to) of each window, wall clock."""
    windows = []
    for index in range(2 * args.rounds + 1):
        start = time.time()
        ordered = 0
        while index % 2 and ordered * args.every_s < args.throughput_s - 1.0:
            time.sleep(max(0.0, start + ordered * args.every_s - time.time()))
            orders.order(args.requests, None)
            ordered += 1
        time.sleep(max(0.0, start + args.throughput_s - time.time()))
        windows.append((start, time.time()))
    return windows


def _throughput_rounds(windows: list[tuple[float, float]], bins: dict[str, int], bin_s: float,
                       args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each sampled window against the mean of the unsampled windows either side (load drifts)."""
    rates = [_rate(bins, bin_s, lo, hi) for lo, hi in windows]
    rounds = []
    for i in range(1, len(rates) - 1, 2):
        unsampled = (rates[i - 1] + rates[i + 1]) / 2
        rounds.append({"unsampled_tps": unsampled, "sampled_tps": rates[i],
                       "sessions": int((args.throughput_s - 1.0) // args.every_s) + 1,
                       "ratio": rates[i] / unsampled if unsampled else float("nan")})
    return rounds


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    name = args.one
    out_dir = Path(tempfile.mkdtemp(prefix="servprof-light-"))
    app = _build_app(name, args)
    from servprof.middleware import ServprofMiddleware

    # deep_every=0: light sessions stay light unless an order asks for a deep window.
    app.add_middleware(ServprofMiddleware, out_dir=out_dir, telemetry=False, control_token=TOKEN,
                       on_demand_min_interval_s=0.1, deep_every=0, trace_max_files=100,
                       analysis=not args.no_analysis)
    served = TickedServer(app)
    url, ticker = served.url, served.ticker
    load_start = os.getloadavg()[0]
    users = args.demo_users if name == "demo" else args.users
    cases = [c for c in CASES if c[0] in args.cases]
    total_s = 10 + len(cases) * args.repeat * (args.window_s + 20) + (2 * args.rounds + 1) * args.throughput_s + 30
    load_out = out_dir / "load.json"
    load = stream_load.start(url, load_out, users, total_s, args.max_tokens, ignore_eos=True)
    rows: dict[str, list[dict[str, Any]]] = {}
    windows: list[tuple[float, float]] = []
    try:
        time.sleep(args.warm_s)
        middleware = _servprof_of(app)
        base = middleware.runtime.settings
        orders = Orders(url, middleware)
        for key, _label, overrides, tier in cases:
            middleware.runtime.settings = dataclasses.replace(base, **overrides)
            rows[key] = [_measure_session(orders, ticker, args, tier) for _ in range(args.repeat)]
        middleware.runtime.settings = base
        windows = _throughput(orders, args)
        time.sleep(1.0)  # the last window's bins are complete
    finally:
        result = stream_load.stop(load, load_out)
        served.stop()
    rounds = _throughput_rounds(windows, result["bins"], result["bin_s"], args)
    return {"server": name, "users": users, "every_s": args.every_s, "max_tokens": args.max_tokens,
            "loadavg": [load_start, os.getloadavg()[0]], "requests": result.get("requests"),
            "errors": result.get("errors", 0), "cases": rows, "throughput": rounds}


# --- the parent: runs each server, prints tables and one JSON line ------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="demo,hf,loop", help="comma-separated: demo, hf, loop")
    parser.add_argument("--quick", action="store_true",
                        help="one session per case, light 32/256 and the deep window only, one 10 s throughput round")
    parser.add_argument("--repeat", type=int, default=3, help="sessions per case")
    parser.add_argument("--window-s", type=float, default=3.0, help="unsampled seconds before each session")
    parser.add_argument("--throughput-s", type=float, default=20.0, help="seconds of each throughput window")
    parser.add_argument("--rounds", type=int, default=3,
                        help="sampled throughput windows, each between two unsampled ones")
    parser.add_argument("--every-s", type=float, default=10.0, help="a light session every this many seconds")
    parser.add_argument("--requests", type=int, default=1, help="requests per ordered session")
    parser.add_argument("--demo-users", type=int, default=16, help="streaming clients of the demo")
    parser.add_argument("--demo-batch", type=int, default=16, help="the demo's largest decode batch")
    parser.add_argument("--users", type=int, default=4, help="streaming clients of the unmarked servers")
    parser.add_argument("--max-tokens", type=int, default=320, help="per request: above 256, so one can stream 256 steps")
    parser.add_argument("--warm-s", type=float, default=5.0, help="load before the first measurement")
    parser.add_argument("--no-analysis", action="store_true",
                        help="servprof's analysis child off (analysis=False): what capture alone costs")
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu", help="the demo's device")
    parser.add_argument("--one", choices=sorted(["demo", *SERVERS]), help=argparse.SUPPRESS)
    parser.add_argument("--cases", default=",".join(c[0] for c in CASES), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        faulthandler.enable()  # a crash in the server process says where
        args.cases = args.cases.split(",")
        Path(args.out).write_bytes(orjson.dumps(run_one(args), option=orjson.OPT_SERIALIZE_NUMPY))
        # Leave without the interpreter's teardown: Kineto's threads, started off the main thread,
        # can abort the process at exit (bench_zero_touch.py).
        os._exit(0)
    if args.quick:
        args.repeat, args.window_s, args.throughput_s, args.rounds, args.warm_s = 1, 2.0, 10.0, 1, 4.0
    if min(args.repeat, args.rounds, args.requests, args.users, args.demo_users) < 1 or args.every_s <= 0:
        parser.error("--repeat, --rounds, --requests, --users, --demo-users and --every-s must be positive")
    cases = QUICK_CASES if args.quick else tuple(c[0] for c in CASES)
    console = Console(width=150)
    runs = []
    for name in args.servers.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
            path = out.name
        command = [sys.executable, __file__, "--one", name, "--out", path, "--cases", ",".join(cases)]
        command += ["--no-analysis"] if args.no_analysis else []
        for option in ("repeat", "window_s", "throughput_s", "rounds", "every_s", "requests", "demo_users",
                       "demo_batch", "users", "max_tokens", "warm_s", "device"):
            command += ["--" + option.replace("_", "-"), str(getattr(args, option))]
        console.print(f"running {name} ...")
        started = time.monotonic()
        log = Path(path).with_suffix(".stderr.txt")
        with log.open("wb") as stderr:
            done = subprocess.run(command, env={**os.environ, "KINETO_LOG_LEVEL": "6"}, stderr=stderr)
        if not Path(path).stat().st_size:
            console.print(f"[red]{name} run failed (exit status {done.returncode})[/red], its stderr in {log}: "
                          f"{log.read_text(errors='replace')[-3000:]}")
            continue
        log.unlink()
        runs.append(orjson.loads(Path(path).read_bytes()))
        os.unlink(path)
        console.print(f"  {time.monotonic() - started:.0f} s")
    verdicts = {}
    for run in runs:
        verdicts[run["server"]] = _print_run(console, run)
    print(orjson.dumps({"bench": "light_sessions", "args": {k: v for k, v in vars(args).items() if k != "one"},
                        "runs": runs, "goals": verdicts}).decode())
    return 0


def _med(values: list[Any]) -> str:
    numbers = [float(v) for v in values if v is not None]
    if not numbers:
        return "-"
    median = statistics.median(numbers)
    return f"{median:.1f}" if len(numbers) == 1 else f"{median:.1f} ({min(numbers):.1f}..{max(numbers):.1f})"


def _state_max(row: dict[str, Any], states: tuple[str, ...]) -> float:
    return max((ms for state, ms in row["max_ms_by_state"].items() if state in states), default=0.0)


def _steps(row: dict[str, Any]) -> float:
    """Decode steps a session captured, for the goals: the trace's model steps (a batched step of
    the demo counts once; the unmarked servers step once per request thread)."""
    return _num(row.get("model_steps") if row.get("model_steps") is not None else row.get("decode_ranges"))


def _print_run(console: Console, run: dict[str, Any]) -> dict[str, Any]:
    title = (f"{run['server']}: {run['users']} streaming clients, max_tokens {run['max_tokens']}; "
             f"{run['requests']} requests, {run['errors']} errors; load average {run['loadavg'][0]:.1f} at the start, "
             f"{run['loadavg'][1]:.1f} at the end")
    table = Table(title=title)
    for column in ("case", "stop reason", "steps streamed / model steps / decode ranges", "events / budget",
                   "stop + export ms (timed)", "stall in stop/export ms", "max lag ms: capture..export / analysis / before",
                   "goal: steps, stall"):
        table.add_column(column, justify="left" if column in ("case", "stop reason") else "right")
    verdicts: dict[str, Any] = {}
    for key, label, _overrides, _tier in CASES:
        rows = run["cases"].get(key)
        if not rows:
            continue
        reasons = sorted({str(r["stop_reason"]) + (" (cut)" if r.get("collection_cut") else "") for r in rows})
        errors = [r["error"] for r in rows if r.get("error")]
        stalls = [r["stop_stall_ms"] for r in rows]
        steps = [_steps(r) for r in rows]
        goal = GOALS.get(key)
        verdict = "-"
        if goal is not None:
            min_steps, max_stall = goal
            met = sum((min_steps is None or s >= min_steps) and st is not None and st <= max_stall and not r.get("error")
                      for s, st, r in zip(steps, stalls, rows, strict=True))
            verdict = f"{'>= ' + str(min_steps) + ' steps, ' if min_steps else ''}<= {max_stall:.0f} ms: {met}/{len(rows)}"
            verdicts[key] = {"met": met, "sessions": len(rows)}
        table.add_row(
            label, ", ".join(reasons) + (f" [red]{errors[0]}[/red]" if errors else ""),
            f"{_med([r['steps_streamed'] for r in rows])} / {_med([r['model_steps'] for r in rows])} / "
            f"{_med([r['decode_ranges'] for r in rows])}",
            f"{_med([r['events'] for r in rows])} / {_med([r['budget'] for r in rows])}",
            f"{_med([r['stop_ms'] for r in rows])} + {_med([r['export_ms'] for r in rows])}",
            _med(stalls),
            f"{_med([_state_max(r, CAPTURE_STATES) for r in rows])} / {_med([_state_max(r, ('analysing',)) for r in rows])}"
            f" / {_med([r['before_max_ms'] for r in rows])}",
            verdict)
    console.print(table)
    for i, round_ in enumerate(run["throughput"], 1):
        ratio = _num(round_["ratio"])
        console.print(f"  throughput round {i}: unsampled windows either side {_num(round_['unsampled_tps']):.0f} tok/s, "
                      f"with a light session ordered every {run['every_s']:.0f} s ({round_['sessions']} orders) "
                      f"{_num(round_['sampled_tps']):.0f} tok/s -> {ratio:.3f} (goal >= 0.95)")
    ratios = [_num(r["ratio"]) for r in run["throughput"]]
    if ratios:
        verdicts["throughput"] = {"ratio": statistics.median(ratios), "met": statistics.median(ratios) >= 0.95}
    console.print("  medians (min..max) over the sessions; goals per session: light >= 32 model steps with a stall "
                  "<= 5 ms in its stop/export window, >= 256 with <= 20 ms; a deep window <= 20 ms")
    return verdicts


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    raise SystemExit(main())
