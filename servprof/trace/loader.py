"""Read Kineto chrome traces (.json, .json.gz, or a directory of them) into a columnar Trace.

Each file is parsed once by orjson; columns are then built with one list
comprehension per field, which is where nearly all the load time goes.
Every way a file can be unusable ends in a one-line TraceError.
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from servprof.trace.model import Trace

# Uncompressed bytes accepted per file; a bigger trace is refused rather than
# exhausting memory. Override with SERVPROF_MAX_TRACE_BYTES.
DEFAULT_MAX_TRACE_BYTES = 2 * 1024**3
TRACE_SUFFIXES = (".json", ".json.gz")

ProgressCallback = Callable[[str, int, int], None]  # (stage, done, total)


class TraceError(ValueError):
    """A trace that cannot be analysed; str() is one line meant for the user."""


def max_trace_bytes() -> int:
    raw = os.environ.get("SERVPROF_MAX_TRACE_BYTES", "")
    try:
        return int(raw) if raw else DEFAULT_MAX_TRACE_BYTES
    except ValueError:
        raise TraceError(f"SERVPROF_MAX_TRACE_BYTES must be an integer, got {raw!r}") from None


def trace_files(path: str | os.PathLike[str]) -> list[Path]:
    """The trace files a path names: itself, or the .json/.json.gz files in a directory."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(TRACE_SUFFIXES))
        if not files:
            raise TraceError(f"{p}: directory holds no .json or .json.gz trace files")
        return files
    if not p.exists():
        raise TraceError(f"{p}: no such file or directory")
    return [p]


def read_bytes(path: Path, limit: int) -> bytes:
    """The file's JSON bytes, decompressed when gzipped, refusing more than ``limit``."""
    try:
        size = path.stat().st_size
        if size == 0:
            raise TraceError(f"{path}: empty file")
        with open(path, "rb") as f:
            magic = f.read(2)
        if magic == b"\x1f\x8b":
            with gzip.open(path, "rb") as gz:
                data = gz.read(limit + 1)
        else:
            if size > limit:
                raise TraceError(f"{path}: {size} bytes is larger than the {limit}-byte limit (SERVPROF_MAX_TRACE_BYTES)")
            data = path.read_bytes()
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise TraceError(f"{path}: truncated or corrupt gzip ({exc})") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise TraceError(f"{path}: more than {limit} bytes uncompressed (limit SERVPROF_MAX_TRACE_BYTES)")
    if not data.strip():
        raise TraceError(f"{path}: empty trace")
    return data


def parse_document(path: Path, data: bytes) -> tuple[dict[str, Any], list[Any]]:
    """Top-level keys (without the events) and the event list."""
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise TraceError(f"{path}: not valid JSON ({str(exc).splitlines()[0]})") from None
    if isinstance(document, list):  # the chrome-trace "JSON Array Format"
        return {}, document
    if not isinstance(document, dict) or "traceEvents" not in document:
        raise TraceError(f"{path}: no 'traceEvents' key; not a chrome trace")
    events = document.pop("traceEvents")
    if not isinstance(events, list):
        raise TraceError(f"{path}: 'traceEvents' is not a list")
    servprof_meta = document.get("servprof")
    if isinstance(servprof_meta, (str, bytes)):  # add_metadata_json stores raw JSON text
        try:
            document["servprof"] = orjson.loads(servprof_meta)
        except orjson.JSONDecodeError:
            document["servprof"] = {}
    return document, events


def _int_or(value: Any, default: int) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return default
    return default


class _Interner:
    def __init__(self) -> None:
        self.lookup: dict[str, int] = {}
        self.strings: list[str] = []

    def ids(self, values: list[Any]) -> np.ndarray:
        lookup, strings = self.lookup, self.strings

        def one(value: Any) -> int:
            key = value if isinstance(value, str) else ("" if value is None else str(value))
            found = lookup.get(key)
            if found is None:
                found = lookup[key] = len(strings)
                strings.append(key)
            return found

        return np.fromiter((one(v) for v in values), dtype=np.int32, count=len(values))

    def process_ids(self, values: list[Any]) -> np.ndarray:
        """pid/tid: integers stay, strings (e.g. "Spans") become negative interned ids."""
        out = np.empty(len(values), dtype=np.int64)
        for i, v in enumerate(values):
            if isinstance(v, int):
                out[i] = v
            else:
                out[i] = -(int(self.ids([v])[0]) + 2)
        return out


def _columns(events: list[dict[str, Any]], rank: int, interner: _Interner) -> dict[str, Any]:
    n = len(events)
    ts = np.array([e.get("ts") for e in events], dtype=np.float64)
    dur = np.array([e.get("dur", 0.0) or 0.0 for e in events], dtype=np.float64)
    # µs rounding of ns clocks (and some exporters) can give a tiny negative duration.
    np.maximum(dur, 0.0, out=dur)
    args = [e.get("args") for e in events]
    ph = np.array([ord(p[0]) if isinstance(p, str) and p else 0 for p in (e.get("ph") for e in events)], dtype=np.uint8)

    def arg_int(key: str) -> np.ndarray:
        return np.fromiter(
            (_int_or(a.get(key), -1) if isinstance(a, dict) else -1 for a in args), dtype=np.int64, count=n
        )

    flow = ((ph == ord("s")) | (ph == ord("f")) | (ph == ord("t")))
    flow_ids = np.fromiter((_int_or(e.get("id"), -1) for e in events), dtype=np.int64, count=n)
    flow_ids[~flow] = -1
    return {
        "name_id": interner.ids([e.get("name", "") for e in events]),
        "cat_id": interner.ids([e.get("cat", "") for e in events]),
        "ph": ph,
        "pid": interner.process_ids([e.get("pid", -1) for e in events]),
        "tid": interner.process_ids([e.get("tid", -1) for e in events]),
        "ts": ts,
        "dur": dur,
        "stream": arg_int("stream"),
        "correlation": arg_int("correlation"),
        "external_id": arg_int("External id"),
        "flow_id": flow_ids,
        "rank": np.full(n, rank, dtype=np.int32),
        "raw_args": args,
    }


def load_trace(
    path: str | os.PathLike[str],
    progress: ProgressCallback | None = None,
    max_bytes: int | None = None,
) -> Trace:
    """Load a trace file or a directory of per-rank trace files.

    Raises TraceError (one line) for anything that is not a usable chrome trace.
    """
    files = trace_files(path)
    limit = max_trace_bytes() if max_bytes is None else max_bytes
    interner = _Interner()
    parts: list[dict[str, Any]] = []
    metadata: dict[int, dict[str, Any]] = {}
    thread_names: dict[tuple[int, int, int], str] = {}
    for index, file in enumerate(files):
        if progress:
            progress("read", index, len(files))
        document, events = parse_document(file, read_bytes(file, limit))
        info = document.get("distributedInfo")
        rank = _int_or(info.get("rank"), index) if isinstance(info, dict) else index
        if rank in metadata:  # two files claim one rank: keep them apart
            rank = max(metadata) + 1
        metadata[rank] = document
        timed: list[dict[str, Any]] = []
        for event in events:
            if not isinstance(event, dict):
                raise TraceError(f"{file}: an entry of 'traceEvents' is not an object")
            ts = event.get("ts")
            if event.get("ph") == "M":
                if event.get("name") == "thread_name":
                    label = (event.get("args") or {}).get("name")
                    if isinstance(label, str):
                        key = (rank, _int_or(event.get("pid"), -1), _int_or(event.get("tid"), -1))
                        thread_names[key] = label
                continue
            if isinstance(ts, (int, float)) and not isinstance(ts, bool) and math.isfinite(ts):
                timed.append(event)
        parts.append(_columns(timed, rank, interner))
        if progress:
            progress("read", index + 1, len(files))
    if not any(len(p["ts"]) for p in parts):
        raise TraceError(f"{path}: the trace holds no timed events")
    merged: dict[str, Any] = {}
    for key in parts[0]:
        if key == "raw_args":
            merged[key] = [a for p in parts for a in p[key]]
        else:
            merged[key] = np.concatenate([p[key] for p in parts])
    return Trace(
        source=str(path),
        names=interner.strings,
        metadata=metadata,
        thread_names=thread_names,
        _name_lookup=interner.lookup,
        **merged,
    )
