"""Model steps in a trace that marks none, read from what every iteration of the loop does first.

The most common way to profile a model is ``with torch.profiler.profile(): model.generate(...)``
(or a training loop): no schedule, so no ``ProfilerStep#N``, no ``with_stack``, no annotation.
Such a trace still holds one landmark per iteration:

- a language model's forward starts by looking its input ids up, ``aten::embedding`` (models
  with learned positions or token types look two or three tables up back to back: those
  lookups are one forward);
- a training loop's iteration starts by fetching its batch, ``enumerate(DataLoader)#...``;
- a training loop that fetches none (tensors already in memory, a synthetic batch) still steps
  its optimizer once an iteration, ``Optimizer.step#SGD.step`` (torch records it for every
  optimizer): an iteration runs from one optimizer step to the next, and the last one opens
  none (what follows it is no whole iteration).

Each step runs on its thread from one landmark to the next. The last one, which no landmark
closes, ends with the thread's last host op after it, at most ``LAST_STEP_MEDIANS`` median
steps long (a thread can go on to other work); so does one followed by a prefill, once the
kinds are known (``end_before_prefills``: the wait for the next request lies between), and a
decode step followed by one of another kind (Whisper's encoder looks its positions up: a step of
no kind, which then opens a request). Both
also stop at the longest pause where a whole step's events end: on a loaded machine earlier
steps can run as long as the wait, but they hold no more events.
"""

from __future__ import annotations

import re

import numpy as np

from servprof.detect.data_loading import loader_rows
from servprof.detect.name_guard import Guarded
from servprof.detect.step_forms import EMBEDDING_ROWS, Step, host_rows, outermost, step_from_row
from servprof.trace.model import Trace, median

# A lookup this close after the previous one (host events between their starts, nested ones
# included) belongs to the same forward: under a quarter of a typical iteration, or under a floor
# no forward of even one layer comes near (GPT-2 looks positions up right after tokens).
SAME_ITERATION_SHARE = 0.25
SAME_ITERATION_EVENTS = 64
LAST_STEP_MEDIANS = 2.0
END_EVENTS_SHARE = 0.9
LONG_PAUSE_SHARE = 0.5
LANDMARK_SOURCES = ("embedding", "data_loader", "optimizer")
OPTIMIZER_STEP = Guarded(re.compile(r"^Optimizer\.step#"), "Optimizer.step#")


def embedding_steps(trace: Trace) -> list[Step]:
    """One step per forward of a language model: from its first token-embedding lookup to the next forward's."""
    return _landmark_steps(trace, host_rows(trace, EMBEDDING_ROWS), "embedding")


def loader_steps(trace: Trace) -> list[Step]:
    """One step per training-loop iteration: from its DataLoader fetch to the next one."""
    rows = loader_rows(trace)  # (the ranges data_loading.py names as a cause)
    return _landmark_steps(trace, outermost(trace, rows[np.argsort(trace.ts[rows], kind="stable")]), "data_loader")


def optimizer_steps(trace: Trace) -> list[Step]:
    """One step per training-loop iteration that fetches no batch the trace shows: from one
    optimizer step to the next (find_steps reads these only where no DataLoader fetch opens
    the iterations). An optimizer step closes an iteration, so a thread's last one opens none:
    what follows it is no whole iteration (nor is what precedes its first)."""
    steps = _landmark_steps(trace, outermost(trace, host_rows(trace, OPTIMIZER_STEP)), "optimizer")  # (in time order)
    last = {(s.rank, s.tid): i for i, s in enumerate(steps)}  # (sorted by rank and start: a thread's last)
    return [s for i, s in enumerate(steps) if last[(s.rank, s.tid)] != i]


def _landmark_steps(trace: Trace, rows: np.ndarray, source: str) -> list[Step]:
    steps: list[Step] = []
    if rows.size == 0:
        return steps
    host = trace.complete() & (trace.stream < 0)
    threads = sorted(set(zip(trace.rank[rows].tolist(), trace.tid[rows].tolist(), strict=True)))
    for rank, tid in threads:
        mine = rows[(trace.rank[rows] == rank) & (trace.tid[rows] == tid)]
        thread = np.flatnonzero(host & (trace.rank == rank) & (trace.tid == tid))
        order = np.argsort(trace.ts[thread], kind="stable")
        thread_ts, thread_end = trace.ts[thread][order], trace.end[thread][order]
        opens = mine[_iteration_starts(thread_ts, trace.ts[mine])]
        starts = trace.ts[opens].astype(float).tolist()
        ends = starts[1:] + [_last_end(thread_ts, thread_end, starts[-1], np.diff(starts))]
        for row, start, end in zip(opens.tolist(), starts, ends, strict=True):
            step = step_from_row(trace, row, "step", source, trace.name(row))
            step.start_us, step.end_us = start, end
            steps.append(step)
    steps.sort(key=lambda s: (s.rank, s.start_us))
    return steps


def end_before_prefills(trace: Trace, steps: list[Step]) -> None:
    """A landmark step followed on its thread by a prefill, or a decode step by a step of another
    kind (kinds read from the shapes after the steps were found), ends with its last host op
    before the next step, at most LAST_STEP_MEDIANS median steps of its kind long: what lies
    between is the wait for the next request, then its set-up (no part of the step before it, nor
    a stall inside it). It, and the thread's last step, also stop at a long pause where a whole
    step's events end (_end_window): on a loaded machine earlier steps run as long as the wait,
    but they hold no more events."""
    by_thread: dict[tuple[int, int], list[Step]] = {}
    for step in steps:
        if step.source in LANDMARK_SOURCES:
            by_thread.setdefault((step.rank, step.tid), []).append(step)
    host: np.ndarray | None = None
    for (rank, tid), mine in by_thread.items():
        mine.sort(key=lambda s: s.start_us)
        before = [i for i in range(len(mine) - 1) if _opens_other_work(mine[i], mine[i + 1])]
        for i in before:
            # A step of no kind between two runs of decode steps (an encoder's pass) opens a request.
            if mine[i + 1].kind == "step" and i + 2 < len(mine) and mine[i + 2].kind == "decode":
                mine[i + 1].opens_request = True
        if not before and len(mine) < 2:
            continue
        if host is None:
            host = trace.complete() & (trace.stream < 0)
        thread = np.flatnonzero(host & (trace.rank == rank) & (trace.tid == tid))
        order = np.argsort(trace.ts[thread], kind="stable")
        thread_ts, thread_end = trace.ts[thread][order], trace.end[thread][order]
        first = np.searchsorted(thread_ts, [s.start_us for s in mine], side="left")
        whole = {i: int(first[i + 1] - first[i]) for i in range(len(mine) - 1) if i not in before}
        for i in before:
            upto = int(first[i + 1])
            # (Against the steps of its kind before it as they now are: one that held an earlier wait no
            # longer does; an encoder's pass is no measure of a decode step.)
            end = _last_end(thread_ts[:upto], np.minimum(thread_end[:upto], mine[i + 1].start_us), mine[i].start_us,
                            np.array([s.dur_us for s in mine[:i] if s.kind == mine[i].kind]))
            mine[i].end_us = max(mine[i].start_us, min(mine[i].end_us, end))
        # (An optimizer step's last iteration is closed by the landmark it drops: a whole one.)
        for i in before if mine[-1].source == "optimizer" else [*before, len(mine) - 1]:
            window = _end_window(mine, whole, i)
            if window is None:
                continue
            begin, upto = int(first[i]), int(first[i + 1]) if i + 1 < len(mine) else thread_ts.size
            end = _end_before_long_pause(thread_ts[begin:upto], thread_end[begin:upto], *window)
            if end is not None:
                mine[i].end_us = max(mine[i].start_us, min(mine[i].end_us, end))


def _opens_other_work(step: Step, after: Step) -> bool:
    """The step after ``step`` is a prefill, or ends a run of decode steps with work of another
    kind (an encoder-decoder's encoder pass: Whisper's looks its positions up, a step of no kind):
    what lies between is no part of the step."""
    return after.kind == "prefill" or (step.kind == "decode" and after.kind != "decode")


def _end_window(mine: list[Step], whole: dict[int, int], i: int) -> tuple[int, int, float] | None:
    """Where in its events a step of step i's kind ends on its thread, from END_EVENTS_SHARE of the
    median a whole step (one a landmark closes, no prefill after it) holds to the most one holds,
    and the shortest pause there that ends it (LONG_PAUSE_SHARE of a median whole step: not the
    loop's next op); None where the thread has no whole step of that kind."""
    kind = [j for j in whole if mine[j].kind == mine[i].kind]
    if not kind:
        return None
    counts = [whole[j] for j in kind]
    return (int(END_EVENTS_SHARE * float(np.median(counts))), max(counts),
            LONG_PAUSE_SHARE * median([mine[j].dur_us for j in kind]))


def _end_before_long_pause(ts: np.ndarray, end: np.ndarray, low: int, high: int, long_pause: float) -> float | None:
    """The end of a step's own events (ts, end: its thread's host events from its landmark on),
    which stop at the longest pause after one of its events low..high, where a whole step's end
    lies, if at least long_pause (the end of the events, where they stop before high, is the
    longest: nothing follows); a step ending a request ends there (what follows is the wait for
    the next one and its set-up). None where the step holds fewer events than low, or no pause
    there is long."""
    high = min(high, ts.size)
    if high < max(low, 1):
        return None
    busy_until = np.maximum.accumulate(end[:high])
    pauses = np.append(ts[1:high] - busy_until[:-1], np.inf if high == ts.size else ts[high] - busy_until[-1])
    k = max(low, 1) - 1 + int(np.argmax(pauses[max(low, 1) - 1:]))
    return float(busy_until[k]) if pauses[k] >= long_pause else None


def _iteration_starts(thread_ts: np.ndarray, landmark_ts: np.ndarray) -> np.ndarray:
    """Which landmarks (time-sorted) open an iteration: the first, and each with enough of the
    thread's host work since the previous one."""
    between = np.diff(np.searchsorted(thread_ts, landmark_ts, side="left"))
    if between.size == 0:
        return np.ones(landmark_ts.shape, dtype=bool)
    typical = float(np.sort(between)[(3 * (between.size - 1)) // 4])  # upper quartile: whole iterations
    threshold = max(SAME_ITERATION_SHARE * typical, SAME_ITERATION_EVENTS)
    return np.concatenate(([True], between >= threshold))


def _last_end(thread_ts: np.ndarray, thread_end: np.ndarray, start: float, lengths: np.ndarray) -> float:
    """The end of a step no landmark closes (the last, or one before a new request's prefill): the
    latest end of the thread's host events from its ``start`` on, cut at LAST_STEP_MEDIANS median
    steps, or the longest earlier step if longer, when earlier steps (their ``lengths``) give a
    median (what follows the loop is no step; a last step as slow as an earlier one still is)."""
    after = thread_end[np.searchsorted(thread_ts, start, side="left"):]
    end = float(after.max()) if after.size else start
    if lengths.size >= 2:
        end = min(end, start + max(LAST_STEP_MEDIANS * median(lengths), float(lengths.max())))
    return end
