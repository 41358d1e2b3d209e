"""decode_gap findings: the gaps (gaps.py) grouped by cause and place into one finding each,
with a fix, and a severity from their share of the step time; plus the per-step host read
(host_reads.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from servprof.detect.cause_texts import cause_fix, untraced_fix
from servprof.detect.collective_arrivals import last_arrivals_text
from servprof.detect.finding import WARNING_SHARE, Finding, severity_for_share
from servprof.detect.gaps import Gap, find_gaps
from servprof.detect.steps import Step
from servprof.detect.tier import NEEDS_DEEP_CAUSE, is_light
from servprof.trace.model import median

__all__ = ["Gap", "detect_decode_gaps", "find_gaps", "step_span_us", "step_words"]

# A cause is reported when its gaps take a real share of the step time, and recur (or are
# large alone): one preemption of a few ms by the OS is not something to fix.
MIN_SHARE = WARNING_SHARE
MIN_SHARE_SINGLE = 0.2
# A gap nothing recorded explains is a finding above info only when most steps have one.
MIN_RECURRENCE_UNEXPLAINED = 0.5
UNEXPLAINED = ("untraced_host_time", NEEDS_DEEP_CAUSE)
# A rank's first training or decode step that took this many times the median of its later ones
# of that kind (a prefill is longer by nature) is reported apart, so that it neither hides the
# steady state's causes nor passes for them: the other steps' gaps are judged against the other
# steps' time, its own against all of it (as without it). Causes that are one-time costs by what
# they are (a kernel's code loaded, the device's memory set up, torch.compile compiling) are
# warm-up there, and never critical.
FIRST_STEP_FACTOR = 3.0
FIRST_STEP_MIN_STEPS = 3
FIRST_STEP_KINDS = ("train", "decode")
WARM_UP_CAUSES = ("slow_launch", "runtime_calls", "compiling")

# --- findings ---------------------------------------------------------------------------------


def step_words(steps: list[Step]) -> str:
    """What to call the steps in a title: decode steps only when they are decode steps."""
    kinds = {s.kind for s in steps}
    if kinds <= {"decode"}:
        return "decode steps"
    if kinds <= {"train"}:
        return "training steps"
    if kinds <= {"prefill"}:
        return "prefill steps"
    return "model steps"


def step_span_us(steps: list[Step]) -> float:
    """The time the steps cover, per rank (first start to last end, device spans where known), summed.
    Host steps on several threads (one model call per request, each on its own thread) are judged
    per thread, as their gaps are: each thread's span, summed (a share never passes 100%)."""
    total = 0.0
    for rank in {s.rank for s in steps}:
        mine = [s for s in steps if s.rank == rank]
        if any(s.on_device for s in mine):
            starts = [s.device_start_us if s.on_device else s.start_us for s in mine]
            ends = [s.device_end_us if s.on_device else s.end_us for s in mine]
            total += max(e for e in ends if e is not None) - min(s for s in starts if s is not None)
            continue
        for tid in {s.tid for s in mine}:
            thread = [s for s in mine if s.tid == tid]
            total += max(s.end_us for s in thread) - min(s.start_us for s in thread)
    return total


def _recurrence(group: list[Gap], steps: list[Step]) -> float:
    """The share of the steps (of the kinds these gaps belong to) that have such a gap."""
    hit = {g.step for g in group if 0 <= g.step < len(steps)}
    kinds = {steps[i].kind for i in hit}
    pool = sum(1 for s in steps if s.kind in kinds)
    return len(hit) / pool if pool else 0.0


def long_first_steps(steps: list[Step]) -> set[int]:
    """Indices of the steps reported apart: per rank and kind (training or decode), the first, when
    it took FIRST_STEP_FACTOR times the median of at least FIRST_STEP_MIN_STEPS - 1 later ones."""
    by_rank_kind: dict[tuple[int, str], list[int]] = {}
    for i, step in enumerate(steps):
        if step.kind in FIRST_STEP_KINDS:
            by_rank_kind.setdefault((step.rank, step.kind), []).append(i)
    out: set[int] = set()
    for indices in by_rank_kind.values():
        if len(indices) < FIRST_STEP_MIN_STEPS:
            continue
        first, *later = sorted(indices, key=lambda i: steps[i].start_us)
        if steps[first].time_us > FIRST_STEP_FACTOR * median([steps[i].time_us for i in later]):
            out.add(first)
    return out


def _first_step_text(steps: list[Step], group: list[Gap]) -> str:
    first = steps[group[0].step]
    later = [s.time_us for s in steps if s.rank == first.rank and s.kind == first.kind and s is not first]
    return f"{first.time_us / 1000:.2f} ms, the later ones {median(later) / 1000:.2f} ms at the median"


def detect_decode_gaps(trace: Any, steps: list[Step], found: tuple[list[Gap], dict[str, Any]] | None = None
                       ) -> tuple[list[Finding], dict[str, Any]]:
    """Findings (one per cause and place) from the gaps; ``found`` is find_gaps' result when the caller has it."""
    from servprof.detect.idle_split import idle_split

    gaps, stats = found if found is not None else find_gaps(trace, steps)
    summary: dict[str, Any] = {
        **stats,
        "gaps": sum(g.count for g in gaps),
        "gap_ms_total": round(sum(g.idle_us for g in gaps if g.cause != "collective_straggler") / 1000.0, 3),
        "idle_split": [s.to_dict() for s in idle_split(trace)],
    }
    findings: list[Finding] = []
    long_first = long_first_steps(steps)
    spans = {False: step_span_us([s for i, s in enumerate(steps) if i not in long_first]),
             True: step_span_us(steps)}
    by_cause: dict[tuple[str, str, bool], list[Gap]] = {}
    for gap in gaps:
        by_cause.setdefault((gap.cause, gap.where, gap.where == "inside_step" and gap.step in long_first),
                            []).append(gap)
    for (cause, where, in_first), group in by_cause.items():
        idle = np.array([g.idle_us for g in group])
        count = sum(g.count for g in group)
        judged = spans[in_first]  # the time these gaps are a share of
        share = float(idle.sum()) / judged if judged > 0 else 1.0
        if share < MIN_SHARE or (count < 2 and share < MIN_SHARE_SINGLE):
            summary.setdefault("unreported_gaps", []).extend(g.to_dict() for g in group[:50])
            # What was seen under the bar, for a report that would otherwise say only "no findings".
            summary.setdefault("below_bar", []).append({
                "cause": cause, "where": where, "steps": step_words([steps[g.step] for g in group if 0 <= g.step < len(steps)] or steps),
                "gaps": count, "ms": round(float(idle.sum()) / 1000.0, 3), "share": round(share, 4),
                "bar": MIN_SHARE_SINGLE if count < 2 else MIN_SHARE})
            continue
        severity = severity_for_share(share, float(idle.sum()) / 1000.0)
        warm_up = in_first and cause in WARM_UP_CAUSES
        if warm_up and severity == "critical":
            severity = "warning"
        recurrence = _recurrence(group, steps)
        if cause in UNEXPLAINED and recurrence < MIN_RECURRENCE_UNEXPLAINED:
            # Nothing recorded says why, and it is not the loop's habit: a preemption or a busy host.
            severity = "info"
        worst = sorted(group, key=lambda g: -g.idle_us)
        words = step_words([steps[g.step] for g in group if 0 <= g.step < len(steps)] or steps)
        where_text = f"between {words}" if where == "between_steps" else f"inside {words}"
        if in_first:
            where_text = f"inside the first of the {words} ({_first_step_text(steps, group)}" + \
                ("; a one-time warm-up cost)" if warm_up else ")")
        what = "waiting for another rank" if cause == "collective_straggler" else "of device idle" \
            if stats.get("mode") == "device" else "of host time"
        findings.append(Finding(
            kind="decode_gap",
            severity=severity,  # type: ignore[arg-type]
            cost_ms=float(idle.sum()) / 1000.0,
            start_us=min(g.start_us for g in group),
            end_us=max(g.end_us for g in group),
            title=(f"{count} gap(s) {where_text}, {idle.sum() / 1000:.2f} ms {what} ({share:.0%} of step time): "
                   # (a folder of ranks: the thread named is that rank's process's)
                   f"{f'rank {worst[0].rank}: ' if len(trace.ranks) > 1 else ''}{worst[0].explanation}"),
            request_ids=sorted({r for g in group for r in g.request_ids})[:100],
            evidence={
                "cause": cause,
                "where": where,
                "gaps": count,
                "mean_gap_ms": round(float(idle.sum()) / count / 1000.0, 4),
                "median_gap_ms": round(median(idle / np.array([g.count for g in group])) / 1000.0, 4),
                "max_gap_ms": round(float(idle.max()) / 1000.0, 4),
                "share_of_step_time": round(share, 4),
                "steps_affected_share": round(recurrence, 4),
                "first_step_only": in_first,
                "warm_up": warm_up,
                "worst_gaps": [g.to_dict() for g in worst[:10]],
            },
            fix=untraced_fix(worst[0].evidence, bool(trace.servprof_metadata())) if cause == "untraced_host_time" else
            (last_arrivals_text(group) if cause == "collective_straggler" else "")
            + cause_fix(cause, training=words == "training steps", on_device=stats.get("mode") == "device"),
        ))
    _add_host_reads(trace, steps, step_span_us(steps), findings, summary)
    return findings, summary


def _add_host_reads(trace: Any, steps: list[Step], span: float, findings: list[Finding], summary: dict[str, Any]
                    ) -> None:
    """A read of a device value every step: its own finding on CPU traces; on device traces its
    count per step goes with the sync gaps it causes (their idle is the measured cost). A light
    CPU trace records no op, so no read: nothing is said from that (tier.light_missing says it)."""
    from servprof.detect.host_reads import detect_host_reads, reads_in_forward

    if is_light(trace) and not trace.has_device_events():
        return

    finding, reads = detect_host_reads(trace, steps, span)
    if reads:
        summary["host_reads"] = reads
    if finding is not None:
        findings.append(finding)
        return
    if reads and reads["steps_with_reads"] >= 0.8 * reads["steps"]:
        for f in findings:
            if f.evidence.get("cause") == "synchronize":
                f.evidence["host_reads_per_step"] = reads["reads_per_step"]
                f.evidence["host_read_calls"] = reads["calls"]
                f.evidence["host_reads_in_forward_per_step"] = reads["in_forward_per_step"]
                if reads_in_forward(reads) and f.evidence.get("where") == "inside_step":
                    # (Mid-forward, with layers still to launch: not the sampled token's read.)
                    f.title += (f" (the model's forward reads the device {reads['in_forward_per_step']:.1f}x per step, "
                                "its later layers not yet launched)")
                    f.fix = cause_fix("host_read_in_forward")
                else:
                    f.title += f" (the loop reads the device {reads['reads_per_step']:.1f}x per step)"
