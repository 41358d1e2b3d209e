"""Who allocated: the ops, phases and requests behind a series' allocator events.

A trace with memory profiling has an allocator event per allocation and free (a large share
of its events): everything here is array operations over them, sums taken in the events' order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from servprof.detect.memory_series import MemorySeries
from servprof.detect.nesting import open_at, start_order
from servprof.detect.steps import Step, step_index
from servprof.detect.threads import thread_groups
from servprof.trace.model import Trace, distinct, distinct_first_inverse

TOP = 5
NO_OP = "(no op)"


def attribution(trace: Trace, series: MemorySeries, steps: list[Step], enclosing: np.ndarray | None = None
                ) -> dict[str, Any]:
    """Ops, phases and requests behind the allocator events: bytes allocated (sum of +Bytes)
    and bytes kept (signed sum) by each. ``enclosing``: enclosing_ops of the series' rows, when
    the caller found them for several series at once."""
    assert series.rows is not None and series.delta is not None
    rows, delta = series.rows, series.delta
    allocating = delta > 0
    if enclosing is None:
        enclosing = enclosing_ops(trace, rows)
    names = trace.names
    top_ops = _top_labelled(enclosing[allocating], delta[allocating], lambda i: names[i] if i >= 0 else NO_OP)
    mine = [s for s in steps if s.rank == series.rank]
    where = step_index(mine, trace.rank[rows], trace.ts[rows]) if mine else np.full(rows.shape, -1)
    # Each event's phase (its step's kind, "outside_steps" at -1, the last entry), grouped through
    # the few step indices present rather than a string per event.
    kinds = [s.kind for s in mine] + ["outside_steps"]
    present = sorted({kinds[i] for i in distinct(where).tolist()})
    code_of = {kind: code for code, kind in enumerate(present)}
    which = np.array([code_of.get(kind, -1) for kind in kinds], dtype=np.int64)[where]
    by_phase = {}
    for code, name in enumerate(present):
        size = delta[which == code]
        by_phase[name] = {"allocated_bytes": _sum(np.maximum(size, 0.0)), "kept_bytes": _sum(size)}
    return {"top_ops": [{"op": op, "allocated_bytes": int(b)} for op, b in top_ops],
            "by_phase": {k: {n: int(v) for n, v in d.items()} for k, d in sorted(by_phase.items())},
            "top_requests": [{"request_id": r, "allocated_bytes": int(b)}
                             for r, b in _by_request(mine, where, delta)]}


def _sum(values: np.ndarray) -> float:
    """0.0 + each value in turn (as a running Python sum would)."""
    total = np.zeros(1)
    np.add.at(total, np.zeros(values.size, dtype=np.int64), values)
    return float(total[0])


def _top_labelled(ids: np.ndarray, sizes: np.ndarray, label: Callable[[int], str]) -> list[tuple[str, float]]:
    """The labels with the largest sums of their events' sizes (summed in order), the first seen
    first among equals; each distinct id is labelled once, and ids with one label (two interned
    strings of one text) are one key."""
    if not ids.size:
        return []
    distinct_ids, first, inverse = distinct_first_inverse(ids)
    # Ids in order of first appearance, so a label's code is in order of its first appearance.
    by_first = np.argsort(first, kind="stable")
    index: dict[str, int] = {}
    code = np.empty(distinct_ids.size, dtype=np.int64)
    for i, value in zip(by_first.tolist(), distinct_ids[by_first].tolist(), strict=True):
        code[i] = index.setdefault(label(value), len(index))
    totals = np.bincount(code[inverse], weights=sizes, minlength=len(index))
    names = list(index)
    return [(names[i], float(totals[i])) for i in np.lexsort((np.arange(totals.size), -totals))[:TOP]]


def _by_request(steps: list[Step], where: np.ndarray, delta: np.ndarray) -> list[tuple[str, float]]:
    """Each allocation in a step shared evenly among the step's requests, summed per request."""
    counts = np.array([len(s.request_ids) for s in steps] + [0], dtype=np.int64)
    taken = np.flatnonzero((where >= 0) & (delta > 0) & (counts[where] > 0))
    if taken.size == 0:
        return []
    per_event = counts[where[taken]]
    share = delta[taken] / per_event
    # One entry per (allocation, request of its step), in the allocations' order.
    first_id = np.concatenate([[0], np.cumsum(counts)])
    position = np.arange(int(per_event.sum())) - np.repeat(np.cumsum(per_event) - per_event, per_event)
    ids = [rid for s in steps for rid in s.request_ids]
    entry = np.repeat(first_id[where[taken]], per_event) + position
    return _top_labelled(entry, np.repeat(share, per_event), ids.__getitem__)


def enclosing_ops_by_series(trace: Trace, series: list[MemorySeries]) -> list[np.ndarray | None]:
    """enclosing_ops of each series' rows (None: a series without rows), in one pass: the ops of a
    thread are sorted once for all its devices' allocator events. An event's answer does not depend
    on the other events asked with it (an event holds nothing)."""
    rows = [s.rows for s in series if s.rows is not None and s.delta is not None]
    found = enclosing_ops(trace, np.concatenate(rows)) if rows else np.zeros(0, dtype=np.int64)
    out: list[np.ndarray | None] = []
    at = 0
    for s in series:
        if s.rows is None or s.delta is None:
            out.append(None)
            continue
        out.append(found[at:at + s.rows.size])
        at += s.rows.size
    return out


def enclosing_ops(trace: Trace, rows: np.ndarray) -> np.ndarray:
    """The name id of the innermost op running on the event's thread at each allocator event
    (-1 when none)."""
    found = np.full(rows.shape, -1, dtype=np.int64)
    if rows.size == 0:
        return found
    ops_mask = trace.complete() & trace.mask_category("cpu_op", "user_annotation") & (trace.stream < 0)
    threads, thread_of = thread_groups(trace.rank[rows], trace.pid[rows], trace.tid[rows])
    for number, (rank, pid, tid) in enumerate(threads.tolist()):
        on_thread = np.flatnonzero(ops_mask & (trace.rank == rank) & (trace.pid == pid) & (trace.tid == tid))
        if on_thread.size == 0:
            continue
        on_thread = on_thread[start_order(trace.ts[on_thread], trace.dur[on_thread])]
        wanted = np.flatnonzero(thread_of == number)
        op = open_at(trace.ts[on_thread], trace.ts[on_thread] + trace.dur[on_thread], trace.ts[rows[wanted]])
        found[wanted] = np.where(op >= 0, trace.name_id[on_thread[np.maximum(op, 0)]], -1)
    return found
