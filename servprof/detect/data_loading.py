"""Time a thread spent waiting for its next batch of input: inside ``enumerate(DataLoader)#...``,
the range torch.profiler records around every ``DataLoader.__next__`` (its single-process
iterator loads the batch right there; the multi-process one waits for a worker's). A device gap
the launching thread spent there is data loading, whatever the range holds (ops, Python frames,
a queue wait): the profiler's own mark says so."""

from __future__ import annotations

from typing import Any

import numpy as np

from servprof.detect.intervals import covered, merge
from servprof.detect.name_scan import ids_holding
from servprof.trace.model import distinct

DATALOADER_RANGE = "enumerate(DataLoader)#"


def loader_rows(trace: Any, rank: int | None = None) -> np.ndarray:
    """The rank's (None: every rank's) DataLoader ranges (rows), found once by the caller for all
    its questions."""
    ids = ids_holding(trace, (DATALOADER_RANGE,), lambda s: s.startswith(DATALOADER_RANGE))
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    mask = trace.has_id(trace.name_id, ids) & trace.complete() & (trace.stream < 0)
    return np.flatnonzero(mask if rank is None else mask & (trace.rank == rank))


def loading_us(trace: Any, rows: np.ndarray, a: np.ndarray, b: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """Per window [a, b] on thread ``tid``: how much of it that thread spent inside a DataLoader's
    ``__next__`` (the union of ``rows``, loader_rows' answer)."""
    out = np.zeros(np.shape(a))
    if rows.size == 0 or out.size == 0:
        return out
    for t in sorted(set(distinct(tid).tolist()) & set(distinct(trace.tid[rows]).tolist())):
        mine = rows[trace.tid[rows] == t]
        start, end = merge(trace.ts[mine], trace.ts[mine] + trace.dur[mine])
        sel = tid == t
        out[sel] = covered(start, end, a[sel], b[sel])
    return out


def loading_range(trace: Any, rows: np.ndarray, tid: int, a: float, b: float) -> str:
    """The name of the DataLoader range (of ``rows``) on thread ``tid`` that covers most of [a, b]."""
    rows = rows[trace.tid[rows] == tid]
    overlap = np.minimum(trace.ts[rows] + trace.dur[rows], b) - np.maximum(trace.ts[rows], a)
    return trace.name(int(rows[np.argmax(overlap)])) if rows.size else DATALOADER_RANGE
