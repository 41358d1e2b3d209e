"""The model running on the serving event loop's own thread.

A FastAPI server that calls the model from an ``async def`` handler or an async generator (a
hand-written decode loop that streams each token, ``model.generate()`` awaited nowhere) runs every
forward pass on the event loop: while a step runs, the loop accepts, streams and answers nothing
else. Each step may be short (a millisecond on a small model, under the watchdog's stall
threshold), yet together they hold the loop for most of the session.

The session's metadata names the loop's thread (``event_loop_tid``, docs/CONTRACTS.md) and every
step carries the thread it ran on, so this is read off the trace, not guessed: the steps on that
thread, their time, and its share of the span they cover. Traces without servprof's metadata
(offline traces) say nothing about an event loop and get no finding.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from servprof.detect.finding import Finding, severity_for_share
from servprof.detect.steps import Step
from servprof.trace.meta import loop_thread
from servprof.trace.model import Trace, median

KIND = "loop_stall"
CAUSE = "model_on_event_loop"


def detect_model_on_loop(trace: Trace, steps: list[Step]) -> tuple[list[Finding], dict[str, Any]]:
    tid = loop_thread(trace.servprof_metadata())
    on_loop = [s for s in steps if tid is not None and s.tid == tid]
    summary: dict[str, Any] = {"loop_tid": tid, "steps_on_loop": len(on_loop)}
    if not on_loop:
        return [], summary
    durations = [s.dur_us for s in on_loop]
    busy_us = sum(durations)
    start_us, end_us = min(s.start_us for s in on_loop), max(s.end_us for s in on_loop)
    span_us = end_us - start_us
    share = busy_us / span_us if span_us > 0 else 1.0
    kinds = Counter(s.kind for s in on_loop)
    models = [m for m in (trace.servprof_metadata().get("auto") or {}).get("models") or [] if isinstance(m, str)]
    model = f"the model ({', '.join(models[:3])})" if models else "the model"
    step_ms, longest_ms = median(durations) / 1e3, max(durations) / 1e3
    summary.update({"step_ms_on_loop": round(busy_us / 1e3, 3), "share_of_loop_time": round(share, 4)})
    title = (f"{model[0].upper()}{model[1:]} runs on the event loop's thread: {len(on_loop)} steps "
             f"({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}), {busy_us / 1e3:.1f} ms, "
             f"{share:.0%} of the loop's time from the first to the last; while a step runs (median "
             f"{step_ms:.2f} ms, longest {longest_ms:.2f} ms) the server accepts, streams and answers nothing else")
    finding = Finding(
        kind=KIND,
        severity=severity_for_share(share, busy_us / 1e3),
        cost_ms=busy_us / 1e3,
        start_us=start_us,
        end_us=end_us,
        title=title,
        request_ids=sorted({r for s in on_loop for r in s.request_ids})[:100],
        evidence={"source": "model steps on the event loop's thread", "cause": CAUSE, "loop_tid": tid,
                  "steps": len(on_loop), "step_kinds": dict(sorted(kinds.items())), "models": models,
                  "step_ms_total": round(busy_us / 1e3, 3), "span_ms": round(span_us / 1e3, 3),
                  "share_of_loop_time": round(share, 4), "median_step_ms": round(step_ms, 4),
                  "max_step_ms": round(longest_ms, 4)},
        fix=("Run the model off the event loop and keep only I/O there: make the endpoint a plain `def` "
             "(FastAPI runs it in its thread pool), or call the model with `await asyncio.to_thread(...)` "
             "(a whole `generate()`, or each step of a streaming loop), or feed one model thread from a queue "
             "(a batcher). torch releases the GIL inside its ops, so the loop keeps serving while the model "
             "computes."),
    )
    return [finding], summary
