"""`servprof demo`: the whole product in one command.

Starts the demo LLM server with servprof's middleware (its own process), replays the
representative traffic mix against it with the locust harness (its own process: gevent
and torch do not share one), orders N sampled requests mid-run through the control
endpoint, waits for the analysis, reports the findings of the session's trace with
`servprof analyze`, and writes everything under --out. A piece that is missing or
fails is reported by name; what the others produced is still listed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from servprof.demo.artifacts import Artifacts, print_artifacts
from servprof.demo.options import DEMO_SESSION_ENV, INJECT_FLAGS, add_arguments, cpu_peak_note  # noqa: F401 - add_arguments: servprof.cli
from servprof.demo.progress import progress_for

HEALTH_TIMEOUT_S = 180.0
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and where its log is."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _missing_pieces() -> list[str]:
    needed = {"servprof.demo.server": "the demo server", "servprof.middleware": "the servprof middleware",
              "locust": "locust (pip install 'servprof[demo]')", "httpx": "httpx (pip install 'servprof[demo]')",
              "servprof.report.analyze_cli": "servprof analyze"}
    return [f"{what} ({module})" for module, what in needed.items() if importlib.util.find_spec(module) is None]


class Demo:
    def __init__(self, args: argparse.Namespace, console: Console) -> None:
        import httpx

        self.args = args
        self.console = console
        self.out: Path = args.out.resolve()
        self.logs = self.out / "logs"
        self.token = secrets.token_urlsafe(24)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=10.0, headers={"authorization": f"Bearer {self.token}"})
        self.artifacts = Artifacts(self.out)
        self.server: subprocess.Popen | None = None
        self.locust: subprocess.Popen | None = None
        self.session_id: str | None = None
        self.analysis: dict[str, Any] | None = None

    # --- processes -------------------------------------------------------------------------------

    def _spawn(self, name: str, command: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = (self.logs / f"{name}.log").open("wb")
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.out,
                                start_new_session=True)

    def start_server(self) -> None:
        flags = [flag for fault in self.args.inject for flag in INJECT_FLAGS[fault]]
        if getattr(self.args, "compile", False) and "--compile" not in flags:
            flags.append("--compile")
        if getattr(self.args, "compile_backend", None):
            flags += ["--compile-backend", self.args.compile_backend]
        command = [sys.executable, "-m", "servprof.demo.server", "--host", "127.0.0.1", "--port", str(self.port),
                   "--size", self.args.size, "--device", self.args.device, "--log-level", "warning", *flags]
        env = {**DEMO_SESSION_ENV, **os.environ, "SERVPROF_CONTROL_TOKEN": self.token,
               "SERVPROF_OUT_DIR": str(self.out), "SERVPROF_REQUESTS_PER_SESSION": str(self.args.sample)}
        self.server = self._spawn("server", command, env)

    def _log_tail(self, name: str) -> str:
        try:
            lines = (self.logs / f"{name}.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return lines[-1].strip() if lines else "(empty log)"

    def wait_for_health(self) -> None:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.server is not None and self.server.poll() is not None:
                raise DemoError(f"the demo server exited with status {self.server.returncode}: "
                                f"{self._log_tail('server')}; see {self.logs / 'server.log'}")
            try:
                if self.http.get("/health", timeout=2.0).status_code == 200:
                    return
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            time.sleep(0.25)
        raise DemoError(f"the demo server was not healthy within {HEALTH_TIMEOUT_S:.0f} s; "
                        f"see {self.logs / 'server.log'}")

    def status(self) -> dict[str, Any] | None:
        """/servprof/status, or None when the middleware's control endpoints do not answer."""
        try:
            response = self.http.get("/servprof/status")
            if response.status_code == 200 and "counters" in response.json():
                return response.json()
        except Exception:  # noqa: BLE001
            pass
        return None

    def max_input_words(self) -> int:
        """A prompt cut (in words) that fits the served model's context.

        The context comes from GET /v1/models; tokens per word from one probe request's
        usage (small tokenizers split the harness's words into several tokens).
        """
        import numpy as np

        from servprof.harness.datasets import words

        probe_words = 64
        try:
            context = int(self.http.get("/v1/models").json()["data"][0]["max_model_len"])
            probe = words(probe_words, np.random.default_rng(0))
            body = self.http.post("/v1/completions", json={"model": "demo", "prompt": probe, "max_tokens": 1},
                                  timeout=60.0).json()
            tokens_per_word = max(body["usage"]["prompt_tokens"] / probe_words, 1.0)
        except Exception:  # noqa: BLE001 - a server that does not say: no cut
            return 0
        room = context - self.args.max_output_tokens - 8
        return max(int(room / (tokens_per_word * 1.25)), 8)  # 25% margin: words differ in length

    def start_locust(self) -> None:
        locustfile = Path(__file__).resolve().parents[1] / "harness" / "locustfile.py"
        (self.out / "locust").mkdir(exist_ok=True)
        arrival = ["--arrival", "poisson", "--rate", str(self.args.rate)] if self.args.rate > 0 else []
        command = [sys.executable, "-m", "locust", "-f", str(locustfile), "--headless", "-H", self.url,
                   "-u", str(self.args.users), "-r", str(self.args.users), "-t", f"{self.args.duration:g}s",
                   "--only-summary", "--csv", str(self.out / "locust" / "locust"), "--dataset", "synthetic",
                   "--max-output-tokens", str(self.args.max_output_tokens),
                   "--max-input-tokens", str(self.max_input_words()),
                   "--summary-json", str(self.artifacts.paths["harness summary"]),
                   "--requests-jsonl", str(self.artifacts.paths["per-request timings"]), *arrival]
        # The demo server takes no key: a user's own OPENAI_API_KEY is not sent to it.
        self.locust = self._spawn("locust", command, {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"})

    def order_sample(self) -> str | None:
        """None when the order was taken, else why not."""
        response = self.http.post("/servprof/sample", params={"n": self.args.sample})
        if response.status_code != 202:
            return f"sample order refused: HTTP {response.status_code} {response.text[:200]}"
        return None

    def stop(self) -> None:
        for process in (self.locust, self.server):
            if process is not None and process.poll() is None:
                # SIGINT: uvicorn shuts down cleanly, so telemetry flushes its spans.
                process.send_signal(signal.SIGINT)
        for process in (self.locust, self.server):
            if process is None:
                continue
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.http.close()

    # --- the run ---------------------------------------------------------------------------------

    def _session_done(self, status: dict[str, Any], sessions_before: int) -> dict[str, Any] | None:
        counters = status["counters"]
        finished = counters.get("sessions_done", 0) + counters.get("sessions_failed", 0)
        if finished <= sessions_before or not status.get("last_sessions"):
            return None
        return status["last_sessions"][-1]

    def load_and_sample(self) -> tuple[str, dict[str, Any] | None]:
        """Show progress while the load runs, order the sample, wait for its analysis."""
        status = self.status()
        controllable = status is not None
        before = 0
        if status is not None:
            before = status["counters"].get("sessions_done", 0) + status["counters"].get("sessions_failed", 0)
        sample_at = self.args.sample_at if self.args.sample_at is not None else self.args.duration / 3
        note = f"sample at {sample_at:.3g} s" if controllable else "no servprof control endpoints: not sampling"
        session: dict[str, Any] | None = None
        ordered, refused = False, None
        with progress_for(self.console, self.args.duration) as progress:
            # The clock starts with the harness's first request (locust takes seconds to
            # start), so the sample lands in steady load, not in the first burst.
            spawned = time.monotonic()
            served_before = status["counters"]["requests"] if status else 0
            start: float | None = None
            analysis_deadline: float | None = None
            while True:
                locust_running = self.locust is not None and self.locust.poll() is None
                status = self.status() if controllable else None
                if start is None and (not status or status["counters"]["requests"] > served_before
                                      or time.monotonic() - spawned > 30 or not locust_running):
                    start = time.monotonic()
                elapsed = time.monotonic() - start if start is not None else 0.0
                if status is not None and not ordered and elapsed >= sample_at:
                    ordered = True
                    refused = self.order_sample()
                    note = refused or f"ordered {self.args.sample}"
                if status is not None and ordered and session is None:
                    session = self._session_done(status, before)
                    current = status.get("current_session")
                    if session is not None:
                        note = f"session {session['state']}"
                    elif current:
                        note = f"session {current['state']} {len(current['requests'])}/{current['target_requests']}"
                progress.show("load" if locust_running else "analysis", min(elapsed, self.args.duration),
                              status["counters"]["requests"] if status else None, note)
                if not locust_running:
                    if session is not None or not ordered:
                        break
                    analysis_deadline = analysis_deadline or time.monotonic() + self.args.analysis_timeout
                    if time.monotonic() > analysis_deadline:
                        return f"no analysis within {self.args.analysis_timeout:g} s after the load", None
                time.sleep(0.5)
        if session is not None:
            note = (f"session {session['session_id']} {session['state']}: {len(session.get('requests') or [])} "
                    f"requests, {session.get('steps_streamed_at_stop')} steps streamed when it stopped "
                    f"({session.get('stop_reason')})")
        elif refused is not None:
            note = refused
        return note, session

    def write_analysis(self, status: dict[str, Any] | None) -> None:
        if status and status.get("last_analysis"):
            live = {"last_analysis": status["last_analysis"], "findings": status.get("last_findings", []),
                    "session": (status.get("last_sessions") or [None])[-1]}
            self.artifacts.paths["findings (live analysis)"].write_bytes(orjson.dumps(live, option=orjson.OPT_INDENT_2))

    def analyze(self, trace_file: str | None) -> None:
        if not trace_file or not Path(trace_file).is_file():
            for name in ("report HTML", "report JSON"):
                self.artifacts.notes.setdefault(name, "no session trace to analyse")
            return
        paths = self.artifacts.paths
        command = [sys.executable, "-m", "servprof.cli", "analyze", trace_file,
                   "--json", str(paths["report JSON"]), "--html", str(paths["report HTML"])]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        (self.logs / "analyze.log").write_text(result.stdout + result.stderr)
        if result.returncode != 0:
            note = f"servprof analyze failed ({result.stderr.strip()[-200:]}); see {self.logs / 'analyze.log'}"
            self.artifacts.notes["report HTML"] = self.artifacts.notes["report JSON"] = note
            return
        self.print_findings(orjson.loads(paths["report JSON"].read_bytes()))

    def print_findings(self, report: dict[str, Any]) -> None:
        from servprof.report.findings_table import print_findings

        summary = report.get("summary") if isinstance(report.get("summary"), dict) else {}
        findings = [f for f in report.get("findings") or [] if isinstance(f, dict)]
        print_findings(self.console, summary, findings, title="servprof findings")

    def print_artifacts(self) -> bool:
        return print_artifacts(self.console, self.artifacts)


def run(args: argparse.Namespace) -> int:
    console = Console() if sys.stdout.isatty() else Console(width=120)
    err = Console(stderr=True)
    problems = [message for ok, message in [
        (args.duration > 0, "--duration must be > 0"), (args.users >= 1, "--users must be >= 1"),
        (args.sample >= 1, "--sample must be >= 1"), (args.rate >= 0, "--rate must be >= 0"),
        (args.max_output_tokens >= 1, "--max-output-tokens must be >= 1"),
        (args.sample_at is None or 0 <= args.sample_at < args.duration, "--sample-at must be within --duration"),
    ] if not ok]
    if problems:
        err.print(f"servprof demo: {'; '.join(problems)}", soft_wrap=True)
        return EXIT_BAD_INPUT
    missing = _missing_pieces()
    if any("demo server" in m or "locust" in m or "httpx" in m for m in missing):
        err.print(f"servprof demo: cannot run without: {', '.join(missing)}")
        return EXIT_BAD_INPUT
    for piece in missing:
        err.print(f"servprof demo: [yellow]{piece} is not available[/]: the demo runs without it")
    try:
        (args.out / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        err.print(f"servprof demo: cannot create --out {args.out}: {exc.strerror}")
        return EXIT_BAD_INPUT
    if "sync" in args.inject and not args.device.startswith("cuda"):
        err.print("servprof demo: note: --inject sync costs nothing on CPU (no device to wait for); use --device cuda")
    demo = Demo(args, console)
    try:
        if args.device == "cpu":
            console.print(f"servprof demo: {cpu_peak_note()}", soft_wrap=True, highlight=False)
        console.print(f"servprof demo: starting the demo server ({args.size}, {args.device}) on {demo.url}")
        demo.start_server()
        demo.wait_for_health()
        console.print(f"servprof demo: {args.duration:g} s of load from {args.users} users; "
                      f"sampling {args.sample} requests at {args.sample_at or args.duration / 3:g} s")
        demo.start_locust()
        note, session = demo.load_and_sample()
        console.print(f"servprof demo: {note}")
        status = demo.status()
        if status is None:
            why = "the server runs without servprof's middleware (no /servprof/status)"
            for name in ("findings (live analysis)", "traces", "spans", "report HTML", "report JSON"):
                demo.artifacts.notes[name] = why
        elif session is None:
            for name in ("findings (live analysis)", "traces", "report HTML", "report JSON"):
                demo.artifacts.notes[name] = f"no analysed session ({note})"
        demo.write_analysis(status)
        if demo.locust is not None and demo.locust.returncode not in (0, None):
            console.print(f"servprof demo: [yellow]locust exited with {demo.locust.returncode}[/] "
                          f"(some requests failed); see {demo.logs / 'locust.log'}")
    except DemoError as exc:
        err.print(f"servprof demo: {exc}", soft_wrap=True, highlight=False)
        demo.stop()
        return EXIT_FAILED
    except KeyboardInterrupt:
        err.print("servprof demo: interrupted")
        demo.stop()
        return EXIT_FAILED
    demo.stop()
    summary_path = demo.artifacts.paths["harness summary"]
    if summary_path.is_file():
        from servprof.harness.summary import summary_table

        console.print(summary_table(orjson.loads(summary_path.read_bytes())))
    demo.analyze(session.get("trace_file") if session else None)
    return EXIT_OK if demo.print_artifacts() else EXIT_FAILED
