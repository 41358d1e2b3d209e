"""Model steps a user marked with ``torch.profiler.record_function``, whatever the names.

A hand-written serving loop is often annotated the way the PyTorch docs show::

    with record_function("prefill"):
        logits = model(ids)
    for i in range(max_new_tokens):
        with record_function("decode_step"):
            ...

The names are the user's own ("decode", "generate_token_3", "step", "llm_call"): a name that
says it may be a step (``STEP_WORDS``) is read as one by what its ranges hold. On a thread whose
model forwards the trace shows (module frames, each forward's first embedding lookup, a compiled
region), a name's ranges are steps when they hold about one forward each (a range holding many
is a phase or a whole ``generate()``; one holding none is host work such as sampling or a
tokenizer's ``decode``), and the ranges taken hold nearly all the thread's forwards (a user who
marked the prefill alone did not mark the steps). Where the trace shows no forward, ranges
that hold recorded ops are taken.

The name also says the step's kind where it can (``prefill``/``prompt``, ``decode``/``token``,
``train``),
and it labels the forwards of a thread whose annotations are phases, not steps: a forward
inside a ``decode`` range is a decode step.
"""

from __future__ import annotations

import re

import numpy as np

from servprof.detect.intervals import inside_any, starts_within
from servprof.detect.step_forms import Step, is_step_annotation, outermost, step_from_row
from servprof.trace.model import Trace, distinct

ANNOTATION_CATEGORY = "user_annotation"
# A name's ranges holding more forwards than this on average are a phase or a whole generate().
MAX_FORWARDS_PER_STEP = 1.5
# The share of a thread's forwards the ranges taken must hold to be its steps.
MIN_FORWARDS_HELD = 0.9
# Words a step's name holds (a framework's own ranges, such as vLLM's "capture_1_PIECEWISE" around a
# CUDA graph capture, hold a forward but are no step).
STEP_WORDS = re.compile(r"step|iter|token|generat|infer|predict|forward|fwd|model|llm|call|run|batch|decod|prefill"
                        r"|prompt|train", re.I)
KIND_WORDS = (("prefill", re.compile(r"prefill|prompt", re.I)), ("decode", re.compile(r"decod|token", re.I)),
              ("train", re.compile(r"train", re.I)))
_NUMBERS = re.compile(r"\d+")
# torch's and servprof's own ranges: never the user's steps.
_NOT_USERS = ("servprof:", "Optimizer.", "enumerate(DataLoader)", "nccl:", "## Call CompiledFxGraph",
              "Torch-Compiled Region", "CompiledFunction")


def annotation_rows(trace: Trace) -> np.ndarray:
    """The user's record_function ranges on the host, in time order (none of the step forms
    step_forms.py reads, none of torch's or servprof's own)."""
    # (the category first: a with_stack trace has 100,000s of frame names, and few annotations)
    rows = np.flatnonzero(trace.mask_category(ANNOTATION_CATEGORY) & trace.complete() & (trace.stream < 0)
                          & (trace.dur > 0))
    if rows.size == 0:
        return rows
    ids = trace.ids_matching(lambda s: not s.startswith(_NOT_USERS) and not is_step_annotation(s),
                             distinct(trace.name_id[rows]))
    rows = rows[trace.has_id(trace.name_id[rows], ids)]
    return rows[np.argsort(trace.ts[rows], kind="stable")]


def annotation_steps(trace: Trace, rows: np.ndarray, rank: int, forwards: list[Step]) -> list[Step]:
    """The rank's annotated steps (the module's rules), per thread. ``rows``: annotation_rows();
    ``forwards``: the rank's model forwards that the trace shows (forward frames, embedding
    lookups or compiled regions)."""
    rows = rows[trace.rank[rows] == rank]
    steps: list[Step] = []
    for tid in sorted(set(trace.tid[rows].tolist())):
        mine = rows[trace.tid[rows] == tid]
        forward_starts = np.sort(np.array([f.start_us for f in forwards if f.tid == tid], dtype=float))
        taken = _taken(trace, mine, forward_starts, rank, tid)
        if taken.size == 0:
            continue
        held = inside_any(forward_starts, trace.ts[taken], trace.ts[taken] + trace.dur[taken])  # (outermost: disjoint)
        if forward_starts.size and held.sum() < MIN_FORWARDS_HELD * forward_starts.size:
            continue
        steps.extend(step_from_row(trace, row, kind_of(trace.name(row)), "annotation", trace.name(row))
                     for row in taken.tolist())
    steps.sort(key=lambda s: (s.rank, s.start_us))
    return steps


def kind_of(name: str) -> str:
    """The step kind a name says, "step" when it says none."""
    return next((kind for kind, words in KIND_WORDS if words.search(name)), "step")


def label_kinds_from_phases(trace: Trace, rows: np.ndarray, steps: list[Step]) -> None:
    """Steps of unknown kind inside a user's range (``rows``: annotation_rows()) whose name says a
    kind (a "decode" range around a request's decode loop): the innermost such range's kind."""
    unknown = [s for s in steps if s.kind == "step"]
    if not unknown or rows.size == 0:
        return
    said = {int(i): kind_of(trace.names[i]) for i in distinct(trace.name_id[rows]).tolist()}
    phases = rows[np.fromiter((said[i] != "step" for i in trace.name_id[rows].tolist()), dtype=bool, count=rows.size)]
    for (rank, tid), mine in _by_thread(unknown).items():
        on_thread = phases[(trace.rank[phases] == rank) & (trace.tid[phases] == tid)]
        if on_thread.size == 0:
            continue
        start = trace.ts[on_thread]  # (time order: rows are)
        end = start + trace.dur[on_thread]
        open_until = np.maximum.accumulate(end)  # no range before this one is open later than this
        for step in mine:
            pos = int(np.searchsorted(start, step.start_us, side="right")) - 1
            while pos >= 0 and open_until[pos] > step.start_us and end[pos] <= step.start_us:
                pos -= 1  # (a range that closed before the step: an enclosing one started earlier)
            if pos >= 0 and end[pos] > step.start_us:
                step.kind = said[int(trace.name_id[on_thread[pos]])]


def _by_thread(steps: list[Step]) -> dict[tuple[int, int], list[Step]]:
    out: dict[tuple[int, int], list[Step]] = {}
    for step in steps:
        out.setdefault((step.rank, step.tid), []).append(step)
    return out


def _taken(trace: Trace, rows: np.ndarray, forward_starts: np.ndarray, rank: int, tid: int) -> np.ndarray:
    """One thread's ranges that are steps, outermost first: those of each name (numbers aside) whose
    ranges hold about one forward each, or, without forwards, a step's name and recorded ops."""
    name_ids = trace.name_id[rows]
    order = np.argsort(name_ids, kind="stable")
    bounds = np.flatnonzero(np.diff(name_ids[order])) + 1
    groups: dict[str, list[int]] = {}
    for same in np.split(rows[order], bounds):  # (one per distinct name, then numbers aside)
        groups.setdefault(_NUMBERS.sub("#", trace.name(int(same[0]))), []).extend(same.tolist())
    taken: list[int] = []
    ops: np.ndarray | None = None
    for name, members in groups.items():
        group = np.array(members, dtype=np.int64)
        if not STEP_WORDS.search(name):
            continue
        if forward_starts.size:
            held = _held_each(trace, group, forward_starts)
            if np.mean(held >= 1) < 0.5 or np.mean(held) > MAX_FORWARDS_PER_STEP:
                continue
        else:
            ops = _op_starts(trace, rank, tid) if ops is None else ops
            if np.mean(_held_each(trace, group, ops) >= 1) < 0.5:
                continue
        taken.extend(members)
    if not taken:
        return np.zeros(0, dtype=np.int64)
    taken_rows = np.array(sorted(taken, key=lambda r: float(trace.ts[r])), dtype=np.int64)
    return outermost(trace, taken_rows)


def _held_each(trace: Trace, rows: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """How many of the (sorted) start times fall inside each range."""
    return starts_within(starts, trace.ts[rows], trace.ts[rows] + trace.dur[rows])


def _op_starts(trace: Trace, rank: int, tid: int) -> np.ndarray:
    """The sorted start times of the thread's recorded ops (cpu_op)."""
    rows = np.flatnonzero(trace.mask_category("cpu_op") & (trace.stream < 0) & (trace.rank == rank) & (trace.tid == tid))
    return np.sort(trace.ts[rows])
