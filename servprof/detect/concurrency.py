"""Model steps of other threads running during one thread's gap (a server that runs one model
call per request, each on its own thread).

While a thread sits between two of its steps, the other threads' steps show what the CPUs (and
the GIL) were busy with: this is read from the step ranges alone, so it holds on a light trace,
which records no op.
"""

from __future__ import annotations

import numpy as np

from servprof.detect.intervals import covered, merge
from servprof.detect.step_forms import Step
from servprof.trace.model import distinct


def other_steps_during(steps: list[Step], a: np.ndarray, b: np.ndarray, tid: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Per window [a, b] on thread ``tid``: (µs of it covered by other threads' steps, how many
    other threads had a step in it). ``steps``: one rank's; ``tid`` may be a thread that ran none
    (a tokenization on the event loop's thread)."""
    cover, threads = np.zeros(a.size), np.zeros(a.size, dtype=np.int64)
    starts: dict[int, list[float]] = {}
    ends: dict[int, list[float]] = {}
    for s in steps:
        starts.setdefault(s.tid, []).append(s.start_us)
        ends.setdefault(s.tid, []).append(s.end_us)
    if not starts or a.size == 0:
        return cover, threads
    spans = {t: merge(np.asarray(starts[t], dtype=float), np.asarray(ends[t], dtype=float)) for t in starts}
    for t in distinct(tid).tolist():
        mine = np.flatnonzero(tid == t)
        others = [spans[o] for o in spans if o != t]
        if not others:  # (a window on the only thread that ran steps)
            continue
        start, end = merge(np.concatenate([s for s, _ in others]), np.concatenate([e for _, e in others]))
        cover[mine] = covered(start, end, a[mine], b[mine])
        for block_start, block_end in others:
            threads[mine] += covered(block_start, block_end, a[mine], b[mine]) > 0
    return cover, threads
