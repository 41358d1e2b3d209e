"""Arrival processes and the open-loop pacer.

Open loop means arrivals keep their schedule when the server slows down: one pacer
per load-generator process hands out arrival slots, and any free user takes the next
one and sleeps until it is due. With enough spare users the offered load does not
depend on latency (a closed loop, where each user waits for its previous reply,
quietly lowers the load exactly when the server is slow). A slot taken after its time
has come is counted as late, so a shortage of users shows in the summary.

In locust's distributed mode each worker takes every n-th slot of the one global
schedule (worker i of n takes i, i+n, ...), so the merged arrivals are the schedule.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

ARRIVALS = ("poisson", "gamma", "replay", "closed")
_BLOCK = 4096  # schedule generated lazily in blocks, so a run may be as long as it likes


class ArrivalError(ValueError):
    """An arrival option servprof cannot use."""


def interarrival_gaps(kind: str, rate: float, burstiness: float, count: int, rng: np.random.Generator) -> np.ndarray:
    """Gaps (s) between arrivals: gamma with shape=burstiness and mean 1/rate, as vLLM does.

    burstiness 1 is Poisson; below 1 burstier, above 1 more regular (CV = 1/sqrt(shape)).
    """
    if rate <= 0:
        raise ArrivalError(f"--rate must be > 0 for --arrival {kind}, got {rate}")
    shape = 1.0 if kind == "poisson" else burstiness
    if shape <= 0:
        raise ArrivalError(f"--burstiness must be > 0, got {burstiness}")
    return rng.gamma(shape, 1.0 / (rate * shape), size=count)


@dataclass(frozen=True, slots=True)
class Slot:
    index: int  # global request index, also the dataset row (modulo its length)
    due: float | None  # time.monotonic() deadline; None in a closed loop


class Pacer:
    """Hands out arrival slots for one process; thread- and greenlet-safe."""

    def __init__(
        self,
        kind: str,
        *,
        rate: float = 1.0,
        burstiness: float = 1.0,
        seed: int = 0,
        replay: np.ndarray | None = None,
        worker_index: int = 0,
        worker_count: int = 1,
    ) -> None:
        if kind not in ARRIVALS:
            raise ArrivalError(f"unknown arrival process {kind!r}; choose one of: {', '.join(ARRIVALS)}")
        if not 0 <= worker_index < worker_count:
            raise ArrivalError(f"worker index {worker_index} is outside 0..{worker_count - 1}")
        if kind == "replay" and (replay is None or len(replay) == 0):
            raise ArrivalError("--arrival replay needs a timed trace (--dataset trace)")
        if kind in ("poisson", "gamma"):
            interarrival_gaps(kind, rate, burstiness, 0, np.random.default_rng(0))  # validates options
        self.kind = kind
        self.rate = rate
        self.burstiness = burstiness
        self.worker_index = worker_index
        self.worker_count = worker_count
        self._rng = np.random.default_rng(seed)
        self._offsets = np.asarray(replay, dtype=np.float64) if kind == "replay" else np.empty(0)
        self._next_local = 0
        self._start: float | None = None
        self._lock = threading.Lock()

    def _offset(self, index: int) -> float | None:
        if self.kind == "replay":
            return float(self._offsets[index]) if index < len(self._offsets) else None
        while index >= len(self._offsets):
            last = self._offsets[-1] if len(self._offsets) else 0.0
            gaps = interarrival_gaps(self.kind, self.rate, self.burstiness, _BLOCK, self._rng)
            # The first arrival is at t=0, as a run should not start with an idle gap.
            if not len(self._offsets):
                gaps[0] = 0.0
            self._offsets = np.concatenate([self._offsets, last + np.cumsum(gaps)])
        return float(self._offsets[index])

    def claim(self) -> Slot | None:
        """The next slot of this process; None when a replayed trace has run out."""
        with self._lock:
            index = self.worker_index + self._next_local * self.worker_count
            self._next_local += 1
            if self.kind == "closed":
                return Slot(index, None)
            offset = self._offset(index)
            if offset is None:
                return None
            if self._start is None:
                # The schedule starts when the first user asks, not at import or spawn.
                self._start = time.monotonic()
            return Slot(index, self._start + offset)

    def schedule(self, count: int) -> np.ndarray:
        """The first `count` global arrival offsets (s), for tests and reports."""
        if self.kind == "closed":
            raise ArrivalError("a closed loop has no schedule")
        with self._lock:
            offsets = [self._offset(i) for i in range(count)]
        return np.array([o for o in offsets if o is not None])
