"""Requests that waited for their first model step while no model step ran.

Between a sampled request's arrival and the start of its prefill, the model is either busy with
other requests' steps (the server is at capacity: the wait is queueing) or runs nothing at all:
a batcher holding a window open, an engine thread polling its queue with ``sleep``, a lock held
around other work. The second is the server's own delay and is what this reports: the time in
that wait covered by no step on any thread (nor by the request's own tokenize / detokenize
phases, which have their own finding, nor, when it was tokenized on the thread that then ran its
prefill, by anything after its tokenization began: that thread was working on it, with no queue
between, such as ``generate()``'s own set-up before its first forward; nor at all when the thread
of its prefill ran no other request's steps: a thread started for it has no queue).

A request whose model call ran in its own context (an automatic step naming it alone, on a thread
the session does not list among those without a request: ``asyncio.to_thread``, a pool job, a
thread started for it) was held by no queue: its wait, less its own tokenize / detokenize phases and
other requests' steps, is reported apart (``before_model_call``), as what its handler did before
that call (an awaited retrieval, a client built per request, a lock, a model loaded on first use),
whichever thread ran its steps.

Where the trace records ops (a deep window), the thread that then ran the request's first step
is read over that time: ops or Python outside any model forward most of it (feature extraction,
image transforms: the handler's own compute) are named, with what to do about them.

The request's prefill is the first prefill after its arrival that names it: its own (a request
served on its own thread), or a batch's (steps with no request of their own name every request in
flight, and a request can be in no batch that started before it arrived). A step that was already
running when the profiler started is not in the trace, and the model would look idle there: the
wait counts from the trace's start plus the longest recorded step (or its first step, if sooner). Needs the session's request records
(servprof's sessions); an offline trace gets no finding.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from servprof.detect.finding import WARNING_SHARE, Finding, severity_for_share
from servprof.detect.intervals import covered, covered_within, merge
from servprof.detect.request_times import RequestTimes, own_phase_spans
from servprof.detect.steps import Step
from servprof.detect.thread_work import COMPUTING, ThreadWork, thread_work
from servprof.trace.model import Trace, median

KIND = "queue_wait"
MIN_IDLE_US = 1000.0  # a request's wait under this with no step is the ordinary hand-off
# ... and a handler's own way to its model call under this is ordinary too: the framework's hand-off
# to a pool thread, validating and preparing the input (1-9 ms a request on the thread-pool test server
# under load on 2 cores). Awaited work before the call (a retrieval) is tens of ms.
BEFORE_CALL_MIN_US = 10_000.0
FIRST_STEP_KINDS = ("prefill", "mixed")
QUEUED, BEFORE_CALL = "model_idle_while_waiting", "before_model_call"
FIX_QUEUED = (
    "The model was free while these requests waited: start the next step as soon as one is waiting. Wake the model "
    "thread with a blocking queue `get()` or a condition instead of polling with `sleep`; keep a batching window only "
    "while there is nothing to run (take what has arrived and go); hold the model's lock around the model call only."
)
FIX_HANDLER_COMPUTE = (
    "Each of these requests called the model from its own handler, and before the call its thread was computing "
    "(the ops and functions named: the handler's own preprocessing, such as audio feature extraction or image "
    "transforms, done for each request). It adds to every request's time to first token: run it where the model "
    "runs (its torch ops on the model's device), batch it across requests, cache what repeats, or do it once up front."
)
FIX_BEFORE_CALL = (
    "Each of these requests called the model from its own handler, so no queue held it: the time is what its handler "
    "did first (awaited calls such as retrieval or another service, an HTTP client or other object built per request, "
    "a lock or a pool slot it waited for, or its own compute: input preprocessing, a model or file loaded on first "
    "use). Overlap those calls with each other or cache them, build clients and load models once for the app's life "
    "(at start-up), and hold locks around the model call only; the loop_stall findings name any part of it that "
    "blocked the event loop."
)
FIX_BEFORE_CALL_UNSEEN = (
    " A deep window with SERVPROF_WITH_STACK=1 (`POST /servprof/sample?n=1&tier=deep`) names the functions it ran."
)


def detect_queue_wait(trace: Trace, steps: list[Step], times: dict[str, RequestTimes]
                      ) -> tuple[list[Finding], dict[str, Any]]:
    """``times``: the sampled requests' (request_times.py), from the session's records."""
    summary: dict[str, Any] = {"requests_timed": len(times), "waits": []}
    if not times or not steps:
        return [], summary
    busy_start, busy_end = merge(np.array([s.start_us for s in steps]), np.array([s.end_us for s in steps]))
    # A step already running when the profiler started is not in the trace: the model may have been
    # busy for up to one step (the longest recorded) after the trace's start, or until the first
    # recorded step, whichever comes first. Waits count from there.
    longest = max(s.end_us - s.start_us for s in steps)
    recorded_from = min(float(busy_start[0]), float(trace.ts.min()) + longest)
    own = own_phase_spans(trace)
    ordered = sorted(steps, key=lambda s: s.start_us)
    busy_spans = list(zip(busy_start.tolist(), busy_end.tolist(), strict=True))
    served: dict[tuple[int, int], set[str]] = {}  # the requests each thread's steps name
    for step in steps:
        served.setdefault((step.rank, step.tid), set()).update(step.request_ids or ("",))
    shared = _threads_without_request(trace)
    attributed = shared is not None  # the session said which threads' steps ran in no request's context
    shared = shared or set()
    waits: list[dict[str, Any]] = []
    unmeasured: list[dict[str, str]] = []
    for rid, t in sorted(times.items()):
        first = _first_step(ordered, rid, t.arrival_us)
        if first is None:
            unmeasured.append({"request_id": rid, "why": "no prefill of it in the trace"})
            continue
        a, b = max(t.arrival_us, recorded_from), first.start_us
        if b <= a:
            if t.arrival_us < recorded_from:
                unmeasured.append({"request_id": rid, "why": "it arrived before the trace could show what the model "
                                                              "ran (a step then running is not recorded)"})
            continue
        busy = float(covered(busy_start, busy_end, np.array([a]), np.array([b]))[0])
        phases = [(start, end) for start, end, _ in own.get(rid, [])]
        spans = list(phases)
        # Tokenized on the thread that then ran its prefill: that thread worked on the request from
        # then on (the model call's own set-up, unrecorded in a light trace), with no hand-off to wait in.
        on_its_thread = [start for start, _, tid in own.get(rid, []) if tid == first.tid and start < b]
        if on_its_thread:
            spans.append((min(on_its_thread), b))
        if served.get((first.rank, first.tid)) == {rid} and first.tid not in shared:
            # A thread that ran this request's steps only (started for it, as transformers' streaming
            # recipe does): everything before its first step was this request's own way there
            # (handler, hand-off, generate()'s set-up), with no queue of other requests to wait in.
            spans.append((a, b))
        # Its model call was made in its own context (an automatic step on a thread the session did
        # not list as having no request of its own: to_thread, a pool, a thread started for it), so
        # nothing queued it: the time before is its handler's way to that call, all of it but its own
        # tokenize / detokenize phases, on whichever thread (a pool thread that served it alone as
        # much as one that served others: which it was is the pool's chance, not the handler's).
        own_call = attributed and first.source == "servprof_auto" and first.tid not in shared \
            and list(first.request_ids) == [rid]
        if own_call:
            spans = phases
        own_us = _covered(spans, a, b)
        # The request's own work and other requests' steps: what is left is the model doing nothing.
        idle = max(0.0, (b - a) - _covered([*spans, *busy_spans], a, b))
        until = t.first_byte_us if t.first_byte_us is not None else t.end_us
        waits.append({"request_id": rid, "arrival_us": t.arrival_us, "first_step_us": first.start_us,
                      "thread": first.tid, "rank": first.rank, "from_us": a,
                      "wait_ms": round((first.start_us - t.arrival_us) / 1e3, 3), "idle_ms": round(idle / 1e3, 3),
                      "other_steps_ms": round(busy / 1e3, 3), "own_phases_ms": round(own_us / 1e3, 3),
                      "to_first_byte_ms": round((until - t.arrival_us) / 1e3, 3) if until < float("inf") else None,
                      "first_step": first.label, "own_model_call": own_call})
    # (Waits are measured from here: a request that arrived before has the rest of its wait judged.)
    summary["waits"], summary["unmeasured"], summary["measured_from_us"] = waits, unmeasured, recorded_from
    idle_ones = [w for w in waits if w["idle_ms"] * 1e3 >= MIN_IDLE_US]
    judged = sum(w["to_first_byte_ms"] for w in waits if w["to_first_byte_ms"])
    if not idle_ones or judged <= 0:
        return [], summary
    findings = []
    for cause, group in ((QUEUED, [w for w in idle_ones if not w["own_model_call"]]),
                         (BEFORE_CALL, [w for w in idle_ones if w["own_model_call"]
                                        and w["idle_ms"] * 1e3 >= BEFORE_CALL_MIN_US])):
        if not group:
            continue
        idle_ms = sum(w["idle_ms"] for w in group)
        share = min(1.0, idle_ms / judged)
        prefix = "" if cause == QUEUED else "before_model_call_"
        summary.update({f"{prefix}idle_ms": round(idle_ms, 3), f"{prefix}share_of_time_to_first_byte": round(share, 4)})
        if share >= WARNING_SHARE:  # (a few ms of hand-off in a long answer: in the summary only)
            work = thread_work(trace, [(int(w["rank"]), int(w["thread"]), w["from_us"], w["first_step_us"])
                                       for w in group], busy_start, busy_end) if cause == BEFORE_CALL else None
            findings.append(_finding(cause, group, len(waits), idle_ms, share, work))
    return findings, summary


def _finding(cause: str, group: list[dict[str, Any]], requests: int, idle_ms: float, share: float,
             work: ThreadWork | None = None) -> Finding:
    busy_ms = sum(w["other_steps_ms"] for w in group)
    each = f"median {median([w['idle_ms'] for w in group]):.1f} ms each, {share:.0%} of their time to first byte"
    if cause == QUEUED:
        title = (f"{len(group)} of {requests} sampled requests waited for their first model step while no model step "
                 f"ran: {idle_ms:.1f} ms in all ({each})")
    else:
        title = (f"{len(group)} of {requests} sampled requests spent {idle_ms:.1f} ms ({each}) in their handlers "
                 "before calling the model, while no model step ran")
    title += f"; other requests' steps ran {busy_ms:.1f} ms of those waits" if busy_ms >= 0.05 else ""
    title += work.title_part() if work is not None else ""
    severity = severity_for_share(share, idle_ms)
    if cause == BEFORE_CALL and severity == "critical":
        severity = "warning"  # the handler's own work (a retrieval may be the app's design), not capacity left idle
    return Finding(
        kind=KIND, severity=severity, cost_ms=idle_ms,
        start_us=min(w["arrival_us"] for w in group), end_us=max(w["first_step_us"] for w in group),
        title=title, request_ids=[w["request_id"] for w in group],
        evidence={"cause": cause, "requests": requests, "waited": len(group), "idle_ms": round(idle_ms, 3),
                  "share_of_time_to_first_byte": round(share, 4), "other_steps_ms": round(busy_ms, 3),
                  "waits": sorted(group, key=lambda w: -w["idle_ms"])[:20],
                  **({"handler_threads": work.evidence()} if work is not None else {})},
        fix=FIX_QUEUED if work is None else FIX_HANDLER_COMPUTE if work.seen == COMPUTING
        else FIX_BEFORE_CALL + work.unseen_text(FIX_BEFORE_CALL_UNSEEN),
    )


def _threads_without_request(trace: Trace) -> set[int] | None:
    """Threads whose automatic steps named the requests in flight, not a request of their own (the
    session's ``auto.threads_without_request``): an engine thread serving one request stays an
    engine's. None when the trace does not say (no servprof session, automatic phases off)."""
    auto = trace.servprof_metadata().get("auto")
    listed = auto.get("threads_without_request") if isinstance(auto, dict) else None
    return {t for t in listed if isinstance(t, int) and not isinstance(t, bool)} if isinstance(listed, list) else None


def _covered(spans: list[tuple[float, float]], a: float, b: float) -> float:
    return covered_within(np.array([s for s, _ in spans]), np.array([e for _, e in spans]), a, b)


def _first_step(ordered: list[Step], rid: str, arrival_us: float) -> Step | None:
    """The request's prefill: the first prefill after it arrived that names it (its own, or a
    batch's naming every request in flight), else, in a trace whose steps name no request, the
    first prefill after it arrived."""
    after = [s for s in ordered if s.start_us >= arrival_us and s.kind in FIRST_STEP_KINDS]
    named = next((s for s in after if rid in s.request_ids), None)
    if named is not None or any(s.request_ids for s in ordered):
        return named
    return after[0] if after else None
