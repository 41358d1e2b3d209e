"""Memory levels sampled on the capture thread: during a session, and between sessions.

Two kinds of series, each ``[[wall_ns, allocated, reserved], ...]``:
- ``process``: the process's resident memory (RSS, from /proc/self/statm; reserved is
  None). Everything the process holds, not only tensors: on a CPU server it is where
  tensors live; on a GPU server it shows host-side leaks.
- ``cuda:N``: the CUDA caching allocator's allocated and reserved bytes on each device
  this process uses (reserved - allocated is memory cached but unused: fragmentation).

A sample costs a few microseconds (one small /proc read; on CUDA one allocator stats
call per device), taken at most every ``interval_s``; a session keeps at most
``MAX_SAMPLES`` per series (the interval doubles instead). CUDA's full memory_stats are
read at the session's start and end only.

Between sessions the capture thread also keeps a process-wide ``MemoryHistory``: the same
levels once a second while no session runs, plus one reading just before each session
starts and one just after it ends, each with the count of model requests (POSTs) served
so far. A leak shows there: the profiler's own buffers grow with every captured event
while a session runs (0-900 bytes per event in the process RSS, measured; most in its first session), so growth
*inside* a session's RSS is never blamed on the app; growth between sessions is.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

SAMPLE_INTERVAL_S = 0.01
MAX_SAMPLES = 1024
HISTORY_INTERVAL_S = 1.0
HISTORY_POINTS = 512
# memory_stats keys kept at a session's start and end (the full dict has ~100).
CUDA_STAT_KEYS = ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
                  "reserved_bytes.all.peak", "active_bytes.all.current", "inactive_split_bytes.all.current",
                  "num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")
_UNLIMITED = 1 << 60  # cgroup v1 writes a huge number for "no limit"


def rss_bytes() -> int | None:
    """This process's resident set size, None where /proc is not there."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _page_size()
    except (OSError, ValueError, IndexError):
        return None


@functools.lru_cache(maxsize=1)
def _page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


@functools.lru_cache(maxsize=1)
def host_memory_limit() -> tuple[int | None, str]:
    """(bytes, where from): the cgroup's memory limit when one is set, else the machine's RAM."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < _UNLIMITED:
            return int(text), f"cgroup limit ({path})"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024, "MemTotal (/proc/meminfo)"
    except (OSError, ValueError, IndexError):
        pass
    return None, "unknown"


def cuda_devices_in_use() -> list[int]:
    """Devices whose caching allocator holds memory, without initialising CUDA: [] when this
    process has not touched CUDA (a vLLM API server, a CPU server)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    devices = [d for d in range(torch.cuda.device_count()) if torch.cuda.memory_reserved(d) > 0]
    return devices or [torch.cuda.current_device()]


def cuda_levels(device: int) -> tuple[int, int]:
    """(allocated, reserved) bytes: one raw stats call (torch.cuda.memory_allocated and
    memory_reserved would each flatten the whole stats dict)."""
    import torch

    stats = torch._C._cuda_memoryStats(device)
    return int(stats["allocated_bytes"]["all"]["current"]), int(stats["reserved_bytes"]["all"]["current"])


def cuda_stats(device: int) -> dict[str, Any]:
    import torch

    stats = torch.cuda.memory_stats(device)
    out: dict[str, Any] = {key: int(stats[key]) for key in CUDA_STAT_KEYS if key in stats}
    try:
        free, total = torch.cuda.mem_get_info(device)
        out["device_free_bytes"], out["device_total_bytes"] = int(free), int(total)
    except Exception:  # noqa: BLE001 - a driver call that fails leaves the allocator's numbers
        pass
    return out


class MemorySampler:
    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S, max_samples: int = MAX_SAMPLES) -> None:
        self.interval_ns = int(interval_s * 1e9)
        self.max_samples = max_samples
        self.devices = cuda_devices_in_use()
        self.series: dict[str, list[list[int | None]]] = {"process": []} if rss_bytes() is not None else {}
        for device in self.devices:
            self.series[f"cuda:{device}"] = []
        self.stats_start = {f"cuda:{d}": cuda_stats(d) for d in self.devices}
        self._last_ns = 0
        self.sample(force=True)

    def sample(self, force: bool = False) -> None:
        now = time.time_ns()
        if not force and now - self._last_ns < self.interval_ns:
            return
        self._last_ns = now
        if "process" in self.series:
            self._append("process", [now, rss_bytes(), None])
        for device in self.devices:
            allocated, reserved = cuda_levels(device)
            self._append(f"cuda:{device}", [now, allocated, reserved])

    def _append(self, key: str, sample: list[int | None]) -> None:
        samples = self.series[key]
        samples.append(sample)
        if len(samples) >= self.max_samples:
            # Keep the whole session at half the resolution rather than only its start.
            del samples[1::2]
            self.interval_ns *= 2

    def finish(self) -> dict[str, Any]:
        """The ``memory`` key of the session metadata."""
        self.sample(force=True)
        limit, limit_source = host_memory_limit()
        devices: dict[str, Any] = {}
        if "process" in self.series:
            devices["process"] = {"kind": "process_rss", "total_bytes": limit, "total_from": limit_source,
                                  "samples": self.series["process"]}
        for device in self.devices:
            key = f"cuda:{device}"
            end = cuda_stats(device)
            devices[key] = {"kind": "cuda_allocator", "total_bytes": end.get("device_total_bytes"),
                            "total_from": "cudaMemGetInfo", "samples": self.series[key],
                            "stats_start": self.stats_start.get(key, {}), "stats_end": end}
        return {"interval_s": self.interval_ns / 1e9, "devices": devices, "history": memory_history().export()}


def current_levels(devices: list[int]) -> dict[str, list[int | None]]:
    levels: dict[str, list[int | None]] = {}
    rss = rss_bytes()
    if rss is not None:
        levels["process"] = [rss, None]
    for device in devices:
        allocated, reserved = cuda_levels(device)
        levels[f"cuda:{device}"] = [allocated, reserved]
    return levels


class MemoryHistory:
    """Levels outside sessions, process-wide (the capture thread is the only writer)."""

    def __init__(self, interval_s: float = HISTORY_INTERVAL_S, max_points: int = HISTORY_POINTS) -> None:
        self.interval_ns = int(interval_s * 1e9)
        # (wall ns, model requests served so far, sessions started so far, {device: [allocated, reserved]})
        self.points: deque[tuple[int, int, int, dict[str, list[int | None]]]] = deque(maxlen=max_points)
        self._last_ns = 0
        self._devices: list[int] = []
        self._devices_checked_ns = 0

    def tick(self, requests: int, sessions: int, force: bool = False) -> None:
        now = time.time_ns()
        if not force and now - self._last_ns < self.interval_ns:
            return
        self._last_ns = now
        if now - self._devices_checked_ns > 10 * self.interval_ns:  # CUDA may come up after start-up
            self._devices, self._devices_checked_ns = cuda_devices_in_use(), now
        self.points.append((now, requests, sessions, current_levels(self._devices)))

    def export(self) -> dict[str, Any]:
        points = list(self.points)
        names = sorted({name for point in points for name in point[3]})
        return {"interval_s": self.interval_ns / 1e9,
                "points": [[t, requests, sessions] for t, requests, sessions, _ in points],
                "levels": {name: [point[3].get(name, [None, None]) for point in points] for name in names}}


_history = MemoryHistory()


def memory_history() -> MemoryHistory:
    return _history
