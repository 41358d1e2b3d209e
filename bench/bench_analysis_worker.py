"""What the session analysis costs the requests served beside it: a warm worker against a fresh
process per session, on a CPU server that batches requests the way tutorials write it.

The server is tests/servers/dynamic_batching.py (an ``asyncio.Queue``, a 10 ms batching window,
one padded ``generate()`` per batch on a worker thread; torch's own thread pool on every core)
with ServprofMiddleware added as a user adds it, sampling every ``--every``-th request. A closed
loop of ``--users`` clients in another process posts to it for ``--seconds``, each request timed.
Three modes, each in a fresh server process, taken in turn for ``--rounds`` rounds:

- ``off``: ``SERVPROF_ANALYSIS=0`` (sessions captured and stored, never analysed): the baseline;
- ``fresh``: a new analysis process per session, with numpy's default threads (servprof before
  the warm worker: ``analysis_worker.ONE_JOB_PER_WORKER`` and no thread caps);
- ``warm``: servprof as it ships (one warm worker, one thread for its numeric libraries).

Printed per mode (the best round by p99): requests/s, p50 / p99 / max latency, and p99 and
throughput as ratios of ``off`` measured in the same run, plus the analysis' wall ms per session.
The machine may be shared: read the ratios.

    .venv/bin/python bench/bench_analysis_worker.py [--users 8] [--seconds 20] [--every 50] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-analysis-worker"
MODES = ("off", "fresh", "warm")
PROMPT = "The harbour master counted the boats "


def serve(mode: str, port: int) -> None:
    """The server process: the batching server with servprof added, in ``mode``."""
    sys.path.insert(0, str(ROOT / "tests"))
    import uvicorn

    from servprof import ServprofMiddleware, analysis_worker

    if mode == "fresh":
        analysis_worker.ONE_JOB_PER_WORKER = True
        analysis_worker.CHILD_THREADS = {}
    from servers.dynamic_batching import app

    app.add_middleware(ServprofMiddleware)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def load(url: str, seconds: float, users: int, out: str) -> None:
    """The clients' process: ``users`` closed loops, each request's latency written to ``out``."""
    latencies: list[float] = []

    def user(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with httpx.Client(timeout=120) as client:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                body = {"prompt": PROMPT * int(rng.integers(1, 7)), "max_tokens": int(rng.integers(4, 25))}
                start = time.perf_counter()
                response = client.post(url + "/v1/generate", json=body)
                response.raise_for_status()
                latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(users)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    Path(out).write_bytes(orjson.dumps({"seconds": seconds, "latencies": latencies}))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def one_run(mode: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "SERVPROF_OUT_DIR": str(folder / mode), "SERVPROF_TELEMETRY": "0",
           "SERVPROF_CONTROL_TOKEN": TOKEN, "SERVPROF_SAMPLE_EVERY": str(args.every),
           "SERVPROF_ANALYSIS": "0" if mode == "off" else "1"}
    server = subprocess.Popen([sys.executable, __file__, "--serve", mode, str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"the {mode} server did not start")
            time.sleep(0.2)
        time.sleep(3)  # the profiler's warm-up (and the warm worker's imports) done before the load
        out = folder / f"{mode}.json"
        subprocess.run([sys.executable, __file__, "--load", url, str(args.seconds), str(args.users), str(out)],
                       check=True)
        time.sleep(2)  # the last session's analysis
        status = httpx.get(url + "/servprof/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()
    finally:
        server.terminate()
        server.wait(30)
    latencies = np.array(orjson.loads(out.read_bytes())["latencies"]) * 1000
    overhead = status.get("servprof_overhead_ms") or {}
    sessions = max(1, int(overhead.get("sessions") or 0))
    return {"mode": mode, "requests_per_s": latencies.size / args.seconds, "p50": float(np.percentile(latencies, 50)),
            "p99": float(np.percentile(latencies, 99)), "max": float(latencies.max()),
            "sessions": int(overhead.get("sessions") or 0), "analysis_ms": float(overhead.get("analysis") or 0) / sessions,
            "failed": status["counters"]["sessions_failed"]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--load":
        load(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--every", type=int, default=50, help="sample every k-th request")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import tempfile

    best: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for mode in MODES:
                row = one_run(mode, args, Path(tmp) / f"r{round_}")
                print(f"round {round_ + 1} {mode}: {row['requests_per_s']:.0f} req/s, p99 {row['p99']:.1f} ms, "
                      f"{row['sessions']} sessions, analysis {row['analysis_ms']:.0f} ms each", flush=True)
                if mode not in best or row["p99"] < best[mode]["p99"]:
                    best[mode] = row
    base = best["off"]
    table = Table(title=f"{args.users} users, {args.seconds:g} s, every {args.every}th request sampled "
                        f"(best of {args.rounds} rounds by p99)")
    for column in ("mode", "req/s", "p50 ms", "p99 ms", "max ms", "p99 / off", "req/s / off", "sessions",
                   "analysis ms each", "failed"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for mode in MODES:
        row = best[mode]
        table.add_row(mode, f"{row['requests_per_s']:.0f}", f"{row['p50']:.1f}", f"{row['p99']:.1f}", f"{row['max']:.1f}",
                      f"{row['p99'] / base['p99']:.2f}", f"{row['requests_per_s'] / base['requests_per_s']:.2f}",
                      str(row["sessions"]), "-" if mode == "off" else f"{row['analysis_ms']:.0f}", str(row["failed"]))
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
