"""Fuzz `load_trace` and `servprof analyze` with >= 10,000 inputs mutated from real traces.

    .venv/bin/python bench/fuzz_analyze.py [--examples 10000] [--processes 40]

Inputs come from tests/_fuzz_helpers.py (the same strategies CI runs a few hundred of): real
traces broken at the byte level (truncation, bit flips, splices, gzip damage) and the structure
level (dropped/retyped fields, NaN/huge/negative ts and dur, garbage args, no traceEvents, and retyped or
dropped metadata fields: deviceProperties entries, distributedInfo, baseTimeNanoseconds, servprof's block).
Every input goes through load_trace and the whole `servprof analyze --json --html` in this
process; a sample, plus a gzip bomb, multi-GB sparse files and 100k-deep JSON, also through the
command as its own process (peak RSS per child from wait4). Prints counts, failures (any
exception but TraceError, exit codes other than 0/2, more than one stderr line), the slowest
input's time and peak memory. Exit status 1 if anything failed.
"""

from __future__ import annotations

import argparse
import gzip
import resource
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

import orjson
from hypothesis import HealthCheck, Phase, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _fuzz_helpers import (  # noqa: E402
    analyze_in_process,
    clean_failure_line,
    deeply_nested,
    run_analyze,
    seed_documents,
    seed_sources,
    trace_inputs,
    write_gzip_bomb,
    write_sparse,
)

from servprof.trace import TraceError, load_trace  # noqa: E402

HANG_LIMIT_S = 5.0


def _innermost(lines: int = 8) -> str:
    """The end of the current traceback: where it was raised and what."""
    return "\n".join(traceback.format_exc().rstrip().splitlines()[-lines:])


def fuzz_in_process(examples: int, work: Path) -> dict[str, object]:
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    slowest = (0.0, "")
    slowest_input = ("", b"")
    kept: list[tuple[str, bytes]] = []  # a few inputs of each outcome, for the process sample

    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=trace_inputs())
    def one(case: tuple[str, bytes]) -> None:
        nonlocal slowest, slowest_input
        suffix, data = case
        path = work / f"input{suffix}"
        path.write_bytes(data)
        started = time.perf_counter()
        try:
            load_trace(path)
            loaded = "loaded"
        except TraceError:
            loaded = "trace_error"
        except Exception:  # noqa: BLE001 - any other exception is exactly what we are looking for
            failures.append(f"load_trace: {_innermost()}")
            loaded = "crash"
        try:
            status, stderr = analyze_in_process(path, work)
            if status == 2 and not clean_failure_line(stderr):
                failures.append(f"exit 2 without one clean line: {stderr!r}")
            elif status not in (0, 2):
                failures.append(f"exit {status}: {stderr!r}")
        except Exception:  # noqa: BLE001
            failures.append(f"analyze: {_innermost()}")
            status = -1
        seconds = time.perf_counter() - started
        if seconds > HANG_LIMIT_S:
            failures.append(f"{seconds:.1f} s on one input ({len(data)} bytes)")
        if seconds > slowest[0]:
            slowest = (seconds, f"{len(data)} bytes{suffix}, {loaded}, exit {status}")
            slowest_input = (suffix, data)
        outcome = f"{loaded}/exit{status}"
        if outcomes[outcome] < 20:
            kept.append((suffix, data))
        outcomes[outcome] += 1

    # One clean input first, so that the slowest input is not the one that paid for the imports.
    clean = work / "warm.json.gz"
    clean.write_bytes(gzip.compress(orjson.dumps(seed_documents()[0])))
    analyze_in_process(clean, work)
    started = time.perf_counter()
    one()
    return {"outcomes": dict(outcomes), "failures": failures, "slowest": slowest, "kept": kept,
            "slowest_input": slowest_input,
            "seconds": time.perf_counter() - started,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # this process, all inputs


def special_inputs(work: Path) -> list[tuple[str, Path, dict[str, str]]]:
    """(label, path, env) for the inputs that test size and depth limits."""
    bomb = work / "bomb.json.gz"
    write_gzip_bomb(bomb, 4 * 1024**3)  # 4 GiB of JSON whitespace in a few MiB
    sparse = work / "sparse-3g.json"
    write_sparse(sparse, 3 * 1024**3)
    sparse_small = work / "sparse-200m.json"
    write_sparse(sparse_small, 200 * 1024**2)
    deep = work / "deep.json"
    deep.write_bytes(deeply_nested(100_000))
    deep_gz = work / "deep.json.gz"
    deep_gz.write_bytes(gzip.compress(deeply_nested(1_000_000)))
    limit = {"SERVPROF_MAX_TRACE_BYTES": str(256 * 1024**2)}
    return [
        (f"gzip bomb ({bomb.stat().st_size / 1024**2:.1f} MiB -> 4 GiB), default 2 GiB limit", bomb, {}),
        ("gzip bomb, SERVPROF_MAX_TRACE_BYTES=256 MiB", bomb, limit),
        ("3 GiB sparse .json (over the default limit)", sparse, {}),
        ("200 MiB sparse .json (under the limit)", sparse_small, {}),
        ("100k nested arrays (.json)", deep, {}),
        ("1M nested arrays (.json.gz)", deep_gz, {}),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=10_000)
    parser.add_argument("--processes", type=int, default=40, help="mutated inputs also run as a process each")
    parser.add_argument("--save-slowest", metavar="STEM", help="write the slowest input to STEM.json[.gz]")
    args = parser.parse_args()
    print(f"seeds: {len(seed_documents())} real traces ({', '.join(p.name for p in seed_sources())})")
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="servprof-fuzz-") as tmp:
        work = Path(tmp)
        result = fuzz_in_process(args.examples, work)
        total = sum(result["outcomes"].values())
        failures += result["failures"]
        print(f"\nin process: {total} inputs in {result['seconds']:.0f} s; outcomes {result['outcomes']}")
        print(f"  failures: {len(result['failures'])}; slowest input {result['slowest'][0] * 1000:.0f} ms "
              f"({result['slowest'][1]}); peak RSS of this process {result['peak_rss_mb']:.0f} MiB")

        if args.save_slowest:
            suffix, data = result["slowest_input"]
            Path(args.save_slowest + suffix).write_bytes(data)
        print(f"\nas a process each (`python -m servprof.cli analyze`), {args.processes} mutated inputs:")
        statuses: Counter[str] = Counter()
        slowest_process, peak = 0.0, 0.0
        for index, (suffix, data) in enumerate(result["kept"][: args.processes]):
            path = work / f"proc{index}{suffix}"
            path.write_bytes(data)
            run = run_analyze(path, timeout_s=60)
            statuses[str(run.returncode)] += 1
            slowest_process, peak = max(slowest_process, run.seconds), max(peak, run.peak_rss_mb)
            if run.returncode not in (0, 2) or (run.returncode == 2 and not clean_failure_line(run.stderr)):
                failures.append(f"process {path.name}: exit {run.returncode}: {run.stderr[-500:]!r}")
        print(f"  exit statuses {dict(statuses)}; slowest {slowest_process:.2f} s (interpreter start included); "
              f"largest peak RSS {peak:.0f} MiB")

        baseline = run_analyze(Path(__file__).resolve().parents[1] / "tests/fixtures/demo_clean.json.gz", 60)
        print(f"  baseline: a clean 140 kB fixture takes {baseline.seconds:.2f} s, peak RSS {baseline.peak_rss_mb:.0f} MiB")

        print("\nsize and depth limits, each as a process:")
        for label, path, env in special_inputs(work):
            run = run_analyze(path, timeout_s=120, env=env)
            ok = run.returncode == 2 and clean_failure_line(run.stderr)
            if not ok:
                failures.append(f"{label}: exit {run.returncode}: {run.stderr[-500:]!r}")
            print(f"  {label}: exit {run.returncode} in {run.seconds:.2f} s, peak RSS {run.peak_rss_mb:.0f} MiB "
                  f"({run.peak_rss_mb / baseline.peak_rss_mb:.1f}x baseline) -- {run.stderr.strip()[:110]}")
    print(f"\n{'FAILURES' if failures else 'no failures'}: {len(failures)}")
    for failure in failures[:20]:
        print("  " + failure.replace("\n", "\n    "))
    print(orjson.dumps({"inputs": total, "failures": len(failures)}).decode())
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
