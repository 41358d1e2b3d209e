"""One profiler session: the requests it covers, its state, its bounds' signals, its files.

The capture thread (servprof.capture) owns it; the event loop only appends records to it
under the controller's lock.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from servprof.analysis import empty_result, run_analysis
from servprof.auto.session import SessionInstruments
from servprof.observers import RequestRecord
from servprof.probes import SessionProbes
from servprof.settings import Settings
from servprof.store import StoreError, TraceStore
from servprof.tiers import DEEP

STARTING, CAPTURING, STOPPING, EXPORTING, ANALYSING, DONE, FAILED = (
    "starting", "capturing", "stopping", "exporting", "analysing", "done", "failed")


class Session:
    """One profiler window covering one or more sampled requests."""

    def __init__(self, settings: Settings, store: TraceStore, reason: str, target_requests: int,
                 on_finished: Callable[[Session], None], tier: str = DEEP, max_steps: int | None = None):
        self.session_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self.settings = settings
        self.store = store
        self.reason = reason
        self.target_requests = target_requests
        self.order_id: int | None = None  # the on-demand order it serves, if any
        self.tier = tier  # servprof.tiers: "light" (annotations + device activity) or "deep" (every op)
        self.tier_note: str | None = None  # why the tier is not the one asked for (a torch without light capture)
        self.max_steps = max_steps or settings.max_session_steps  # the tier's bound on decode steps
        self.on_finished = on_finished
        self.records: list[RequestRecord] = []
        # Sampled requests the app refused (a 4xx: unauthorised, invalid, rate-limited) before any
        # model work: they stay in the session's records but leave their place to other requests.
        self.refused = 0
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
        return self.still_capturing() and self.counted_requests() < self.target_requests

    def still_capturing(self) -> bool:
        return self.state in (STARTING, CAPTURING) and self.stop_requested is None

    def counted_requests(self) -> int:
        """The sampled requests that count towards the session's target (those the app did not refuse)."""
        return len(self.records) - self.refused

    def request_joined(self, request_id: str) -> None:
        """Called on the serving loop by each sampled request: the watchdog attaches to the loop
        (once), and the step hooks watch for a model this session has not seen yet."""
        instruments = self.instruments
        if instruments is not None and self.state == CAPTURING:
            instruments.attach_loop()
            instruments.request_joined(request_id)

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
                "tier": self.tier, "tier_note": self.tier_note, "max_steps": self.max_steps,
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

    def analyse(self, trace_path: Path) -> dict[str, Any]:
        """The analysis child's result for the stored trace, or an empty one saying why it was
        skipped. A shutdown (stop_now) kills a running child; one arriving just as the child
        starts is caught by should_stop."""
        # The analysis child's view: a snapshot at the stop (requests may still be streaming);
        # rewritten with the final records once the session and its requests are done.
        self.session_file = self.store.write_json(self.session_id, ".session.json", self.description())
        self.state = ANALYSING  # before the check: stop_now reads the state after setting stop_requested
        if self.stop_requested is not None or not self.settings.analysis:
            skipped = "shutdown" if self.stop_requested is not None else "analysis is off"
            return empty_result(self.session_id, trace_path, summary={"analysis_skipped": skipped})
        started = time.perf_counter_ns()
        result = run_analysis(self.session_id, trace_path, self.session_file,
                              self.store.path_for(self.session_id, ".analysis.json"),
                              self.settings.analysis_timeout_s,
                              should_stop=lambda: self.stop_requested is not None)
        self.timed("analysis", started)
        return result

    def write_file(self) -> None:
        """Rewrite <session>.session.json as /servprof/status shows the session now."""
        if self.session_file is None or not self.session_file.exists():  # gone with retention
            return
        with contextlib.suppress(StoreError, ValueError):  # a full disk: status still has it
            self.store.write_json(self.session_id, ".session.json", self.description())


def _record_summary(record: RequestRecord) -> dict[str, Any]:
    return {"request_id": record.request_id, "method": record.method, "path": record.path, "route": record.route,
            "arrival_ns": record.arrival_ns, "arrival_perf_ns": record.arrival_perf_ns,
            "first_byte_ns": record.first_byte_ns, "last_byte_ns": record.last_byte_ns, "end_ns": record.end_ns,
            "status": record.status, "chunks": record.chunks, "bytes_sent": record.bytes_sent,
            "disconnected": record.disconnected, "error": record.error_type}
