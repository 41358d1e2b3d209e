"""Near-OOM memory snapshots of the CUDA caching allocator (SERVPROF_MEMORY_SNAPSHOT=1).

While on, torch records the allocator's history (``torch.cuda.memory._record_memory_history``,
bounded to ``memory_snapshot_max_entries`` events, Python stacks), starting once this
process has initialised CUDA itself (never initialising it: a vLLM API server or a CPU
server stays as it is). A watcher thread reads the reserved memory of each device once a
second (one allocator stats call) and, when it passes ``memory_snapshot_threshold`` of the
device, writes a snapshot (``torch.cuda.memory._snapshot()``, pickled) into the trace
directory: before the OOM, not after. ``POST /servprof/memory-snapshot`` takes one on
demand. At most one snapshot per ``memory_snapshot_interval_s``; the newest
``memory_snapshot_max_files`` are kept. Open one at https://pytorch.org/memory_viz or
``python -m torch.cuda._memory_viz trace_plot FILE -o FILE.html``.

Taking a snapshot holds the GIL while torch builds and pickles it (longer with more
entries); it runs on the watcher thread or a worker thread, never on the event loop.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from servprof.settings import Settings

SNAPSHOT_SUFFIX = ".memory-snapshot.pickle"
WATCH_INTERVAL_S = 1.0
REARM_BELOW = 0.05  # a threshold snapshot again only after reserved fell this far under the threshold
VIZ = "https://pytorch.org/memory_viz"


def open_with(path: Path | str) -> str:
    return f"drag {path} onto {VIZ}, or: python -m torch.cuda._memory_viz trace_plot {path} -o {path}.html"


class SnapshotUnavailable(RuntimeError):
    """No snapshot can be taken here; the message says why (for a 409)."""


class SnapshotTooSoon(RuntimeError):
    """Another snapshot was taken less than memory_snapshot_interval_s ago (for a 429)."""

    def __init__(self, wait_s: float) -> None:
        super().__init__(f"retry in {wait_s:.1f} s")
        self.wait_s = wait_s


def cuda_state() -> tuple[bool, bool]:
    """(CUDA available, initialised by this process), without initialising it."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return False, False
    return True, bool(torch.cuda.is_initialized())


def _torch_snapshot() -> Any:
    import torch

    return torch.cuda.memory._snapshot()


class MemorySnapshots:
    """One per process (memory history is process-wide, like the profiler)."""

    def __init__(self, settings: Settings, traces_dir: Path,
                 take_snapshot: Callable[[], Any] = _torch_snapshot, needs_cuda: bool = True) -> None:
        self.settings = settings
        self.traces_dir = Path(traces_dir)
        # Tests on a CPU machine give a stand-in for the CUDA allocator's snapshot (needs_cuda=False).
        self._take_snapshot, self.needs_cuda = take_snapshot, needs_cuda
        self._lock = threading.Lock()  # one snapshot at a time
        self.last_at = 0.0  # monotonic time of the last snapshot (or attempt)
        self.armed = True
        self.taken = 0
        self.last_error: str | None = None
        self.last_file: str | None = None

    # --- the watcher thread -------------------------------------------------------------------

    def start_watching(self) -> None:
        """One watcher per process (the first runtime with snapshots on); history is process-wide."""
        global _watching
        with _watch_lock:
            if _watching or not self.settings.memory_snapshot or not cuda_state()[0]:
                return
            _watching = True
        threading.Thread(target=self._watch, name="servprof-memory", daemon=True).start()

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_INTERVAL_S)
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 - the watcher must outlive any failure
                self.last_error = f"{type(exc).__name__}: {exc}"

    def check(self) -> None:
        """Start recording once CUDA is up; snapshot when a device passes the threshold."""
        available, initialised = cuda_state()
        if not (available and initialised):
            return
        if not _recording_started():
            self._start_recording()
        share = max_reserved_share()
        threshold = self.settings.memory_snapshot_threshold
        if share is None:
            return
        if share < threshold - REARM_BELOW:
            self.armed = True
        elif share >= threshold and self.armed and self.wait_s() <= 0:
            self.armed = False
            self.take(f"reserved memory at {share:.0%} of the device (threshold {threshold:.0%})")

    def _start_recording(self) -> None:
        import torch

        global _recording
        torch.cuda.memory._record_memory_history(
            enabled="all", context="all", stacks="python", max_entries=self.settings.memory_snapshot_max_entries)
        _recording = True

    # --- taking one ---------------------------------------------------------------------------

    def unavailable(self) -> str | None:
        """Why no snapshot can be taken now (None: one can)."""
        available, initialised = cuda_state()
        if not self.settings.memory_snapshot:
            needs = "" if available else " (and a CUDA device: this process has none)"
            return f"memory snapshots are off: set SERVPROF_MEMORY_SNAPSHOT=1{needs}"
        if not available and self.needs_cuda:
            return ("memory snapshots need CUDA: torch.cuda.is_available() is False in this process "
                    "(the CPU allocator keeps no history to snapshot)")
        if not initialised and self.needs_cuda:
            return "this process has not used CUDA yet: there is no device memory to snapshot"
        return None

    def wait_s(self) -> float:
        """Seconds until the next snapshot is allowed (0 when it is)."""
        if not self.last_at:
            return 0.0
        return max(0.0, self.last_at + self.settings.memory_snapshot_interval_s - time.monotonic())

    def take(self, reason: str) -> dict[str, Any]:
        """Write a snapshot now; returns its file, size and how to open it. Raises
        SnapshotUnavailable, SnapshotTooSoon, or OSError when the trace directory cannot take it."""
        problem = self.unavailable()
        if problem:
            raise SnapshotUnavailable(problem)
        with self._lock:
            wait = self.wait_s()  # checked again here: two callers may both have seen none taken
            if wait > 0:
                raise SnapshotTooSoon(wait)
            self.last_at = time.monotonic()
            started = time.perf_counter()
            snapshot = self._take_snapshot()
            taken_s = time.perf_counter() - started
            # Named by the clock, so that names sort in the order the snapshots were taken.
            now = time.time_ns()
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now // 10**9))
            name = f"{stamp}.{now % 10**9:09d}Z-{uuid.uuid4().hex[:6]}{SNAPSHOT_SUFFIX}"
            path = self.traces_dir / name
            try:
                self.traces_dir.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)  # stacks name the code
                with os.fdopen(fd, "wb") as out:
                    pickle.dump(snapshot, out, protocol=pickle.HIGHEST_PROTOCOL)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    path.unlink()
                self.last_error = f"could not write {path}: {exc.strerror or exc}"
                raise
            written_s = time.perf_counter() - started - taken_s
            self.taken += 1
            self.last_file, self.last_error = str(path), None
            removed = self.enforce_retention()
        return {"file": str(path), "bytes": path.stat().st_size, "reason": reason,
                "snapshot_s": round(taken_s, 4), "write_s": round(written_s, 4),
                "removed": [str(p) for p in removed], "open_with": open_with(path)}

    def snapshots(self) -> list[Path]:
        """Stored snapshots, oldest first (their names start with the UTC time they were taken)."""
        try:
            return sorted((p for p in self.traces_dir.iterdir() if p.name.endswith(SNAPSHOT_SUFFIX)),
                          key=lambda p: p.name)
        except OSError:
            return []

    def enforce_retention(self) -> list[Path]:
        """Keep the newest memory_snapshot_max_files, each counted in the trace store's byte budget:
        the oldest go first."""
        paths = self.snapshots()
        budget = int(self.settings.trace_max_mb * 1024 * 1024)
        removed = []
        total = sum(_size(p) for p in paths)
        for path in paths[:-1]:  # the newest always stays
            if len(paths) - len(removed) <= self.settings.memory_snapshot_max_files and total <= budget:
                break
            total -= _size(path)
            path.unlink(missing_ok=True)
            removed.append(path)
        return removed

    def status(self) -> dict[str, Any]:
        available, initialised = cuda_state()
        return {"enabled": self.settings.memory_snapshot, "cuda": available, "cuda_initialised": initialised,
                "recording": _recording_started(), "threshold": self.settings.memory_snapshot_threshold,
                "max_entries": self.settings.memory_snapshot_max_entries, "taken": self.taken,
                "files": [str(p) for p in self.snapshots()], "last_file": self.last_file,
                "last_error": self.last_error, "unavailable": self.unavailable(),
                "open_with": open_with(self.last_file) if self.last_file else f"{VIZ} (no snapshot yet)"}


def max_reserved_share() -> float | None:
    """The largest reserved / total memory over this process's devices, one stats call each."""
    from servprof.probes.memory import cuda_devices_in_use, cuda_levels

    shares = []
    for device in cuda_devices_in_use():
        _, reserved = cuda_levels(device)
        shares.append(reserved / _device_total(device))
    return max(shares) if shares else None


_totals: dict[int, int] = {}


def _device_total(device: int) -> int:
    if device not in _totals:
        import torch

        _totals[device] = int(torch.cuda.get_device_properties(device).total_memory)
    return _totals[device]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


_watching = False
_watch_lock = threading.Lock()
_recording = False


def _recording_started() -> bool:
    return _recording


def memory_snapshots(settings: Settings, traces_dir: Path) -> MemorySnapshots:
    """A runtime's snapshot keeper (its settings, its trace dir); the first with snapshots on
    also starts the process's watcher."""
    keeper = MemorySnapshots(settings, traces_dir)
    keeper.start_watching()
    return keeper
