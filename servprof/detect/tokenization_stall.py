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

from servprof.detect.finding import Finding
from servprof.detect.gaps import Gap
from servprof.detect.host_stacks import TOKENIZER_NAMES
from servprof.detect.overhead import stop_cutoffs
from servprof.detect.steps import Step
from servprof.trace.model import Trace
from servprof.trace.phases import phase_events

# A Rust BPE tokenizer takes ~0.1-0.3 ms per 100 tokens; on a busy host a preemption can
# stretch that to a few ms. Below 5 ms a tokenization is neither a stall nor worth fixing.
MIN_TOKENIZE_MS = 5.0
# Critical when it is most of the request's time to its first model step (or a fifth of the
# session) and long enough to matter to a person: tens of ms.
CRITICAL_SHARE, CRITICAL_MS = 0.5, 20.0
MISSING_MESSAGE = (
    "No tokenization was recorded in this trace, so tokenization stalls cannot be judged: mark it with "
    "`servprof.phase(\"tokenize\")`, or let servprof's zero-touch instrumentation cover transformers, tokenizers, "
    "tiktoken and sentencepiece while a session runs (SERVPROF_AUTO_INSTRUMENT, on by default); vLLM and SGLang "
    "tokenize in their API-server process, which a worker's trace does not include."
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
    rows = np.flatnonzero(trace.mask_name(lambda s: TOKENIZER_NAMES.search(s) is not None) & trace.complete()
                          & (trace.stream < 0))
    rows = rows[np.argsort(trace.ts[rows], kind="stable")]
    covered_until: dict[tuple[int, int], float] = {}
    for row in rows:
        key = (int(trace.rank[row]), int(trace.tid[row]))
        start, end = float(trace.ts[row]), min(float(trace.ts[row] + trace.dur[row]), cutoffs.get(key[0], np.inf))
        if end <= start or start < covered_until.get(key, -np.inf):
            continue  # nested inside the previous tokenizer range
        covered_until[key] = end
        spans.append((None, start, end, key[0], key[1]))
    return spans


def detect_tokenization_stalls(trace: Trace, steps: list[Step], gaps: list[Gap]) -> tuple[list[Finding], dict[str, Any]]:
    spans = _tokenize_spans(trace)
    session_us = float(trace.end.max() - trace.ts.min()) if len(trace) else 0.0
    decode_steps = [s for s in steps if s.kind == "decode"]
    typical_step = float(np.median([s.dur_us for s in decode_steps])) if decode_steps else 0.0
    # Decode steps more than 20% slower than the median: the ones a tokenizer may have delayed.
    slow_steps = np.array([i for i, s in enumerate(decode_steps) if s.dur_us > 1.2 * typical_step], dtype=np.int64)
    slow_rank = np.array([decode_steps[i].rank for i in slow_steps], dtype=np.int64)
    slow_start = np.array([decode_steps[i].start_us for i in slow_steps])
    slow_end = np.array([decode_steps[i].end_us for i in slow_steps])
    gap_rank = np.array([g.rank for g in gaps], dtype=np.int64)
    gap_start = np.array([g.start_us for g in gaps])
    gap_end = np.array([g.end_us for g in gaps])
    loop_tid = trace.servprof_metadata().get("event_loop_tid")
    per_request: dict[str, dict[str, Any]] = {}
    findings: list[Finding] = []
    for index, (rid, start, end, rank, tid) in enumerate(spans):
        key = rid or f"unattributed-{index}"
        mine = [s for s in steps if s.rank == rank and rid is not None and rid in s.request_ids and s.start_us >= start]
        first_model = min((s.start_us for s in mine), default=None)
        entry = per_request.setdefault(key, {
            "request_id": rid, "tokenize_ms": 0.0, "start_us": start, "end_us": end, "thread": tid,
            "to_first_model_step_ms": None, "delayed_steps": 0, "delayed_step_ms": 0.0,
            "delayed_request_ids": set(), "overlapping_gap_ms": 0.0,
        })
        entry["tokenize_ms"] += (end - start) / 1000.0
        entry["end_us"] = max(entry["end_us"], end)
        if first_model is not None:
            entry["to_first_model_step_ms"] = round((first_model - entry["start_us"]) / 1000.0, 3)
        # Other requests' decode steps that ran meanwhile and were slower than a typical one.
        if slow_steps.size:
            hit = slow_steps[(slow_rank == rank) & (slow_end > start) & (slow_start < end)]
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
            overlap = np.minimum(gap_end, end) - np.maximum(gap_start, start)
            entry["overlapping_gap_ms"] += float(overlap[(gap_rank == rank) & (overlap > 0)].sum()) / 1000.0
    for entry in per_request.values():
        entry["delayed_request_ids"] = sorted(entry["delayed_request_ids"])
        entry["tokenize_ms"] = round(entry["tokenize_ms"], 4)
        entry["delayed_step_ms"] = round(entry["delayed_step_ms"], 3)
        entry["overlapping_gap_ms"] = round(entry["overlapping_gap_ms"], 3)
        entry["on_event_loop"] = (entry["thread"] == loop_tid) if loop_tid is not None else None
        if entry["tokenize_ms"] < MIN_TOKENIZE_MS:
            continue
        ttft_path = entry["to_first_model_step_ms"]
        share = entry["tokenize_ms"] / ttft_path if ttft_path else None
        cost = entry["tokenize_ms"] + entry["delayed_step_ms"]
        harm = ""
        if entry["delayed_steps"]:
            harm = (f"; {entry['delayed_steps']} decode step(s) of other requests ran "
                    f"{entry['delayed_step_ms']:.1f} ms slower meanwhile")
        if entry["on_event_loop"]:
            harm += "; it ran on the event loop, blocking every other request"
        who = f"request {entry['request_id']}" if entry["request_id"] else "a tokenizer call"
        big = (share or 0) >= CRITICAL_SHARE or (session_us > 0 and cost * 1000 >= 0.2 * session_us) \
            or entry["on_event_loop"] or entry["delayed_steps"]
        fix = FIX_ON_LOOP if entry["on_event_loop"] else (FIX_GIL if entry["delayed_steps"] else FIX_SLOW)
        findings.append(Finding(
            kind="tokenization_stall",
            severity="critical" if big and cost >= CRITICAL_MS else "warning",
            fix=fix,
            cost_ms=cost,
            start_us=entry["start_us"],
            end_us=entry["end_us"],
            title=f"{who} spent {entry['tokenize_ms']:.1f} ms tokenizing before its first model step{harm}",
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
                  "on_event_loop": e["on_event_loop"], "delayed_step_ms": e["delayed_step_ms"]}
            for key, e in list(per_request.items())[:200]
        },
    }
    return findings, summary
