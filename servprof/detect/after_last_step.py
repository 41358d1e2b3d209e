"""Requests whose response went out long after their last model step.

After a sampled request's last model step (the last step that names it), the rest of its time to
its response's last byte is the server's own: its handler's work after the model (a filter or a
classifier over the text, a format conversion, a second pass), then building and sending the
response. The request's own tokenize / detokenize phases there have their own finding and are not
counted, nor is anything after its last byte (a background task runs after the response: the
client already has its answer). A request's tail counts from AFTER_MIN_US; the finding is made
when the tails are a twentieth of the requests' time. A request answered after servprof stopped
recording (its collection cut, its stop) is not judged: its last steps may not be in the trace. Where the trace records ops (a deep window),
the thread of each request's last step is read over its tail, outside every model step: ops or
Python (with SERVPROF_WITH_STACK=1) most of it are named. Needs the session's request records and
steps that name their requests (servprof's sessions); an offline trace gets no finding.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from servprof.detect.finding import WARNING_SHARE, Finding, severity_for_share
from servprof.detect.intervals import covered, covered_within, merge
from servprof.detect.overhead import stop_cutoffs
from servprof.detect.request_times import RequestTimes, own_phase_spans
from servprof.detect.steps import Step
from servprof.detect.thread_work import ThreadWork, thread_work
from servprof.trace.model import Trace, median

KIND = "after_last_step"
# A request's own way out after its last step under this is ordinary (sending the last chunks,
# the framework's response): a per-request filter or conversion is tens of ms.
AFTER_MIN_US = 10_000.0
FIX = (
    "After their last model step these requests' handlers kept them for the time named before the answer went out: "
    "work done per request after the model (a filter or classifier over the text, a format conversion, building a "
    "large response). It adds to each request's end-to-end latency and holds the GIL from other requests' steps. "
    "Make it cheaper (compile patterns once, one pass over the text, a batch across requests), run it on the stream "
    "as tokens come, or move what the client need not wait for off its path (a background task after the response, "
    "another process)."
)
FIX_UNSEEN = (
    " What the handler did then is not in this trace: a deep window (`POST /servprof/sample?tier=deep`) with "
    "SERVPROF_WITH_STACK=1 names its functions."
)


def detect_after_last_step(trace: Trace, steps: list[Step], times: dict[str, RequestTimes]
                           ) -> tuple[list[Finding], dict[str, Any]]:
    """``times``: the sampled requests' (request_times.py), from the session's records."""
    summary: dict[str, Any] = {"tails": []}
    if not times or not steps:
        return [], summary
    own = own_phase_spans(trace)
    steps_start, steps_end = merge(np.array([s.start_us for s in steps]), np.array([s.end_us for s in steps]))
    # Steps are recorded until servprof stopped recording (its collection cut, or its stop()): a
    # request answered after that may have had steps the trace does not show.
    recorded_until = min(stop_cutoffs(trace).values(), default=float(trace.end.max()))
    tails: list[dict[str, Any]] = []
    unmeasured: list[dict[str, str]] = []
    for rid, t in sorted(times.items()):
        if t.last_byte_us is None:
            continue
        if t.last_byte_us > recorded_until:
            unmeasured.append({"request_id": rid, "why": "answered after the trace stopped recording its steps"})
            continue
        last = max((s for s in steps if rid in s.request_ids and s.end_us <= t.last_byte_us),
                   key=lambda s: s.end_us, default=None)
        if last is None or t.last_byte_us <= last.end_us:
            continue
        a, b = last.end_us, t.last_byte_us
        spans = own.get(rid, [])
        own_us = covered_within(np.array([s for s, _e, _t in spans]), np.array([e for _s, e, _t in spans]), a, b)
        other_us = float(covered(steps_start, steps_end, np.array([a]), np.array([b]))[0])
        tails.append({"request_id": rid, "last_step_end_us": a, "last_byte_us": b, "thread": last.tid,
                      "rank": last.rank, "tail_ms": round(max(0.0, b - a - own_us) / 1e3, 3),
                      "own_phases_ms": round(own_us / 1e3, 3), "other_steps_ms": round(other_us / 1e3, 3),
                      "request_ms": round((b - t.arrival_us) / 1e3, 3), "last_step": last.label})
    summary["tails"], summary["unmeasured"] = tails, unmeasured
    long = [x for x in tails if x["tail_ms"] * 1e3 >= AFTER_MIN_US]
    judged = sum(x["request_ms"] for x in tails)
    if not long or judged <= 0:
        return [], summary
    tail_ms = sum(x["tail_ms"] for x in long)
    share = min(1.0, tail_ms / judged)
    summary.update({"tail_ms": round(tail_ms, 3), "share_of_request_time": round(share, 4)})
    if share < WARNING_SHARE:
        return [], summary
    work = thread_work(trace, [(int(x["rank"]), int(x["thread"]), x["last_step_end_us"], x["last_byte_us"])
                               for x in long], steps_start, steps_end)
    return [_finding(long, len(tails), tail_ms, share, work)], summary


def _finding(long: list[dict[str, Any]], requests: int, tail_ms: float, share: float, work: ThreadWork) -> Finding:
    title = (f"{len(long)} of {requests} sampled requests' responses went out {tail_ms:.1f} ms in all after their last "
             f"model step (median {median([x['tail_ms'] for x in long]):.1f} ms each, {share:.0%} of their time)")
    other = sum(x["other_steps_ms"] for x in long)
    if other >= 0.05:
        title += f"; other requests' steps ran {other:.1f} ms of that time"
    title += work.title_part()
    severity = severity_for_share(share, tail_ms)
    if severity == "critical":
        severity = "warning"  # the handler's own work (a safety filter may be the app's design), not capacity lost
    return Finding(
        kind=KIND, severity=severity, cost_ms=tail_ms,
        start_us=min(x["last_step_end_us"] for x in long), end_us=max(x["last_byte_us"] for x in long),
        title=title, request_ids=[x["request_id"] for x in long],
        evidence={"requests": requests, "late": len(long), "tail_ms": round(tail_ms, 3),
                  "share_of_request_time": round(share, 4), "other_steps_ms": round(other, 3),
                  "tails": sorted(long, key=lambda x: -x["tail_ms"])[:20],
                  "handler_threads": work.evidence()},
        fix=FIX + work.unseen_text(FIX_UNSEEN),
    )
