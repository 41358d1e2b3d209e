"""Soak: minutes of harness traffic against the demo server with servprof sampling every k requests.

    .venv/bin/python bench/soak.py --minutes 10 --out /tmp/soak

The server and the locust harness are started exactly as `servprof demo` starts them (its
Demo class), with SERVPROF_SAMPLE_EVERY=k, production session budgets and telemetry to the
embedded OTLP file. Every few seconds the server process is sampled (RSS, threads, child
processes, open fds) with its loop-lag probe (/demo/stats) and servprof's counters
(/servprof/status); a side thread times GET /health ten times a second, which is what a
client sees of the event loop's lag. At the end it prints a table and writes soak.json:
servprof-caused errors (goal 0), RSS growth after warm-up (goal <= 50 MB), trace dir size
vs its cap, threads/processes/fds at start and end, event-loop lag, sessions done/failed.
Not run in CI (it takes minutes); tests/test_faults.py holds the fast fault checks.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import psutil
from rich.console import Console
from rich.table import Table

from servprof.demo.run_demo import Demo, DemoError

RSS_GOAL_MB = 50.0
_MIB = 1024 * 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="minutes of load (default 10)")
    parser.add_argument("--out", type=Path, default=Path("soak-out"), help="output directory (./soak-out)")
    parser.add_argument("--users", type=int, default=8, help="harness users, closed loop (default 8)")
    parser.add_argument("--sample-every", type=int, default=25, help="SERVPROF_SAMPLE_EVERY: k (default 25)")
    parser.add_argument("--requests-per-session", type=int, default=2, help="sampled requests per session (2)")
    parser.add_argument("--trace-max-mb", type=float, default=20.0, help="trace dir cap in MiB (default 20)")
    parser.add_argument("--trace-max-files", type=int, default=20, help="trace dir cap in files (default 20)")
    parser.add_argument("--baseline-minutes", type=float, default=3.0,
                        help="minutes of the same load with sampling off first, for the lag ratio (3; 0 = none)")
    parser.add_argument("--warmup-s", type=float, default=60.0, help="RSS growth is counted after this (60 s)")
    parser.add_argument("--interval-s", type=float, default=5.0, help="seconds between process samples (5)")
    parser.add_argument("--max-output-tokens", type=int, default=64, help="cap on tokens per request (64)")
    parser.add_argument("--size", default="tiny", help="demo model size (default tiny)")
    args = parser.parse_args(argv)
    problems = [m for ok, m in [(args.minutes > 0, "--minutes must be > 0"), (args.users >= 1, "--users must be >= 1"),
                                (args.sample_every >= 1, "--sample-every must be >= 1"),
                                (args.interval_s > 0, "--interval-s must be > 0"),
                                (args.warmup_s < args.minutes * 60, "--warmup-s must be shorter than the run")] if not ok]
    if problems:
        parser.error("; ".join(problems))
    # What servprof demo's Demo class reads from its own arguments.
    args.duration, args.rate, args.device, args.inject = args.minutes * 60, 0.0, "cpu", []
    args.sample = args.requests_per_session  # Demo passes it on as SERVPROF_REQUESTS_PER_SESSION
    return args


class HealthProbe(threading.Thread):
    """GET /health at 10 Hz: its latency is how long the event loop keeps a client waiting."""

    def __init__(self, url: str) -> None:
        super().__init__(name="soak-health-probe", daemon=True)
        self.url = url
        self.latencies_s: list[float] = []
        self.failures: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10.0) as client:
            while not self.stop.wait(0.1):
                started = time.perf_counter()
                try:
                    response = client.get("/health")
                    if response.status_code != 200:
                        self.failures.append(f"HTTP {response.status_code}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                self.latencies_s.append(time.perf_counter() - started)


def process_sample(process: psutil.Process) -> dict[str, Any]:
    with process.oneshot():
        return {"rss_mb": process.memory_info().rss / _MIB, "threads": process.num_threads(),
                "children": len(process.children(recursive=True)), "fds": process.num_fds()}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def locust_failures(out: Path) -> dict[str, Any]:
    """Failures locust recorded, split into 5xx and the rest (from its failures CSV)."""
    counts = {"total": 0, "http_5xx": 0, "other": 0, "messages": []}
    path = out / "locust" / "locust_failures.csv"
    if not path.is_file():
        return counts
    with path.open(newline="") as file:
        for row in csv.DictReader(file):
            n = int(row.get("Occurrences") or 0)
            message = row.get("Error") or ""
            counts["total"] += n
            counts["http_5xx" if any(f" {code}" in message or message.startswith(str(code))
                                      for code in range(500, 600)) else "other"] += n
            counts["messages"].append(f"{n}x {message[:160]}")
    return counts


def loop_lag(demo: Demo) -> dict[str, Any] | None:
    try:
        return demo.http.get("/demo/stats", params={"steps": 0}).json()["loop_lag"]
    except Exception:  # noqa: BLE001 - a missed sample is a gap, not a failure
        return None


def soak(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """The same load twice on fresh servers: sampling off (the baseline), then sampling on."""
    baseline = None
    if args.baseline_minutes > 0:
        base_args = argparse.Namespace(**{**vars(args), "minutes": args.baseline_minutes, "sample_every": 0,
                                          "duration": args.baseline_minutes * 60, "out": args.out / "baseline",
                                          "warmup_s": min(args.warmup_s, args.baseline_minutes * 30)})
        console.print("soak: baseline with sampling off")
        baseline = run_phase(base_args, console)
    console.print("soak: sampling on")
    result = run_phase(args, console)
    result["baseline"] = baseline
    return result


def run_phase(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    os.environ.update({"SERVPROF_SAMPLE_EVERY": str(args.sample_every),
                       "SERVPROF_REQUESTS_PER_SESSION": str(args.requests_per_session),
                       "SERVPROF_TRACE_MAX_MB": f"{args.trace_max_mb:g}",
                       "SERVPROF_TRACE_MAX_FILES": str(args.trace_max_files),
                       "SERVPROF_TELEMETRY_EXPORTER": "file"})
    # Production session budgets (Settings' defaults), not the demo's long sessions.
    for name in ("SERVPROF_MAX_SESSION_EVENTS", "SERVPROF_MAX_SESSION_STEPS"):
        os.environ.setdefault(name, "")
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    demo = Demo(args, console)
    samples: list[dict[str, Any]] = []
    probe = HealthProbe(demo.url)
    exit_code: int | None = None
    try:
        console.print(f"soak: demo server ({args.size}) on {demo.url}, sampling every {args.sample_every} requests")
        demo.start_server()
        demo.wait_for_health()
        assert demo.server is not None
        server = psutil.Process(demo.server.pid)
        demo.start_locust()
        probe.start()
        start = time.monotonic()
        console.print(f"soak: {args.minutes:g} min of load from {args.users} users; samples every {args.interval_s:g} s")
        while demo.locust is not None and demo.locust.poll() is None:
            if demo.server.poll() is not None:
                raise DemoError(f"the demo server exited with {demo.server.returncode} mid-soak")
            sample = {"t_s": time.monotonic() - start, **process_sample(server), "loop_lag": loop_lag(demo)}
            status = demo.status()
            sample["counters"] = status["counters"] if status else None
            samples.append(sample)
            if len(samples) % max(1, int(60 / args.interval_s)) == 1:
                counters = sample["counters"] or {}
                console.print(f"  {sample['t_s']:6.0f} s  rss {sample['rss_mb']:.0f} MiB  threads {sample['threads']}"
                              f"  fds {sample['fds']}  requests {counters.get('requests')}"
                              f"  sessions {counters.get('sessions_done')}/{counters.get('sessions_failed')} failed")
            time.sleep(args.interval_s)
        # Sessions still in flight finish (and their children exit) before the end sample.
        time.sleep(min(args.interval_s, 5.0))
        samples.append({"t_s": time.monotonic() - start, **process_sample(server), "loop_lag": loop_lag(demo),
                        "counters": (demo.status() or {}).get("counters")})
        final_status = demo.status()
    finally:
        probe.stop.set()
        demo.stop()
        if demo.server is not None:
            exit_code = demo.server.returncode
    return summarize(args, samples, probe, final_status, exit_code)


def summarize(args: argparse.Namespace, samples: list[dict[str, Any]], probe: HealthProbe,
              status: dict[str, Any] | None, exit_code: int | None) -> dict[str, Any]:
    after_warmup = [s for s in samples if s["t_s"] >= args.warmup_s] or samples[-1:]
    rss = np.array([s["rss_mb"] for s in after_warmup])
    lags = [s["loop_lag"] for s in samples if s["loop_lag"]]
    # Mean lag per sampling interval, from the probe's running totals.
    interval_means = [(b["ns_total"] - a["ns_total"]) / max(1, b["probes"] - a["probes"]) / 1e6
                      for a, b in zip(lags, lags[1:], strict=False)]
    health_ms = np.array(probe.latencies_s) * 1000
    server_log = (args.out / "logs" / "server.log").read_text(errors="replace")
    counters = (status or {}).get("counters") or samples[-1].get("counters") or {}
    harness_path = args.out / "harness-summary.json"
    harness = orjson.loads(harness_path.read_bytes()) if harness_path.is_file() else {}
    return {
        "minutes": args.minutes, "users": args.users, "sample_every": args.sample_every,
        "requests_served": counters.get("requests"), "requests_sampled": counters.get("sampled"),
        "requests_per_s": (harness.get("completed") or 0) / (args.minutes * 60),  # the harness's, not probes
        "harness_completed": harness.get("completed"), "harness_failed": harness.get("failed"),
        "locust_failures": locust_failures(args.out), "health_probe_failures": len(probe.failures),
        "server_tracebacks": server_log.count("Traceback"), "server_exit_code": exit_code,
        "sessions_done": counters.get("sessions_done"), "sessions_failed": counters.get("sessions_failed"),
        "last_error": (status or {}).get("last_error"),
        "rss_mb_after_warmup": float(rss[0]), "rss_mb_end": float(rss[-1]), "rss_mb_max": float(rss.max()),
        "rss_growth_mb": float(rss[-1] - rss[0]), "rss_goal_mb": RSS_GOAL_MB,
        "trace_dir_mb": dir_bytes(args.out / "traces") / _MIB, "trace_cap_mb": args.trace_max_mb,
        "trace_files": len(list((args.out / "traces").glob("*.pt.trace.json.gz"))),
        "trace_cap_files": args.trace_max_files, "spans_file_mb": dir_bytes(args.out / "spans") / _MIB,
        "start": {k: samples[0][k] for k in ("rss_mb", "threads", "children", "fds")},
        "warm": {k: after_warmup[0][k] for k in ("rss_mb", "threads", "children", "fds")},
        "end": {k: samples[-1][k] for k in ("rss_mb", "threads", "children", "fds")},
        "max_threads": max(s["threads"] for s in samples), "max_fds": max(s["fds"] for s in samples),
        "loop_lag_interval_mean_ms_p99": float(np.percentile(interval_means, 99)) if interval_means else None,
        "loop_lag_max_ms": lags[-1]["ns_max"] / 1e6 if lags else None,
        "loop_lag_probes": lags[-1]["probes"] if lags else 0,
        "health_latency_ms": {f"p{p}": float(np.percentile(health_ms, p)) for p in (50, 99)} | {
            "max": float(health_ms.max()), "count": int(health_ms.size)} if health_ms.size else None,
        "samples": samples,
    }


def print_table(result: dict[str, Any], console: Console) -> None:
    def goal(ok: bool) -> str:
        return "[green]met[/]" if ok else "[red]missed[/]"

    base = result.get("baseline") or {}
    base_health = base.get("health_latency_ms") or {}

    def ratio(value: float | None, baseline: float | None) -> str:
        return f" ({value / baseline:.2f}x baseline {baseline:.1f})" if value and baseline else ""

    failures = result["locust_failures"]
    errors = (failures["total"] + result["health_probe_failures"] + result["server_tracebacks"])
    start, warm, end = result["start"], result["warm"], result["end"]
    health = result["health_latency_ms"] or {}
    table = Table(title=f"servprof soak: {result['minutes']:g} min, {result['users']} users, "
                        f"sampling every {result['sample_every']} requests", title_justify="left")
    for column in ("figure", "value", "goal"):
        table.add_column(column)
    rows = [
        ("requests served / sampled", f"{result['requests_served']} / {result['requests_sampled']}", ""),
        ("harness requests per second", f"{result['requests_per_s']:.1f}"
         + ratio(result["requests_per_s"], base.get("requests_per_s")), ""),
        ("errors (locust failures, 5xx, /health failures, server tracebacks)",
         f"{errors} ({failures['total']}, {failures['http_5xx']}, {result['health_probe_failures']}, "
         f"{result['server_tracebacks']})", goal(errors == 0)),
        ("sessions done / failed", f"{result['sessions_done']} / {result['sessions_failed']}",
         goal(not result["sessions_failed"])),
        ("RSS after warm-up -> end (max)", f"{result['rss_mb_after_warmup']:.1f} -> {result['rss_mb_end']:.1f} MiB "
         f"({result['rss_mb_max']:.1f})", ""),
        ("RSS growth after warm-up", f"{result['rss_growth_mb']:+.1f} MiB",
         goal(result["rss_growth_mb"] <= result["rss_goal_mb"])),
        ("trace dir vs cap", f"{result['trace_dir_mb']:.1f} / {result['trace_cap_mb']:g} MiB, "
         f"{result['trace_files']} / {result['trace_cap_files']} files", goal(result["trace_dir_mb"] <= result["trace_cap_mb"])),
        ("threads idle start / warm -> end (max)",
         f"{start['threads']} / {warm['threads']} -> {end['threads']} ({result['max_threads']})",
         goal(end["threads"] <= warm["threads"])),
        ("child processes idle start / warm -> end", f"{start['children']} / {warm['children']} -> {end['children']}",
         goal(end["children"] <= warm["children"])),
        ("open fds idle start / warm -> end (max)", f"{start['fds']} / {warm['fds']} -> {end['fds']} ({result['max_fds']})",
         goal(end["fds"] <= warm["fds"])),
        ("loop lag: p99 of 5 s means", f"{result['loop_lag_interval_mean_ms_p99'] or 0:.2f} ms"
         + ratio(result["loop_lag_interval_mean_ms_p99"], base.get("loop_lag_interval_mean_ms_p99")), ""),
        ("loop lag: max", f"{result['loop_lag_max_ms'] or 0:.1f} ms ({result['loop_lag_probes']} probes)"
         + ratio(result["loop_lag_max_ms"], base.get("loop_lag_max_ms")), ""),
        ("GET /health latency p50", f"{health.get('p50', 0):.1f} ms" + ratio(health.get("p50"), base_health.get("p50")), ""),
        ("GET /health latency p99", f"{health.get('p99', 0):.1f} ms" + ratio(health.get("p99"), base_health.get("p99")), ""),
        ("GET /health latency max", f"{health.get('max', 0):.1f} ms ({health.get('count', 0)} probes)"
         + ratio(health.get("max"), base_health.get("max")), ""),
        ("server exit code (SIGINT at the end)", str(result["server_exit_code"]), goal(result["server_exit_code"] == 0)),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()
    console = Console() if sys.stdout.isatty() else Console(width=140)
    try:
        result = soak(args, console)
    except DemoError as exc:
        console.print(f"soak: {exc}")
        return 1
    (args.out / "soak.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    print_table(result, console)
    if result.get("baseline"):
        base = result["baseline"]
        console.print(f"baseline (sampling off): {base['requests_served']} requests, "
                      f"RSS growth {base['rss_growth_mb']:+.1f} MiB, errors {base['locust_failures']['total']}")
    console.print(f"soak: figures in {args.out / 'soak.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
