"""Stalls inside steps on a CPU trace: the time a step's own thread recorded no work in it (it
waited for the GIL, slept, or was off the CPU), each a gap inside the step with its cause. With
Python frames recorded, a wait for the GIL shows as the thread's Python at the same time as
another thread's (HostStacks.gil_wait): that time is not the step's work either.

Prefills are judged each against itself (a quarter of it unrecorded: a stall of the time to first
token). Decode steps, and a training loop's, are judged when 1.5x slower than their kind's median, and all of them when the median
one left as much of itself unrecorded as a host gap must be (a wait in every iteration slows no
step more than the others). Steps of unknown kind (a landmark's: an unmarked trace without
shapes) only in that second case, and not those far past the median: without step kinds, the
last forward of a ``generate()`` call runs to the next call's first, across any idle time
between requests. Those left unjudged that would be stalls are said in ``summary.missing``,
with what would let them be judged.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from servprof.detect.causes import GapExplainer
from servprof.detect.concurrency import other_steps_during
from servprof.detect.gap import CPU_MIN_GAP_US, RELATIVE_MIN_GAP, STEP_KIND_HINT, Gap
from servprof.detect.host_classes import BUSY_CLASSES, GC, TOKENIZE
from servprof.detect.intervals import covered_within
from servprof.detect.steps import Step
from servprof.trace.model import median

# A loop's steps, each like the others: judged against their kind's median.
LOOP_KINDS = ("decode", "train")
# Of unknown kind, steps past this many times the median unrecorded time are not judged.
UNKNOWN_OUTLIER = 4.0
# The step's own work: what its thread recorded, but Python's garbage collector (a collection that
# runs inside a step stalls it as a wait would; servprof's sessions mark them: auto/gc_ranges.py).
STEP_WORK = [c for c in BUSY_CLASSES if c != GC]


def _in_steps(steps: list[Step], tid: int, a: float, b: float) -> bool:
    """Whether thread ``tid`` was in model steps of its own for half of [a, b] at least (the thread
    that held the GIL was running another request's model call)."""
    mine = [s for s in steps if s.tid == tid]
    return covered_within(np.array([s.start_us for s in mine]), np.array([s.end_us for s in mine]), a, b) >= 0.5 * (b - a)


def _unrecorded_us(steps: list[Step], explainer: GapExplainer) -> np.ndarray:
    return _step_time(steps, explainer)[0]


def _step_time(steps: list[Step], explainer: GapExplainer) -> tuple[np.ndarray, np.ndarray]:
    """Per step, the time its own thread recorded no work of the step's in it (nothing, a collection,
    or its Python while another thread's ran: HostStacks.gil_wait), and the time it recorded work.
    Holes under CPU_MIN_GAP_US between two recorded events are left out where no other thread recorded
    work for half as long meanwhile: alone, the thread was running the model's Python between its ops
    (not recorded without with_stack; a fast model's ops, int8 ones, left 38% of each step so), not
    waiting; beside another thread's work (another request's steps) they may be waits for the GIL, and
    count (that thread's Python, unrecorded too, makes its recorded work less than what it held)."""
    out, recorded = np.zeros(len(steps)), np.zeros(len(steps))
    for tid in {s.tid for s in steps}:
        at = [i for i, s in enumerate(steps) if s.tid == tid]
        a, b = np.array([steps[i].start_us for i in at]), np.array([steps[i].end_us for i in at])
        stack = explainer.stacks.thread(tid)
        short = stack.short_holes(a, b, CPU_MIN_GAP_US)
        alone = explainer.busy_elsewhere(a, b, np.full(a.size, tid, dtype=np.int64)) < 0.5 * short
        # (Its Python beside another thread's is a wait for the GIL, not the step's work.)
        recorded[at] = stack.class_times(a, b)[:, STEP_WORK].sum(axis=1) - explainer.stacks.gil_wait(tid, a, b)
        out[at] = (b - a) - recorded[at] - np.where(alone, short, 0.0)
    return out, recorded


def _candidates(steps: list[Step], explainer: GapExplainer
                ) -> tuple[dict[int, float], list[tuple[Step, float]], float]:
    """The steps to judge (the module's rules), each (by id()) with the typical step of its kind it
    is judged against; the steps of unknown kind left unjudged that would be stalls if judged (with
    their unrecorded µs), and the typical one of those."""
    judged: dict[int, float] = {}
    loops = [loop for kind in LOOP_KINDS if len(loop := [s for s in steps if s.kind == kind]) >= 3]
    for loop in loops:  # each kind against its own median
        typical = median([s.dur_us for s in loop])
        every = _usual_unrecorded(loop, explainer, typical)[0] is not None  # a wait in every step: all
        judged.update((id(s), typical) for s in loop if every or s.dur_us >= 1.5 * typical)
    if loops:
        return judged, [], 0.0
    unknown = [s for s in steps if s.kind == "step"]
    if len(unknown) < 3:
        return {}, [], 0.0
    typical = median([s.dur_us for s in unknown])
    usual, unrecorded = _usual_unrecorded(unknown, explainer, typical)
    fits = [u <= UNKNOWN_OUTLIER * usual if usual is not None else False for u in unrecorded.tolist()]
    stall = max(CPU_MIN_GAP_US, RELATIVE_MIN_GAP * typical)
    unjudged = [(s, u) for s, u, j in zip(unknown, unrecorded.tolist(), fits, strict=True)
                if not j and u >= stall and s.dur_us >= 1.5 * typical]
    return {id(s): typical for s, j in zip(unknown, fits, strict=True) if j}, unjudged, typical


def unjudged_missing(unjudged: list[tuple[Step, float]], typical_us: float) -> dict[str, str]:
    """summary["missing"] entry for steps of unknown kind that recorded nothing for long and were
    not judged (the module's rules): a "nothing found" must say what it could not tell."""
    total, longest = sum(u for _, u in unjudged), max(u for _, u in unjudged)
    return {"what": "step kinds", "message": (
        f"{len(unjudged)} step(s) of unknown kind recorded nothing on their thread for {total / 1000:.1f} ms in all "
        f"(up to {longest / 1000:.1f} ms in one; the median step takes {typical_us / 1000:.2f} ms), and were not "
        "judged: without step kinds servprof cannot tell a stall inside the model loop from the wait between "
        f"two requests or generate() calls (the last forward of one runs to the next one's first). {STEP_KIND_HINT}")}


def _usual_unrecorded(steps: list[Step], explainer: GapExplainer, typical: float) -> tuple[float | None, np.ndarray]:
    """(the median step's unrecorded time when it is as long as a host gap must be, else None; each
    step's). None too where the steps record no work at all (step ranges alone: nothing to judge)."""
    unrecorded = _unrecorded_us(steps, explainer)
    recorded = np.array([s.dur_us for s in steps]) - unrecorded
    usual = float(np.median(unrecorded))
    if float(np.median(recorded)) <= 0.0 or usual < max(CPU_MIN_GAP_US, RELATIVE_MIN_GAP * typical):
        return None, unrecorded
    return usual, unrecorded


def stalled_steps(steps: list[Step], index: dict[int, int], explainer: GapExplainer,
                  stats: dict[str, Any] | None = None) -> list[Gap]:
    """Steps whose own thread recorded no work for much of the step (it waited for the GIL, slept,
    or was off the CPU): the unrecorded time is a gap inside the step. ``stats``: find_gaps' summary,
    where the steps left unjudged are said (``missing``)."""
    typical_of, unjudged, typical_unknown = _candidates(steps, explainer)
    if unjudged and stats is not None:
        stats.setdefault("missing", []).append(unjudged_missing(unjudged, typical_unknown))
    # A stall is a quarter of the typical step (1 ms at least); a prefill's, of itself: prompts differ
    # in length, and a prefill's thread records ops nearly all through it.
    # (Not a prefill in which its thread recorded no work at all: step ranges alone, nothing to judge.)
    bar = {key: max(CPU_MIN_GAP_US, RELATIVE_MIN_GAP * typical) for key, typical in typical_of.items()}
    bar.update({id(s): max(CPU_MIN_GAP_US, RELATIVE_MIN_GAP * s.dur_us) for s in steps if s.kind == "prefill"})
    judged = [s for s in steps if id(s) in bar]
    out: list[Gap] = []
    for tid in {s.tid for s in judged}:
        mine = [s for s in judged if s.tid == tid]
        a, b = np.array([s.start_us for s in mine]), np.array([s.end_us for s in mine])
        stalled, recorded = _step_time(mine, explainer)
        worked = (recorded > 0) | np.array([s.kind != "prefill" for s in mine])
        keep = (stalled >= np.array([bar[id(s)] for s in mine])) & worked
        if not keep.any():
            continue
        a, b, stalled = a[keep], b[keep], stalled[keep]
        mine = [s for s, k in zip(mine, keep.tolist(), strict=True) if k]
        ones = np.ones(a.size, dtype=bool)
        explained = explainer.explain(a, b, np.full(a.size, tid, dtype=np.int64), ones, ~ones, ~ones,
                                      look_elsewhere=True,
                                      concurrent=other_steps_during(steps, a, b, np.full(a.size, tid, dtype=np.int64)))
        for i, step in enumerate(mine):
            # Its own recorded work is not what made it slow: the time it recorded nothing is, and
            # the thread that ran meanwhile (holding the GIL), if one did.
            other = explained.other_us[i]
            busy_other = float(other[list(BUSY_CLASSES)].sum())
            if explained.class_us[i][GC] >= 0.5 * stalled[i]:  # the collector ran on the step's own thread
                cause = "python_gc"
                explained.other_tid[i] = -1
            elif explained.other_tid[i] >= 0 and busy_other >= 0.5 * stalled[i]:
                cause = "tokenization" if other[TOKENIZE] >= 0.5 * busy_other else \
                    "python_gc" if other[GC] >= 0.5 * busy_other else \
                    "concurrent_steps" if _in_steps(steps, int(explained.other_tid[i]), a[i], b[i]) else \
                    "gil_contention"
            else:
                cause = "untraced_host_time"
                explained.other_tid[i] = -1
            explained.cause[i] = cause
            out.append(Gap(step.rank, float(a[i]), float(b[i]), float(stalled[i]), "inside_step", cause,
                           explainer.described_later(explained, i, float(a[i]), float(b[i]), inside_step=True),
                           list(step.request_ids), step=index[id(step)]))
    return out
