"""One process-wide owner of torch.profiler: one session at a time, run on its own thread.

Starting, stopping, exporting and the analysis hand-off all happen on the
``servprof-capture`` thread; the event loop only appends records to a session under a
short lock and waits for a sampled request's session to start (in a worker thread).

Facts this follows (../shared/facts/torch-profiler-in-a-server.md): only
``profile_all_threads`` sees the engine's threads; ``stop()`` holds the GIL ~5-9 us per
captured event and export ~2-3 us, so every session is bounded by time, requests,
decode steps and an estimate of captured events; a second profiler started while one
runs can crash the process, so ``_is_profiler_enabled`` is checked first.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import torch
import torch.autograd.profiler as autograd_profiler
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from servprof.analysis import empty_result, kill_running_analyses, run_analysis
from servprof.auto import AutoInstrumentation
from servprof.auto.session import SessionInstruments
from servprof.budget import STOP_AT, EventBudget, LiveSignals
from servprof.observers import RequestRecord
from servprof.probes import IDLE_TICK_S, SessionProbes, tick_memory_history
from servprof.settings import Settings
from servprof.store import StoreError, TraceStore

POLL_S = 0.005  # how often the bounds of a running session are checked
SHUTDOWN_FLUSH_S = 5.0  # the longest a shutdown waits for the observers to export their spans and metrics
RAW_BYTES_PER_EVENT = 260  # chrome-trace JSON per CPU event, used when the analysis gave no count

STARTING, CAPTURING, STOPPING, EXPORTING, ANALYSING, DONE, FAILED = (
    "starting", "capturing", "stopping", "exporting", "analysing", "done", "failed")
STOP_SHUTDOWN = "shutdown"
KINETO_QUIET_LEVEL = "6"  # above USDT (5) and ERROR (4): Kineto prints nothing
FOREIGN_PROFILER = ("another torch profiler is active in this process; servprof does not start a second "
                    "one (two at once can crash the process)")


class Session:
    """One profiler window covering one or more sampled requests."""

    def __init__(self, settings: Settings, store: TraceStore, reason: str, target_requests: int,
                 on_finished: Callable[[Session], None]):
        self.session_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self.settings = settings
        self.store = store
        self.reason = reason
        self.target_requests = target_requests
        self.order_id: int | None = None  # the on-demand order it serves, if any
        self.on_finished = on_finished
        self.records: list[RequestRecord] = []
        self.open_requests = 0
        self.state = STARTING
        self.stop_requested: str | None = None
        self.stop_reason: str | None = None
        self.error: str | None = None
        self.store_problem = False  # failed because the trace dir cannot take a trace
        self.wall_start_ns: int | None = None
        self.perf_start_ns: int | None = None
        self.perf_end_ns: int | None = None
        self.capture_end_ns: int | None = None  # when stop() began: events are captured until then
        self.busy_ns = 0  # capture time with at least one request in flight
        self.steps_captured = 0  # decode steps when the capture stopped (the streams go on after)
        # Wall time servprof itself spent on this session (profiler start, stop, export, analysis):
        # servprof's own overhead, shown apart from the app's time in status and the session files.
        self.overhead_ms: dict[str, float] = {}
        self.last_poll_ns = 0
        self.trace_path: Any = None
        self.session_file: Path | None = None  # <session>.session.json, once written
        self.trace_raw_bytes = 0
        self.result: dict[str, Any] | None = None
        self.event_loop_tid: int | None = None  # the serving loop's thread, so analysis can tell loop work apart
        self.probes: SessionProbes | None = None  # memory levels, torch.compile records (servprof.probes)
        self.instruments: SessionInstruments | None = None  # automatic phases + loop watchdog, while capturing
        self.started = threading.Event()  # set once capturing, or failed before capturing
        self.finished = threading.Event()

    def has_room(self) -> bool:
        return (self.state in (STARTING, CAPTURING) and self.stop_requested is None
                and len(self.records) < self.target_requests)

    def watch_loop(self) -> None:
        """Called on the serving loop by the first sampled request: the watchdog attaches to it."""
        instruments = self.instruments
        if instruments is not None and self.state == CAPTURING:
            instruments.attach_loop()

    def open_request_ids(self) -> list[str]:
        return [r.request_id for r in list(self.records) if r.end_ns is None]

    def steps(self) -> int:
        """Decode steps so far, estimated as the most body chunks any sampled request streamed
        (`steps_streamed`; the analysis counts the model steps in the trace: `model_steps`)."""
        return max((r.chunks for r in self.records), default=0)

    def finished_state(self) -> bool:
        return self.state in (DONE, FAILED)

    def timed(self, part: str, started_ns: int) -> None:
        """Add the time since `started_ns` (perf_counter_ns) to servprof's overhead `part`."""
        elapsed_ms = (time.perf_counter_ns() - started_ns) / 1e6
        self.overhead_ms[part] = round(self.overhead_ms.get(part, 0.0) + elapsed_ms, 3)

    def duration_s(self) -> float | None:
        if self.perf_start_ns is None:
            return None
        end = self.perf_end_ns or time.perf_counter_ns()
        return (end - self.perf_start_ns) / 1e9

    def description(self) -> dict[str, Any]:
        """What the analysis child and /servprof/status get to know about the session."""
        return {"session_id": self.session_id, "state": self.state, "reason": self.reason,
                "target_requests": self.target_requests, "stop_reason": self.stop_reason, "error": self.error,
                "wall_start_ns": self.wall_start_ns, "perf_start_ns": self.perf_start_ns,
                "duration_s": self.duration_s(), "busy_s": self.busy_ns / 1e9,
                # Body chunks of the sampled requests, not model steps: the stream goes on after
                # the stop; the analysis's own count of model steps in the trace is `model_steps`.
                "steps_streamed": self.steps(), "steps_streamed_at_stop": self.steps_captured,
                "servprof_overhead_ms": dict(self.overhead_ms),
                "open_requests": self.open_requests,  # > 0: the records below may still change
                "trace_file": str(self.trace_path) if self.trace_path else None,
                **(self.instruments.summary if self.instruments is not None else {}),
                "requests": [_record_summary(r) for r in list(self.records)]}


def _record_summary(record: RequestRecord) -> dict[str, Any]:
    return {"request_id": record.request_id, "method": record.method, "path": record.path, "route": record.route,
            "arrival_ns": record.arrival_ns, "arrival_perf_ns": record.arrival_perf_ns,
            "first_byte_ns": record.first_byte_ns, "last_byte_ns": record.last_byte_ns, "end_ns": record.end_ns,
            "status": record.status, "chunks": record.chunks, "bytes_sent": record.bytes_sent,
            "disconnected": record.disconnected}


class CaptureController:
    wait_for_start = True  # a sampled request waits (off the loop) until its session captures

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._warmup_lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._profiler: profile | None = None
        self.session: Session | None = None
        self.warm = False
        self.warmup_wanted = False
        self.warmup_error: str | None = None
        self.sessions_started = 0  # profiler starts by servprof in this process (warm-up excluded)
        self.in_flight = 0  # HTTP requests being served by any ServprofMiddleware in this process
        self.model_requests_done = 0  # POST requests served (model calls in OpenAI-style APIs), for memory history
        self.first_model_request_ns: int | None = None  # wall clock: compiles before it were start-up warm-up
        self.memory_history = False  # keep memory levels between sessions (a runtime with memory_samples on)
        self.budget = EventBudget()  # events per step / chunk / second, learned from stored traces
        self.auto = AutoInstrumentation()
        self._atexit_registered = False
        self._final_writes: list[Session] = []  # finished sessions whose last streaming request ended
        # Called (with a time budget in seconds) after a shutdown stopped the session: flush what the
        # observers still hold (spans, metrics). Weak: a runtime that is gone is not kept alive.
        self._shutdown_hooks: list[weakref.WeakMethod] = []

    # --- called from the event loop: cheap, never blocking --------------------------------------

    def ensure_running(self, warmup: bool) -> None:
        with self._lock:
            if warmup and not self.warm:
                self.warmup_wanted = True
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="servprof-capture", daemon=True)
                self._thread.start()
            if not self._atexit_registered:
                atexit.register(self.stop_now, "process exit", 30.0, SHUTDOWN_FLUSH_S)
                self._atexit_registered = True
        self._wake.set()

    def refusal(self) -> tuple[str, str] | None:
        """(kind, message) when a new sampled request cannot be taken now, else None."""
        if self.warmup_wanted and not self.warm:
            return "warming_up", "warming up the profiler (first start takes 1-2 s)"
        session = self.session
        if session is not None:
            return None if session.has_room() else ("busy", f"session {session.session_id} is {session.state}")
        if autograd_profiler._is_profiler_enabled:
            return "foreign_profiler", FOREIGN_PROFILER
        return None

    def admit(self, record: RequestRecord, settings: Settings, store: TraceStore, reason: str,
              target_requests: int, on_finished: Callable[[Session], None]) -> Session | None:
        """Put a candidate into the session (a new one if none runs); it is the session's only once
        confirm() says so."""
        with self._lock:
            session = self.session
            if session is None:
                session = self.session = Session(settings, store, reason, target_requests, on_finished)
            elif not session.has_room():
                return None
            session.records.append(record)
            session.open_requests += 1
        self._wake.set()
        return session

    def add_shutdown_hook(self, method: Callable[[float], None]) -> None:
        """Call the bound `method(timeout_s)` on the stop path (stop_now) while its object lives."""
        with self._lock:
            self._shutdown_hooks = [h for h in self._shutdown_hooks if h() is not None]
            self._shutdown_hooks.append(weakref.WeakMethod(method))  # type: ignore[arg-type]

    def confirm(self, session: Session, record: RequestRecord) -> bool:
        """Whether an admitted request is the session's: it is while the session captures (or, where
        the capture starts elsewhere, while it starts). Decided under the lock the stop takes too, so
        a request is either in the session's list, its trace and its spans, or in none of them."""
        with self._lock:
            joined = session.state == CAPTURING or (not self.wait_for_start and session.state == STARTING)
            if joined:
                record.sampled = True
                record.session_id = session.session_id
            else:
                self._withdraw_locked(session, record)
        if not joined:
            self._wake.set()
        return joined

    def withdraw(self, session: Session, record: RequestRecord) -> None:
        """An admitted request leaves before it was confirmed (its wait was cancelled)."""
        with self._lock:
            self._withdraw_locked(session, record)
        self._wake.set()

    def _withdraw_locked(self, session: Session, record: RequestRecord) -> None:
        session.records = [r for r in session.records if r is not record]
        session.open_requests -= 1

    def request_finished(self, session: Session) -> None:
        with self._lock:
            session.open_requests -= 1
            if session.finished_state() and session.open_requests <= 0:
                # The session was handed off while this request still streamed: its files get the
                # final records (route, chunks, last byte) now.
                self._final_writes.append(session)
        self._wake.set()

    # --- blocking: shutdown / exit ---------------------------------------------------------------

    def stop_now(self, reason: str = STOP_SHUTDOWN, timeout_s: float = 30.0, flush_s: float | None = None) -> Session | None:
        """Stop the running session (trace kept, analysis skipped) and wait for its export; then,
        with `flush_s`, have the observers export what they still hold (see flush_observers)."""
        session = self.session
        if session is not None:
            # Also read by a session already stopping or exporting: it then skips its analysis.
            session.stop_requested = f"{STOP_SHUTDOWN}: {reason}"
            self._wake.set()
            if session.state == ANALYSING:
                kill_running_analyses()
            session.finished.wait(timeout_s)
        if flush_s is not None:
            self.flush_observers(flush_s)
        return session

    def flush_observers(self, timeout_s: float) -> None:
        """Run the shutdown hooks (each runtime's observer flush), all within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        for ref in list(self._shutdown_hooks):
            hook = ref()
            if hook is not None:
                with contextlib.suppress(Exception):  # a failing flush must not stop the others
                    hook(max(0.0, deadline - time.monotonic()))

    # --- the capture thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            session = self.session
            self._wake.wait(POLL_S if session is not None and session.state == CAPTURING else IDLE_TICK_S)
            self._wake.clear()
            self._write_final_files()
            if self.warmup_wanted and not self.warm:
                self._warm_up()
            session = self.session
            if session is None:
                if self.memory_history:
                    tick_memory_history(self.model_requests_done, self.sessions_started)
                continue
            try:
                if session.state == STARTING:
                    self._start(session)
                elif session.state == CAPTURING:
                    if session.probes is not None:
                        session.probes.sample()
                    why = self._stop_reason(session)
                    if why:
                        self._finish(session, why)
            except Exception as exc:  # noqa: BLE001 - the capture thread must survive anything
                self._fail(session, f"capture error: {type(exc).__name__}: {exc}")

    def _new_profiler(self, settings: Settings | None) -> profile:
        # Kineto reads KINETO_LOG_LEVEL once, at the first profiler start in the process (not when
        # torch is imported): unless the user chose a level, its `USDT ... profiler_start/stop` lines
        # (one pair per session) stay out of the server's log. This level hides Kineto's own errors too.
        os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET_LEVEL)
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        return profile(activities=activities,
                       record_shapes=bool(settings and settings.record_shapes),
                       profile_memory=bool(settings and settings.profile_memory),
                       with_stack=bool(settings and settings.with_stack),
                       experimental_config=_ExperimentalConfig(profile_all_threads=True))

    def warm_up_now(self) -> None:
        """Warm Kineto up on the calling thread, now (1-2 s). Kineto's one-time init expects the thread
        that loaded torch; run on another it prints `ERROR: External init callback must run in same
        thread as registerClient` (harmless: capture works). A launcher that owns the main thread
        calls this there before serving (`servprof demo-server` does)."""
        self._warm_up()

    def _warm_up(self) -> None:
        # Kineto's first start costs 1-2 s; pay it here, not in the first sampled request.
        with self._warmup_lock:
            if self.warm:
                return
            try:
                if autograd_profiler._is_profiler_enabled:
                    self.warmup_error = FOREIGN_PROFILER
                else:
                    warm = self._new_profiler(None)
                    warm.start()
                    warm.stop()
            except Exception as exc:  # noqa: BLE001
                self.warmup_error = f"warm-up failed: {exc}"
            self.warm = True

    def _start(self, session: Session) -> None:
        problem = session.store.check_writable()
        if problem:
            self._fail(session, problem, store_problem=True)
            return
        if autograd_profiler._is_profiler_enabled:
            self._fail(session, FOREIGN_PROFILER)
            return
        prof = self._new_profiler(session.settings)
        session.probes = SessionProbes(session.settings.memory_samples, self.model_requests_done, self.sessions_started)
        session.wall_start_ns = time.time_ns()
        session.perf_start_ns = session.last_poll_ns = time.perf_counter_ns()
        prof.start()
        session.timed("start", session.perf_start_ns)
        self._profiler = prof
        self.sessions_started += 1
        session.instruments = SessionInstruments(session.settings, self.auto, self.budget, session.open_request_ids,
                                                 lambda: self.in_flight, self._wake.set)
        session.instruments.start()
        self._begin_capture(session)

    def _begin_capture(self, session: Session) -> None:
        with self._lock:  # confirm() decides under it whether a waiting request made it in
            session.state = CAPTURING
        session.started.set()

    def _begin_stop(self, session: Session, why: str) -> None:
        """From here on no request joins: those admitted but not yet confirmed (still waking up
        from their wait for the start) are left out of the session's list and its trace."""
        with self._lock:
            session.stop_reason = why
            session.state = STOPPING
            session.records = [r for r in session.records if r.sampled]

    @property
    def events_per_second(self) -> float | None:
        return self.budget.per_second

    @property
    def events_per_step(self) -> float | None:
        return self.budget.per_step or self.budget.per_chunk

    def estimated_events(self, elapsed_s: float, steps: int, assumed_per_s: float = 0.0) -> float:
        session = self.session
        instruments = session.instruments if session is not None else None
        live = instruments.live() if instruments is not None else LiveSignals()
        return self.budget.estimate(elapsed_s, steps, live, assumed_per_s)

    def _stop_reason(self, session: Session) -> str | None:
        if session.stop_requested:
            return session.stop_requested
        settings = session.settings
        now = time.perf_counter_ns()
        elapsed = (now - (session.perf_start_ns or 0)) / 1e9
        # Events come from serving work: count only the time some request was in flight, so an
        # idle server can wait for the session's requests without spending the event budget.
        if self.in_flight > 0:
            session.busy_ns += now - session.last_poll_ns
        session.last_poll_ns = now
        steps = session.steps()
        if len(session.records) >= session.target_requests and session.open_requests <= 0:
            return "requests_done"
        if elapsed >= settings.max_session_s:
            return "max_session_s"
        if steps >= settings.max_session_steps:
            return "max_session_steps"
        if self.estimated_events(session.busy_ns / 1e9, steps, settings.assumed_events_per_s) >= \
                self.budget.budget(settings) * STOP_AT:
            return "max_session_events"
        return None

    def _finish(self, session: Session, why: str) -> None:
        self._begin_stop(session, why)
        prof, self._profiler = self._profiler, None
        assert prof is not None
        instruments = session.instruments
        # The watchdog stops first: whatever the loop waits for from here on is servprof's stop/export.
        serving = instruments.stop(why == "max_session_events") if instruments is not None else {}
        metadata = {**serving, "session_id": session.session_id, "request_ids": [r.request_id for r in session.records],
                    "wall_start_ns": session.wall_start_ns, "perf_start_ns": session.perf_start_ns,
                    "stop_reason": why, "reason": session.reason, "event_loop_tid": session.event_loop_tid,
                    # From here on the profiler's own stop() holds the GIL: whatever the trace shows
                    # after this instant is servprof's overhead, never the app's.
                    "stop_wall_ns": time.time_ns()}
        if session.probes is not None:
            metadata.update(session.probes.finish(session.wall_start_ns, self.first_model_request_ns))
        prof.add_metadata_json("servprof", orjson.dumps(metadata).decode())
        session.capture_end_ns = time.perf_counter_ns()
        session.steps_captured = session.steps()
        prof.stop()  # holds the GIL ~5-9 us per captured event: why the sessions are bounded
        session.perf_end_ns = time.perf_counter_ns()
        session.timed("stop", session.capture_end_ns)
        if instruments is not None:
            instruments.remove()
        session.state = EXPORTING
        try:
            export_started = time.perf_counter_ns()
            session.trace_path, session.trace_raw_bytes = session.store.export(prof, session.session_id)
            session.timed("export", export_started)
            del prof
            result = self._analysis_result(session, session.trace_path)
        except StoreError as exc:
            self._fail(session, str(exc), store_problem=True)
            return
        self._learn(session, result)
        session.result = result
        session.error = result.get("error")
        self._end(session, FAILED if session.error else DONE)

    def _analysis_result(self, session: Session, trace_path: Path) -> dict[str, Any]:
        """The analysis child's result for the stored trace, or an empty one saying why it was
        skipped. A shutdown (stop_now) kills a running child; one arriving just as the child
        starts is caught by should_stop."""
        # The analysis child's view: a snapshot at the stop (requests may still be streaming);
        # rewritten with the final records once the session and its requests are done.
        session_file = session.store.write_json(session.session_id, ".session.json", session.description())
        session.session_file = session_file
        session.state = ANALYSING  # before the check: stop_now reads the state after setting stop_requested
        if session.stop_requested is not None or not session.settings.analysis:
            skipped = "shutdown" if session.stop_requested is not None else "analysis is off"
            return empty_result(session.session_id, trace_path, summary={"analysis_skipped": skipped})
        started = time.perf_counter_ns()
        result = run_analysis(session.session_id, trace_path, session_file,
                              session.store.path_for(session.session_id, ".analysis.json"),
                              session.settings.analysis_timeout_s,
                              should_stop=lambda: session.stop_requested is not None)
        session.timed("analysis", started)
        return result

    def _learn(self, session: Session, result: dict[str, Any]) -> None:
        count = (result.get("summary") or {}).get("event_count")
        if not isinstance(count, (int, float)) or count <= 0:
            count = session.trace_raw_bytes / RAW_BYTES_PER_EVENT
        summary = session.instruments.summary if session.instruments is not None else {}
        auto = summary.get("auto") or {}
        # A step still running at the stop left only part of its events: half a step each; after
        # a cut (collection switched off by the step hooks) steps went on uncounted in the trace.
        model_steps = (auto.get("steps") or 0) - (auto.get("running_at_stop") or 0) / 2
        if summary.get("steps_at_cut") is not None:
            model_steps = summary["steps_at_cut"]
        # Busy capture time only (stop() holds the GIL, so next to nothing is captured during it);
        # chunks at the stop, not now: the sampled streams went on after it.
        stop_s = (session.perf_end_ns - session.capture_end_ns) / 1e9 \
            if session.perf_end_ns and session.capture_end_ns else None
        self.budget.learn(count, session.settings, session.busy_ns / 1e9, model_steps, session.steps_captured, stop_s)

    def _fail(self, session: Session, error: str, store_problem: bool = False) -> None:
        session.error = error
        session.store_problem = store_problem
        if self._profiler is not None:
            prof, self._profiler = self._profiler, None
            # Already failing: the first error is the one worth reporting.
            with contextlib.suppress(Exception):
                prof.stop()
        if session.instruments is not None:
            with contextlib.suppress(Exception):
                session.instruments.remove()
        self._end(session, FAILED)

    def _end(self, session: Session, state: str) -> None:
        with self._lock:
            session.state = state
            # A session that failed before capturing lists none of the requests that waited for it.
            session.records = [r for r in session.records if r.sampled]
        if session.perf_start_ns is not None and session.perf_end_ns is None:
            session.perf_end_ns = time.perf_counter_ns()
        session.started.set()
        self._write_session_file(session)  # the final state; again when its last stream ends
        try:
            # Before the controller takes a new session: the hand-off ends an on-demand order and
            # pauses sampling on a store problem, so no request can slip into a session meanwhile.
            session.on_finished(session)
        except Exception as exc:  # noqa: BLE001 - reported, never re-entered
            session.error = session.error or f"session hand-off failed: {type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                if self.session is session:
                    self.session = None
            if self.memory_history:  # the level right after a session: the next quiet stretch starts here
                tick_memory_history(self.model_requests_done, self.sessions_started, force=True)
            session.finished.set()

    def _write_final_files(self) -> None:
        with self._lock:
            sessions, self._final_writes = self._final_writes, []
        for session in sessions:
            self._write_session_file(session)

    def _write_session_file(self, session: Session) -> None:
        """Rewrite <session>.session.json as /servprof/status shows the session now."""
        if session.session_file is None or not session.session_file.exists():  # gone with retention
            return
        with contextlib.suppress(StoreError, ValueError):  # a full disk: status still has it
            session.store.write_json(session.session_id, ".session.json", session.description())


_controller: CaptureController | None = None
_controller_lock = threading.Lock()


def get_controller() -> CaptureController:
    """The process-wide controller (torch.profiler is process-wide too)."""
    global _controller
    with _controller_lock:
        if _controller is None:
            _controller = CaptureController()
        return _controller
