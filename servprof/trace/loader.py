"""Read Kineto chrome traces (.json, .json.gz, or a directory of them) into a columnar Trace.

Each file is parsed once by orjson; columns are then built with one list
comprehension per field, which is where nearly all the load time goes.
Every way a file can be unusable ends in a one-line TraceError.
"""

from __future__ import annotations

import gc
import gzip
import math
import os
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import compress, islice
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from servprof.trace.meta import MAX_RANK, claimed_rank
from servprof.trace.model import Trace

# Uncompressed bytes accepted per file; a bigger trace is refused rather than
# exhausting memory. Override with SERVPROF_MAX_TRACE_BYTES.
DEFAULT_MAX_TRACE_BYTES = 2 * 1024**3
TRACE_SUFFIXES = (".json", ".json.gz")
# servprof's own files beside its session traces (capture.py): never traces themselves.
SIDECAR_SUFFIXES = (".session.json", ".analysis.json")
# Added to each file's metadata: the file's name, for messages about it (e.g. two files claiming a rank).
SOURCE_FILE_KEY = "servprof_source_file"

ProgressCallback = Callable[[str], None]  # called with the stage just finished: "read", "parse", "columns"


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
        files = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(TRACE_SUFFIXES)
                       and not f.name.endswith(SIDECAR_SUFFIXES))
        if not files:
            raise TraceError(f"{p}: directory holds no .json or .json.gz trace files")
        return files
    if not p.exists():
        raise TraceError(f"{p}: no such file or directory")
    return [p]


def read_bytes(path: Path, limit: int) -> bytes | bytearray:
    """The file's JSON bytes, decompressed when gzipped, refusing more than ``limit``."""
    try:
        size = path.stat().st_size
        if size == 0:
            raise TraceError(f"{path}: empty file")
        with open(path, "rb") as f:
            magic = f.read(2)
        if magic == b"\x1f\x8b":
            data = _inflate(path, limit)
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
    if not data or data.isspace():  # (not strip(): that copies a whole trace that ends in a newline)
        raise TraceError(f"{path}: empty trace")
    return data


# Kineto traces inflate 12-16:1; far past that, a gzip stream is a run of repeated bytes (a
# "gzip bomb"), refused once this much is inflated instead of inflating up to the size limit.
MAX_GZIP_RATIO = 200
GZIP_RATIO_CHECK_BYTES = 16 * 1024**2
_INFLATE_CHUNK = 4 * 1024**2


def _inflate(path: Path, limit: int) -> bytearray:
    """The gzip file's contents, read in chunks so that neither a bomb nor a file over ``limit``
    is ever inflated whole."""
    data = bytearray()
    with open(path, "rb") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz:
        while chunk := gz.read(min(_INFLATE_CHUNK, limit + 1 - len(data))):
            data += chunk
            if len(data) > limit:
                break
            if len(data) >= GZIP_RATIO_CHECK_BYTES and len(data) > MAX_GZIP_RATIO * max(1, raw.tell()):
                raise TraceError(f"{path}: inflates more than {MAX_GZIP_RATIO}:1 (traces inflate ~15:1); "
                                 "refused as a gzip bomb")
    return data  # orjson parses a bytearray as is: no copy


def parse_document(path: Path, data: bytes | bytearray) -> tuple[dict[str, Any], list[Any]]:
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


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _int_or(value: Any, default: int) -> int:
    """``value`` as an int64 where it is one (or a whole number in a float or string), else default."""
    if isinstance(value, bool):
        return default
    if isinstance(value, float):
        value = int(value) if math.isfinite(value) else default
    elif isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            return default
    if isinstance(value, int) and INT64_MIN <= value <= INT64_MAX:
        return value
    return default


class _Interner:
    def __init__(self) -> None:
        self.lookup: dict[str, int] = {}
        self.strings: list[str] = []

    def ids(self, values: list[Any]) -> np.ndarray:
        lookup = self.lookup
        try:
            # setdefault evaluates len(lookup) first, so a new string gets the next id.
            ids = [lookup.setdefault(v, len(lookup)) for v in values]
        except TypeError:  # an unhashable name (a list, a dict): fall back to its text
            ids = [lookup.setdefault(v if isinstance(v, str) else str(v), len(lookup)) for v in values]
        known = len(self.strings)
        if known < len(lookup):
            # Only the names this call added (dicts keep insertion order): the work stays
            # proportional to what is new, however many calls come.
            added = list(islice(lookup, known, None))
            # Non-string names (numbers, None) were interned as themselves; store their text.
            self.strings.extend(v if isinstance(v, str) else "" if v is None else str(v) for v in added)
        return np.array(ids, dtype=np.int32)

    def process_ids(self, values: list[Any]) -> np.ndarray:
        """pid/tid: integers stay, anything else (e.g. "Spans") becomes a negative interned id."""
        try:
            column = np.array(values, dtype=np.int64)
            if column.shape == (len(values),):
                return column
        except (TypeError, ValueError, OverflowError):
            pass
        # Usually a handful of named processes among thousands of integer ones: patch those,
        # interning each distinct name once.
        foreign = [i for i, v in enumerate(values)
                   if type(v) is not int or not INT64_MIN <= v <= INT64_MAX]  # a name, or past int64
        texts = [str(values[i]) for i in foreign]
        names = dict.fromkeys(texts)
        for text, name_id in zip(names, self.ids(list(names)).tolist(), strict=True):
            names[text] = -(name_id + 2)
        patched = list(values)
        for i, text in zip(foreign, texts, strict=True):
            patched[i] = names[text]
        return np.array(patched, dtype=np.int64)


def _int_column(values: list[Any]) -> np.ndarray:
    """Integers with -1 for absent; odd values (strings, floats, bools) are converted one by one."""
    try:
        column = np.array(values, dtype=np.int64)
        if column.shape == (len(values),):  # lists as values would make a 2-D array
            return column
    except (TypeError, ValueError, OverflowError):
        pass
    return np.array([_int_or(v, -1) for v in values], dtype=np.int64)


def _float_column(values: list[Any], default: float) -> np.ndarray:
    try:
        column = np.array(values, dtype=np.float64)
        if column.shape == (len(values),):  # lists as values would make a 2-D array
            return column
    except (TypeError, ValueError, OverflowError):
        pass
    return np.array([float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default
                     for v in values], dtype=np.float64)


_NO_ARGS: dict[str, Any] = {}


def _columns(events: list[Any], rank: int, interner: _Interner, file: Path) -> dict[str, Any]:
    nan = float("nan")
    try:
        ts = _float_column([e.get("ts", nan) for e in events], nan)
    except AttributeError:
        raise TraceError(f"{file}: an entry of 'traceEvents' is not an object") from None
    phases = [e.get("ph", "") for e in events]
    # Timed events only: metadata ("M") events and events without a usable ts are dropped,
    # from the finished columns (masking arrays is cheaper than rebuilding the event list).
    is_metadata = np.array([p == "M" for p in phases], dtype=bool)
    metadata_events = list(compress(events, is_metadata.tolist()))
    keep = np.isfinite(ts) & ~is_metadata
    dur = _float_column([e.get("dur", 0.0) for e in events], 0.0)
    # µs rounding of ns clocks (and some exporters) can give a tiny negative duration.
    np.nan_to_num(dur, copy=False, nan=0.0)
    np.maximum(dur, 0.0, out=dur)
    args = [e.get("args") or _NO_ARGS for e in events]
    # Chrome-trace phases are single ASCII letters; anything else is no known phase (0).
    ph = np.array([ord(p[0]) if isinstance(p, str) and p and p[0] < "\x80" else 0 for p in phases], dtype=np.uint8)
    flow = (ph == ord("s")) | (ph == ord("f")) | (ph == ord("t"))
    flow_ids = np.full(len(events), -1, dtype=np.int64)
    if flow.any():
        flow_rows = np.flatnonzero(flow).tolist()
        flow_ids[flow] = _int_column([events[i].get("id", -1) for i in flow_rows])
    columns = {
        "name_id": interner.ids([e.get("name", "") for e in events]),
        "cat_id": interner.ids([e.get("cat", "") for e in events]),
        "ph": ph,
        "pid": interner.process_ids([e.get("pid", -1) for e in events]),
        "tid": interner.process_ids([e.get("tid", -1) for e in events]),
        "ts": ts,
        "dur": dur,
        **_arg_columns(args),
        "flow_id": flow_ids,
    }
    everything = keep.all()
    n = len(events) if everything else int(keep.sum())
    return {
        **(columns if everything else {key: column[keep] for key, column in columns.items()}),
        "rank": np.full(n, rank, dtype=np.int32),
        "raw_args": args if everything else list(compress(args, keep.tolist())),
        "metadata_events": metadata_events,
    }


def _arg_columns(args: list[Any]) -> dict[str, np.ndarray]:
    try:
        return {
            "stream": _int_column([a.get("stream", -1) for a in args]),
            "correlation": _int_column([a.get("correlation", -1) for a in args]),
            "external_id": _int_column([a.get("External id", -1) for a in args]),
        }
    except AttributeError:  # an "args" that is not an object: treated as no args
        for i, a in enumerate(args):
            if not isinstance(a, dict):
                args[i] = _NO_ARGS
        return _arg_columns(args)


def _thread_names(events: list[Any], rank: int) -> dict[tuple[int, int, int], str]:
    names = {}
    for event in events:
        if isinstance(event, dict) and event.get("ph") == "M" and event.get("name") == "thread_name":
            args = event.get("args")
            label = args.get("name") if isinstance(args, dict) else None
            if isinstance(label, str):
                names[(rank, _int_or(event.get("pid"), -1), _int_or(event.get("tid"), -1))] = label
    return names


def load_trace(
    path: str | os.PathLike[str],
    progress: ProgressCallback | None = None,
    max_bytes: int | None = None,
) -> Trace:
    """Load a trace file or a directory of per-rank trace files.

    Raises TraceError (one line) for anything that is not a usable chrome trace. Pauses
    Python's cyclic garbage collector while it runs: call it in an analysis process or
    a CLI, never on a serving process's threads (the serving process never parses traces).
    """
    files = trace_files(path)
    limit = max_trace_bytes() if max_bytes is None else max_bytes
    with paused_gc():
        return _load(path, files, limit, progress)


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector. A parsed trace is millions of small dicts and
    lists, none of them cyclic garbage; with the collector on, its full passes over them
    cost as much as the parse (and, later, the detectors) themselves."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _load(path: str | os.PathLike[str], files: list[Path], limit: int, progress: ProgressCallback | None) -> Trace:
    interner = _Interner()
    parts: list[dict[str, Any]] = []
    metadata: dict[int, dict[str, Any]] = {}
    thread_names: dict[tuple[int, int, int], str] = {}
    for index, file in enumerate(files):
        data = read_bytes(file, limit)
        if progress:
            progress("read")
        document, events = parse_document(file, data)
        del data
        if progress:
            progress("parse")
        claimed = claimed_rank(document)  # type-checked and in int32 range, else the file's index
        rank = index if claimed is None else claimed
        if rank in metadata:  # two files claim one rank: keep them apart (the analysis warns)
            rank = max(metadata) + 1 if max(metadata) < MAX_RANK else min(set(range(len(files))) - set(metadata))
        document[SOURCE_FILE_KEY] = file.name
        metadata[rank] = document
        columns = _columns(events, rank, interner, file)
        thread_names.update(_thread_names(columns.pop("metadata_events"), rank))
        parts.append(columns)
        del events
        if progress:
            progress("columns")
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
