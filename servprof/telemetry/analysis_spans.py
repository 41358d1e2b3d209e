"""Child spans for sampled requests, emitted after their session's analysis.

The request span ended long before the trace was analysed, so the children are started
under its kept SpanContext with explicit timestamps taken from the trace:
  <request span>
    tokenize / queue / prefill / detokenize     one span per phase, real start and end
                                                (at most MAX_SPANS_PER_PHASE of each name)
    decode                                      first step start .. last step end
      decode_step x N                           when N <= MAX_STEP_SPANS, else step events
    servprof.analysis                           trace file, session, per-phase totals,
                                                events of the findings that name this request
  servprof.session_analysis                     (its own trace, linked to every sampled request
                                                span) events of the findings about the session as
                                                a whole: those that name no request
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode

from servprof.telemetry.finding_event import (
    FINDING_EVENT,
    MAX_EVIDENCE_CHARS,
    evidence_limit,
    finding_event_attributes,
)

MAX_STEP_SPANS = 32  # more decode steps than this become events on the decode span
MAX_STEP_EVENTS = 100  # below the SDK's default limit of 128 events per span
MAX_SPANS_PER_PHASE = 16  # e.g. detokenize once per token: the rest are only counted
MAX_SESSION_FINDINGS = 100  # below the SDK's default limit of 128 events per span
__all__ = ["AnalysisSpanEmitter", "FINDING_EVENT", "MAX_EVIDENCE_CHARS", "SampledParent", "SampledParents"]


@dataclass(frozen=True, slots=True)
class SampledParent:
    span_context: SpanContext
    start_ns: int  # wall-clock ns, as the request span was started and ended
    end_ns: int | None = None  # None while the request is still streaming


class SampledParents:
    """Request id -> the ended request span's context, for the last `capacity` sampled ones."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, SampledParent] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, request_id: str, parent: SampledParent) -> None:
        with self._lock:
            self._items[request_id] = parent
            self._items.move_to_end(request_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def ended(self, request_id: str, end_ns: int) -> None:
        """The request finished: its end time, if its analysis has not already used the parent
        (a long stream often outlives its session's capture and analysis)."""
        with self._lock:
            parent = self._items.get(request_id)
            if parent is not None:
                self._items[request_id] = SampledParent(parent.span_context, parent.start_ns, end_ns)

    def pop(self, request_id: str) -> SampledParent | None:
        with self._lock:
            return self._items.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class AnalysisCounts:
    analyses: int = 0
    spans: int = 0
    requests: int = 0
    orphaned_requests: int = 0  # analysed, but the request span's context was not kept
    errors: int = 0
    session_spans: int = 0  # servprof.session_analysis spans (sessions with whole-session findings)


class _Clock:
    def __init__(self, result: dict[str, Any]) -> None:
        clock = result.get("clock") or {}
        offset = clock.get("trace_us_to_unix_ns_offset")
        self.offset = int(offset) if isinstance(offset, int | float) else None

    def unix_ns(self, ts_us: Any) -> int | None:
        if self.offset is None or not isinstance(ts_us, int | float):
            return None
        return int(ts_us * 1000) + self.offset


def _findings(result: dict[str, Any]) -> list[dict[str, Any]]:
    findings = result.get("findings")
    return [f for f in (findings if isinstance(findings, list) else []) if isinstance(f, dict)]


def _findings_for(result: dict[str, Any], request_id: str) -> list[dict[str, Any]]:
    """The findings that name this request (those naming none are the session's, not every request's)."""
    return [f for f in _findings(result) if isinstance(f.get("request_ids"), list) and request_id in f["request_ids"]]


def _session_findings(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in _findings(result) if not f.get("request_ids")]


class AnalysisSpanEmitter:
    def __init__(self, tracer: trace.Tracer, parents: SampledParents) -> None:
        self._tracer = tracer
        self._parents = parents
        self.counts = AnalysisCounts()
        self._evidence_limit = evidence_limit()

    def emit(self, result: dict[str, Any], record_ids: list[str]) -> None:
        """Spans for every analysed request whose parent context was kept."""
        self.counts.analyses += 1
        clock = _Clock(result)
        requests = result.get("requests")
        requests = requests if isinstance(requests, dict) else {}
        request_ids = list(dict.fromkeys([*requests, *record_ids]))
        linked: list[SampledParent] = []
        for request_id in request_ids:
            parent = self._parents.pop(request_id)
            if parent is None:
                self.counts.orphaned_requests += 1
                continue
            linked.append(parent)
            try:
                self._emit_request(result, clock, request_id, requests.get(request_id) or {}, parent)
                self.counts.requests += 1
            except (TypeError, ValueError, KeyError, AttributeError):  # a malformed result: skip that request
                self.counts.errors += 1
        try:
            self._emit_session(result, clock, linked)
        except (TypeError, ValueError, KeyError, AttributeError):
            self.counts.errors += 1

    def _emit_session(self, result: dict[str, Any], clock: _Clock, linked: list[SampledParent]) -> None:
        """One span for the findings about the whole session, linked to the sampled requests' spans
        (it is not any one request's child: the finding is not any one request's)."""
        findings = _session_findings(result)[:MAX_SESSION_FINDINGS]
        if not findings:
            return
        now = time.time_ns()
        start = min((p.start_ns for p in linked), default=now)
        attributes: dict[str, Any] = {"servprof.findings": len(findings), "servprof.sampled_requests": len(linked)}
        for key, attribute in (("session_id", "servprof.session_id"), ("trace_file", "servprof.trace_file")):
            if result.get(key):
                attributes[attribute] = str(result[key])
        self.counts.spans += 1
        self.counts.session_spans += 1
        span = self._tracer.start_span(
            "servprof.session_analysis", context=trace.set_span_in_context(trace.INVALID_SPAN), kind=SpanKind.INTERNAL,
            start_time=start, attributes=attributes, links=[Link(p.span_context) for p in linked])
        for finding in findings:
            timestamp = clock.unix_ns(finding.get("start_us")) or start
            span.add_event(FINDING_EVENT, finding_event_attributes(finding, self._evidence_limit), timestamp=timestamp)
        span.end(end_time=max(now, start))

    def _start(self, name: str, context: Any, start_ns: int, attributes: dict[str, Any]) -> trace.Span:
        self.counts.spans += 1
        return self._tracer.start_span(
            name, context=context, kind=SpanKind.INTERNAL, start_time=start_ns, attributes=attributes
        )

    def _emit_request(
        self,
        result: dict[str, Any],
        clock: _Clock,
        request_id: str,
        request: dict[str, Any],
        parent: SampledParent,
    ) -> None:
        context = trace.set_span_in_context(NonRecordingSpan(parent.span_context))
        timed: list[tuple[str, int, int]] = []
        phases = request.get("phases") if isinstance(request, dict) else None
        for phase in phases if isinstance(phases, list) else []:
            if not isinstance(phase, dict):
                continue
            start, end = clock.unix_ns(phase.get("start_us")), clock.unix_ns(phase.get("end_us"))
            if start is not None and end is not None and end >= start:
                timed.append((str(phase.get("name")), start, end))
        timed.sort(key=lambda item: item[1])
        steps = [item for item in timed if item[0] == "decode_step"]
        others: list[tuple[str, int, int]] = []
        totals: dict[str, list[float]] = {}  # phase -> [count, total ms]
        for name, start, end in timed:
            total = totals.setdefault(name, [0, 0.0])
            if name != "decode_step" and total[0] < MAX_SPANS_PER_PHASE:
                others.append((name, start, end))
            total[0] += 1
            total[1] += (end - start) / 1e6

        # Start order follows time, so a trace view lists them as they happened.
        decode_start = steps[0][1] if steps else None
        emitted_decode = False
        for name, start, end in others:
            if decode_start is not None and not emitted_decode and decode_start < start:
                self._emit_decode(context, steps, request_id)
                emitted_decode = True
            span = self._start(
                name, context, start, {"servprof.phase": name, "servprof.request_id": request_id}
            )
            span.end(end_time=end)
        if steps and not emitted_decode:
            self._emit_decode(context, steps, request_id)
        self._emit_analysis(result, clock, request_id, context, parent, totals)

    def _emit_decode(self, context: Any, steps: list[tuple[str, int, int]], request_id: str) -> None:
        durations_ms = np.array([end - start for _, start, end in steps], dtype=np.float64) / 1e6
        gaps_ms = (
            np.array([b[1] - a[2] for a, b in zip(steps, steps[1:], strict=False)], dtype=np.float64) / 1e6
        )
        attributes: dict[str, Any] = {
            "servprof.phase": "decode",
            "servprof.request_id": request_id,
            "servprof.decode_steps": len(steps),
            "servprof.decode_step_ms.mean": float(durations_ms.mean()),
            "servprof.decode_step_ms.p50": float(np.median(durations_ms)),
            "servprof.decode_step_ms.max": float(durations_ms.max()),
        }
        if gaps_ms.size:
            attributes["servprof.decode_gap_ms.max"] = float(gaps_ms.max())
        decode = self._start("decode", context, steps[0][1], attributes)
        if len(steps) <= MAX_STEP_SPANS:
            step_context = trace.set_span_in_context(decode)
            for index, (_, start, end) in enumerate(steps):
                span = self._start(
                    "decode_step",
                    step_context,
                    start,
                    {"servprof.phase": "decode_step", "servprof.step": index},
                )
                span.end(end_time=end)
        else:
            for index, (_, start, _end) in enumerate(steps[:MAX_STEP_EVENTS]):
                decode.add_event(
                    "servprof.decode_step",
                    {"servprof.step": index, "servprof.duration_ms": float(durations_ms[index])},
                    timestamp=start,
                )
            decode.set_attribute("servprof.decode_step_events_truncated", len(steps) > MAX_STEP_EVENTS)
        decode.end(end_time=max(end for _, _, end in steps))

    def _emit_analysis(
        self,
        result: dict[str, Any],
        clock: _Clock,
        request_id: str,
        context: Any,
        parent: SampledParent,
        totals: dict[str, list[float]],
    ) -> None:
        findings = _findings_for(result, request_id)
        attributes: dict[str, Any] = {
            "servprof.request_id": request_id,
            "servprof.findings": len(findings),
        }
        for name, (count, total_ms) in totals.items():
            attributes[f"servprof.phase.{name}.count"] = int(count)
            attributes[f"servprof.phase.{name}.total_ms"] = total_ms
        for key, attribute in (("session_id", "servprof.session_id"), ("trace_file", "servprof.trace_file")):
            if result.get(key):
                attributes[attribute] = str(result[key])
        span = self._start("servprof.analysis", context, parent.start_ns, attributes)
        for finding in findings:
            timestamp = clock.unix_ns(finding.get("start_us")) or parent.start_ns
            span.add_event(FINDING_EVENT, finding_event_attributes(finding, self._evidence_limit), timestamp=timestamp)
        if result.get("error"):
            span.set_status(Status(StatusCode.ERROR, str(result["error"])[:MAX_EVIDENCE_CHARS]))
        # A request still streaming when its analysis arrives: the analysis span ends now.
        end_ns = parent.end_ns if parent.end_ns is not None else time.time_ns()
        span.end(end_time=max(end_ns, parent.start_ns))
