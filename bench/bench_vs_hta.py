"""servprof's trace loading + idle-time split against Holistic Trace Analysis' on the same traces.

    .venv/bin/python bench/bench_vs_hta.py [TRACE ...] [--repeats 3]

For each trace (default: every public trace vendored in tests/fixtures/public and the project's
fixtures), in this one process: HTA's `TraceAnalysis(trace_dir=...)` (parse) plus
`get_idle_time_breakdown()`, and servprof's `load_trace` plus `idle_split`, each
the best of --repeats runs, imports excluded (reported apart). Prints each
trace's times, the ratio HTA / servprof, the ceiling (HTA / the time to inflate and
orjson-parse the file alone: what a loader with no work after parsing would reach),
and whether the host_wait / kernel_wait figures agree. Installs `holistictraceanalysis` and `pandas<3` into this venv
first if HTA is missing (the project's `hta` extra).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_TRACES = ROOT / "tests" / "fixtures" / "public"


def ensure_hta() -> None:
    try:
        importlib.import_module("hta")
    except ImportError:
        print("installing holistictraceanalysis and pandas<3 into this venv ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "holistictraceanalysis", "pandas<3"], check=True)


def best_of(repeats: int, fn):  # type: ignore[no-untyped-def]
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def run_hta(trace_path: Path, repeats: int) -> tuple[float, dict[int, tuple[float, float]] | str]:
    from hta.trace_analysis import TraceAnalysis

    with tempfile.TemporaryDirectory() as tmp:
        # HTA reads a directory of rank files; give it one holding only this trace.
        shutil.copy(trace_path, Path(tmp) / trace_path.name)

        def once() -> dict[int, tuple[float, float]]:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                analysis = TraceAnalysis(trace_dir=tmp)
                frame = analysis.get_idle_time_breakdown(visualize=False)[0]
            out: dict[int, tuple[float, float]] = {}
            for stream in frame["stream"].unique():
                rows = frame[frame["stream"] == stream].set_index("idle_category")["idle_time"]
                out[int(stream)] = (float(rows.get("host_wait", 0.0)), float(rows.get("kernel_wait", 0.0)))
            return out

        try:
            return best_of(repeats, once)
        except Exception as exc:  # HTA's own failures are part of the comparison
            return float("nan"), f"HTA failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"


def run_servprof(trace_path: Path, repeats: int) -> tuple[float, dict[int, tuple[float, float]]]:
    from servprof.detect.idle_split import idle_split
    from servprof.trace import load_trace

    def once() -> dict[int, tuple[float, float]]:
        return {s.stream: (s.host_wait_us, s.kernel_wait_us) for s in idle_split(load_trace(trace_path))}

    return best_of(repeats, once)


def parse_floor(trace_path: Path, repeats: int) -> float:
    """Seconds to inflate and orjson-parse the file alone: no loader that parses every event can
    be faster, so HTA's time over this is the highest ratio any such loader could show."""
    from servprof.trace.loader import parse_document, paused_gc, read_bytes

    def once() -> None:
        with paused_gc():
            parse_document(trace_path, read_bytes(trace_path, 2**40))

    return best_of(repeats, once)[0]


COLD_HTA = """
import contextlib, io, logging, shutil, sys, tempfile
from pathlib import Path
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
with tempfile.TemporaryDirectory() as tmp:
    shutil.copy(sys.argv[1], Path(tmp) / Path(sys.argv[1]).name)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        TraceAnalysis(trace_dir=tmp).get_idle_time_breakdown(visualize=False)
"""
COLD_SERVPROF = """
import sys
from servprof.detect.idle_split import idle_split
from servprof.trace import load_trace
idle_split(load_trace(sys.argv[1]))
"""


def cold_seconds(code: str, trace_path: Path) -> float:
    """A fresh interpreter: imports, load and idle breakdown, as a one-shot command pays them."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, str(trace_path)], capture_output=True)
    elapsed = time.perf_counter() - start
    return elapsed if done.returncode == 0 else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
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
    importlib.import_module("servprof.trace")
    importlib.import_module("servprof.detect.idle_split")
    servprof_import = time.perf_counter() - start
    print(f"imports: HTA {hta_import:.2f} s, servprof {servprof_import:.2f} s (not in the times below)")
    print(f"{'trace':44} {'MB':>5} {'HTA s':>7} {'servprof s':>10} {'ratio':>6} {'cold HTA':>9} "
          f"{'cold servprof':>13} {'ratio':>6} {'ceiling':>7}  split agrees")
    ratios, cold_ratios = [], []
    for path in traces:
        hta_s, hta_split = run_hta(path, args.repeats)
        ours_s, ours_split = run_servprof(path, args.repeats)
        if isinstance(hta_split, str):
            agree = hta_split
        else:
            agree = "yes" if all(
                abs(hta_split[k][0] - ours_split.get(k, (0, 0))[0]) < 0.5
                and abs(hta_split[k][1] - ours_split.get(k, (0, 0))[1]) < 0.5 for k in hta_split
            ) else f"no: HTA {hta_split} servprof {ours_split}"
        ratio = hta_s / ours_s if hta_s == hta_s else float("nan")
        if ratio == ratio:
            ratios.append(ratio)
        cold_hta, cold_ours = cold_seconds(COLD_HTA, path), cold_seconds(COLD_SERVPROF, path)
        cold_ratio = cold_hta / cold_ours
        if cold_ratio == cold_ratio:
            cold_ratios.append(cold_ratio)
        ceiling = hta_s / parse_floor(path, args.repeats)
        size = path.stat().st_size / 1e6
        print(f"{path.name[:44]:44} {size:5.2f} {hta_s:7.3f} {ours_s:10.3f} {ratio:5.1f}x {cold_hta:9.2f} "
              f"{cold_ours:13.2f} {cold_ratio:5.1f}x {ceiling:6.1f}x  {agree}", flush=True)
    for label, values in (("in-process, imports excluded", ratios), ("cold, fresh process", cold_ratios)):
        if values:
            geo = 1.0
            for r in values:
                geo *= r
            print(f"HTA / servprof (load + idle-time breakdown, {label}): min {min(values):.1f}x, "
                  f"max {max(values):.1f}x, geometric mean {geo ** (1 / len(values)):.1f}x over {len(values)} traces")
    return 0


if __name__ == "__main__":
    sys.exit(main())
