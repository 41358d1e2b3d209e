"""What servprof's shutdown costs and saves: the real `servprof demo-server`, N completions, SIGTERM
at once (inside the batch processor's 5 s delay), then the time to exit and the spans on disk.

    python bench/bench_shutdown.py --requests 50 --repeat 3

Per run it prints the time from SIGTERM to the process's end, servprof's own figures (session stop
and span/metric flush, from its "servprof: shutdown" log line) and how many of the requests' spans
reached the spans file; the baseline is the same server with servprof's telemetry off, measured in
the same run, and the ratio is against it.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

SERVER = ("import logging, sys\n"
          "handler = logging.StreamHandler()\n"
          "logging.getLogger('servprof').addHandler(handler)\n"
          "logging.getLogger('servprof').setLevel(logging.INFO)\n"
          "from servprof.demo.server import main\n"
          "sys.exit(main(sys.argv[1:]))\n")
SHUTDOWN_LINE = re.compile(r"session stopped in (\d+) ms, spans and metrics flushed in (\d+) ms")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spans_of(out: Path, ids: set[str]) -> int:
    path = out / "spans" / "spans.otlp.jsonl"
    if not path.is_file():
        return 0
    found = set()
    for line in path.read_bytes().splitlines():
        for resource in orjson.loads(line)["resourceSpans"]:
            for scope in resource["scopeSpans"]:
                for span in scope["spans"]:
                    for attribute in span.get("attributes", []):
                        if attribute["key"] == "servprof.request_id" and attribute["value"].get("stringValue") in ids:
                            found.add(attribute["value"]["stringValue"])
    return len(found)


def run_once(telemetry: bool, requests: int, workdir: Path) -> dict[str, float]:
    out, port = Path(tempfile.mkdtemp(dir=workdir)), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SERVPROF_"))}
    env.update({"SERVPROF_OUT_DIR": str(out), "SERVPROF_TELEMETRY": "1" if telemetry else "0",
                "SERVPROF_TELEMETRY_EXPORTER": "file"})
    log = out / "server.log"
    with log.open("wb") as sink:
        server = subprocess.Popen([sys.executable, "-c", SERVER, "--port", str(port), "--log-level", "warning"],
                                  env=env, stdout=sink, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the demo server did not start: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    ids = {f"bench-{i}" for i in range(requests)}
    with httpx.Client(base_url=base, timeout=60) as client:
        for rid in sorted(ids):
            client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4}, headers={"x-request-id": rid})
    sent = time.perf_counter()
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=120)
    exit_s = time.perf_counter() - sent
    text = log.read_text()
    match = SHUTDOWN_LINE.search(text)
    return {"exit_ms": exit_s * 1000, "stop_ms": float(match.group(1)) if match else float("nan"),
            "flush_ms": float(match.group(2)) if match else float("nan"),
            "spans_found": _spans_of(out, ids), "requests": requests}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs: dict[str, list[dict[str, float]]] = {"telemetry off": [], "telemetry on (file)": []}
        for _ in range(args.repeat):  # interleaved, so both see the same machine load
            runs["telemetry off"].append(run_once(False, args.requests, Path(tmp)))
            runs["telemetry on (file)"].append(run_once(True, args.requests, Path(tmp)))
    baseline = statistics.median(r["exit_ms"] for r in runs["telemetry off"])
    print(f"{'':22} {'exit ms':>9} {'ratio':>6} {'stop ms':>8} {'flush ms':>9} {'spans/requests':>15}")
    for name, results in runs.items():
        exit_ms = statistics.median(r["exit_ms"] for r in results)
        stop_ms = statistics.median(r["stop_ms"] for r in results)
        flush_ms = statistics.median(r["flush_ms"] for r in results)
        spans = [f"{int(r['spans_found'])}/{int(r['requests'])}" for r in results]
        print(f"{name:22} {exit_ms:9.0f} {exit_ms / baseline:6.2f} {stop_ms:8.0f} {flush_ms:9.0f} "
              f"{' '.join(spans):>15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
