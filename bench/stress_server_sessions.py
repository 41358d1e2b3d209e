"""Sessions on a loaded transformers server until it dies or the time is up: the reproduction of
torch 2.13's stop() race in light sessions (docs/middleware.md, "Sessions and torch's stop() race").

Serves tests/servers/hf_streaming.py with the one-line middleware in its own process (light
sessions, PYTHONFAULTHANDLER on: a crash prints every thread's stack to the server's stderr file),
streams from ten clients without pause, and orders a one-request session every 0.5 s. Prints
whether the server is alive, its exit status, and how many sessions it finished. Run a CPU hog
beside it on a small machine to widen the race (`python -c "while True: pass" &`).

    .venv/bin/python bench/stress_server_sessions.py --seconds 300 [--stderr /tmp/server.err]
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

import httpx

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "stress"
PROSE = "The harbour master counted the boats twice before the storm. " * 20
SERVER = """
import sys, importlib, uvicorn
sys.path.insert(0, {tests!r})
from servprof import ServprofMiddleware
app = importlib.import_module("servers.hf_streaming").app
app.add_middleware(ServprofMiddleware)
uvicorn.run(app, host="127.0.0.1", port={port}, log_level="warning")
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--tier", choices=["light", "deep"], default="light")
    parser.add_argument("--stderr", default="stress_server.err", help="the server's stderr (crash dumps)")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "SERVPROF_CONTROL_TOKEN": TOKEN, "SERVPROF_TELEMETRY": "0", "SERVPROF_OUT_DIR":
           str(Path(args.stderr).with_suffix(".out")), "SERVPROF_REQUESTS_PER_SESSION": "1",
           "SERVPROF_ON_DEMAND_MIN_INTERVAL_S": "0.1", "SERVPROF_TIER": args.tier, "SERVPROF_DEEP_EVERY": "0",
           "KINETO_LOG_LEVEL": "6", "PYTHONFAULTHANDLER": "1"}
    with open(args.stderr, "w") as err:
        server = subprocess.Popen([sys.executable, "-c", SERVER.format(tests=str(ROOT / "tests"), port=port)],
                                  env=env, stderr=err, stdout=subprocess.DEVNULL)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.poll() is None:
        try:
            httpx.get(url + "/servprof/status", headers=auth, timeout=2)
            break
        except httpx.HTTPError:
            time.sleep(0.2)
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set() and server.poll() is None:
                try:
                    with http.stream("POST", url + "/v1/completions", json={"prompt": PROSE, "max_tokens": 40}) as r:
                        for _ in r.iter_lines():
                            pass
                except httpx.HTTPError:
                    time.sleep(0.1)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    sessions = None
    while time.monotonic() - started < args.seconds and server.poll() is None:
        try:
            httpx.post(url + "/servprof/sample?n=1", headers=auth, timeout=5)
            sessions = httpx.get(url + "/servprof/status", headers=auth, timeout=5).json()["counters"]["sessions_done"]
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    stop.set()
    status = server.poll()
    print(f"{args.tier} sessions: server {'died (exit ' + str(status) + ')' if status is not None else 'alive'} after "
          f"{time.monotonic() - started:.0f} s; sessions finished: {sessions} (last read); stderr: {args.stderr}")
    server.kill()
    return 1 if status is not None else 0


if __name__ == "__main__":
    sys.exit(main())
