"""Session trace files under ``<out_dir>/traces``, bounded by file count and total size.

File names come from servprof's own session ids, never from request input. Files are
created with mode 0600 (traces can hold shapes and names from the serving code).
Everything here runs on the capture thread, never on the event loop.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import re
import shutil
from pathlib import Path
from typing import Any

import orjson

TRACE_SUFFIX = ".pt.trace.json.gz"
_SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MIB = 1024 * 1024


class StoreError(OSError):
    """The trace dir cannot take a trace; the message says why, for /servprof/status."""


class TraceStore:
    def __init__(self, out_dir: Path, max_files: int, max_mb: float, min_free_mb: float = 50.0):
        self.traces_dir = Path(out_dir) / "traces"
        self.max_files = max_files
        self.max_bytes = int(max_mb * _MIB)
        self.min_free_bytes = int(min_free_mb * _MIB)

    def check_writable(self) -> str | None:
        """None when a trace can be written now, otherwise the reason it cannot."""
        try:
            self.traces_dir.mkdir(parents=True, exist_ok=True)
            probe = self.traces_dir / f".probe-{os.getpid()}"
            os.close(os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600))
            probe.unlink()
            free = shutil.disk_usage(self.traces_dir).free
        except OSError as exc:
            return f"trace dir {self.traces_dir} is not writable: {exc.strerror or exc}"
        if free < self.min_free_bytes:
            return f"trace dir {self.traces_dir} has {free / _MIB:.0f} MiB free (< {self.min_free_bytes / _MIB:.0f})"
        return None

    def path_for(self, session_id: str, suffix: str = TRACE_SUFFIX) -> Path:
        if not _SESSION_ID.match(session_id):
            raise ValueError(f"not a servprof session id: {session_id!r}")
        return self.traces_dir / f"{session_id}{suffix}"

    def create_private(self, path: Path) -> None:
        """An empty file with mode 0600, so whatever writes into it later keeps that mode."""
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600))

    def write_json(self, session_id: str, suffix: str, data: Any) -> Path:
        path = self.path_for(session_id, suffix)
        try:
            self.create_private(path)
            path.write_bytes(orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS))
        except OSError as exc:  # a full or unwritable dir: a store problem, as for the trace
            with contextlib.suppress(OSError):
                path.unlink()
            raise StoreError(exc.errno, f"could not write {path}: {exc.strerror or exc}") from exc
        return path

    def export(self, profiler: Any, session_id: str) -> tuple[Path, int]:
        """Export the stopped profiler's trace gzipped; returns (path, uncompressed bytes)."""
        raw = self.path_for(session_id, ".pt.trace.json")
        final = self.path_for(session_id)
        try:
            self.create_private(raw)
            profiler.export_chrome_trace(str(raw))  # native exporter; holds the GIL ~2-3 us/event
            raw_size = raw.stat().st_size
            self.create_private(final)
            # zlib releases the GIL while it compresses, so this part does not stall serving.
            with open(raw, "rb") as src, open(final, "wb") as dst_file, \
                    gzip.GzipFile(fileobj=dst_file, mode="wb", compresslevel=3) as dst:
                shutil.copyfileobj(src, dst, length=4 * _MIB)
        except OSError as exc:
            final.unlink(missing_ok=True)
            raise StoreError(exc.errno, f"could not write trace {final}: {exc.strerror or exc}") from exc
        finally:
            raw.unlink(missing_ok=True)
            # torch's exporter writes <raw>.tmp then renames it: a failed write (disk full) leaves it.
            raw.with_name(raw.name + ".tmp").unlink(missing_ok=True)
        self.enforce_retention(keep=final)
        return final, raw_size

    def traces(self) -> list[Path]:
        """Stored traces, oldest first."""
        try:
            paths = [p for p in self.traces_dir.iterdir() if p.name.endswith(TRACE_SUFFIX)]
        except OSError:
            return []
        stats = {}
        for path in paths:
            try:
                stats[path] = path.stat()
            except OSError:  # removed meanwhile (another worker's retention sharing the dir)
                continue
        return sorted(stats, key=lambda p: (stats[p].st_mtime_ns, p.name))

    def enforce_retention(self, keep: Path | None = None) -> list[Path]:
        """Delete the oldest traces (and their session/result files) beyond the limits."""
        paths = self.traces()
        sizes = {p: _size(p) for p in paths}
        total = sum(sizes.values())
        removed: list[Path] = []
        for path in paths:
            if len(paths) - len(removed) <= self.max_files and total <= self.max_bytes:
                break
            if path == keep:
                continue
            stem = path.name[: -len(TRACE_SUFFIX)]
            for companion in self.traces_dir.glob(f"{stem}.*"):
                companion.unlink(missing_ok=True)
            total -= sizes[path]
            removed.append(path)
        return removed


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # removed meanwhile
        return 0
