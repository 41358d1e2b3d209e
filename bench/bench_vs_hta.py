"""servprof's trace analysis against Holistic Trace Analysis' on the same traces.

    .venv/bin/python bench/bench_vs_hta.py [TRACE ...] [--repeats 3] [--no-cold]

For each trace (default: every public trace vendored in tests/fixtures/public and the project's
fixtures), in this one process, each the best of --repeats runs taken in turn (more, up to 30,
while a trace's rounds take under 3 s), imports excluded (reported apart):

- HTA: `TraceAnalysis(trace_dir=...)` (parse) plus `get_idle_time_breakdown()`;
- servprof: `load_trace` plus `idle_split` (the same work), and the ratio HTA / servprof
  (goal: >= 10x on every trace);
- `servprof analyze TRACE --json -` whole (every detector, the JSON report on stdout), and
  HTA's time over it (goal: >= 5x on every trace); and `servprof analyze TRACE --json OUT`, which
  also prints the terminal report (rich's tables), for scale;
- the orjson loader servprof used before (servprof.trace.reference) plus `idle_split`, for scale.

Then each in a fresh interpreter (imports included, what a user waits for): HTA's parse + idle
breakdown against servprof's load + idle split (goal: geometric mean >= 8x), and against the
whole `servprof analyze` command. Also prints whether the host_wait / kernel_wait figures agree.
Installs `holistictraceanalysis` and `pandas<3` into this venv first if HTA is missing (the
project's `hta` extra).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_TRACES = ROOT / "tests" / "fixtures" / "public"
Split = dict[int, tuple[float, float]]


def ensure_hta() -> None:
    try:
        importlib.import_module("hta")
    except ImportError:
        print("installing holistictraceanalysis and pandas<3 into this venv ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "holistictraceanalysis", "pandas<3"], check=True)


def best_in_turn(repeats: int, runs: dict[str, Callable[[], Any]], min_seconds: float = 3.0,
                 max_rounds: int = 30) -> dict[str, tuple[float, Any]]:
    """Best time of each run over ``repeats`` rounds (more, up to ``max_rounds``, while the rounds
    have taken less than ``min_seconds``: small traces get more tries), the runs taken in turn in
    every round, so that a busy moment on a shared machine falls on all of them, not on one."""
    best: dict[str, tuple[float, Any]] = {name: (math.inf, None) for name in runs}
    started, rounds = time.perf_counter(), 0
    while rounds < repeats or (rounds < max_rounds and time.perf_counter() - started < min_seconds):
        rounds += 1
        for name, fn in runs.items():
            start = time.perf_counter()
            try:
                result = fn()
            except Exception as exc:  # HTA's own failures are part of the comparison
                best[name] = (math.nan, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}")
                continue
            elapsed = time.perf_counter() - start
            if not elapsed >= best[name][0]:
                best[name] = (elapsed, result)
    return best


def hta_run(trace_dir: str) -> Callable[[], Split]:
    from hta.trace_analysis import TraceAnalysis

    def once() -> Split:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            frame = TraceAnalysis(trace_dir=trace_dir).get_idle_time_breakdown(visualize=False)[0]
        out: Split = {}
        for stream in frame["stream"].unique():
            rows = frame[frame["stream"] == stream].set_index("idle_category")["idle_time"]
            out[int(stream)] = (float(rows.get("host_wait", 0.0)), float(rows.get("kernel_wait", 0.0)))
        return out

    return once


def servprof_run(trace_path: Path, loader: Callable[[Path], Any]) -> Callable[[], Split]:
    from servprof.detect.idle_split import idle_split

    return lambda: {s.stream: (s.host_wait_us, s.kernel_wait_us) for s in idle_split(loader(trace_path))}


def analyze_run(trace_path: Path, out: Path | None) -> Callable[[], int]:
    """`servprof analyze` in this process: the JSON alone to stdout (out None), or to a file with
    the terminal report on stdout."""
    from servprof.cli import main

    def once() -> int:
        sink = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")  # (--json - writes to stdout's buffer)
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(io.StringIO()):  # (its warnings)
            status = main(["analyze", str(trace_path), "--json", "-" if out is None else str(out)])
        if status != 0:
            raise RuntimeError(f"servprof analyze exited {status}")
        return status

    return once


COLD_HTA = """
import contextlib, io, logging, sys
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    TraceAnalysis(trace_dir=sys.argv[1]).get_idle_time_breakdown(visualize=False)
"""
COLD_SERVPROF = """
import sys
from servprof.detect.idle_split import idle_split
from servprof.trace import load_trace
idle_split(load_trace(sys.argv[1]))
"""


# Fresh interpreters run as an installed package runs: with its modules' bytecode cached (pip
# compiles it at install; HTA's and numpy's is in site-packages). A checkout run with
# PYTHONDONTWRITEBYTECODE=1 would otherwise compile servprof's modules in every process.
COLD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def cold_seconds(command: list[str]) -> float:
    """A fresh interpreter: imports, load and analysis, as a one-shot command pays them."""
    start = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=COLD_ENV)
    elapsed = time.perf_counter() - start
    return elapsed if done.returncode == 0 else math.nan


def best_cold(repeats: int, commands: dict[str, list[str]]) -> dict[str, float]:
    best = {name: math.inf for name in commands}
    for command in commands.values():  # a first run, not timed: bytecode written, files in the page cache
        cold_seconds(command)
    for _ in range(repeats):
        for name, command in commands.items():
            seconds = cold_seconds(command)
            best[name] = seconds if seconds != seconds else min(best[name], seconds)  # a failure: nan
    return best


def agreement(hta: Split | str, ours: Split) -> str:
    if isinstance(hta, str):
        return f"HTA {hta}"
    same = all(abs(h - o) < 0.5 for k in hta for h, o in zip(hta[k], ours.get(k, (0.0, 0.0)), strict=True))
    return "yes" if same else f"no: HTA {hta} servprof {ours}"


def geomean(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-cold", action="store_true", help="skip the fresh-process runs")
    args = parser.parse_args()
    traces = args.traces or sorted(PUBLIC_TRACES.glob("*.json.gz")) + sorted((ROOT / "tests" / "fixtures").glob("*.json.gz"))
    if not traces:
        print(f"no traces given and none in {PUBLIC_TRACES}", file=sys.stderr)
        return 2
    ensure_hta()
    logging.disable(logging.WARNING)  # HTA logs a warning per parse
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    start = time.perf_counter()
    importlib.import_module("hta.trace_analysis")
    hta_import = time.perf_counter() - start
    start = time.perf_counter()
    for module in ("servprof.trace", "servprof.detect.idle_split", "servprof.cli", "servprof.report.analyze_cli"):
        importlib.import_module(module)
    servprof_import = time.perf_counter() - start
    from servprof.trace import load_trace
    from servprof.trace.reference import load_trace_orjson

    print(f"imports: HTA {hta_import:.2f} s, servprof (analyze included) {servprof_import:.2f} s (not in the "
          "in-process times)")
    print(f"{'trace':36} {'MB':>5} {'HTA s':>7} {'servprof':>8} {'ratio':>6} {'analyze':>7} {'ratio':>6} "
          f"{'+table':>7} {'ratio':>6} {'orjson':>6} {'cold HTA':>8} {'cold sp':>7} {'ratio':>6} {'cold an':>7} "
          f"{'ratio':>6}  split agrees")
    ratios: dict[str, list[float]] = {"in process": [], "analyze": [], "analyze + table": [], "orjson loader": [],
                                      "cold": [], "cold analyze": []}
    for path in traces:
        with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as out:
            # HTA reads a directory of rank files; give it one holding only this trace.
            shutil.copy(path, Path(tmp) / path.name)
            best = best_in_turn(args.repeats, {
                "hta": hta_run(tmp),
                "servprof": servprof_run(path, load_trace),
                "analyze": analyze_run(path, None),
                "analyze + table": analyze_run(path, Path(out) / "report.json"),
                "orjson": servprof_run(path, load_trace_orjson),
            })
            cold = {"hta": math.nan, "servprof": math.nan, "analyze": math.nan}
            if not args.no_cold:
                cold = best_cold(args.repeats, {
                    "hta": [sys.executable, "-c", COLD_HTA, tmp],
                    "servprof": [sys.executable, "-c", COLD_SERVPROF, str(path)],
                    "analyze": [sys.executable, "-m", "servprof.cli", "analyze", str(path), "--json",
                                str(Path(out) / "cold.json")],
                })
        hta_s = best["hta"][0]
        row = {
            "in process": hta_s / best["servprof"][0],
            "analyze": hta_s / best["analyze"][0],
            "analyze + table": hta_s / best["analyze + table"][0],
            "orjson loader": hta_s / best["orjson"][0],
            "cold": cold["hta"] / cold["servprof"],
            "cold analyze": cold["hta"] / cold["analyze"],
        }
        for key, value in row.items():
            if value == value:
                ratios[key].append(value)
        print(f"{path.name[:36]:36} {path.stat().st_size / 1e6:5.2f} {hta_s:7.3f} {best['servprof'][0]:8.3f} "
              f"{row['in process']:5.1f}x {best['analyze'][0]:7.3f} {row['analyze']:5.1f}x "
              f"{best['analyze + table'][0]:7.3f} {row['analyze + table']:5.1f}x {row['orjson loader']:5.1f}x "
              f"{cold['hta']:8.2f} {cold['servprof']:7.2f} {row['cold']:5.1f}x {cold['analyze']:7.2f} "
              f"{row['cold analyze']:5.1f}x  {agreement(best['hta'][1], best['servprof'][1])}", flush=True)
    goals = {"in process": ("min", 10.0), "analyze": ("min", 5.0), "cold": ("geomean", 8.0)}
    for key, values in ratios.items():
        if not values:
            continue
        line = (f"HTA / servprof, {key}: min {min(values):.1f}x, max {max(values):.1f}x, "
                f"geometric mean {geomean(values):.1f}x over {len(values)} traces")
        if key in goals:
            measure, target = goals[key]
            value = min(values) if measure == "min" else geomean(values)
            line += f"  [goal: {measure} >= {target:g}x: {'met' if value >= target else 'NOT met'}]"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
