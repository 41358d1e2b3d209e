"""Python's cyclic garbage collector, marked in a session's trace.

A collection of the older generations walks every object they hold (a server's long-lived heap:
its model's Python objects, caches, the framework's state) with the GIL held: tens to hundreds of
milliseconds in a big process, on whichever thread allocated the object that tipped a threshold.
The profiler records nothing of it: the time reads as the self time of the Python frame that was
running (an innocent allocation's), or as nothing at all without stacks. So while a session
records, each collection of generation 1 or 2 is a range ``servprof:auto.gc|`` on the thread it
ran on (``gc.callbacks``, the standard hook around every collection), which the gap detector reads
as the cause it is (detect/causes.py: ``python_gc``). Generation 0's collections, hundreds a
second and each over a few hundred young objects, are left out (their time stays with the frame).

The ranges are servprof's own (auto/emit.py): opened only until the capture thread begins to stop
the profiler, and a range open then is waited for before the stop (tiers.drain_ops).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

from torch.autograd import profiler as _autograd_profiler

from servprof.auto.emit import auto_phase_name, close_range, open_range

GC_PHASE = "gc"
MIN_GENERATION = 1


class GcRanges:
    """The ranges of the collections that run while a session records."""

    def __init__(self) -> None:
        self.collections = 0  # collections marked
        self._handle: Any = None  # the collection running now (one at a time: gc does not nest)
        self._opening = False
        self._installed = False
        self._name = auto_phase_name(GC_PHASE, ())

    def start(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True
        self._opening = True

    def stop_opening(self) -> None:
        """No new range from now on (the capture thread is about to stop the profiler); the one of a
        collection running now still closes."""
        self._opening = False

    def remove(self) -> None:
        """After the profiler's stop."""
        self._opening = False
        if self._installed:
            with contextlib.suppress(ValueError):
                gc.callbacks.remove(self._on_gc)
            self._installed = False
        if self._handle is not None:  # (a collection cut short by an exception in another callback)
            handle, self._handle = self._handle, None
            close_range(handle)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        try:
            if phase == "start":
                if self._opening and self._handle is None and info.get("generation", 0) >= MIN_GENERATION \
                        and _autograd_profiler._is_profiler_enabled:  # (a plain global: no profiler, no range)
                    self._handle = open_range(self._name)
                    self.collections += 1
            elif self._handle is not None:
                handle, self._handle = self._handle, None
                close_range(handle)
        except Exception:  # noqa: BLE001 - an error in a gc callback is printed to stderr by the collector
            self._handle = None
