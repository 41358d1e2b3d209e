"""What servprof's ``ThreadPoolExecutor.submit`` patch (servprof.auto.context: a job carries the
request that submitted it) costs a ``submit`` + ``result``, against the unpatched method in the
same run.

    .venv/bin/python bench/bench_submit_patch.py [--jobs 20000] [--rounds 7]

Three modes, taken in turn each round (a busy moment falls on all of them), best round each:
unpatched; patched, submitted outside any request; patched, submitted while serving a request
(the job is wrapped and runs as that request). Prints µs per job and the ratio to unpatched.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import servprof.auto.context as context
from servprof.observers import RequestRecord
from servprof.request_context import request_record_var


def per_job_us(jobs: int) -> float:
    with ThreadPoolExecutor(1) as pool:
        start = time.perf_counter()
        futures = [pool.submit(int) for _ in range(jobs)]
        for future in futures:
            future.result()
        return (time.perf_counter() - start) / jobs * 1e6


def run(mode: str, jobs: int) -> float:
    if mode == "unpatched":
        context.remove_thread_inheritance()
        return per_job_us(jobs)
    context.install_thread_inheritance()
    if mode == "patched, no request":
        return per_job_us(jobs)
    token = request_record_var.set(RequestRecord("bench", "POST", "/", None, "http", None, None, 0, 0))
    try:
        return per_job_us(jobs)
    finally:
        request_record_var.reset(token)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    modes = ["unpatched", "patched, no request", "patched, in a request"]
    best = dict.fromkeys(modes, float("inf"))
    for _ in range(args.rounds):
        for mode in modes:
            best[mode] = min(best[mode], run(mode, args.jobs))
    base = best["unpatched"]
    for mode in modes:
        print(f"{mode:24} {best[mode]:6.2f} µs per job  {best[mode] / base:5.2f}x unpatched")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
