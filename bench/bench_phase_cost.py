"""What one ``servprof.phase`` costs: with no session (the serving path's cost while servprof
is not sampling), under a light session (user-scope range, kept) and under a deep one.

CPU time of the calling thread per enter/exit pair, medians of interleaved rounds (a shared
machine's waits for a CPU do not count), printed against an empty ``with`` block measured in
the same run.

    .venv/bin/python bench/bench_phase_cost.py [--calls 20000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

from rich.console import Console
from rich.table import Table
from torch.profiler import ProfilerActivity, profile

from servprof.phases import phase
from servprof.tiers import LightProfile


def _us_per_pair(calls: int, make: Any) -> float:
    start = time.thread_time_ns()
    for _ in range(calls):
        with make():
            pass
    return (time.thread_time_ns() - start) / calls / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    cases = {"empty with-block": (None, contextlib.nullcontext),
             "phase, no session": (None, lambda: phase("decode_step", request_ids=["r1", "r2"])),
             "phase, light session": (LightProfile, lambda: phase("decode_step", request_ids=["r1", "r2"])),
             "phase, deep session": (profile, lambda: phase("decode_step", request_ids=["r1", "r2"]))}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (profiler_class, make) in cases.items():
            prof = profiler_class(activities=[ProfilerActivity.CPU]) if profiler_class else None
            if prof is not None:
                prof.start()
            samples[name].append(_us_per_pair(args.calls, make))
            if prof is not None:
                prof.stop()
    base = statistics.median(samples["empty with-block"])
    table = Table(title=f"servprof.phase enter+exit, CPU µs per pair (median of {args.rounds} rounds)")
    for column in ("case", "µs", "x empty block"):
        table.add_column(column)
    for name, values in samples.items():
        median = statistics.median(values)
        table.add_row(name, f"{median:.2f}", f"{median / base:.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
