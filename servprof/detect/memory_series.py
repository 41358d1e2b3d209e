"""Memory levels over time, per device, from whatever a trace carries.

Two sources, each turned into one ``MemorySeries`` per device:
- the profiler's allocator events (``profile_memory=True``): ``[memory]`` instant events
  whose args hold ``Bytes`` (+ allocated, - freed), ``Total Allocated``, ``Total Reserved``,
  ``Device Type`` and ``Device Id``; exact, and each can be tied to the op and step it
  happened in. (torch 2.13 writes none under ``profile_all_threads``.)
- servprof's own samples in the session metadata (``servprof.memory``, see
  servprof.probes.memory): CUDA allocator levels per device and the process's RSS,
  every ~10 ms, with CUDA's memory_stats at the session's start and end.
Where both describe one device, the allocator events win.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servprof.trace.model import Trace, distinct

MEMORY_EVENT = "[memory]"
DEVICE_TYPES = {0: "cpu", 1: "cuda", 12: "xpu", 13: "mps", 20: "privateuse1"}  # c10::DeviceType


@dataclass
class MemorySeries:
    device: str  # "cuda:0", "cpu" (allocator events on the host), "process" (RSS samples)
    source: str  # "profiler_events" | "cuda_allocator" | "process_rss"
    rank: int
    t_us: np.ndarray  # trace µs, ascending
    allocated: np.ndarray  # bytes (float64)
    reserved: np.ndarray  # bytes, NaN where the source has no such number
    total_bytes: int | None = None  # the device's (or the host's) memory
    total_from: str = ""
    rows: np.ndarray | None = None  # trace rows of the allocator events
    delta: np.ndarray | None = None  # signed bytes of each allocator event
    stats_start: dict[str, Any] = field(default_factory=dict)
    stats_end: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.t_us.shape[0])

    def level_at(self, times: np.ndarray, values: np.ndarray | None = None) -> np.ndarray:
        """The level at each time: the last reading at or before it (the first before any)."""
        values = self.allocated if values is None else values
        index = np.searchsorted(self.t_us, times, side="right") - 1
        return values[np.clip(index, 0, len(self) - 1)]

    @property
    def has_reserved(self) -> bool:
        return bool(np.isfinite(self.reserved).any())


def memory_series(trace: Trace) -> list[MemorySeries]:
    """Every device's series, allocator events first, then servprof's samples for the devices
    the events did not cover."""
    series = _from_events(trace)
    covered = {(s.rank, s.device) for s in series}
    series.extend(s for s in _from_samples(trace) if (s.rank, s.device) not in covered)
    return series


def _number(value: Any) -> float:
    if isinstance(value, bool):
        return math.nan
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return math.nan
    return math.nan


def _numbers(trace: Trace, rows: np.ndarray, keys: tuple[str, ...], chunk: int = 4096) -> list[np.ndarray]:
    """Per key, the number each row's args hold there (_number), read a chunk of rows at a time
    (an event per allocation and free: their args are never all decoded at once, nor kept)."""
    out = [np.empty(rows.size) for _ in keys]
    for first in range(0, rows.size, chunk):
        args = list(trace.args_each(rows[first:first + chunk], chunk))
        for column, key in zip(out, keys, strict=True):
            values = [a.get(key) for a in args]
            if set(map(type, values)) <= {int, float}:  # all numbers, no bool: as _number reads them
                column[first:first + len(args)] = values
            else:
                column[first:first + len(args)] = [_number(v) for v in values]
    return out


def _from_events(trace: Trace) -> list[MemorySeries]:
    name_id = trace.string_id(MEMORY_EVENT)
    if name_id < 0:
        return []
    rows = np.flatnonzero(trace.name_id == name_id)
    if rows.size == 0:
        return []
    rows = rows[np.argsort(trace.ts[rows], kind="stable")]
    kinds, indices, allocated, reserved, delta = _numbers(
        trace, rows, ("Device Type", "Device Id", "Total Allocated", "Total Reserved", "Bytes"))
    ranks = trace.rank[rows]
    out = []
    usable = np.isfinite(allocated) & np.isfinite(delta)
    for rank in distinct(ranks):
        for kind in distinct(kinds[np.isfinite(kinds)]):
            for index in distinct(indices[np.isfinite(indices)]):
                mine = usable & (ranks == rank) & (kinds == kind) & (indices == index)
                if not mine.any():
                    continue
                type_name = DEVICE_TYPES.get(int(kind), f"device{int(kind)}")
                device = "cpu" if type_name == "cpu" else f"{type_name}:{max(int(index), 0)}"
                mine_reserved = reserved[mine]
                if type_name == "cpu" or not np.any(mine_reserved > 0):
                    mine_reserved = np.full(mine_reserved.shape, np.nan)  # the CPU allocator reserves nothing
                total, source = _device_total(trace, int(rank), type_name, int(index))
                out.append(MemorySeries(device, "profiler_events", int(rank), trace.ts[rows[mine]], allocated[mine],
                                        mine_reserved, total, source, rows[mine], delta[mine]))
    return out


def _device_total(trace: Trace, rank: int, type_name: str, index: int) -> tuple[int | None, str]:
    """A GPU's memory from the trace's deviceProperties (Kineto writes totalGlobalMem)."""
    if type_name == "cpu":
        return None, ""
    properties = (trace.metadata.get(rank) or {}).get("deviceProperties")
    if not isinstance(properties, list):
        return None, ""
    for entry in properties:
        if isinstance(entry, dict) and entry.get("id") == index:
            total = entry.get("totalGlobalMem")
            if isinstance(total, int) and not isinstance(total, bool) and total > 0:
                return total, "trace deviceProperties"
    return None, ""


def _from_samples(trace: Trace) -> list[MemorySeries]:
    meta = trace.servprof_metadata()
    memory = meta.get("memory")
    devices = memory.get("devices") if isinstance(memory, dict) else None
    if not isinstance(devices, dict):
        return []
    rank = min(trace.metadata) if trace.metadata else 0
    base = (trace.metadata.get(rank) or {}).get("baseTimeNanoseconds")
    if not isinstance(base, (int, float)) or isinstance(base, bool):
        return []
    out = []
    for device, data in devices.items():
        if not isinstance(device, str) or not isinstance(data, dict) or not isinstance(data.get("samples"), list):
            continue
        rows = [s for s in data["samples"] if isinstance(s, list) and len(s) == 3 and _number(s[0]) == _number(s[0])]
        t = np.array([_number(s[0]) for s in rows], dtype=np.float64)
        allocated = np.array([_number(s[1]) for s in rows], dtype=np.float64)
        reserved = np.array([_number(s[2]) for s in rows], dtype=np.float64)
        keep = np.isfinite(t) & np.isfinite(allocated)
        if keep.sum() < 2:
            continue
        order = np.argsort(t[keep], kind="stable")
        total = data.get("total_bytes")
        total = int(total) if isinstance(total, (int, float)) and not isinstance(total, bool) and total > 0 else None
        source = "process_rss" if data.get("kind") == "process_rss" else "cuda_allocator"
        out.append(MemorySeries(device, source, rank, ((t[keep] - base) / 1e3)[order], allocated[keep][order],
                                reserved[keep][order], total, str(data.get("total_from") or ""),
                                stats_start=_stats(data.get("stats_start")), stats_end=_stats(data.get("stats_end"))))
    return out


def _stats(value: Any) -> dict[str, int]:
    if not isinstance(value, dict):
        return {}
    return {str(k): int(v) for k, v in value.items() if isinstance(v, int) and not isinstance(v, bool)}
