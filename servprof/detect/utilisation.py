"""Per-step utilisation: for every step, how long the device was busy, idle inside the step,
and idle between it and the step before, in ms and as a share of the step.

A step's *cycle* is the idle between the previous step and this one plus the step's own
device span (device_segments: disjoint, so no stretch counts for two steps); busy is the
union of every device event on the rank inside the span (kernels of other streams
included: the device was working), idle inside is the rest of the span. busy + idle
inside + idle between = the cycle, and each is also given as a share of it. On a CPU-only
trace the same table is read on the host: busy is the union of the work recorded on the
step's own thread inside its range, and "between" is the host time since the previous
step on that thread. A light CPU trace records no work inside a step (tier.py): there busy
and idle inside are null (not split), never zero.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from servprof.detect.gaps import device_rows, zones
from servprof.detect.host_classes import BUSY_CLASSES, NameClasses
from servprof.detect.host_stacks import HostStacks
from servprof.detect.intervals import covered, merge
from servprof.detect.overhead import stop_cutoffs
from servprof.detect.step_forms import SOURCE_LABELS, Step
from servprof.detect.tier import LIGHT_TRACE, is_light
from servprof.trace.model import median as median_of

MAX_STEP_ROWS = 2000  # per-step rows kept in the JSON (the aggregates cover every step)


def utilisation(trace: Any, steps: list[Step]) -> dict[str, Any]:
    """summary["utilisation"]: per-step rows and per (rank, kind) aggregates."""
    rows: list[dict[str, Any]] = []
    cutoffs = stop_cutoffs(trace)
    classes = None
    light = is_light(trace)
    for rank in trace.ranks:
        mine = [s for s in steps if s.rank == rank]
        if not mine:
            continue
        if any(s.on_device for s in mine):
            rows.extend(_device_rows(trace, rank, mine, cutoffs.get(rank, np.inf)))
        else:
            classes = classes or NameClasses(trace)
            rows.extend(_host_rows(HostStacks(trace, rank, classes), mine, light))
    mode = "device" if any(r["on"] == "device" for r in rows) else ("host" if rows else None)
    unsplit = any(r["busy_ms"] is None for r in rows)
    return {
        "mode": mode,
        **({"note": f"busy and idle inside a step are not split (null): {LIGHT_TRACE}; step and between-step "
                    "times are measured"} if unsplit else {}),
        "aggregates": _aggregate(rows),
        "steps": rows[:MAX_STEP_ROWS],
        "steps_total": len(rows),
        "sources": {str(rank): SOURCE_LABELS.get(src, src) for rank, src in
                    sorted({(s.rank, s.source) for s in steps})},
    }


def _row(step: Step, index: int, on: str, start: float, end: float, busy: float | None, between: float
         ) -> dict[str, Any]:
    """One step's row; ``busy`` None: not recorded (a light CPU trace), so busy and idle inside are null."""
    span = end - start
    cycle = span + between
    inside = None if busy is None else max(span - busy, 0.0)

    def pct(v: float | None) -> float | None:
        return None if v is None else round(100.0 * v / cycle, 2) if cycle > 0 else 0.0

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v / 1000, 4)

    return {"rank": step.rank, "index": index, "kind": step.kind, "source": step.source, "on": on,
            "start_us": round(start, 3), "end_us": round(end, 3), "step_ms": round(span / 1000, 4),
            "cycle_ms": round(cycle / 1000, 4), "busy_ms": ms(busy),
            "idle_inside_ms": ms(inside), "idle_between_ms": round(between / 1000, 4),
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


def _host_rows(stacks: HostStacks, steps: list[Step], light: bool = False) -> list[dict[str, Any]]:
    out = []
    for tid in sorted({s.tid for s in steps}):
        mine = sorted((s for s in steps if s.tid == tid), key=lambda s: s.start_us)
        a, b = np.array([s.start_us for s in mine]), np.array([s.end_us for s in mine])
        busy = None if light else stacks.thread(tid).class_times(a, b)[:, list(BUSY_CLASSES)].sum(axis=1)
        previous_end = np.concatenate([[a[0]], np.maximum.accumulate(b)[:-1]])
        between = np.maximum(a - previous_end, 0.0)
        for pos, step in enumerate(mine):
            out.append(_row(step, pos, "host", float(a[pos]), float(b[pos]),
                            None if busy is None else float(busy[pos]), float(between[pos])))
    return out


def _aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (rank, kind): step count, median step, and busy / idle inside / idle between, as
    the median per step (ms) and as a share of all the steps' cycles."""
    out = []
    for rank, kind in sorted({(r["rank"], r["kind"]) for r in rows}):
        mine = [r for r in rows if r["rank"] == rank and r["kind"] == kind]
        cycle = sum(r["cycle_ms"] for r in mine)

        def total(key: str, group: list[dict[str, Any]] = mine) -> float | None:
            values = [r[key] for r in group]
            return None if None in values else sum(values)

        def share(key: str, whole: float = cycle) -> float | None:
            value = total(key)
            return None if value is None else round(100.0 * value / whole, 2) if whole > 0 else 0.0

        def median(key: str, group: list[dict[str, Any]] = mine) -> float | None:
            values = [r[key] for r in group]
            return None if None in values else round(median_of(values), 4)

        def rounded(value: float | None) -> float | None:
            return None if value is None else round(value, 4)

        out.append({
            "rank": rank, "kind": kind, "steps": len(mine), "on": mine[0]["on"],
            "median_step_ms": median("step_ms"), "median_cycle_ms": median("cycle_ms"),
            "median_busy_ms": median("busy_ms"), "median_idle_inside_ms": median("idle_inside_ms"),
            "median_idle_between_ms": median("idle_between_ms"),
            "total_cycle_ms": round(cycle, 4), "busy_ms": rounded(total("busy_ms")),
            "idle_inside_ms": rounded(total("idle_inside_ms")), "idle_between_ms": rounded(total("idle_between_ms")),
            "busy_pct": share("busy_ms"), "idle_inside_pct": share("idle_inside_ms"),
            "idle_between_pct": share("idle_between_ms"),
        })
    return out
