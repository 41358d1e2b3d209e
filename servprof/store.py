"""Session trace files under ``<out_dir>/traces``, bounded by file count and total size.

File names come from servprof's own session ids, never from request input. Files are
created with mode 0600 (traces can hold shapes and names from the serving code).
Everything here runs on the capture thread, never on the event loop.

A session whose trace was written by someone else (vLLM's workers, into their
``torch_profiler_dir``) is a folder ``<session>.<kind>`` of links to those files. It counts
as one session with the size of everything it left behind, and retention removes it whole:
the links, the files they point to and any other file named with the session's prefix
(``servprof_<session>_...``) in the folders it is linked to.
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
LINKED_PREFIX = "servprof_"  # files others write for a session are named <LINKED_PREFIX><session id>_...
_SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MIB = 1024 * 1024


class StoreError(OSError):
    """The trace dir cannot take a trace; the message says why, for /servprof/status."""


def linked_prefix(session_id: str) -> str:
    """The prefix of the files another process writes for this session (vLLM's profile_prefix)."""
    return LINKED_PREFIX + session_id


class TraceStore:
    def __init__(self, out_dir: Path, max_files: int, max_mb: float, min_free_mb: float = 50.0):
        self.traces_dir = Path(out_dir) / "traces"
        self.max_files = max_files
        self.max_bytes = int(max_mb * _MIB)
        self.min_free_bytes = int(min_free_mb * _MIB)
        # Folders where another process writes this store's session files (vLLM's torch_profiler_dir).
        self.linked_dirs: set[Path] = set()

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
        """Write the file whole or not at all: a session file is rewritten while the session goes on
        and read meanwhile (status tools, the analysis), and a reader must never see it half written.
        A failed rewrite leaves the last complete one."""
        path = self.path_for(session_id, suffix)
        partial = path.with_name(path.name + ".tmp")  # (retention removes it with its session)
        document = orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)
        try:
            self.create_private(partial)
            partial.write_bytes(document)
            os.replace(partial, path)
        except OSError as exc:  # a full or unwritable dir: a store problem, as for the trace
            with contextlib.suppress(OSError):
                partial.unlink()
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

    def link_session(self, session_id: str, files: list[Path], kind: str) -> Path:
        """A folder <session>.<kind> of links to `files` (written elsewhere, named with the
        session's linked_prefix): the session's entry in this store, then retention is applied."""
        folder = self.path_for(session_id, f".{kind}")
        folder.mkdir(parents=True, exist_ok=True)
        for path in files:
            self.linked_dirs.add(path.parent)
            link = folder / path.name
            if not link.is_symlink():
                os.symlink(path, link)
        self.enforce_retention(keep=folder)
        return folder

    def traces(self) -> list[Path]:
        """Stored sessions (trace files and linked folders), oldest first."""
        try:
            paths = [p for p in self.traces_dir.iterdir() if p.name.endswith(TRACE_SUFFIX) or _is_linked_folder(p)]
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
        """Delete the oldest sessions (trace, linked files, session/result files) beyond the limits."""
        paths = self.traces()
        sizes = {p: self._entry_size(p) for p in paths}
        total = sum(sizes.values())
        removed: list[Path] = []
        for path in paths:
            if len(paths) - len(removed) <= self.max_files and total <= self.max_bytes:
                break
            if path == keep:
                continue
            self.remove_session(_session_of(path))
            total -= sizes[path]
            removed.append(path)
        return removed

    def remove_session(self, session_id: str) -> None:
        """Every file of one session: its trace or linked folder (and what the links point to),
        files named with its linked prefix in the linked dirs, its .session/.analysis files."""
        for linked in self._linked_files(session_id):
            linked.unlink(missing_ok=True)
        for companion in self.traces_dir.glob(f"{session_id}.*"):
            if _is_linked_folder(companion):
                shutil.rmtree(companion, ignore_errors=True)
            else:
                companion.unlink(missing_ok=True)

    def _linked_files(self, session_id: str) -> set[Path]:
        """Files written elsewhere for this session: link targets and prefix matches, never a file
        whose name does not carry the session's prefix (a link someone else made stays untouched)."""
        prefix = linked_prefix(session_id) + "_"
        dirs = set(self.linked_dirs)
        found: set[Path] = set()
        for folder in self.traces_dir.glob(f"{session_id}.*"):
            if not _is_linked_folder(folder):
                continue
            for link in _entries(folder):
                if link.is_symlink():
                    target = Path(os.path.realpath(link))
                    dirs.add(target.parent)
                    if target.name.startswith(prefix):
                        found.add(target)
        for directory in dirs:
            found.update(p for p in _entries(directory) if p.name.startswith(prefix) and p.is_file())
        return found

    def _entry_size(self, path: Path) -> int:
        if not path.is_dir():
            return _size(path)
        return sum(_size(p) for p in self._linked_files(_session_of(path)))


def _is_linked_folder(path: Path) -> bool:
    stem, dot, _kind = path.name.partition(".")
    return bool(dot) and bool(_SESSION_ID.match(stem)) and path.is_dir() and not path.is_symlink()


def _session_of(path: Path) -> str:
    return path.name[: -len(TRACE_SUFFIX)] if path.name.endswith(TRACE_SUFFIX) else path.name.split(".", 1)[0]


def _entries(directory: Path) -> list[Path]:
    try:
        return list(directory.iterdir())
    except OSError:
        return []


def _size(path: Path) -> int:
    try:
        return path.stat().st_size  # a link counts as what it points to
    except OSError:  # removed meanwhile
        return 0
