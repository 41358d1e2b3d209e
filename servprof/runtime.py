"""Per-middleware state: the sampler, the trace store, counters, observers and session history.

The process-wide CaptureController owns the profiler; this object decides what a
candidate request becomes, keeps what /servprof/status shows, and hands finished
sessions to the observers (on the capture thread, never on the event loop).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import os
import threading
import time
from collections import deque
from typing import Any

import anyio.to_thread

from servprof.auto import install_thread_inheritance
from servprof.capture import FAILED, STARTING, CaptureController, Session, get_controller
from servprof.observers import RequestObserver, RequestRecord
from servprof.probes.snapshot import memory_snapshots
from servprof.sampling import REASON_ON_DEMAND, Sampler
from servprof.settings import Settings
from servprof.store import TraceStore
from servprof.tiers import light_status

PAUSE_RECHECK_S = 5.0  # how soon a paused store is tried again
START_WAIT_S = 5.0  # the longest a sampled request waits for its session to start
HISTORY = 10


def create_observers(settings: Settings) -> tuple[list[RequestObserver], str | None]:
    """Telemetry's observer when its module is there and telemetry is on; else none (and why)."""
    if not settings.telemetry:
        return [], None
    try:
        if importlib.util.find_spec("servprof.telemetry") is None:
            return [], "servprof.telemetry is not installed"
        observer = importlib.import_module("servprof.telemetry").create_observer(settings)
    except Exception as exc:  # noqa: BLE001 - telemetry must never stop serving
        return [], f"telemetry observer could not be created: {type(exc).__name__}: {exc}"
    return ([observer] if observer is not None else []), None


WEBSOCKETS_UNSAMPLED = (
    "{n} WebSocket connection(s) passed through unsampled: servprof samples HTTP requests (a connection is not one "
    "request, and may outlast any session). Model work a connection starts still shows in a session sampled from "
    "HTTP requests (every thread is recorded), named for no request; to sample it, serve the same model call over "
    "an HTTP route (streamed, for tokens) and send requests there."
)


def _on_main_thread_loop() -> bool:
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # built at import, before any loop runs
        return False
    return True


class ServprofRuntime:
    def __init__(self, settings: Settings, observers: list[RequestObserver] | None = None,
                 observer_problem: str | None = None, controller: CaptureController | None = None):
        self.settings = settings
        self.sampler = Sampler(settings)
        self.store = TraceStore(settings.out_dir, settings.trace_max_files, settings.trace_max_mb)
        # Integrations (vLLM) bring a controller that captures elsewhere than this process.
        self.controller = controller or get_controller()
        self.observers = observers or []
        self.observer_problem = observer_problem
        self.counters = {"requests": 0, "websocket_connections": 0, "sampled": 0, "skipped": 0, "observer_errors": 0,
                         "disconnects": 0, "sessions_done": 0, "sessions_failed": 0, "control_requests": 0,
                         "refused": 0}  # sampled requests the app refused (a 4xx): their places went to others
        self.skipped_by_reason: dict[str, int] = {}
        self.paused_reason: str | None = None
        self._paused_until = 0.0
        self.last_error: str | None = None
        # Finished sessions, described live: a record still streaming at the hand-off gets its
        # final route, chunks and last byte here (and in its .session.json) once it ends.
        self._sessions: deque[Session] = deque(maxlen=HISTORY)
        self.findings_history: deque[dict[str, Any]] = deque(maxlen=HISTORY)  # per session, newest last
        self.overhead_ms: dict[str, float] = {}  # servprof's own time over every session of this runtime
        self.last_result: dict[str, Any] | None = None
        self.last_order_at = 0.0
        self.order_tier: str | None = None  # the tier the last on-demand order asked for
        self.shutdown_report: dict[str, Any] | None = None  # what the last shutdown flush did
        self.memory_snapshots = memory_snapshots(settings, self.store.traces_dir)  # CUDA only; off by default
        self.warmup_deferred = False
        if settings.enabled:
            self.controller.memory_history = self.controller.memory_history or settings.memory_samples
            can_sample = settings.sample_every > 0 or settings.sample_rate > 0 or bool(settings.control_token)
            self.controller.prestart_analysis |= settings.warmup and settings.analysis and can_sample
            # Kineto's one-time init wants the thread that imported torch (as a rule the main thread:
            # on another it prints "ERROR: External init callback must run in same thread as
            # registerClient"). A runtime built by the app's first call on the main thread's event
            # loop (Starlette builds its middleware then: the lifespan startup, or with lifespan off
            # the first request) warms up there at lifespan startup, before the server serves
            # (warm_up_at_startup); built anywhere else, or with no lifespan, it warms up on the
            # capture thread (at once, or at the first request).
            self.warmup_deferred = settings.warmup and not self.controller.warm and _on_main_thread_loop()
            self.controller.ensure_running(settings.warmup and not self.warmup_deferred)
            self.controller.add_shutdown_hook(self.flush_observers)
            if settings.auto_instrument:
                install_thread_inheritance()  # threads started for a request carry its id into sessions

    def warm_up_at_startup(self) -> None:
        """At lifespan startup, the app's own done and nothing served yet: a deferred warm-up runs on
        this thread when it is the main thread (~1 s, blocking it: the server waits for startup to
        complete before it serves), else on the capture thread."""
        if not self.warmup_deferred:
            return
        self.warmup_deferred = False
        if threading.current_thread() is threading.main_thread():
            self.controller.warm_up_now()
        self.controller.ensure_running(True)

    def start_deferred_warmup(self) -> None:
        """A request came with no lifespan startup before it (lifespan off): the capture thread warms up."""
        if self.warmup_deferred:
            self.warmup_deferred = False
            self.controller.ensure_running(True)

    @property
    def history(self) -> list[dict[str, Any]]:
        """The last HISTORY finished sessions, oldest first, as /servprof/status shows them."""
        return [session.description() for session in list(self._sessions)]

    # --- sampling --------------------------------------------------------------------------------

    def order(self, n: int, tier: str | None = None) -> None:
        self.sampler.order(n)
        self.order_tier = tier
        self.last_order_at = time.monotonic()

    def request_finished(self, session: Session, record: RequestRecord) -> None:
        """A sampled request ended; one the app refused leaves its place in the session to another,
        and an on-demand order's slot stays owed to the next request."""
        if self.controller.request_finished(session, record):
            self.counters["refused"] += 1
            if session.reason == REASON_ON_DEMAND:
                self.sampler.give_back(REASON_ON_DEMAND)

    def _skip(self, kind: str, reason: str) -> None:
        self.sampler.give_back(reason)
        self.counters["skipped"] += 1
        self.skipped_by_reason[kind] = self.skipped_by_reason.get(kind, 0) + 1

    async def join_session(self, record: RequestRecord, reason: str) -> Session | None:
        """Put a candidate request into a session; None when it runs unsampled."""
        if self.paused_reason is not None and time.monotonic() < self._paused_until:
            self._skip("paused", reason)
            return None
        refusal = self.controller.refusal()
        if refusal is not None:
            self._skip(refusal[0], reason)
            return None
        # An order's session waits for all of the order's requests (this one and those still owed).
        target = self.sampler.on_demand_pending + 1 if reason == REASON_ON_DEMAND else self.settings.requests_per_session
        session = self.controller.admit(record, self.settings, self.store, reason, max(1, target),
                                        self._session_finished,
                                        self.order_tier if reason == REASON_ON_DEMAND else None)
        if session is None:
            self._skip("busy", reason)
            return None
        if reason == REASON_ON_DEMAND and session.order_id is None:
            session.order_id = self.sampler.order_id
        if session.event_loop_tid is None:
            session.event_loop_tid = threading.get_native_id()  # join_session runs on the serving loop
        if self.controller.wait_for_start and not session.started.is_set():
            # Only a sampled request waits for the profiler; the wait happens off the loop.
            try:
                await anyio.to_thread.run_sync(session.started.wait, START_WAIT_S)
            except BaseException:  # cancelled: the session must not wait for this request
                self.controller.withdraw(session, record)
                raise
        # Where the profiler runs elsewhere (vLLM's engine, wait_for_start false) it picks the
        # request up at its next step: the request goes on at once and is the session's unless the
        # start already failed. Here, it is the session's only if the session still captures now
        # that the request runs: one that stopped meanwhile never lists it.
        if not self.controller.confirm(session, record):
            self._skip(self._not_joined(session), reason)
            return None
        self.paused_reason = None
        self.counters["sampled"] += 1
        try:
            session.request_joined(record.request_id)  # the loop watchdog attaches (once), the step hooks look out
        except Exception as exc:  # noqa: BLE001 - the session's instruments never fail the request
            self.last_error = f"session instruments, on a sampled request's arrival: {type(exc).__name__}: {exc}"
        return session

    @staticmethod
    def _not_joined(session: Session) -> str:
        """Why an admitted request did not become the session's (a skipped_by_reason key)."""
        if session.state == STARTING:
            return "start_timeout"  # the profiler took longer than START_WAIT_S to start
        if session.state == FAILED and session.stop_reason is None:
            return "start_failed"  # it failed before it captured anything
        return "session_stopped"  # it stopped (a bound, a shutdown) before this request ran

    # --- the capture thread calls these ---------------------------------------------------------

    def _session_finished(self, session: Session) -> None:
        if session.reason == REASON_ON_DEMAND:
            # One order, one session: what it did not fill is dropped (a newer order is kept).
            self.sampler.cancel_order(session.order_id)
        if session.store_problem:
            self.paused_reason = session.error
            self._paused_until = time.monotonic() + PAUSE_RECHECK_S
        key = "sessions_failed" if session.error else "sessions_done"
        self.counters[key] += 1
        self.last_error = session.error or self.last_error
        self._sessions.append(session)
        for part, ms in session.overhead_ms.items():
            self.overhead_ms[part] = round(self.overhead_ms.get(part, 0.0) + ms, 3)
        result = session.result
        summary = (result or {}).get("summary") or {}
        self.findings_history.append({"session_id": session.session_id, "state": session.state,
                                      "error": session.error, "findings": (result or {}).get("findings", []),
                                      "missing": summary.get("missing", [])})
        if result is None:
            return
        self.last_result = result
        for observer in self.observers:
            try:
                observer.on_analysis(result, list(session.records))
            except Exception:  # noqa: BLE001 - an observer never breaks capture
                self.counters["observer_errors"] += 1

    def flush_observers(self, timeout_s: float) -> None:
        """Export what the observers still hold (spans, metrics), within `timeout_s`. Called on the
        controller's stop path (lifespan shutdown, process exit) after the session has stopped."""
        started = time.perf_counter()
        flushed, errors = 0, []
        for observer in self.observers:
            flush = getattr(observer, "force_flush", None)
            if flush is None:
                continue
            left_ms = int(max(0.0, timeout_s - (time.perf_counter() - started)) * 1000)
            try:
                flush(left_ms)
                flushed += 1
            except Exception as exc:  # noqa: BLE001 - shutdown goes on whatever an exporter does
                errors.append(f"{type(exc).__name__}: {exc}")
        self.shutdown_report = {"observers_flushed": flushed, "errors": errors,
                                "flush_ms": round((time.perf_counter() - started) * 1000, 3)}

    # --- /servprof/status ------------------------------------------------------------------------

    def why_paused(self) -> str | None:
        if not self.settings.enabled:
            return "servprof is disabled (SERVPROF_ENABLED=0)"
        if self.paused_reason is not None:
            return self.paused_reason
        refusal = self.controller.refusal()
        return refusal[1] if refusal and refusal[0] != "busy" else None

    def status(self) -> dict[str, Any]:
        controller = self.controller
        current = controller.session
        last = self.last_result or {}
        status = {
            # Which process answered: under several workers (uvicorn --workers, gunicorn -w) each
            # has its own sessions, and a control call reaches one of them.
            "process": {"pid": os.getpid(), "parent_pid": os.getppid()},
            "settings": self.settings.public_dict(),
            "counters": dict(self.counters),
            "skipped_by_reason": dict(self.skipped_by_reason),
            "sampler": self.sampler.status(),
            "paused": self.why_paused(),
            "profiler": {"warm": controller.warm, "warmup_error": controller.warmup_error,
                         "sessions_started_in_process": controller.sessions_started,
                         "events_per_second": controller.events_per_second,
                         "events_per_step": controller.events_per_step,
                         "event_budget": controller.budget.status(),
                         "light_event_budget": controller.light_budget.status(),
                         "tiers": {**light_status(), "next": controller.tier_for(self.settings)[0],
                                   "light_since_deep": controller.light_since_deep}},
            "current_session": current.description() if current is not None else None,
            "last_sessions": self.history,
            "last_findings": last.get("findings", []),
            "findings_by_session": list(self.findings_history),
            # Wall time servprof spent on its own sessions (profiler start and stop, trace export,
            # analysis child), in total; each session's share is in its servprof_overhead_ms.
            "servprof_overhead_ms": {"sessions": self.counters["sessions_done"] + self.counters["sessions_failed"],
                                     **self.overhead_ms},
            "missing": self.missing(),
            "last_analysis": {k: last.get(k) for k in ("session_id", "error", "summary")} if last else None,
            "last_error": self.last_error,
            "observers": {"count": len(self.observers), "errors": self.counters["observer_errors"],
                          "problem": self.observer_problem, "dropped_spans": self._dropped_spans()},
            "telemetry": self._telemetry_status(),
            "memory_snapshots": self.memory_snapshots.status(),
        }
        extra = getattr(controller, "extra_status", None)  # what an integration's controller adds
        if extra is not None:
            status.update(extra())
        return status

    def missing(self) -> list[dict[str, str]]:
        """What the last session could not show, and how to get it (docs/CONTRACTS.md
        ``summary["missing"]``): the analysis' entries, then the serving side's own (automatic
        phases off, no tokenizer library, no loop watched) when the analysis did not carry them."""
        last_session = self.history[-1] if self.history else {}
        summary = (self.last_result or {}).get("summary") or {}
        if self.last_result is not None and self.last_result.get("session_id") != last_session.get("session_id"):
            summary = {}  # the last session's analysis did not come back (failed or skipped)
        out: list[dict[str, str]] = []
        for entry in [*(summary.get("missing") or []), *(last_session.get("missing") or [])]:
            if isinstance(entry, dict) and entry not in out:
                out.append(entry)
        if self.counters["websocket_connections"]:
            out.append({"what": "websocket connections", "message": WEBSOCKETS_UNSAMPLED.format(
                n=self.counters["websocket_connections"])})
        return out

    def _telemetry_status(self) -> dict[str, Any] | None:
        # This middleware's own telemetry observer (exporter, span counts, dropped spans).
        for observer in self.observers:
            report = getattr(observer, "status", None)
            if report is None:
                continue
            try:
                return report()
            except Exception as exc:  # noqa: BLE001 - status must answer even when telemetry cannot
                return {"error": f"{type(exc).__name__}: {exc}"}
        return None

    def _dropped_spans(self) -> int | None:
        # Spans the observers lost (None when none can tell, e.g. on a host's provider).
        counts = [d for d in (getattr(o, "dropped_spans", None) for o in self.observers) if isinstance(d, int)]
        return sum(counts) if counts else None
