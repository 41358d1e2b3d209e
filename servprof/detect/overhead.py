"""servprof's own time seen in a session trace: everything after it stopped recording the app.

The session metadata (top-level key ``servprof``) carries ``stop_wall_ns``, the wall clock
just before the profiler's ``stop()``, and ``cut_wall_ns`` when collection was switched off
before that (the event budget's cut, a deep session's drain: servprof/tiers.py); trace µs =
(unix ns - baseTimeNanoseconds) / 1000. ``stop()`` holds the GIL for ~5-9 µs per captured
event, so a step that was running then looks stalled for the whole stop; after a cut, a range
still open gets its end but none of its ops: either way servprof's doing, never the app's.
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
    """rank -> trace µs at which servprof stopped recording the app (its collection cut, else its
    stop()), for ranks whose metadata says so."""
    return {rank: cutoff for rank, (cutoff, _cut) in _cutoffs(trace).items()}


def whole_before_stop(trace: Trace, steps: list[Step]) -> int | None:
    """How many steps ended before servprof stopped recording their rank (every op of theirs is in
    the trace; a step still running then may have lost its end); None outside servprof's sessions."""
    cutoffs = stop_cutoffs(trace)
    if not cutoffs:
        return None
    return sum(1 for step in steps if step.rank in cutoffs and step.end_us <= cutoffs[step.rank])


def _cutoffs(trace: Trace) -> dict[int, tuple[float, bool]]:
    """rank -> (cutoff µs, whether it is a collection cut rather than the stop)."""
    out: dict[int, tuple[float, bool]] = {}
    for rank, meta in trace.metadata.items():
        session = meta.get("servprof") if isinstance(meta, dict) else None
        if not isinstance(session, dict):
            continue
        stop, base = _number(session.get("stop_wall_ns")), _number(meta.get("baseTimeNanoseconds"))
        cut = _number(session.get("cut_wall_ns"))
        if stop is None or base is None or stop <= base:
            continue
        is_cut = cut is not None and base < cut < stop
        out[int(rank)] = ((cut if is_cut else stop) - base) / 1000.0, is_cut
    return out


def overhead_summary(trace: Trace, steps: list[Step], dropped_steps: int = 0) -> dict[str, Any] | None:
    """What servprof's own stop() shows in this trace, for the report; None when the trace
    carries no stop time (not a servprof session)."""
    cutoffs = _cutoffs(trace)
    if not cutoffs:
        return None
    rank, (cutoff, is_cut) = min(cutoffs.items())
    mine = trace.rank == rank
    trace_end = float(trace.end[mine].max()) if mine.any() else cutoff
    timed = mine & trace.complete() & (trace.dur > 0)
    first = float(trace.ts[timed].min()) if timed.any() else cutoff
    tail_ms = max(trace_end - cutoff, 0.0) / 1000.0
    cut = [s for s in steps if s.cut_at_stop_us > 0]
    cut_ms = sum(s.cut_at_stop_us for s in cut) / 1000.0
    if is_cut:
        message = (f"servprof switched collection off {(cutoff - first) / 1000:.1f} ms into the trace, then stopped "
                   f"the profiler; the {tail_ms:.1f} ms the trace runs on after the cut are ranges still open then "
                   f"(none of their ops recorded) and the profiler stopping: servprof's doing, left out of every "
                   f"finding")
    else:
        message = (f"servprof's own stop() began {(cutoff - first) / 1000:.1f} ms into the trace; the {tail_ms:.1f} "
                   f"ms the trace runs on after it is the profiler stopping (it holds the GIL): servprof's overhead, "
                   f"left out of every finding")
    if cut:
        message += f" ({len(cut)} step(s) running then were cut there, {cut_ms:.1f} ms)"
    if dropped_steps:
        message += f"; {dropped_steps} step(s) that began after it were dropped"
    return {"rank": rank, "stop_us": round(cutoff, 3), "stop_after_start_ms": round((cutoff - first) / 1000, 3), "after_stop_ms": round(tail_ms, 3),
            "steps_cut": len(cut), "steps_cut_ms": round(cut_ms, 3), "steps_dropped": dropped_steps,
            "message": message + "."}
