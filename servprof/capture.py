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
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable

import torch.autograd.profiler as autograd_profiler
from torch.profiler import profile

from servprof.analysis import kill_running_analyses
from servprof.analysis_worker import WORKERS
from servprof.auto import AutoInstrumentation
from servprof.auto.session import SessionInstruments, trace_metadata_json
from servprof.budget import STOP_AT, EventBudget, LiveSignals
from servprof.observers import RequestRecord
from servprof.probes import IDLE_TICK_S, SessionProbes, tick_memory_history
from servprof.session import (  # noqa: F401 - re-exported: the session's states live with it
    ANALYSING,
    CAPTURING,
    DONE,
    EXPORTING,
    FAILED,
    STARTING,
    STOPPING,
    Session,
)
from servprof.settings import Settings
from servprof.store import StoreError, TraceStore
from servprof.tiers import DEEP, LIGHT, drain_ops, new_profiler, stop_profiler

POLL_S = 0.005  # how often the bounds of a running session are checked
SHUTDOWN_FLUSH_S = 5.0  # the longest a shutdown waits for the observers to export their spans and metrics

FORK_WAIT_S = 10.0  # the longest a fork waits for a warm-up in progress to end

STOP_SHUTDOWN = "shutdown"
FOREIGN_PROFILER = ("another torch profiler is active in this process; servprof does not start a second "
                    "one (two at once can crash the process)")


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
        self.prestart_analysis = False  # start the analysis worker with the warm-up (a runtime that can sample)
        self.sessions_started = 0  # profiler starts by servprof in this process (warm-up excluded)
        self.in_flight = 0  # HTTP requests being served by any ServprofMiddleware in this process
        self.model_requests_done = 0  # POST requests served (model calls in OpenAI-style APIs), for memory history
        self.first_model_request_ns: int | None = None  # wall clock: compiles before it were start-up warm-up
        self.memory_history = False  # keep memory levels between sessions (a runtime with memory_samples on)
        self.budget = EventBudget()  # deep sessions: events per step / chunk / second, learned from stored traces
        self.light_budget = EventBudget(light=True)  # light sessions: annotations (+ device activity) only
        self.light_since_deep = 0  # light sessions captured since the last deep window
        self.auto = AutoInstrumentation()
        self._atexit_registered = False
        self._final_writes: list[Session] = []  # finished sessions whose last streaming request ended
        # Called (with a time budget in seconds) after a shutdown stopped the session: flush what the
        # observers still hold (spans, metrics). Weak: a runtime that is gone is not kept alive.
        self._shutdown_hooks: list[weakref.WeakMethod] = []
        self._fork_held = False
        if hasattr(os, "register_at_fork"):
            hooks = {when: weakref.WeakMethod(method) for when, method in (
                ("before", self._before_fork), ("after_in_parent", self._after_fork_in_parent),
                ("after_in_child", self._forget_parent))}
            os.register_at_fork(**{when: functools.partial(_call_if_alive, ref) for when, ref in hooks.items()})

    def _before_fork(self) -> None:
        """Let a warm-up in progress (the first Kineto start) end before the process forks: a fork in
        the middle of it leaves the child's profiler half started, and every session there hangs."""
        self._fork_held = self._warmup_lock.acquire(timeout=FORK_WAIT_S)

    def _after_fork_in_parent(self) -> None:
        if self._fork_held:
            self._fork_held = False
            self._warmup_lock.release()

    def _forget_parent(self) -> None:
        """In a forked child (gunicorn --preload, any pre-fork server that built the middleware
        first): the capture thread did not come along, a lock another thread held at the fork stays
        held, and the parent's session, profiler and requests are the parent's. Start afresh; the
        capture thread starts again with the first request that could be sampled (refusal)."""
        self._lock, self._warmup_lock, self._wake = threading.Lock(), threading.Lock(), threading.Event()
        self._fork_held = False
        self._thread = None
        self._profiler = self.session = None
        self.in_flight = 0
        self._final_writes = []

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
        if self._thread is None or not self._thread.is_alive():  # a forked child (_forget_parent)
            self.ensure_running(self.warmup_wanted)
        if self.warmup_wanted and not self.warm:
            return "warming_up", "warming up the profiler (first start takes 1-2 s)"
        session = self.session
        if session is not None:
            return None if session.has_room() else ("busy", f"session {session.session_id} is {session.state}")
        if autograd_profiler._is_profiler_enabled:
            return "foreign_profiler", FOREIGN_PROFILER
        return None

    def tier_for(self, settings: Settings, asked: str | None = None) -> tuple[str, int]:
        """(tier, decode-step bound) of the next session: every session deep with tier "deep";
        else light, with a deep window of deep_steps after every deep_every light ones or when
        an order asks for one."""
        if settings.tier == DEEP:
            return DEEP, settings.max_session_steps
        if asked == DEEP or (settings.deep_every and self.light_since_deep >= settings.deep_every):
            return DEEP, settings.deep_steps
        return LIGHT, settings.light_max_steps

    def budget_of(self, session: Session) -> EventBudget:
        return self.light_budget if session.tier == LIGHT else self.budget

    def admit(self, record: RequestRecord, settings: Settings, store: TraceStore, reason: str,
              target_requests: int, on_finished: Callable[[Session], None],
              tier: str | None = None) -> Session | None:
        """Put a candidate into the session (a new one if none runs); it is the session's only once
        confirm() says so. ``tier`` is what an on-demand order asked for."""
        with self._lock:
            session = self.session
            if session is None:
                chosen, max_steps = self.tier_for(settings, tier)
                session = self.session = Session(settings, store, reason, target_requests, on_finished,
                                                 chosen, max_steps)
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

    def request_finished(self, session: Session, record: RequestRecord | None = None) -> bool:
        """A sampled request ended. Returns whether it left its place to another request: the app
        refused it (RequestRecord.refused_by_app) while the session still captures, which then waits for one
        more (bounded by its time and event budget), so that it is not spent on no model work."""
        with self._lock:
            session.open_requests -= 1
            refunded = record is not None and record.refused_by_app() and session.still_capturing()
            if refunded:
                session.refused += 1
            if session.finished_state() and session.open_requests <= 0:
                # The session was handed off while this request still streamed: its files get the
                # final records (route, chunks, last byte) now.
                self._final_writes.append(session)
        self._wake.set()
        return refunded

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
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - even failing a session failed: drop it, go on
                self._drop(f"capture error: {type(exc).__name__}: {exc}")

    def _tick(self) -> None:
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
            return
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

    def _drop(self, error: str) -> None:
        """The last resort: end the running session (if any) without its files or hand-off, so the
        waiting requests go on and the next session can start."""
        if self._profiler is not None:
            prof, self._profiler = self._profiler, None
            with contextlib.suppress(Exception):
                stop_profiler(prof, self.session.tier if self.session is not None else DEEP)
        with self._lock:
            session, self.session = self.session, None
        if session is not None and not session.finished.is_set():
            session.error = session.error or error
            session.state = FAILED
            session.started.set()
            with contextlib.suppress(Exception):  # the runtime counts it and ends its order
                session.on_finished(session)
            session.finished.set()

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
                    # Light where torch allows: Kineto's init is the same; stopped at once, undrained
                    # (no servprof range runs yet: tiers.stop_profiler).
                    warm, tier, _note = new_profiler(None, LIGHT)
                    warm.start()
                    stop_profiler(warm, tier, drain=False)
            except Exception as exc:  # noqa: BLE001
                self.warmup_error = f"warm-up failed: {exc}"
            self.warm = True
        if self.prestart_analysis:
            # Its imports (~100 ms of CPU) paid at start-up too, not beside the first session's requests.
            WORKERS.prestart()

    def _start(self, session: Session) -> None:
        problem = session.store.check_writable()
        if problem:
            self._fail(session, problem, store_problem=True)
            return
        if autograd_profiler._is_profiler_enabled:
            self._fail(session, FOREIGN_PROFILER)
            return
        prof, session.tier, session.tier_note = new_profiler(session.settings, session.tier)
        if session.tier_note:  # no light capture on this torch: the deep bounds apply
            session.max_steps = min(session.max_steps, session.settings.max_session_steps)
        session.probes = SessionProbes(session.settings.memory_samples, self.model_requests_done, self.sessions_started)
        session.wall_start_ns = time.time_ns()
        session.perf_start_ns = session.last_poll_ns = time.perf_counter_ns()
        prof.start()
        session.timed("start", session.perf_start_ns)
        self._profiler = prof
        self.sessions_started += 1
        session.instruments = SessionInstruments(session.settings, self.auto, self.budget_of(session),
                                                 session.open_request_ids,
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
        budget = self.budget_of(session) if session is not None else self.budget
        return budget.estimate(elapsed_s, steps, live, assumed_per_s)

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
        if session.counted_requests() >= session.target_requests and session.open_requests <= 0:
            return "requests_done"
        if elapsed >= settings.max_session_s:
            return "max_session_s"
        if steps >= session.max_steps:
            return "max_session_steps"
        budget = self.budget_of(session)
        if self.estimated_events(session.busy_ns / 1e9, steps, budget.assumed_per_s(settings)) >= \
                budget.budget(settings) * STOP_AT:
            return "max_session_events"
        return None

    def _finish(self, session: Session, why: str) -> None:
        self._begin_stop(session, why)
        prof, self._profiler = self._profiler, None
        assert prof is not None
        instruments = session.instruments
        # The watchdog stops first: whatever the loop waits for from here on is servprof's stop/export.
        # Collection goes off now (light or deep): the ops and ranges in flight end before the stop.
        serving = instruments.stop(why == "max_session_events", drain=True) \
            if instruments is not None else {}
        metadata = {**serving, "session_id": session.session_id, "request_ids": [r.request_id for r in session.records],
                    "wall_start_ns": session.wall_start_ns, "perf_start_ns": session.perf_start_ns,
                    "stop_reason": why, "reason": session.reason, "event_loop_tid": session.event_loop_tid,
                    "tier": session.tier, "tier_note": session.tier_note,
                    # From here on the profiler's own stop() holds the GIL: whatever the trace shows
                    # after this instant is servprof's overhead, never the app's.
                    "stop_wall_ns": time.time_ns()}
        if session.probes is not None:
            metadata.update(session.probes.finish(session.wall_start_ns, self.first_model_request_ns))
        prof.add_metadata_json("servprof", trace_metadata_json(metadata))
        session.steps_captured = session.steps()
        drain_ops(session.tier, instruments.cut_perf_ns if instruments is not None else None)
        session.capture_end_ns = time.perf_counter_ns()
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
            result = session.analyse(session.trace_path)
        except StoreError as exc:
            self._fail(session, str(exc), store_problem=True)
            return
        self.budget_of(session).learn_session(session, result)
        session.result = result
        session.error = result.get("error")
        self._end(session, FAILED if session.error else DONE)

    def _fail(self, session: Session, error: str, store_problem: bool = False) -> None:
        session.error = error
        session.store_problem = store_problem
        if self._profiler is not None:
            prof, self._profiler = self._profiler, None
            # Already failing: the first error is the one worth reporting.
            with contextlib.suppress(Exception):
                stop_profiler(prof, session.tier)
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
        if session.perf_start_ns is not None:  # it captured: counts towards the next deep window
            self.light_since_deep = self.light_since_deep + 1 if session.tier == LIGHT else 0
        session.started.set()
        session.write_file()  # the final state; again when its last stream ends
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
            session.write_file()



def _call_if_alive(ref: weakref.WeakMethod) -> None:
    method = ref()
    if method is not None:
        method()


_controller: CaptureController | None = None
_controller_lock = threading.Lock()


def get_controller() -> CaptureController:
    """The process-wide controller (torch.profiler is process-wide too)."""
    global _controller
    with _controller_lock:
        if _controller is None:
            _controller = CaptureController()
        return _controller
