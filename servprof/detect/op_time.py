"""An op's time on the device: the kernels it launched from its thread inside its span (its
host duration says only how long the launch took)."""

from __future__ import annotations

import numpy as np

from servprof.detect.threads import thread_groups
from servprof.trace.model import Trace


def launched_by(trace: Trace, ops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(device rows, the index in ``ops`` of the op that launched each): the device work launched from
    an op's thread inside its span. Ops of one thread must not overlap (counted ops never do)."""
    dev = np.flatnonzero(trace.device_mask())
    launch = trace.launch_row_for(dev)
    linked = launch >= 0
    dev, launch = dev[linked], launch[linked]
    found_dev, found_op = [], []
    if not ops.size or not dev.size:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    threads, thread_of = thread_groups(trace.rank[ops], trace.pid[ops], trace.tid[ops])
    launch_threads = np.stack([trace.rank[launch], trace.pid[launch], trace.tid[launch]], axis=1)
    for number, key in enumerate(threads.tolist()):
        mine = np.flatnonzero(thread_of.ravel() == number)
        mine = mine[np.argsort(trace.ts[ops[mine]], kind="stable")]
        starts, ends = trace.ts[ops[mine]], trace.ts[ops[mine]] + trace.dur[ops[mine]]
        here = np.flatnonzero((launch_threads == np.array(key)).all(axis=1))
        if not here.size:
            continue
        at = trace.ts[launch[here]]
        pos = np.searchsorted(starts, at, side="right") - 1
        ok = (pos >= 0) & (at <= ends[np.maximum(pos, 0)])
        found_dev.append(dev[here[ok]])
        found_op.append(mine[pos[ok]])
    if not found_dev:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(found_dev), np.concatenate(found_op)


def device_time(trace: Trace, ops: np.ndarray) -> np.ndarray:
    """Per op: the summed duration of the device work launched from its thread inside its span (NaN: none)."""
    out = np.full(ops.shape, np.nan)
    dev, op = launched_by(trace, ops)
    if dev.size:
        totals = np.zeros(ops.shape)
        np.add.at(totals, op, trace.dur[dev])
        launched = np.zeros(ops.shape, dtype=bool)
        launched[op] = True
        out[launched] = totals[launched]
    return out
