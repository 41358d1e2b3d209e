"""Profiler restart stress: worker threads run a small model while the main thread starts and
stops a profiler back to back (``profile_all_threads``), light or deep (every op) or mixed.

torch 2.13 CPU, 2 cores: deep capture crashed the process in 2 of 3 runs of 90-100 s (SIGSEGV in
``_disable_profiler`` or heap corruption in a worker's op), with or without servprof's ranges in
the workers; light capture ran 2,564 sessions without one. With ``--drain`` (servprof's own
stop: op collection off for DRAIN_S first, servprof/tiers.py) deep capture does not crash
(docs/middleware.md). Prints the sessions run; a crash is the process dying (run it under
``timeout``; faulthandler prints every thread's stack).

    KINETO_LOG_LEVEL=6 .venv/bin/python bench/stress_restart.py --seconds 90 --tier deep [--drain] [--no-ranges] [--pause]
"""

from __future__ import annotations

import argparse
import faulthandler
import random
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from servprof.auto.emit import close_range, open_range
from servprof.phases import phase
from servprof.tiers import DEEP, LIGHT, LightProfile, drain_ops, pause_collection


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--tier", choices=["light", "deep", "mixed"], default="mixed")
    parser.add_argument("--threads", type=int, default=6)
    parser.add_argument("--no-ranges", action="store_true", help="workers run the model only (no servprof range)")
    parser.add_argument("--pause", action="store_true", help="switch collection off before some stops (the budget's cut)")
    parser.add_argument("--drain", action="store_true",
                        help="servprof's drain before every deep stop (servprof.tiers.drain_ops)")
    args = parser.parse_args()
    faulthandler.enable()
    stop = threading.Event()
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])

    def worker(index: int) -> None:
        while not stop.is_set():
            if args.no_ranges:
                with torch.no_grad():
                    model(torch.randn(2, 32))
                continue
            with phase("decode_step", request_ids=[f"r{index}"]):
                handle = open_range(f"servprof:auto.decode_step|r{index}")
                with torch.no_grad():
                    model(torch.randn(2, 32))
                close_range(handle)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.threads)]
    for thread in threads:
        thread.start()
    sessions = 0
    with tempfile.TemporaryDirectory() as out:
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            light = args.tier == "light" or (args.tier == "mixed" and random.random() < 0.5)
            prof = (LightProfile if light else profile)(
                activities=[ProfilerActivity.CPU], experimental_config=_ExperimentalConfig(profile_all_threads=True))
            prof.start()
            time.sleep(random.random() * 0.05)
            if args.pause and random.random() < 0.3:
                pause_collection()
            if args.drain:
                drain_ops(LIGHT if light else DEEP)
            prof.stop()
            if random.random() < 0.5:
                prof.export_chrome_trace(str(Path(out) / f"{sessions}.json"))
            sessions += 1
    stop.set()
    for thread in threads:
        thread.join(10)
    print(f"{sessions} {args.tier} sessions, no crash", flush=True)


if __name__ == "__main__":
    main()
