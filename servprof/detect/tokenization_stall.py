"""Tokenization stalls: time a request spends tokenizing before its first model work.

Per request (from servprof's ``tokenize`` phases, explicit or automatic, or recognised
tokenizer ops and Python frames in traces without them): how long tokenization took,
the share of the time to its first model step, and the harm to others: model steps of
other requests that ran while it tokenized and took longer than usual (tokenizers that
hold the GIL slow the engine thread down), and decode gaps it overlapped. Nothing after
servprof's own stop() counts. A trace without any tokenization says so in
``summary["missing"]``, with how to get it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from servprof.detect.concurrency import other_steps_during
from servprof.detect.finding import Finding
from servprof.detect.gaps import Gap
from servprof.detect.host_classes import TOKENIZER_NAMES
from servprof.detect.name_scan import host_ids_matching
from servprof.detect.overhead import stop_cutoffs
from servprof.detect.step_forms import outermost
from servprof.detect.steps import Step
from servprof.trace.meta import loop_thread
from servprof.trace.model import Trace, median
from servprof.trace.phases import phase_events

# A Rust BPE tokenizer takes ~0.1-0.3 ms per 100 tokens; on a busy host a preemption can
# stretch that to a few ms. Below 5 ms a tokenization is neither a stall nor worth fixing.
MIN_TOKENIZE_MS = 5.0
# Critical when it is most of the request's time to its first model step (or a fifth of the
# session) and long enough to matter to a person: tens of ms.
CRITICAL_SHARE, CRITICAL_MS = 0.5, 20.0
# A warning (worth fixing) when it is most of the request's wait for its first step, ran on the
# event loop, or is long in itself; a few ms that are a minor share of the wait (a busy host's
# preemption stretches a ~1 ms call that far) are noted as info.
WARNING_MS = 10.0
MISSING_MESSAGE = (
    "No tokenization was recorded in this trace, so tokenization stalls cannot be judged: mark it with "
    "`servprof.phase(\"tokenize\")`, or let servprof's zero-touch instrumentation cover transformers, tokenizers, "
    "tiktoken and sentencepiece while a session runs (SERVPROF_AUTO_INSTRUMENT, on by default); vLLM and SGLang "
    "tokenize in their API-server process, which a worker's trace does not include, and a server that tokenizes in "
    "a process pool does so outside the process it records."
)
FIX_ON_LOOP = (
    "Take tokenization off the event loop: run it in a worker thread or process "
    "(`await anyio.to_thread.run_sync(tokenizer.encode, text)`, or a ProcessPoolExecutor for long prompts); in vLLM it "
    "runs in the tokenizer workers: raise `--renderer-num-workers` (or `--api-server-count`)."
)
FIX_GIL = (
    "Tokenizing in the model's process slowed other requests' steps (it holds the GIL): tokenize in a separate "
    "process (a process pool, or vLLM's API-server processes), or with a Rust tokenizer (`tokenizers`, use_fast=True)."
)
FIX_SLOW = (
    "Use a fast (Rust) tokenizer (`tokenizers`, `AutoTokenizer.from_pretrained(..., use_fast=True)`), cache chat "
    "templates and repeated prefixes, and tokenize in a pool off the request's critical path."
)
# Model steps on other threads covered most of the tokenization: it shared the CPUs and the GIL with
# them, so its time says as much about them as about the tokenizer.
CONTENDED_SHARE = 0.5
FIX_CONTENDED = (
    "It ran while model calls on other threads kept the CPUs and the GIL busy, so the tokenizer may be starved "
    "rather than slow: time the same call alone (a Rust tokenizer takes ~0.1-0.3 ms per 100 tokens). If it is fast "
    "alone, leave it CPU: cap concurrent model calls at what the machine runs at once, or batch requests on one "
    "model thread fed by a queue; on a CPU server keep a core for the server "
    "(`torch.set_num_threads(os.cpu_count() - 1)`), or tokenize in a separate process (a ProcessPoolExecutor). "
    "If it is slow alone too: " + FIX_SLOW[0].lower() + FIX_SLOW[1:]
)

# A tokenizer call whose thread ran on a CPU for less than this share of it mostly waited (servprof
# sessions time one text's calls: servprof.auto.tokenizers): what to fix is what it waited for.
RAN_SHARE = 0.5
WAITED = (
    "its thread ran on a CPU for only part of the call and waited the rest, for the GIL (held by Python on other "
    "threads: other requests' pre- and post-processing, generate()'s loop, the event loop), for a CPU, or for I/O "
    "inside the call (a file, a network round trip: load or fetch it once, at start-up). For the GIL or a CPU, reduce "
    "what competes with it: cap concurrent model calls at what the machine runs at once, or batch requests on one "
    "model thread fed by a queue; on a CPU server keep a core for the server "
    "(`torch.set_num_threads(os.cpu_count() - 1)`); or tokenize in a separate process (a ProcessPoolExecutor), "
    "which has a GIL of its own."
)
FIX_WAITED = "The tokenizer is not what is slow: " + WAITED
FIX_WAITED_AND_SLOW = ("Most of the call was not the tokenizer's work: " + WAITED + " Its own CPU time is a stall "
                       "too: " + FIX_SLOW[0].lower() + FIX_SLOW[1:])


def missing(spans: list[Any], steps: list[Step]) -> list[dict[str, str]]:
    """summary["missing"] entry when the trace shows no tokenization at all (not for training traces)."""
    if spans or (steps and all(s.kind == "train" for s in steps)):
        return []
    return [{"what": "tokenization", "message": MISSING_MESSAGE}]


def _tokenize_spans(trace: Trace) -> list[tuple[str | None, float, float, int, int]]:
    """(request id or None, start, end, rank, tid) for every tokenization, cut at servprof's stop."""
    cutoffs = stop_cutoffs(trace)
    spans: list[tuple[str | None, float, float, int, int]] = []
    for event in phase_events(trace):
        if event.phase == "tokenize":
            rank = int(trace.rank[event.row])
            end = min(event.end_us, cutoffs.get(rank, np.inf))
            if end <= event.start_us:
                continue
            for rid in event.request_ids or (None,):
                spans.append((rid, event.start_us, end, rank, event.tid))
    if spans:
        return spans
    # Foreign traces: outermost tokenizer-named ranges (python frames or ops).
    rows = np.flatnonzero(trace.has_id(trace.name_id, host_ids_matching(trace, TOKENIZER_NAMES))
                          & trace.complete()
                          & (trace.stream < 0))
    rows = rows[np.argsort(trace.ts[rows], kind="stable")]
    ranks, rank_of = np.unique(trace.rank[rows], return_inverse=True)
    cutoff = np.array([cutoffs.get(int(r), np.inf) for r in ranks.tolist()], dtype=float)[rank_of]
    ends = np.minimum(trace.ts[rows] + trace.dur[rows], cutoff)
    lasting = ends > trace.ts[rows]
    kept = np.isin(rows, outermost(trace, rows[lasting], ends[lasting]))  # not nested in the previous one
    return [(None, start, end, rank, tid) for start, end, rank, tid in zip(
        trace.ts[rows[kept]].tolist(), ends[kept].tolist(), trace.rank[rows[kept]].tolist(),
        trace.tid[rows[kept]].tolist(), strict=True)]


def _timed_calls(trace: Trace) -> dict[int, np.ndarray]:
    """tid -> rows of (start µs, end µs, CPU µs) on the trace's clock: the tokenizer calls whose
    thread CPU time the session measured (its metadata's ``auto.tokenizer_cpu_ns``); {} when it
    has none (any other trace, or no call of one text took 1 ms)."""
    meta = trace.servprof_metadata()
    auto = meta.get("auto") if isinstance(meta.get("auto"), dict) else {}
    calls, base = auto.get("tokenizer_cpu_ns"), trace.base_time_ns()
    wall0, perf0 = meta.get("wall_start_ns"), meta.get("perf_start_ns")
    if not isinstance(calls, list) or wall0 is None or perf0 is None or base is None:
        return {}
    rows: dict[int, list[tuple[float, float, float]]] = {}
    for call in calls:
        if not (isinstance(call, list) and len(call) == 4
                and all(isinstance(v, int) and not isinstance(v, bool) for v in call)):
            continue  # (a damaged file: that call is not judged)
        tid, start_ns, wall_ns, cpu_ns = call
        if wall_ns <= 0 or cpu_ns < 0:
            continue
        start_us = (wall0 + start_ns - perf0 - base) / 1000.0  # trace µs = (unix ns - base) / 1000
        rows.setdefault(tid, []).append((start_us, start_us + wall_ns / 1000.0, min(cpu_ns, wall_ns) / 1000.0))
    return {tid: np.array(values) for tid, values in rows.items()}


def _cpu_during(timed: dict[int, np.ndarray], tid: int, start: float, end: float) -> tuple[float, float]:
    """(µs of the span the timed calls on its thread cover, their CPU µs): a call counts when at
    least half of it lies in the span (the clocks agree to well under that)."""
    calls = timed.get(tid)
    if calls is None:
        return 0.0, 0.0
    overlap = np.minimum(calls[:, 1], end) - np.maximum(calls[:, 0], start)
    inside = overlap >= 0.5 * (calls[:, 1] - calls[:, 0])
    return float(overlap[inside].sum()), float(calls[inside, 2].sum())


def _step_starts_by_request(steps: list[Step]) -> dict[tuple[int, str], np.ndarray]:
    """(rank, request id) -> the sorted starts of the steps that name the request."""
    starts: dict[tuple[int, str], list[float]] = {}
    for step in steps:
        for rid in step.request_ids:
            starts.setdefault((step.rank, rid), []).append(step.start_us)
    return {key: np.sort(np.array(values)) for key, values in starts.items()}


class _Near:
    """Intervals (rank, start, end) found by a binary search on their starts: those that
    overlap a window, in their own order."""

    def __init__(self, rank: np.ndarray, start: np.ndarray, end: np.ndarray) -> None:
        self.rank, self.start, self.end = rank, start, end
        self.by_start = np.lexsort((start, rank))
        self.keys = (rank[self.by_start], start[self.by_start])
        self.longest = float((end - start).max()) if start.size else 0.0

    def overlapping(self, rank: int, start: float, end: float, touching: bool = False) -> np.ndarray:
        """Indices of the intervals on ``rank`` with start < end and end > start (any that might
        touch the window when ``touching``: the caller measures the overlap), in index order."""
        ranks, starts = self.keys
        lo_rank, hi_rank = np.searchsorted(ranks, rank, side="left"), np.searchsorted(ranks, rank, side="right")
        reach = 2 * self.longest + 1.0  # (wider than any interval: rounding never leaves one out)
        lo = lo_rank + np.searchsorted(starts[lo_rank:hi_rank], start - reach, side="left")
        hi = lo_rank + np.searchsorted(starts[lo_rank:hi_rank], end, side="right" if touching else "left")
        near = np.sort(self.by_start[lo:hi])
        return near if touching else near[self.end[near] > start]


def _other_steps_during_spans(spans: list[tuple[str | None, float, float, int, int]], steps: list[Step]
                              ) -> tuple[np.ndarray, np.ndarray]:
    """Per tokenization: µs of it covered by model steps on other threads of its rank, and how many
    threads those were."""
    cover, threads = np.zeros(len(spans)), np.zeros(len(spans), dtype=np.int64)
    if not spans or not steps:
        return cover, threads
    rank_of_span = np.array([rank for _, _, _, rank, _ in spans], dtype=np.int64)
    for rank in np.unique(rank_of_span).tolist():
        mine = np.flatnonzero(rank_of_span == rank)
        rank_steps = [s for s in steps if s.rank == rank]
        if rank_steps:
            cover[mine], threads[mine] = other_steps_during(
                rank_steps, np.array([spans[i][1] for i in mine]), np.array([spans[i][2] for i in mine]),
                np.array([spans[i][4] for i in mine], dtype=np.int64))
    return cover, threads


def _fix(entry: dict[str, Any], waited: bool, worked_long: bool, contended: bool) -> str:
    if entry["on_event_loop"]:
        return FIX_ON_LOOP
    if waited:  # (a thread that mostly waited did not hold the GIL that slowed others' steps meanwhile)
        return FIX_WAITED_AND_SLOW if worked_long else FIX_WAITED
    if entry["delayed_steps"]:
        return FIX_GIL
    return FIX_CONTENDED if contended else FIX_SLOW


def detect_tokenization_stalls(trace: Trace, steps: list[Step], gaps: list[Gap]) -> tuple[list[Finding], dict[str, Any]]:
    spans = _tokenize_spans(trace)
    session_us = float(trace.end.max() - trace.ts.min()) if len(trace) else 0.0
    decode_steps = [s for s in steps if s.kind == "decode"]
    typical_step = median([s.dur_us for s in decode_steps]) if decode_steps else 0.0
    # Decode steps more than 20% slower than the median: the ones a tokenizer may have delayed.
    slow_steps = np.array([i for i, s in enumerate(decode_steps) if s.dur_us > 1.2 * typical_step], dtype=np.int64)
    slow_rank = np.array([decode_steps[i].rank for i in slow_steps], dtype=np.int64)
    slow_start = np.array([decode_steps[i].start_us for i in slow_steps])
    slow_end = np.array([decode_steps[i].end_us for i in slow_steps])
    gap_rank = np.array([g.rank for g in gaps], dtype=np.int64)
    gap_start = np.array([g.start_us for g in gaps])
    gap_end = np.array([g.end_us for g in gaps])
    loop_tid = loop_thread(trace.servprof_metadata())
    per_request: dict[str, dict[str, Any]] = {}
    findings: list[Finding] = []
    first_steps = _step_starts_by_request(steps)
    slow_near = _Near(slow_rank, slow_start, slow_end)
    gaps_near = _Near(gap_rank, gap_start, gap_end)
    contended_us, contended_threads = _other_steps_during_spans(spans, steps)
    timed = _timed_calls(trace)
    for index, (rid, start, end, rank, tid) in enumerate(spans):
        key = rid or f"unattributed-{index}"
        starts = first_steps.get((rank, rid)) if rid is not None else None
        at = int(np.searchsorted(starts, start, side="left")) if starts is not None else 0
        first_model = float(starts[at]) if starts is not None and at < starts.size else None
        entry = per_request.setdefault(key, {
            "request_id": rid, "tokenize_ms": 0.0, "start_us": start, "end_us": end, "thread": tid,
            "to_first_model_step_ms": None, "delayed_steps": 0, "delayed_step_ms": 0.0,
            "delayed_request_ids": set(), "overlapping_gap_ms": 0.0,
            "other_steps": {"us": 0.0, "threads": 0}, "timed_us": 0.0, "cpu_us": 0.0,
        })
        entry["tokenize_ms"] += (end - start) / 1000.0
        timed_us, cpu_us = _cpu_during(timed, tid, start, end)
        entry["timed_us"] += timed_us
        entry["cpu_us"] += cpu_us
        entry["other_steps"]["us"] += float(contended_us[index])
        entry["other_steps"]["threads"] = max(entry["other_steps"]["threads"], int(contended_threads[index]))
        entry["end_us"] = max(entry["end_us"], end)
        if first_model is not None:
            entry["to_first_model_step_ms"] = round((first_model - entry["start_us"]) / 1000.0, 3)
        # Other requests' decode steps that ran meanwhile and were slower than a typical one.
        if slow_steps.size:
            hit = slow_steps[slow_near.overlapping(rank, start, end)]
            for index in hit.tolist():
                step = decode_steps[index]
                if rid and rid in step.request_ids:
                    continue
                # Only the part of the step's excess that fell while this tokenization ran.
                overlap = min(step.end_us, end) - max(step.start_us, start)
                entry["delayed_steps"] += 1
                entry["delayed_step_ms"] += (step.dur_us - typical_step) * overlap / step.dur_us / 1000.0
                entry["delayed_request_ids"].update(step.request_ids)
        if gap_start.size:
            near = gaps_near.overlapping(rank, start, end, touching=True)
            overlap = np.minimum(gap_end[near], end) - np.maximum(gap_start[near], start)
            entry["overlapping_gap_ms"] += float(overlap[overlap > 0].sum()) / 1000.0
    for entry in per_request.values():
        entry["delayed_request_ids"] = sorted(entry["delayed_request_ids"])
        entry["tokenize_ms"] = round(entry["tokenize_ms"], 4)
        entry["delayed_step_ms"] = round(entry["delayed_step_ms"], 3)
        entry["overlapping_gap_ms"] = round(entry["overlapping_gap_ms"], 3)
        entry["on_event_loop"] = (entry["thread"] == loop_tid) if loop_tid is not None else None
        entry["other_steps"]["us"] = round(entry["other_steps"]["us"], 1)
        # The thread's own CPU time, where the session measured (nearly) all of the tokenization.
        timed_us, cpu_us = entry.pop("timed_us"), entry.pop("cpu_us")
        measured = timed_us >= 0.9 * entry["tokenize_ms"] * 1000 and timed_us > 0
        entry["thread_cpu_ms"] = round(cpu_us / 1000.0, 3) if measured else None
        if entry["tokenize_ms"] < MIN_TOKENIZE_MS:
            continue
        waited = measured and cpu_us < RAN_SHARE * timed_us
        ttft_path = entry["to_first_model_step_ms"]
        share = entry["tokenize_ms"] / ttft_path if ttft_path else None
        cost = entry["tokenize_ms"] + entry["delayed_step_ms"]
        harm = ""
        if entry["delayed_steps"]:
            harm = (f"; {entry['delayed_steps']} decode step(s) of other requests ran "
                    f"{entry['delayed_step_ms']:.1f} ms slower meanwhile")
        if entry["on_event_loop"]:
            harm += "; it ran on the event loop, blocking every other request"
        # (Its own CPU time alone may be a stall: then the tokenizer is slow too.)
        worked_long = cpu_us >= MIN_TOKENIZE_MS * 1000
        if waited:
            harm += (f"; its thread ran on a CPU for {entry['thread_cpu_ms']:.1f} ms of it and waited the rest "
                     "(the GIL, a CPU, I/O)" + ("" if worked_long else ": the tokenizer is not what is slow"))
        # Other threads' steps covering it hint at contention where nothing measured it (a tokenizer
        # whose thread ran all along was working: slow, whatever ran beside it). Beside an on-loop
        # call or one that slowed others' steps, that fix comes first.
        contended = not entry["on_event_loop"] and not entry["delayed_steps"] and not measured \
            and entry["other_steps"]["us"] >= CONTENDED_SHARE * entry["tokenize_ms"] * 1000
        if contended:
            harm += (f"; model steps ran on {entry['other_steps']['threads']} other thread(s) for "
                     f"{entry['other_steps']['us'] / 1000:.1f} ms of it")
        who = f"request {entry['request_id']}" if entry["request_id"] else "a tokenizer call"
        # Only a request's own first model step, found in the trace, is one its tokenization came before.
        where = " before its first model step" if ttft_path is not None else (
            " (no model step of its own after it in the trace)" if entry["request_id"] else
            " (it names no request: a batch's, or outside any request)")
        big = (share or 0) >= CRITICAL_SHARE or (session_us > 0 and cost * 1000 >= 0.2 * session_us) \
            or entry["on_event_loop"] or entry["delayed_steps"]
        noticeable = (share or 0) >= CRITICAL_SHARE or entry["on_event_loop"] or entry["tokenize_ms"] >= WARNING_MS
        fix = _fix(entry, waited, worked_long, contended)
        findings.append(Finding(
            kind="tokenization_stall",
            severity="critical" if big and cost >= CRITICAL_MS else ("warning" if noticeable else "info"),
            fix=fix,
            cost_ms=cost,
            start_us=entry["start_us"],
            end_us=entry["end_us"],
            title=f"{who} spent {entry['tokenize_ms']:.1f} ms tokenizing{where}{harm}",
            request_ids=[r for r in [entry["request_id"], *entry["delayed_request_ids"]] if r],
            evidence={**entry, "share_of_time_to_first_step": round(share, 4) if share is not None else None},
        ))
    summary = {
        "tokenizations": len(spans),
        "missing": missing(spans, steps),
        "requests": len(per_request),
        "stalled_requests": len(findings),
        "tokenize_ms_total": round(sum(e["tokenize_ms"] for e in per_request.values()), 3),
        "tokenize_ms_max": round(max((e["tokenize_ms"] for e in per_request.values()), default=0.0), 3),
        "delayed_step_ms_total": round(sum(e["delayed_step_ms"] for e in per_request.values()), 3),
        "per_request": {
            key: {"tokenize_ms": e["tokenize_ms"], "to_first_model_step_ms": e["to_first_model_step_ms"],
                  "on_event_loop": e["on_event_loop"], "delayed_step_ms": e["delayed_step_ms"],
                  "thread_cpu_ms": e["thread_cpu_ms"]}
            for key, e in list(per_request.items())[:200]
        },
    }
    return findings, summary
