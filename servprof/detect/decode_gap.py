"""Gaps between decode steps, and the cause of each.

On a trace with device events, a gap is device idle time: between the last device
event of step k and the first of step k+1, minus any device work that ran in
between; inside a single step, idle stretches between device events count too
(graph replays and blocking copies leave those). On a CPU-only trace, a gap is
the host time between the end of one model step and the start of the next, and
also the part of an unusually slow decode step in which its own thread ran no
recorded op (it waited for the GIL held by another thread, or was off the CPU).

Each gap's cause is named from what the host was doing meanwhile (causes.py);
gaps are grouped by cause into one finding each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servprof.detect.causes import HostActivity, union_length
from servprof.detect.finding import Finding
from servprof.detect.idle_split import idle_split
from servprof.detect.steps import Step, step_index
from servprof.trace.model import Trace

CPU_MIN_GAP_US = 1000.0  # host gaps below 1 ms are the ordinary cost of a Python engine loop
GPU_MIN_GAP_US = 50.0  # device idle below 50 µs is launch latency, not a stall
RELATIVE_MIN_GAP = 0.25  # ... and a host gap must be at least this share of the median step
# Device idle counts from this share of the median step (between steps) or of the step's
# own device window (inside a step): GPU steps are short, so the bar is lower than on CPU.
DEVICE_RELATIVE_MIN_GAP = 0.02
# A cause is reported when its gaps take a real share of the decode span, and recur (or
# are large alone): one preemption of a few ms by the OS is not something to fix.
MIN_SHARE = 0.05
MIN_SHARE_SINGLE = 0.2


@dataclass
class Gap:
    rank: int
    start_us: float
    end_us: float
    idle_us: float
    where: str  # "between_steps" | "inside_step"
    cause: str
    explanation: str
    request_ids: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "start_us": self.start_us,
            "end_us": self.end_us,
            "idle_us": round(self.idle_us, 1),
            "where": self.where,
            "cause": self.cause,
            "explanation": self.explanation,
            "request_ids": self.request_ids[:20],
            **self.evidence,
        }


def _device_windows(trace: Trace, steps: list[Step]) -> list[tuple[float, float] | None]:
    """Per step: first start and last end of the device work its host side launched."""
    dev = np.flatnonzero(trace.device_mask())
    launch = trace.launch_row_for(dev)
    linked = launch >= 0
    dev, launch = dev[linked], launch[linked]
    owner = step_index(steps, trace.rank[dev], trace.ts[launch])
    inside = owner >= 0
    owner, dev = owner[inside], dev[inside]
    first = np.full(len(steps), np.inf)
    last = np.full(len(steps), -np.inf)
    np.minimum.at(first, owner, trace.ts[dev])
    np.maximum.at(last, owner, trace.ts[dev] + trace.dur[dev])
    return [(float(a), float(b)) if np.isfinite(a) else None for a, b in zip(first, last, strict=True)]


def find_gaps(trace: Trace, steps: list[Step]) -> tuple[list[Gap], dict[str, Any]]:
    gaps: list[Gap] = []
    stats: dict[str, Any] = {"steps": len(steps), "mode": "cpu"}
    for rank in trace.ranks:
        rank_steps = [s for s in steps if s.rank == rank]
        if not rank_steps:
            continue
        activity = HostActivity(trace, rank)
        on_device = activity.dev_start.size > 0
        stats["mode"] = "device" if on_device else "cpu"
        median_step = float(np.median([s.dur_us for s in rank_steps]))
        if on_device:
            gaps.extend(_device_gaps(trace, rank_steps, activity, median_step))
        else:
            gaps.extend(_host_gaps(rank_steps, activity, median_step))
            gaps.extend(_stalled_steps(trace, rank_steps, activity))
    stats["median_step_us"] = round(float(np.median([s.dur_us for s in steps])), 1) if steps else None
    return gaps, stats


def _host_gaps(steps: list[Step], activity: HostActivity, median_step: float) -> list[Gap]:
    threshold = max(CPU_MIN_GAP_US, RELATIVE_MIN_GAP * median_step)
    out = []
    by_thread: dict[int, list[Step]] = {}
    for s in steps:
        by_thread.setdefault(s.tid, []).append(s)
    for thread_steps in by_thread.values():
        for prev, nxt in zip(thread_steps, thread_steps[1:], strict=False):
            if nxt.kind not in ("decode", "mixed", "step"):
                continue
            length = nxt.start_us - prev.end_us
            if length < threshold:
                continue
            window = activity.window(prev.end_us, nxt.start_us)
            cause, why = window.cause()
            out.append(Gap(nxt.rank, prev.end_us, nxt.start_us, length, "between_steps", cause, why,
                           list(nxt.request_ids), window.to_evidence()))
    return out


def _stalled_steps(trace: Trace, steps: list[Step], activity: HostActivity) -> list[Gap]:
    """CPU traces: decode steps whose own thread ran no recorded op for much of the step
    (the thread was waiting for the GIL, or off the CPU). The uncovered time is a gap
    inside the step; what other threads did meanwhile names its cause."""
    decode = [s for s in steps if s.kind == "decode"]
    if len(decode) < 3:
        return []
    typical = float(np.median([s.dur_us for s in decode]))
    out = []
    for step in decode:
        if step.dur_us < 1.5 * typical:
            continue
        own = activity.window(step.start_us, step.end_us, tid=step.tid)
        stalled = step.dur_us - own.op_us
        if stalled < max(CPU_MIN_GAP_US, RELATIVE_MIN_GAP * typical):
            continue
        others = activity.window(step.start_us, step.end_us, exclude_tid=step.tid)
        cause, why = others.cause()
        if cause == "host_ops":
            cause, why = "gil_or_cpu_contention", f"the engine thread ran nothing while other threads ran {why}"
        out.append(Gap(step.rank, step.start_us, step.end_us, stalled, "inside_step", cause, why,
                       list(step.request_ids), others.to_evidence()))
    return out


def _device_gaps(trace: Trace, steps: list[Step], activity: HostActivity, median_step: float) -> list[Gap]:
    out = []
    windows = _device_windows(trace, steps)
    dev_s, dev_e = activity.dev_start, activity.dev_end
    for i, (step, win) in enumerate(zip(steps, windows, strict=True)):
        if win is None:
            continue
        # Idle stretches inside this step's device window.
        near = activity.device_overlapping(win[0], win[1])
        inside = near[(dev_s[near] >= win[0]) & (dev_e[near] <= win[1])]
        for start, end in _idle_intervals(dev_s[inside], dev_e[inside]):
            if end - start >= max(GPU_MIN_GAP_US, DEVICE_RELATIVE_MIN_GAP * (win[1] - win[0])):
                out.append(_device_gap(step, start, end, end - start, "inside_step", activity))
        nxt = next((j for j in range(i + 1, len(steps)) if windows[j] is not None), None)
        if nxt is None or steps[nxt].kind not in ("decode", "mixed", "step"):
            continue
        start, end = win[1], windows[nxt][0]  # type: ignore[index]
        if end <= start:
            continue
        between = activity.device_overlapping(start, end)
        busy = union_length(np.maximum(dev_s[between], start), np.minimum(dev_e[between], end))
        idle = (end - start) - busy
        if idle >= max(GPU_MIN_GAP_US, DEVICE_RELATIVE_MIN_GAP * median_step):
            out.append(_device_gap(steps[nxt], start, end, idle, "between_steps", activity))
    return out


def _device_gap(step: Step, start: float, end: float, idle: float, where: str, activity: HostActivity) -> Gap:
    window = activity.window(start, end)
    cause, why = window.cause()
    return Gap(step.rank, start, end, idle, where, cause, why, list(step.request_ids), window.to_evidence())


def _idle_intervals(starts: np.ndarray, ends: np.ndarray) -> list[tuple[float, float]]:
    if starts.size < 2:
        return []
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], np.maximum.accumulate(ends[order])
    holes = np.flatnonzero(s[1:] > e[:-1])
    return [(float(e[h]), float(s[h + 1])) for h in holes]


def detect_decode_gaps(trace: Trace, steps: list[Step], found: tuple[list[Gap], dict[str, Any]] | None = None
                       ) -> tuple[list[Finding], dict[str, Any]]:
    """Findings (one per cause) from the gaps; ``found`` is find_gaps' result when the caller has it."""
    gaps, stats = found if found is not None else find_gaps(trace, steps)
    split = [s.to_dict() for s in idle_split(trace)]
    summary: dict[str, Any] = {
        **stats,
        "gaps": len(gaps),
        "gap_ms_total": round(sum(g.idle_us for g in gaps) / 1000.0, 3),
        "idle_split": split,
    }
    findings: list[Finding] = []
    span = (max(s.end_us for s in steps) - min(s.start_us for s in steps)) if steps else 0.0
    by_cause: dict[tuple[str, str], list[Gap]] = {}
    for gap in gaps:
        by_cause.setdefault((gap.cause, gap.where), []).append(gap)
    for (cause, where), group in by_cause.items():
        idle = np.array([g.idle_us for g in group])
        cost_ms = float(idle.sum()) / 1000.0
        share = float(idle.sum()) / span if span > 0 else 1.0
        if share < MIN_SHARE or (len(group) < 2 and share < MIN_SHARE_SINGLE):
            summary.setdefault("unreported_gaps", []).extend(g.to_dict() for g in group)
            continue
        severity = "critical" if share >= 0.2 else "warning"
        worst = sorted(group, key=lambda g: -g.idle_us)
        where_text = "between decode steps" if where == "between_steps" else "inside model steps"
        findings.append(
            Finding(
                kind="decode_gap",
                severity=severity,
                cost_ms=cost_ms,
                start_us=min(g.start_us for g in group),
                end_us=max(g.end_us for g in group),
                title=f"{len(group)} gap(s) {where_text}, mean {idle.mean() / 1000:.2f} ms: {worst[0].explanation}",
                request_ids=sorted({r for g in group for r in g.request_ids})[:100],
                evidence={
                    "cause": cause,
                    "where": where,
                    "gaps": len(group),
                    "mean_gap_ms": round(float(idle.mean()) / 1000.0, 4),
                    "median_gap_ms": round(float(np.median(idle)) / 1000.0, 4),
                    "max_gap_ms": round(float(idle.max()) / 1000.0, 4),
                    "share_of_step_span": round(share, 4),
                    "worst_gaps": [g.to_dict() for g in worst[:10]],
                },
            )
        )
    return findings, summary
