"""Per-step utilisation: for every step, how long the device was busy, idle inside the step,
and idle between it and the step before, in ms and as a share of the step.

A step's *cycle* is the idle between the previous step and this one plus the step's own
device span (device_segments: disjoint, so no stretch counts for two steps); busy is the
union of every device event on the rank inside the span (kernels of other streams
included: the device was working), idle inside is the rest of the span. busy + idle
inside + idle between = the cycle, and each is also given as a share of it. On a CPU-only
trace the same table is read on the host: busy is the union of the work recorded on the
step's own thread inside its range, and "between" is the host time since the previous
step on that thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from servprof.detect.gaps import device_rows, zones
from servprof.detect.host_stacks import BUSY_CLASSES, HostStacks, NameClasses
from servprof.detect.intervals import covered, merge
from servprof.detect.overhead import stop_cutoffs
from servprof.detect.step_forms import SOURCE_LABELS, Step

MAX_STEP_ROWS = 2000  # per-step rows kept in the JSON (the aggregates cover every step)


def utilisation(trace: Any, steps: list[Step]) -> dict[str, Any]:
    """summary["utilisation"]: per-step rows and per (rank, kind) aggregates."""
    rows: list[dict[str, Any]] = []
    cutoffs = stop_cutoffs(trace)
    classes = None
    for rank in trace.ranks:
        mine = [s for s in steps if s.rank == rank]
        if not mine:
            continue
        if any(s.on_device for s in mine):
            rows.extend(_device_rows(trace, rank, mine, cutoffs.get(rank, np.inf)))
        else:
            classes = classes or NameClasses(trace)
            rows.extend(_host_rows(HostStacks(trace, rank, classes), mine))
    mode = "device" if any(r["on"] == "device" for r in rows) else ("host" if rows else None)
    return {
        "mode": mode,
        "aggregates": _aggregate(rows),
        "steps": rows[:MAX_STEP_ROWS],
        "steps_total": len(rows),
        "sources": {str(rank): SOURCE_LABELS.get(src, src) for rank, src in
                    sorted({(s.rank, s.source) for s in steps})},
    }


def _row(step: Step, index: int, on: str, start: float, end: float, busy: float, between: float) -> dict[str, Any]:
    span = end - start
    cycle = span + between
    inside = max(span - busy, 0.0)

    def pct(v: float) -> float:
        return round(100.0 * v / cycle, 2) if cycle > 0 else 0.0

    return {"rank": step.rank, "index": index, "kind": step.kind, "source": step.source, "on": on,
            "start_us": round(start, 3), "end_us": round(end, 3), "step_ms": round(span / 1000, 4),
            "cycle_ms": round(cycle / 1000, 4), "busy_ms": round(busy / 1000, 4),
            "idle_inside_ms": round(inside / 1000, 4), "idle_between_ms": round(between / 1000, 4),
            "busy_pct": pct(busy), "idle_inside_pct": pct(inside), "idle_between_pct": pct(between),
            "host_ms": round(step.dur_us / 1000, 4), "batch": step.batch}


def _device_rows(trace: Any, rank: int, steps: list[Step], cutoff: float) -> list[dict[str, Any]]:
    on_device = sorted((s for s in steps if s.on_device), key=lambda s: s.device_start_us or 0.0)
    _, dev_start, dev_end = device_rows(trace, rank, cutoff)
    block_start, block_end = merge(dev_start, dev_end)
    zs, ze, zstep, zinside = zones(on_device)
    busy = covered(block_start, block_end, zs, ze)
    idle = (ze - zs) - busy
    between = np.zeros(len(on_device))
    np.add.at(between, zstep[~zinside], idle[~zinside])
    out = []
    for z in np.flatnonzero(zinside).tolist():
        pos = int(zstep[z])
        out.append(_row(on_device[pos], pos, "device", float(zs[z]), float(ze[z]), float(busy[z]), float(between[pos])))
    return out


def _host_rows(stacks: HostStacks, steps: list[Step]) -> list[dict[str, Any]]:
    out = []
    for tid in sorted({s.tid for s in steps}):
        mine = sorted((s for s in steps if s.tid == tid), key=lambda s: s.start_us)
        a, b = np.array([s.start_us for s in mine]), np.array([s.end_us for s in mine])
        busy = stacks.thread(tid).class_times(a, b)[:, list(BUSY_CLASSES)].sum(axis=1)
        previous_end = np.concatenate([[a[0]], np.maximum.accumulate(b)[:-1]])
        between = np.maximum(a - previous_end, 0.0)
        for pos, step in enumerate(mine):
            out.append(_row(step, pos, "host", float(a[pos]), float(b[pos]), float(busy[pos]), float(between[pos])))
    return out


def _aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (rank, kind): step count, median step, and busy / idle inside / idle between, as
    the median per step (ms) and as a share of all the steps' cycles."""
    out = []
    for rank, kind in sorted({(r["rank"], r["kind"]) for r in rows}):
        mine = [r for r in rows if r["rank"] == rank and r["kind"] == kind]
        cycle = sum(r["cycle_ms"] for r in mine)

        def total(key: str, group: list[dict[str, Any]] = mine) -> float:
            return sum(r[key] for r in group)

        def share(key: str, whole: float = cycle) -> float:
            return round(100.0 * total(key) / whole, 2) if whole > 0 else 0.0

        out.append({
            "rank": rank, "kind": kind, "steps": len(mine), "on": mine[0]["on"],
            "median_step_ms": round(float(np.median([r["step_ms"] for r in mine])), 4),
            "median_cycle_ms": round(float(np.median([r["cycle_ms"] for r in mine])), 4),
            "median_busy_ms": round(float(np.median([r["busy_ms"] for r in mine])), 4),
            "median_idle_inside_ms": round(float(np.median([r["idle_inside_ms"] for r in mine])), 4),
            "median_idle_between_ms": round(float(np.median([r["idle_between_ms"] for r in mine])), 4),
            "total_cycle_ms": round(cycle, 4), "busy_ms": round(total("busy_ms"), 4),
            "idle_inside_ms": round(total("idle_inside_ms"), 4), "idle_between_ms": round(total("idle_between_ms"), 4),
            "busy_pct": share("busy_ms"), "idle_inside_pct": share("idle_inside_ms"),
            "idle_between_pct": share("idle_between_ms"),
        })
    return out
