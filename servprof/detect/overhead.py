"""servprof's own time seen in a session trace: everything after its ``stop()`` began.

The session metadata (top-level key ``servprof``) carries ``stop_wall_ns``, the wall clock
just before the profiler's ``stop()``; trace µs = (unix ns - baseTimeNanoseconds) / 1000.
``stop()`` holds the GIL for ~5-9 µs per captured event, so a step that was running then
looks stalled for the whole stop: that is servprof's overhead, never the app's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from servprof.trace.model import Trace

if TYPE_CHECKING:
    from servprof.detect.step_forms import Step


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
        return None
    return float(value)


def stop_cutoffs(trace: Trace) -> dict[int, float]:
    """rank -> trace µs at which servprof's stop() began, for ranks whose metadata says so."""
    out: dict[int, float] = {}
    for rank, meta in trace.metadata.items():
        session = meta.get("servprof") if isinstance(meta, dict) else None
        if not isinstance(session, dict):
            continue
        stop, base = _number(session.get("stop_wall_ns")), _number(meta.get("baseTimeNanoseconds"))
        if stop is not None and base is not None and stop > base:
            out[int(rank)] = (stop - base) / 1000.0
    return out


def overhead_summary(trace: Trace, steps: list[Step], dropped_steps: int = 0) -> dict[str, Any] | None:
    """What servprof's own stop() shows in this trace, for the report; None when the trace
    carries no stop time (not a servprof session)."""
    cutoffs = stop_cutoffs(trace)
    if not cutoffs:
        return None
    rank, cutoff = min(cutoffs.items())
    mine = trace.rank == rank
    trace_end = float(trace.end[mine].max()) if mine.any() else cutoff
    timed = mine & trace.complete() & (trace.dur > 0)
    first = float(trace.ts[timed].min()) if timed.any() else cutoff
    tail_ms = max(trace_end - cutoff, 0.0) / 1000.0
    cut = [s for s in steps if s.cut_at_stop_us > 0]
    cut_ms = sum(s.cut_at_stop_us for s in cut) / 1000.0
    message = (f"servprof's own stop() began {(cutoff - first) / 1000:.1f} ms into the trace; the {tail_ms:.1f} ms "
               f"the trace runs on after it is the profiler stopping (it holds the GIL): servprof's overhead, left "
               f"out of every finding")
    if cut:
        message += f" ({len(cut)} step(s) running then were cut there, {cut_ms:.1f} ms)"
    if dropped_steps:
        message += f"; {dropped_steps} step(s) that began after it were dropped"
    return {"rank": rank, "stop_us": round(cutoff, 3), "stop_after_start_ms": round((cutoff - first) / 1000, 3), "after_stop_ms": round(tail_ms, 3),
            "steps_cut": len(cut), "steps_cut_ms": round(cut_ms, 3), "steps_dropped": dropped_steps,
            "message": message + "."}
