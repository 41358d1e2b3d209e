"""The bandwidth detector's per-op points, tallied as they come: a trace with millions of ops
with shapes keeps its op groups, one float per op (the times, for the floor percentile), the five
worst ops above peak, and a bounded list of the points themselves (the roofline's), never a dict
per op."""

from __future__ import annotations

import heapq
import math
from array import array
from typing import Any

import numpy as np
import orjson

KEPT_POINTS = 10_000  # the points kept for Analysis.kernels: the first ones...
ROOFLINE_POINTS = 2_000  # ... and the first this many that can be plotted (FLOPs and time above 0)
WORST_ABOVE_PEAK = 5
MIN_OPS_FOR_FLOOR = 20
# No op runs in less than about a microsecond, launch and dispatch included (an empty kernel
# takes ~1-3 µs on the device): an op whose bytes move faster than that at peak is bounded
# by per-op overhead whatever the trace shows, so the floor is never lower.
MIN_OP_US = 1.0


class PointTally:
    """What the summary and findings need of every point, in the order the points came."""

    def __init__(self) -> None:
        self.count = 0
        self.kept: list[dict[str, Any]] = []
        self._plottable_kept = 0
        self.groups: dict[str, dict[str, Any]] = {}  # op, shapes and types -> sums over judged points
        self.judged_times = array("d")
        # Sums over the judged points (int 0 first, as sum() would)
        self.time_us: float = 0
        self.memory_time_us: float = 0
        self.bytes: float = 0
        self.above_count = 0
        self.above_cache_count = 0  # of those, the ones the device's cache can account for
        self._worst_above: list[_Worst] = []  # a heap: the least bad of those kept on top

    def add(self, point: dict[str, Any], key: str | None = None) -> None:
        """``key``: the point's group_key, when the caller already has it (one per op shape)."""
        self.count += 1
        plottable = point["flops"] > 0 and point["time_us"] > 0
        if len(self.kept) < KEPT_POINTS or (plottable and self._plottable_kept < ROOFLINE_POINTS):
            self.kept.append(point)
            self._plottable_kept += plottable
        if point["above_peak"]:
            self.above_count += 1
            self.above_cache_count += bool(point.get("cache_may_serve"))
            worst = _Worst(-point["bandwidth_share"], self.count, point)
            if len(self._worst_above) < WORST_ABOVE_PEAK:
                heapq.heappush(self._worst_above, worst)
            elif worst.order < self._worst_above[0].order:
                heapq.heapreplace(self._worst_above, worst)
            return
        if key is None:
            key = group_key(point["op"], point["shapes"], point["types"])
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = {"op": point["op"], "family": point["family"], "shapes": point["shapes"],
                                        "types": point["types"], "calls": 0, "time_us": 0.0, "bytes": 0.0,
                                        "flops": 0.0, "roofline_us": 0.0}
        group["calls"] += 1
        for k in ("time_us", "bytes", "flops"):
            group[k] += point[k]
        group["roofline_us"] += point["roofline_us"] or 0.0
        self.judged_times.append(point["time_us"])
        self.time_us += point["time_us"]
        self.bytes += point["bytes"]
        if point["bound"] == "memory":
            self.memory_time_us += point["time_us"]

    def worst_above(self) -> list[dict[str, Any]]:
        """The points furthest above peak, the first of equals first (as a stable sort gives)."""
        return [w.point for w in sorted(self._worst_above, key=lambda w: w.order)]


def group_key(op: str, shapes: Any, types: Any) -> str:
    """The op group a point is summed into: its op, shapes and types."""
    return orjson.dumps([op, shapes, types], default=str).decode()


class _Worst:
    """A point above peak, ordered by (-share, arrival): the heap's top is the least bad one kept."""

    __slots__ = ("order", "point")

    def __init__(self, negative_share: float, arrival: int, point: dict[str, Any]) -> None:
        self.order = (negative_share, arrival)
        self.point = point

    def __lt__(self, other: _Worst) -> bool:
        return self.order > other.order


def percentile(values: Any, q: float) -> float:
    """``float(np.percentile(values, q))`` (linear method) of NaN-free values, worked as numpy does:
    numpy's quantile code calls np.unique, which imports numpy.ma (~5 ms of a fresh process)."""
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    n = ordered.size
    virtual = (n - 1) * (q / 100)
    if virtual >= n - 1:
        return float(ordered[-1])
    if virtual < 0:
        return float(ordered[0])
    below = math.floor(virtual)
    a, b, t = float(ordered[below]), float(ordered[below + 1]), virtual - below
    diff = b - a
    return b - diff * (1 - t) if t >= 0.5 else a + diff * t  # numpy's _lerp


def op_floor_us(times: Any) -> float:
    """What the shortest ops of this trace take at all (5th percentile of the modelled ops' times):
    the device's fixed cost per op here (launch, dispatch, the profiler's own per-op cost), never
    under MIN_OP_US. Too few ops to tell (under MIN_OPS_FOR_FLOOR): MIN_OP_US."""
    return max(percentile(times, 5) if len(times) >= MIN_OPS_FOR_FLOOR else 0.0, MIN_OP_US)
