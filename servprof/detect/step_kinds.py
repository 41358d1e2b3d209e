"""What kind a step is when its form does not say (a forward, a profiler step, a landmark), read
from the ops it ran: the offline twin of servprof/auto/step_kind.py, which reads the same from a
live forward's arguments.

- A training step when backward ops ran in it.
- Else from its first embedding lookup's input ids (record_shapes): one token per sequence is a
  decode step. Several tokens are a prefill, unless its attention reads more keys than it has
  queries (a KV cache that already held tokens: a draft's tokens verified, as in assisted
  generation or prompt lookup, or a loop that feeds several new tokens at once), which is a
  decode step of a running sequence -- but for transformers' ``generate()`` running it as its
  prefill (a ``_prefill`` frame outside an assistant's drafting, with_stack: a prompt prefilled
  in chunks, a new turn over a conversation's cache).
- The first step of each transformers ``generate()`` call that ran several opens a request
  (``opens_request``): the gap before it is not the decode loop's (an encoder-decoder's first
  decoder step is a decode step, with the encoder's pass and the wait for the request before it).
- A decode or prefill step of any form whose sequence is one token longer than the step's before
  it on its thread (of the same model, where steps are forwards), same batch, in a run of two such
  steps at least, and whose attention reads no cache: a loop without a KV cache,
  every new token's forward run over the whole sequence (``recomputes_prefix``).
"""

from __future__ import annotations

import re
from functools import cached_property

import numpy as np

from servprof.detect.byte_models import ATTENTION
from servprof.detect.name_guard import Guarded
from servprof.detect.step_forms import EMBEDDING_ROWS, Step, host_rows
from servprof.trace.model import Trace

# Ops that only run when autograd computes gradients: a step holding them is a training step.
BACKWARD = Guarded(re.compile(r"^autograd::engine::evaluate_function|Backward\d*$|^## backward|^Optimizer\.step"),
                   "autograd::engine::evaluate_function", "Backward", "## backward", "Optimizer.step")
# torch's attention ops: query [batch, heads, queries, dim], key [batch, heads, keys, dim].
ATTENTION_ROWS = Guarded(re.compile("^(" + "|".join(map(re.escape, sorted(ATTENTION))) + ")$"), "scaled_dot_product")
# transformers' generate(): the call that runs its prefill, and an assistant model's drafting (whose
# own generate() prefills again from the tokens accepted since, inside the request's decoding).
HF_PREFILL_FRAME = Guarded(re.compile(r"transformers/generation/utils\.py\(\d+\): _prefill$"), "): _prefill")
HF_GENERATE_FRAME = Guarded(re.compile(r"transformers/generation/utils\.py\(\d+\): generate$"), "): generate")
HF_DRAFTING_FRAME = Guarded(re.compile(r"transformers/generation/candidate_generator\.py\(\d+\): get_candidates$"),
                            "): get_candidates")


def label_unknown_kinds(trace: Trace, steps: list[Step]) -> None:
    """Give the steps of unknown kind ("step") the kind their ops say, where they say one."""
    unknown = [s for s in steps if s.kind == "step"]
    if not unknown:
        return
    backward = host_rows(trace, BACKWARD)
    embedding = host_rows(trace, EMBEDDING_ROWS)
    sequences = _Sequences(trace)
    for step in unknown:
        if _first_inside(trace, backward, step, same_thread=False) is not None:
            step.kind = "train"
            continue
        ids = _input_ids(trace, embedding, step)
        if ids is not None:
            step.kind = "decode" if ids[1] == 1 or sequences.extends_sequence(step) else "prefill"
            step.batch, step.tokens = ids


def mark_prefix_recompute(trace: Trace, steps: list[Step]) -> None:
    """Decode and prefill steps, whatever their form, whose first embedding lookup (record_shapes)
    runs over a sequence one token longer than the step before on their thread (of the same
    model), same batch, two such steps in a row at least, with no KV cache read by their attention: a loop without a KV cache runs every new token's forward
    over the whole sequence. They are decode steps (``recomputes_prefix``), for all their
    prefill-like shape."""
    candidates = [s for s in steps if s.kind in ("decode", "prefill")]
    if len(candidates) < 3:
        return
    embedding = host_rows(trace, EMBEDDING_ROWS)
    if embedding.size == 0 or trace.args(int(embedding[0])).get("Input Dims") is None:
        return  # (no shapes recorded)
    sequences = _Sequences(trace)
    # Per thread, and per model where the steps are its forwards (a draft model's steps interleave
    # with the target's in assisted generation, and one's prefill is not the other's before it).
    runs: dict[tuple[int, int, str], list[tuple[Step, tuple[int, int]]]] = {}
    for step in candidates:
        # (label_unknown_kinds read them already for the steps whose kind they gave)
        ids = (step.batch, step.tokens) if step.batch is not None and step.tokens is not None \
            else _input_ids(trace, embedding, step)
        if ids is not None:
            step.tokens = ids[1]
            runs.setdefault((step.rank, step.tid, step.label if step.source == "forward" else ""), []).append((step, ids))
    for run in runs.values():
        run.sort(key=lambda pair: pair[0].start_us)
        longer = [ids[0] == before[0] and ids[1] == before[1] + 1
                  for (_, before), (_, ids) in zip(run, run[1:], strict=False)]
        # Two such steps in a row at least (one alone is a prompt one token longer than the one
        # before it: a draft model's prefill, then the target's over its first draft token).
        for i, (step, _) in enumerate(run[1:]):
            in_a_row = longer[i] and ((i > 0 and longer[i - 1]) or (i + 1 < len(longer) and longer[i + 1]))
            if in_a_row and not sequences.reads_cache(step):
                step.kind = "decode"
                step.recomputes_prefix = True


def mark_request_openers(trace: Trace, steps: list[Step]) -> None:
    """The first step of each transformers ``generate()`` call that ran several (its outermost
    call, with_stack: an assistant model's own calls run inside it) opens a request: the time
    before it on its thread is the wait for the request and its set-up (an encoder-decoder's
    encoder pass, which is no step of the decoder's), not the decode loop's, as before a prefill.
    (A call per token, ``generate(max_new_tokens=1)`` in a loop, opens nothing: its set-up is the loop's.)"""
    frames = host_rows(trace, HF_GENERATE_FRAME)
    if frames.size == 0:
        return
    by_thread: dict[tuple[int, int], list[Step]] = {}
    for step in steps:
        by_thread.setdefault((step.rank, step.tid), []).append(step)
    for (rank, tid), mine in by_thread.items():
        rows = frames[(trace.rank[frames] == rank) & (trace.tid[frames] == tid)]
        if rows.size == 0:
            continue
        start, end = trace.ts[rows], trace.ts[rows] + trace.dur[rows]
        outermost = np.ones(rows.size, dtype=bool)  # (not inside an earlier call: rows in time order)
        outermost[1:] = start[1:] >= np.maximum.accumulate(end)[:-1]
        start, end = start[outermost], end[outermost]
        mine.sort(key=lambda s: s.start_us)
        step_start = np.array([s.start_us for s in mine])
        call = np.searchsorted(start, step_start, side="right") - 1
        call[(call >= 0) & (step_start >= end[np.maximum(call, 0)])] = -1
        calls, first, count = np.unique(call, return_index=True, return_counts=True)
        for c, i, n in zip(calls.tolist(), first.tolist(), count.tolist(), strict=True):
            if c >= 0 and n >= 2:
                mine[i].opens_request = True


class _Sequences:
    """Whether a step's tokens continue a sequence, from its attention's shapes and transformers'
    frames (each kind of row found once per trace, when first asked)."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    @cached_property
    def _attention(self) -> np.ndarray:
        return host_rows(self.trace, ATTENTION_ROWS)

    @cached_property
    def _prefill_frames(self) -> np.ndarray:
        return host_rows(self.trace, HF_PREFILL_FRAME)

    @cached_property
    def _drafting_frames(self) -> np.ndarray:
        return host_rows(self.trace, HF_DRAFTING_FRAME)

    def reads_cache(self, step: Step) -> bool:
        """The step's first attention op reads more keys than it has queries: a KV cache held tokens."""
        row = _first_inside(self.trace, self._attention, step, same_thread=True)
        if row is None:
            return False
        dims = self.trace.args(row).get("Input Dims")
        if not isinstance(dims, list) or len(dims) < 2 or not all(_is_4d(d) for d in dims[:2]):
            return False
        return dims[1][2] > dims[0][2]

    def extends_sequence(self, step: Step) -> bool:
        """A step of several tokens on a sequence already cached, not a generate() call's prefill."""
        if not self.reads_cache(step):
            return False
        prefill = _encloses(self.trace, self._prefill_frames, step)
        return not prefill or _encloses(self.trace, self._drafting_frames, step)


def _is_4d(dims: object) -> bool:
    return isinstance(dims, list) and len(dims) == 4 and all(isinstance(d, int) for d in dims)


def _encloses(trace: Trace, rows: np.ndarray, step: Step) -> bool:
    """One of the (time-sorted) rows, on the step's thread, was open all through the step."""
    before = rows[:int(np.searchsorted(trace.ts[rows], step.start_us, side="right"))]
    return bool(np.any((trace.tid[before] == step.tid) & (trace.rank[before] == step.rank)
                       & (trace.ts[before] + trace.dur[before] >= step.end_us)))


def _input_ids(trace: Trace, embedding: np.ndarray, step: Step) -> tuple[int, int] | None:
    """(batch, sequence length) of the step's first embedding lookup on its thread, if shaped."""
    lookup = _first_inside(trace, embedding, step, same_thread=True)
    return None if lookup is None else _dims(trace, lookup)


def _dims(trace: Trace, lookup: int) -> tuple[int, int] | None:
    dims = trace.args(lookup).get("Input Dims")
    ids = dims[1] if isinstance(dims, list) and len(dims) > 1 else None
    if isinstance(ids, list) and len(ids) == 2 and all(isinstance(d, int) for d in ids):
        return ids[0], ids[1]
    return None


def _first_inside(trace: Trace, rows: np.ndarray, step: Step, same_thread: bool) -> int | None:
    """The first of the (time-sorted) rows that starts inside the step's host range on its rank."""
    lo = int(np.searchsorted(trace.ts[rows], step.start_us, side="left"))
    hi = int(np.searchsorted(trace.ts[rows], step.end_us, side="left"))
    for row in rows[lo:hi].tolist():
        if trace.rank[row] == step.rank and (not same_thread or trace.tid[row] == step.tid):
            return int(row)
    return None
