"""What a request's thread recorded over some windows outside model steps (a deep trace): its
time by class and its top frames, when recorded work covers most of those windows.

queue_wait reads the handler's way to its model call with it, after_last_step the handler's work
after the model."""

from __future__ import annotations

from typing import Any

import numpy as np

from servprof.detect.host_classes import BUSY_CLASSES, CLASSES, DETOKENIZE, TOKENIZE
from servprof.detect.host_stacks import HostStacks
from servprof.detect.intervals import outside
from servprof.trace.model import Trace

# Recorded work on the thread (ops, Python, runtime calls), not the request's own tokenize phases.
HANDLER_BUSY = tuple(c for c in BUSY_CLASSES if c not in (TOKENIZE, DETOKENIZE))


def thread_work(trace: Trace, windows: list[tuple[int, int, float, float]], steps_start: np.ndarray,
                steps_end: np.ndarray) -> dict[str, Any] | None:
    """``windows``: (rank, thread, from µs, to µs), read where no model step ran (on any thread).
    None where the trace records nothing there (a light trace records no ops) or the threads
    mostly recorded nothing (they waited: I/O, a lock, another thread; or ran Python unrecorded)."""
    stacks: dict[int, HostStacks] = {}
    window_us, by_class, frames = 0.0, np.zeros(len(CLASSES)), {}
    for rank, tid, start_us, end_us in windows:
        a, b = outside(float(start_us), float(end_us), steps_start, steps_end)
        stack = stacks.setdefault(rank, HostStacks(trace, rank)).thread(tid)
        window_us += float((b - a).sum())
        by_class += stack.class_times(a, b).sum(axis=0)
        _window, keys, spent = stack.top_keys(a, b, limit=8)
        for key, us in zip(keys.tolist(), spent.tolist(), strict=True):
            frames[key] = frames.get(key, 0.0) + us
    busy_us = float(by_class[list(HANDLER_BUSY)].sum())
    if window_us <= 0 or busy_us < 0.5 * window_us:
        return None
    ranked = sorted((kv for kv in frames.items() if kv[0] % len(CLASSES) in HANDLER_BUSY), key=lambda kv: -kv[1])
    top = [{"name": trace.names[key // len(CLASSES)], "class": CLASSES[key % len(CLASSES)], "self_ms": round(us / 1e3, 3)}
           for key, us in ranked[:5]]
    return {"busy_ms": round(busy_us / 1e3, 3), "window_ms": round(window_us / 1e3, 3),
            "self_ms": {CLASSES[c]: round(float(v) / 1e3, 3) for c, v in enumerate(by_class) if v >= 50.0},
            "top_frames": top}
