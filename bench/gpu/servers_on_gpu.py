"""The test servers (tests/servers: FastAPI servers written the way users write them, none knowing
servprof) served with servprof on a GPU under closed-loop load, each in its own process, a few at
once; for each, the status and every sampled session's analysis are kept and summarised, so the
findings can be read against the servers' code.

    python bench/gpu/servers_on_gpu.py --out DIR [--device cuda] [--model gpu] [--seconds 20]

Runs on CPU too (``--device cpu --model tiny``), which is how the script itself is checked.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
RUNNING: set[subprocess.Popen] = set()  # the servers up now: each in its own session, so stopped by hand
TOKEN = "gpu-check"
PROMPT = "The harbour master counted the boats twice before the storm and once after it. "
# name: (module in tests/servers, route); each takes a completion ({"prompt", "max_tokens"}) but the
# embeddings server, which takes {"input"}.
SERVERS: dict[str, tuple[str, str]] = {
    **{name: (name, "/v1/completions") for name in ("hf_streaming", "handwritten_loop", "to_thread_per_token")},
    **{name: (name, "/v1/generate") for name in ("thread_pool", "loop_bound", "dynamic_batching", "polling_engine",
                                                 "executor", "rag", "process_pool", "compiled_model")},
    "embeddings": ("embeddings", "/v1/embeddings"),
    "hf_streaming_deep": ("hf_streaming", "/v1/completions"),
}
# Deep windows only, with op shapes: what a light session cannot show (shape_setup, bandwidth).
EXTRA_SETTINGS = {"hf_streaming_deep": {"SERVPROF_TIER": "deep", "SERVPROF_RECORD_SHAPES": "1"}}


def request_body(kind: str, rnd: random.Random) -> dict:
    if kind == "embedding":
        return {"input": [PROMPT * rnd.randint(1, 4) for _ in range(rnd.randint(1, 8))]}
    return {"prompt": PROMPT * rnd.randint(1, 6), "max_tokens": rnd.randint(8, 32)}


def drive(url: str, kind: str, seconds: float, users: int) -> dict:
    """Closed-loop users for `seconds`; latencies and failures."""
    latencies: list[float] = []
    failures: list[str] = []

    def user(seed: int) -> None:
        rnd = random.Random(seed)
        with httpx.Client(timeout=120) as client:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                start = time.monotonic()
                try:
                    response = client.post(url, json=request_body(kind, rnd))
                    response.raise_for_status()
                    latencies.append(time.monotonic() - start)
                except httpx.HTTPError as error:
                    failures.append(repr(error)[:200])

    threads = [threading.Thread(target=user, args=(seed,)) for seed in range(users)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    latencies.sort()
    pick = (lambda q: round(latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000, 1)) if latencies else (
        lambda q: None)
    return {"requests": len(latencies), "failures": len(failures), "failure_samples": failures[:3],
            "p50_ms": pick(0.5), "p99_ms": pick(0.99)}


def wait_for_analyses(traces: Path, deadline_s: float) -> None:
    """Until every stored session trace has its analysis (the analysis child runs after each)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        sessions = list(traces.glob("*.session.json"))
        if all(s.with_name(s.name.replace(".session.json", ".analysis.json")).exists() for s in sessions):
            return
        time.sleep(1)


def _what(entry: object) -> str:
    return str(entry.get("what") if isinstance(entry, dict) else entry)[:200]


def summarise(name: str, out: Path, load: dict, status: dict) -> str:
    lines = [f"## {name}: {load}", f"counters {status.get('counters')}", f"last_error {status.get('last_error')}",
             f"servprof_overhead_ms {status.get('servprof_overhead_ms')}"]
    lines += [f"missing (serving): {_what(m)}" for m in status.get("missing") or []]
    for path in sorted((out / "traces").glob("*.analysis.json")):
        report = json.loads(path.read_bytes())
        detect = (report.get("summary") or {}).get("detect") or {}
        steps = detect.get("steps") or {}
        session_file = path.with_name(path.name.replace(".analysis.json", ".session.json"))
        session = json.loads(session_file.read_bytes()) if session_file.exists() else {}
        lines.append(f"### {path.name} events={(report.get('summary') or {}).get('event_count')}/"
                     f"{session.get('event_budget')} stop={session.get('stop_reason')} "
                     f"overhead_ms={session.get('servprof_overhead_ms')}")
        lines.append(f"    tier={detect.get('tier')} error={report.get('error')} "
                     f"device_events={detect.get('device_events')} steps={steps.get('by_kind')} "
                     f"median_step_ms={steps.get('median_step_ms')} timing={(detect.get('utilisation') or {}).get('mode')}")
        lines += [f"  missing: {_what(m)}" for m in detect.get("missing") or []]
        for finding in report.get("findings", []):
            lines.append(f"  {finding['severity']} {finding['kind']} ({finding.get('cost_ms')} ms): "
                         f"{finding['title'][:400]}")
            lines.append(f"      fix: {str(finding.get('fix', ''))[:160]}")
    return "\n".join(lines)


def serve_and_load(name: str, port: int, args: argparse.Namespace) -> str:
    module, route = SERVERS[name]
    kind = "embedding" if module == "embeddings" else "completion"
    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, SERVPROF_TEST_DEVICE=args.device, SERVPROF_TEST_MODEL=args.model,
               SERVPROF_OUT_DIR=str(out), SERVPROF_TELEMETRY="0", SERVPROF_CONTROL_TOKEN=TOKEN,
               SERVPROF_SAMPLE_EVERY=str(args.sample_every), SERVPROF_DEEP_EVERY="2", PYTHONUNBUFFERED="1",
               PYTHONFAULTHANDLER="1", **EXTRA_SETTINGS.get(name, {}))
    log = (out / "server.log").open("wb")
    server = subprocess.Popen([sys.executable, str(ROOT / "tests/servers/run_with_servprof.py"), f"servers.{module}",
                               str(port)],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    RUNNING.add(server)
    base = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + args.start_s
        while time.monotonic() < end and server.poll() is None:
            try:
                if httpx.get(base + "/health", timeout=2).status_code < 500:  # not every server has one
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            if server.poll() is None:
                os.kill(server.pid, signal.SIGABRT)  # PYTHONFAULTHANDLER: every thread's stack into its log
            return f"## {name}: did not start (exit {server.poll()}); see {name}/server.log"
        time.sleep(args.warm_s)  # the profiler's warm-up: requests before it are not sampled
        load = drive(base + route, kind, args.seconds, args.users)
        wait_for_analyses(out / "traces", 40)
        status = httpx.get(base + "/servprof/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()
        (out / "status.json").write_text(json.dumps(status, indent=1, default=str))
        return summarise(name, out, load, status)
    except Exception as error:  # one server's failure must not lose the others' results
        return f"## {name}: {error!r}"
    finally:
        stop(server)
        log.close()
        keep_few_traces(out / "traces", args.keep_traces)


def stop(server: subprocess.Popen) -> None:
    """The server and whatever it started (a process pool's workers)."""
    RUNNING.discard(server)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def stop_all_and_exit(signum: int, _frame: object) -> None:
    """A time limit's SIGTERM: the servers are in sessions of their own and would outlive this."""
    for server in list(RUNNING):
        stop(server)
    os._exit(128 + signum)


def keep_few_traces(traces: Path, keep: int) -> None:
    """Session traces are megabytes on a GPU: keep the first `keep` of each tier (their analyses all
    stay), so that the results can come back from the machine."""
    kept: dict[str, int] = {}
    for trace in sorted(traces.glob("*.pt.trace.json.gz")):
        analysis = trace.with_name(trace.name.replace(".pt.trace.json.gz", ".analysis.json"))
        tier = "?"
        if analysis.exists():
            tier = str(((json.loads(analysis.read_bytes()).get("summary") or {}).get("detect") or {}).get("tier"))
        kept[tier] = kept.get(tier, 0) + 1
        if kept[tier] > keep or trace.stat().st_size > 4_000_000:
            trace.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="gpu", choices=["tiny", "gpu"])
    parser.add_argument("--only", nargs="*", default=[n for n in SERVERS if n != "hf_streaming_deep"],
                        choices=list(SERVERS))
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--sample-every", type=int, default=6)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--start-s", type=float, default=150)
    parser.add_argument("--warm-s", type=float, default=4)
    parser.add_argument("--port", type=int, default=18400)
    parser.add_argument("--keep-traces", type=int, default=2, help="session traces kept per tier and server")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, stop_all_and_exit)
    summary = args.out / "summary.md"
    with ThreadPoolExecutor(args.parallel) as pool:
        jobs = [pool.submit(serve_and_load, name, args.port + i, args) for i, name in enumerate(args.only)]
        for job in jobs:
            text = job.result()
            print(text, flush=True)
            with summary.open("a") as file:
                file.write(text + "\n\n")


if __name__ == "__main__":
    main()
