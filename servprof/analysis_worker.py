"""The serving side of the analysis child: one warm worker process, reused from session to session.

Why a warm worker rather than a fresh process per session: a fresh child spends ~100 ms of CPU
importing numpy and the detectors before it reads a trace, and a light session's analysis itself
takes ~10 ms. On a CPU server that CPU is taken from torch's thread pool, whose every op waits
for its slowest thread: measured on a 2-core machine serving a batching FastAPI server, each
fresh child held the batch that ran beside it ~200 ms (p99 51 -> 226 ms). The worker pays its
imports once.

The worker is ``python -m servprof.analysis --serve`` at low priority, with one thread for its
numeric libraries. One job per line on its stdin (JSON: the trace, session and result paths and
the SERVPROF_* settings of the serving process), one reply per line on its stdout. It keeps the
isolation of a fresh child where it matters: a job that crashes it or outlives its timeout kills
that worker, and the next job starts a new one; it retires after MAX_JOBS jobs or once the memory it
holds after a job passes RETIRE_RSS_BYTES (a big trace's analysis would otherwise stay resident), and exits
after IDLE_EXIT_S without a job, or when the serving process is gone (its stdin closes).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO, Any

import orjson

# Low priority, not idle priority: under SCHED_IDLE the analysis would get no CPU for as long as
# serving keeps every core busy; at nice 10 it gets ~10% of a core from a saturated server.
CHILD_NICENESS = 10
# One thread for the worker's numeric libraries: its numpy work never gains from more, and each
# idle OpenBLAS thread spins on a core torch's pool needs (measured: they doubled a child's CPU).
CHILD_THREADS = {name: "1" for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
MAX_JOBS = 200
RETIRE_RSS_BYTES = 384 * 1024**2
IDLE_EXIT_S = 600.0
# A fresh process per session, as before the warm worker (bench/bench_analysis_worker.py compares).
ONE_JOB_PER_WORKER = False
SETTINGS_PREFIX = "SERVPROF_"  # the settings a job carries: the worker reads them as a fresh child would
STDERR_TAIL_BYTES = 4096


def worker_command() -> list[str]:
    """The worker's command line (tests replace this to make it crash, hang or answer garbage)."""
    command = [sys.executable, "-m", "servprof.analysis", "--serve"]
    # `nice` lowers the worker's priority from its first instruction, Python's start-up included
    # (a preexec_fn would do it too, but makes the serving process fork instead of vfork).
    nice = shutil.which("nice")
    return [nice, "-n", str(CHILD_NICENESS), *command] if nice else command


class JobFailed(Exception):
    """The job gave no answer: the worker crashed, hung or could not start (the message says which)."""


class Worker:
    """One worker process and its pipes."""

    def __init__(self) -> None:
        # A file, not a pipe: a pipe nobody reads could fill and block the worker. Closed in close().
        self.stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115
        try:
            self.process = subprocess.Popen(worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=self.stderr, start_new_session=True,
                                            env={**os.environ, **CHILD_THREADS})
        except OSError as exc:
            self.stderr.close()
            raise JobFailed(f"analysis process could not start: {exc}") from exc
        self.jobs = 0
        self.retiring = False

    def alive(self) -> bool:
        return self.process.poll() is None and not self.retiring

    def send(self, job: dict[str, Any]) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write(orjson.dumps(job) + b"\n")
        stdin.flush()
        self.jobs += 1

    def reply(self, timeout_s: float) -> dict[str, Any]:
        """The job's reply line; JobFailed when the worker died or outlived ``timeout_s`` (then killed)."""
        stdout = self.process.stdout
        assert stdout is not None
        deadline = time.monotonic() + timeout_s
        line = b""
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    self.kill()
                    raise JobFailed(f"analysis timed out after {timeout_s:g} s and was killed")
                chunk = os.read(stdout.fileno(), 65536)
                if not chunk:
                    raise JobFailed(self._death())
                line += chunk
        try:
            reply = orjson.loads(line)
        except orjson.JSONDecodeError:
            reply = None
        if not isinstance(reply, dict):
            self.kill()
            raise JobFailed(f"analysis process answered {line[:200]!r}, not a reply")
        self.retiring = bool(reply.get("retire"))
        return reply

    def _death(self) -> str:
        """What a worker that closed its stdout died of (its exit status and last stderr line)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        status = self.process.poll()
        if status is None:  # closed its stdout but lives on: not a worker
            self.kill()
            status = self.process.returncode
        return f"analysis process exited with status {status}: {self._stderr_tail()}"

    def _stderr_tail(self) -> str:
        with contextlib.suppress(OSError, ValueError):
            size = self.stderr.seek(0, os.SEEK_END)
            self.stderr.seek(max(0, size - STDERR_TAIL_BYTES))
            lines = self.stderr.read().decode(errors="replace").strip().splitlines()
            return lines[-1][:300] if lines else ""
        return ""

    def kill(self) -> None:
        """Kill it, pipes left open: a thread waiting for its reply (a shutdown kills from another
        thread) then reads the end of its output, not a closed descriptor it would wait on forever."""
        try:
            os.killpg(self.process.pid, 9)  # (its own session: a kill takes any grandchildren with it)
        except OSError:
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)

    def close(self) -> None:
        """Let go of the pipes; a worker still alive then sees its stdin close and exits."""
        for pipe in (self.process.stdin, self.process.stdout, self.stderr):
            with contextlib.suppress(OSError, ValueError):
                if pipe is not None:
                    pipe.close()


class Workers:
    """The process's warm worker, and one-shot workers for a job that finds it busy (two sessions
    analysed at once, e.g. two apps in one process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._warm: Worker | None = None
        self.running: set[Worker] = set()

    def run(self, job: dict[str, Any], timeout_s: float, should_stop: Callable[[], bool]) -> dict[str, Any]:
        """The worker's reply to ``job``; JobFailed when it gave none. ``should_stop`` is asked once
        the job's worker is registered: a shutdown that killed the workers just before is not missed."""
        job = {**job, "env": {k: v for k, v in os.environ.items() if k.startswith(SETTINGS_PREFIX)},
               "retire": ONE_JOB_PER_WORKER}
        if not self._lock.acquire(blocking=False):
            return self._one_shot(job, timeout_s, should_stop)
        try:
            return self._on_warm(job, timeout_s, should_stop)
        finally:
            self._lock.release()

    def prestart(self) -> None:
        """Start the warm worker now, if none runs (it imports the detectors, then waits for a job)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._warm is None or not self._warm.alive():
                self._forget(self._warm)
                with contextlib.suppress(JobFailed):  # (the first job will say why)
                    self._warm = self._start()
        finally:
            self._lock.release()

    def _on_warm(self, job: dict[str, Any], timeout_s: float, should_stop: Callable[[], bool]) -> dict[str, Any]:
        worker = self._warm
        reused = worker is not None and worker.alive()
        if not reused:
            self._forget(worker)
            worker = self._warm = self._start()
        assert worker is not None
        try:
            return self._ask(worker, job, timeout_s, should_stop)
        except (JobFailed, OSError) as exc:
            self._forget(worker)
            if reused and worker.process.returncode == 0:  # it had just retired or gone idle: once more, fresh
                worker = self._warm = self._start()
                try:
                    return self._ask(worker, job, timeout_s, should_stop)
                except (JobFailed, OSError) as again:
                    self._forget(worker)
                    raise _failed(again) from again
            raise _failed(exc) from exc
        finally:
            if self._warm is not None and not self._warm.alive():
                self._forget(self._warm)

    def _one_shot(self, job: dict[str, Any], timeout_s: float, should_stop: Callable[[], bool]) -> dict[str, Any]:
        worker = self._start()
        try:
            return self._ask(worker, job, timeout_s, should_stop)
        except (JobFailed, OSError) as exc:
            raise _failed(exc) from exc
        finally:
            self._forget(worker)

    def _start(self) -> Worker:
        worker = Worker()
        self.running.add(worker)
        return worker

    def _ask(self, worker: Worker, job: dict[str, Any], timeout_s: float, should_stop: Callable[[], bool]
             ) -> dict[str, Any]:
        if should_stop():
            worker.kill()
            raise JobFailed(worker._death())
        worker.send(job)
        return worker.reply(timeout_s)

    def _forget(self, worker: Worker | None) -> None:
        """Close a worker's pipes (it exits once its stdin closes) and stop tracking it."""
        if worker is None:
            return
        self.running.discard(worker)
        if self._warm is worker:
            self._warm = None
        worker.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.process.wait(0 if worker.process.poll() is not None else 5)

    def kill_all(self) -> None:
        for worker in list(self.running):
            worker.kill()
        if self._lock.acquire(blocking=False):  # the warm worker had no job: nobody else lets go of it
            try:
                self._forget(self._warm)
            finally:
                self._lock.release()

    def after_fork_in_child(self) -> None:
        """A forked process's workers are its parent's: close this copy of their pipes (so they
        still see their stdin close when the parent exits), never kill them."""
        for worker in list(self.running):
            worker.close()
        self.running.clear()
        self._warm = None
        self._lock = threading.Lock()  # (another thread may have held it at the fork)


def _failed(exc: Exception) -> JobFailed:
    if isinstance(exc, JobFailed):
        return exc
    return JobFailed(f"analysis process unreachable: {exc}")  # a pipe broken as it died


WORKERS = Workers()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=WORKERS.after_fork_in_child)
