"""Model steps (decode / prefill / mixed / training) found in a trace, whoever wrote it.

Per rank, the first form present wins (readers in step_forms.py): servprof's phase
markers (explicit, then automatic), SGLang's step annotations, vLLM's step
annotations, vLLM's ``execute_model`` frames, then ``ProfilerStep#N`` or the user's own
``record_function`` ranges around each step (step_annotations.py; those naming a decode or
prefill even inside a ProfilerStep each), else the outermost model forward (those when each
ProfilerStep holds several, as around a whole ``generate``, unless it is a training step); in
a trace that marks none, the loop's own landmarks (step_landmarks.py): each DataLoader fetch,
else each forward's first embedding lookup. Each step also gets the span of the device work it launched: under
asynchronous scheduling the host range ends long before its kernels do, so step time,
utilisation and gaps are read on the device timeline when there is one.

Nothing after servprof's own ``stop()`` (session metadata ``stop_wall_ns``) is the
app's: steps that start after it are dropped, steps that straddle it are cut there.
"""

from __future__ import annotations

import numpy as np

from servprof.detect.intervals import starts_within
from servprof.detect.overhead import stop_cutoffs
from servprof.detect.step_annotations import annotation_rows, annotation_steps, label_kinds_from_phases
from servprof.detect.step_compiled import compiled_steps
from servprof.detect.step_forms import (
    SOURCE_LABELS,
    Step,
    forward_steps,
    is_step_annotation,
    profiler_steps,
    servprof_steps,
    sglang_steps,
    vllm_frame_steps,
    vllm_steps,
)
from servprof.detect.step_kinds import label_unknown_kinds, mark_prefix_recompute, mark_request_openers
from servprof.detect.step_landmarks import embedding_steps, end_before_prefills, loader_steps, optimizer_steps
from servprof.trace.model import Trace

__all__ = ["SOURCE_LABELS", "Step", "StepList", "device_segments", "find_steps", "is_step_annotation", "step_index"]

NO_STEPS_MESSAGE = (
    "No model step was found in this trace, so there is no per-step utilisation and no decode gap: mark each "
    "step with `servprof.phase(\"decode_step\")` (servprof's automatic forward hooks do this while a session runs), "
    "or record with `with_stack=True` (vLLM's execute_model frames, the model's forward) or a profiler "
    "`schedule` with `prof.step()` (ProfilerStep#N)."
)


class StepList(list[Step]):
    """find_steps' result: the steps, plus what the search left out."""

    dropped_after_stop: int = 0  # steps that began after servprof's own stop()
    ranks_without_steps: list[int]

    def missing(self) -> list[dict[str, str]]:
        """summary["missing"] entries (docs/CONTRACTS.md) for what the step search could not show."""
        if not self:
            return [{"what": "model steps", "message": NO_STEPS_MESSAGE}]
        return []


def find_steps(trace: Trace) -> StepList:
    """All model steps, per rank from the best form present, in start order, with their device spans."""
    found = StepList()
    found.ranks_without_steps = []
    readers = (servprof_steps, sglang_steps, vllm_steps, vllm_frame_steps, profiler_steps, forward_steps,
               loader_steps, embedding_steps, compiled_steps, optimizer_steps)
    read: dict[int, list[Step]] = {}

    def of_rank(i: int, rank: int) -> list[Step]:
        if i not in read:  # each form is read once, and only when a rank needs it
            read[i] = readers[i](trace)
        return [s for s in read[i] if s.rank == rank]

    annotated: list[np.ndarray] = []  # the user's record_function ranges, read once if a rank needs them

    def annotations() -> np.ndarray:
        if not annotated:
            annotated.append(annotation_rows(trace))
        return annotated[0]

    for rank in trace.ranks:
        chosen = next((mine for i in range(4) if (mine := of_rank(i, rank))), [])
        if not chosen:  # a step marked around the loop's body, else one its landmarks open
            outer = of_rank(4, rank) or of_rank(6, rank) or of_rank(9, rank)
            forwards = of_rank(5, rank) or of_rank(7, rank) or of_rank(8, rank)
            # The user's own record_function ranges around each step, else the forwards.
            marked = annotation_steps(trace, annotations(), rank, forwards) if annotations().size else []
            # The user's ranges that name a decode or prefill beat a profiler step around each (which
            # holds the loop's host work too: the gaps between the user's steps).
            named = any(s.kind in ("decode", "prefill") for s in marked)
            chosen = marked if named else _outer_or_forward(trace, outer, marked or forwards)
        if not chosen:
            found.ranks_without_steps.append(rank)
        found.extend(chosen)
    if any(s.kind == "step" for s in found):
        label_kinds_from_phases(trace, annotations(), found)
    label_unknown_kinds(trace, found)
    mark_prefix_recompute(trace, found)
    mark_request_openers(trace, found)
    end_before_prefills(trace, found)
    found.dropped_after_stop = _cut_at_stop(trace, found)
    found.sort(key=lambda s: (s.rank, s.start_us))
    _attach_device_spans(trace, found)
    return found


def _outer_or_forward(trace: Trace, outer: list[Step], forwards: list[Step]) -> list[Step]:
    """The steps around the loop's body (ProfilerStep#N, else each DataLoader fetch's iteration)
    unless each holds several model forwards (a whole generate() in one profiler step): then every
    forward is a step. A training step holding several forwards (gradient accumulation) stays one."""
    if not forwards:
        return outer
    if not outer:
        return forwards
    starts = np.sort(np.array([f.start_us for f in forwards]))
    inside = starts_within(starts, np.array([p.start_us for p in outer]), np.array([p.end_us for p in outer]))
    if np.mean(inside) <= 1.5:
        return outer
    label_unknown_kinds(trace, outer)
    return outer if any(s.kind == "train" for s in outer) else forwards


def _cut_at_stop(trace: Trace, steps: StepList) -> int:
    cutoffs = stop_cutoffs(trace)
    if not cutoffs:
        return 0
    kept, dropped = [], 0
    for step in steps:
        cutoff = cutoffs.get(step.rank)
        if cutoff is not None and step.start_us >= cutoff:
            dropped += 1
            continue
        if cutoff is not None and step.end_us > cutoff:
            step.cut_at_stop_us = step.end_us - cutoff
            step.end_us = cutoff
        kept.append(step)
    steps[:] = kept
    return dropped


def _attach_device_spans(trace: Trace, steps: list[Step]) -> None:
    """Per step: first start and last end of the device work launched from inside its host range
    (device work after servprof's stop is left out)."""
    if not steps:
        return
    dev = np.flatnonzero(trace.device_mask())
    launch = trace.launch_row_for(dev)
    linked = launch >= 0
    dev, launch = dev[linked], launch[linked]
    owner = step_index(steps, trace.rank[dev], trace.ts[launch], trace.tid[launch])
    inside = owner >= 0
    owner, dev = owner[inside], dev[inside]
    start, end = trace.ts[dev], trace.ts[dev] + trace.dur[dev]
    cutoffs = stop_cutoffs(trace)
    if cutoffs:
        ranks, which = np.unique(trace.rank[dev], return_inverse=True)
        limit = np.array([cutoffs.get(int(r), np.inf) for r in ranks.tolist()], dtype=float)[which]
        keep = start < limit
        owner, start, end = owner[keep], start[keep], np.minimum(end[keep], limit[keep])
    first = np.full(len(steps), np.inf)
    last = np.full(len(steps), -np.inf)
    np.minimum.at(first, owner, start)
    np.maximum.at(last, owner, end)
    for step, a, b in zip(steps, first.tolist(), last.tolist(), strict=True):
        if np.isfinite(a):
            step.device_start_us, step.device_end_us = a, b


def device_segments(steps: list[Step]) -> list[tuple[float, float] | None]:
    """Per step (in the given order, one rank): its device span made disjoint from the previous
    step's, so that no stretch of the timeline belongs to two steps. Device spans taken from
    launches overlap when work of consecutive steps interleaves (several streams, or a
    step's tail still running when the next one's first kernel starts); each step then starts
    where the previous one ended. None for steps that launched no device work."""
    out: list[tuple[float, float] | None] = []
    previous_end = -np.inf
    for step in steps:
        if step.device_start_us is None or step.device_end_us is None:
            out.append(None)
            continue
        start = max(step.device_start_us, previous_end)
        end = max(step.device_end_us, start)
        out.append((start, end))
        previous_end = end
    return out


def step_index(steps: list[Step], ranks: np.ndarray, times: np.ndarray, tids: np.ndarray | None = None) -> np.ndarray:
    """For each (rank, time): the index in ``steps`` of the step whose host range contains it, -1 if none.

    One binary search per rank instead of a scan per step; where steps of one rank
    overlap, the latest-starting one that contains the time is taken. With ``tids``, an event
    on a thread that has steps belongs to that thread's steps only (requests served on several
    threads at once, as a thread pool does); events on other threads (the autograd thread of a
    training step) to any step of their rank.
    """
    out = np.full(times.shape, -1, dtype=np.int64)
    stepped = {(s.rank, s.tid) for s in steps} if tids is not None else set()
    for rank in {s.rank for s in steps}:
        own = sorted(t for r, t in stepped if r == rank)
        on_rank = ranks == rank
        if len(own) < 2:  # (one thread with steps: the rank's steps are its)
            _search(steps, [i for i, s in enumerate(steps) if s.rank == rank], np.flatnonzero(on_rank), times, out)
            continue
        elsewhere = on_rank.copy()
        for tid in own:
            here = on_rank & (tids == tid)
            elsewhere &= ~here
            _search(steps, [i for i, s in enumerate(steps) if s.rank == rank and s.tid == tid], np.flatnonzero(here),
                    times, out)
        _search(steps, [i for i, s in enumerate(steps) if s.rank == rank], np.flatnonzero(elsewhere), times, out)
    return out


def _search(steps: list[Step], candidates: list[int], mine: np.ndarray, times: np.ndarray, out: np.ndarray) -> None:
    """out[mine] = the latest-starting of the candidate steps whose host range contains times[mine]."""
    if not candidates or mine.size == 0:
        return
    indices = np.array(candidates, dtype=np.int64)
    starts = np.array([steps[i].start_us for i in indices])
    order = np.argsort(starts, kind="stable")
    indices, starts = indices[order], starts[order]
    ends = np.array([steps[i].end_us for i in indices])
    pos = np.searchsorted(starts, times[mine], side="right") - 1
    ok = pos >= 0
    pos_ok = np.maximum(pos, 0)
    ok &= times[mine] <= ends[pos_ok]
    out[mine[ok]] = indices[pos_ok[ok]]


def time_judged_us(trace: Trace, steps: list[Step], on_device: bool) -> float:
    """What a cost is a share of: the steps' time, or without steps the trace's span per rank (its
    device timeline where it has one, ``on_device``)."""
    if steps:
        return float(sum(s.time_us for s in steps))  # the device span under async scheduling
    rows = trace.device_mask() if on_device else trace.complete()
    total = 0.0
    for rank in trace.ranks:
        mine = np.flatnonzero(rows & (trace.rank == rank))
        if mine.size:
            total += float((trace.ts[mine] + trace.dur[mine]).max() - trace.ts[mine].min())
    return total
