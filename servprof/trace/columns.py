"""Batches of decoded events -> one file's numpy columns.

Events arrive as msgspec Structs holding only the fields servprof reads: TypedEvents (the three
args the columns need read in the same pass, the batch's text kept for the rest), Events
(``args`` as raw JSON text: a big trace, or a batch with odd args values), or, for a batch both
refuse, the dicts orjson makes; all end in the same columns. Strings are interned per file in order of first appearance and mapped to the
trace's ids when the file ends, so ids do not depend on where batches were cut.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import orjson

from servprof.trace.allocator import give_back_freed_memory
from servprof.trace.args import RawArgs, args_text, raw_args_of
from servprof.trace.errors import TraceError
from servprof.trace.model import distinct
from servprof.trace.split import DICTS, TYPED
from servprof.trace.values import (
    NO_ARGS,
    Interner,
    arg_columns,
    float_column,
    int_column,
    phase_codes,
    process_column,
    thread_names,
)

NAN = float("nan")
_FLOW_PHASES = (ord("s"), ord("f"), ord("t"))


class _EventFields(msgspec.Struct, gc=False):
    """What servprof reads of a chrome-trace event, but its args. Any JSON value is accepted in
    each field (the columns convert them, as they did orjson's values)."""

    ph: Any = ""
    name: Any = ""
    cat: Any = ""
    pid: Any = -1
    tid: Any = -1
    ts: Any = NAN
    dur: Any = 0.0
    id: Any = -1


class Event(_EventFields, gc=False):
    """An event with ``args`` kept as JSON text."""

    args: msgspec.Raw = msgspec.Raw(b"{}")


class _ArgFields(msgspec.Struct, gc=False):
    """The args every event's row needs; all other args stay text until read."""

    stream: int = -1
    correlation: int = -1
    external_id: int = msgspec.field(default=-1, name="External id")


class TypedEvent(_EventFields, gc=False):
    """An Event whose args hold integers where the columns read them (any other batch: Events)."""

    args: _ArgFields = msgspec.field(default_factory=_ArgFields)


EVENTS = msgspec.json.Decoder(list[Event])
TYPED_EVENTS = msgspec.json.Decoder(list[TypedEvent])
_ARG_FIELDS = msgspec.json.Decoder(list[_ArgFields])


class FileColumns:
    """One trace file's events, added a batch at a time."""

    def __init__(self, path: Any) -> None:
        self.path = path
        # Strings in order of first appearance in this file (mapped to the trace's ids by finish()).
        self.names, self.cats, self.pid_names, self.tid_names = (Interner(texts=False) for _ in range(4))
        self.parts: dict[str, list[np.ndarray]] = {}  # column -> its pieces, one per batch
        self.rows = 0
        # Rows whose pid/tid is a name, with that name's id in pid_names/tid_names.
        self.named: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"pid": [], "tid": []}
        self.args = RawArgs()
        self.metadata_events: list[dict[str, Any]] = []

    def add(self, events: list[Any], kind: str, text: Any = None) -> None:
        """One batch (split.Batch): its events, their kind, and for TYPED the text they came from."""
        if not isinstance(events, list):
            raise TraceError(f"{self.path}: 'traceEvents' is not a list")
        if not events:
            return
        if kind == TYPED:
            self._add_typed(events, text)
        elif kind == DICTS:
            self._add_dicts(events)
        else:
            self._add_structs(events)

    def _add_typed(self, events: list[TypedEvent], text: Any) -> None:
        phases = [e.ph for e in events]
        args = [e.args for e in events]

        def arg_columns() -> dict[str, np.ndarray]:  # (list comprehensions: faster than map(attrgetter))
            return {"stream": np.fromiter([a.stream for a in args], dtype=np.int64, count=len(args)),
                    "correlation": np.fromiter([a.correlation for a in args], dtype=np.int64, count=len(args)),
                    "external_id": np.fromiter([a.external_id for a in args], dtype=np.int64, count=len(args))}

        keep, metadata_rows = self._add_fields(
            phases, [e.name for e in events], [e.cat for e in events], [e.pid for e in events],
            [e.tid for e in events], [e.ts for e in events], [e.dur for e in events],
            lambda rows: [events[i].id for i in rows], arg_columns)
        kept = None if keep.all() else keep
        named = [i for i in metadata_rows if events[i].name == "thread_name"]
        if not named:
            self.args.add_batch(text, int(np.count_nonzero(keep)), kept)
            return
        # Thread names are decoded from their args' text, as in every other batch: this batch's
        # args are found now (the rows' too).
        raws = raw_args_of(text)
        for i in named:
            event = events[i]
            self.metadata_events.append({"ph": "M", "name": "thread_name", "pid": event.pid, "tid": event.tid,
                                         "args": _decoded(raws[i])})
        if kept is not None:
            raws = [raw for raw, k in zip(raws, keep.tolist(), strict=True) if k]
        self.args.add_text(*args_text(raws))

    def _add_structs(self, events: list[Event]) -> None:
        raws = [e.args for e in events]
        # The args as one JSON array (RawArgs keeps it; the arg columns decode it as it is).
        text, starts, ends = args_text(raws)
        del raws
        phases = [e.ph for e in events]
        keep, metadata_rows = self._add_fields(
            phases, [e.name for e in events], [e.cat for e in events], [e.pid for e in events],
            [e.tid for e in events], [e.ts for e in events], [e.dur for e in events],
            lambda rows: [events[i].id for i in rows], lambda: _arg_columns_of_text(text, starts, ends))
        self.args.add_text(text, starts[keep], ends[keep])
        for i in metadata_rows:  # thread names: a few metadata events
            event = events[i]
            if event.name == "thread_name":
                self.metadata_events.append({"ph": "M", "name": "thread_name", "pid": event.pid, "tid": event.tid,
                                             "args": _decoded(event.args)})

    def _add_dicts(self, events: list[Any]) -> None:
        try:
            ts = [e.get("ts", NAN) for e in events]
        except AttributeError:
            raise TraceError(f"{self.path}: an entry of 'traceEvents' is not an object") from None
        phases = [e.get("ph", "") for e in events]
        raw_args = [e.get("args") or NO_ARGS for e in events]
        keep, metadata_rows = self._add_fields(
            phases, [e.get("name", "") for e in events], [e.get("cat", "") for e in events],
            [e.get("pid", -1) for e in events], [e.get("tid", -1) for e in events], ts,
            [e.get("dur", 0.0) for e in events], lambda rows: [events[i].get("id", -1) for i in rows],
            lambda: arg_columns(raw_args))  # (replaces args that are not objects by NO_ARGS)
        self.args.add_values([a for a, kept in zip(raw_args, keep.tolist(), strict=True) if kept])
        self.metadata_events.extend(events[i] for i in metadata_rows)

    def _add_fields(self, phases: list[Any], names: list[Any], cats: list[Any], pids: list[Any],
                    tids: list[Any], ts: list[Any], dur: list[Any], flow_ids: Any,
                    args: Any) -> tuple[np.ndarray, list[int]]:
        """Append one batch's columns. Returns the rows kept (timed events: a finite ts, phase
        not "M") and the metadata ("M") rows. ``flow_ids(rows)`` and ``args()`` give the
        flow ids of some rows and the stream, correlation and External id columns."""
        n = len(phases)
        ts_column = float_column(ts, NAN)
        ph = phase_codes(phases)
        metadata_rows = [i for i in np.flatnonzero(ph == ord("M")).tolist() if phases[i] == "M"]
        keep = np.isfinite(ts_column)
        keep[metadata_rows] = False
        kept = int(np.count_nonzero(keep))
        dur_column = float_column(dur, 0.0)
        # µs rounding of ns clocks (and some exporters) can give a tiny negative duration.
        np.nan_to_num(dur_column, copy=False, nan=0.0)
        np.maximum(dur_column, 0.0, out=dur_column)
        flow = (ph == _FLOW_PHASES[0]) | (ph == _FLOW_PHASES[1]) | (ph == _FLOW_PHASES[2])  # (np.isin: numpy.ma's import)
        flow_id = np.full(n, -1, dtype=np.int64)
        if flow.any():
            flow_id[flow] = int_column(flow_ids(np.flatnonzero(flow).tolist()))
        row_after_keep = None if kept == n else np.cumsum(keep) - 1
        for key, values, names_table in (("pid", pids, self.pid_names), ("tid", tids, self.tid_names)):
            column, rows, ids = process_column(values, names_table)
            if rows.size:
                if row_after_keep is not None:
                    rows, ids = row_after_keep[rows[keep[rows]]], ids[keep[rows]]
                self.named[key].append((rows + self.rows, ids))
            self._append(key, column, keep, kept)
        for key, column in (("name_id", self.names.ids(names)), ("cat_id", self.cats.ids(cats)), ("ph", ph),
                            ("ts", ts_column), ("dur", dur_column), *args().items(), ("flow_id", flow_id)):
            self._append(key, column, keep, kept)
        self.rows += kept
        return keep, metadata_rows

    def _append(self, key: str, column: np.ndarray, keep: np.ndarray, kept: int) -> None:
        self.parts.setdefault(key, []).append(column if kept == len(column) else column[keep])

    def finish(self, rank: int, interner: Interner) -> tuple[dict[str, np.ndarray], dict[tuple[int, int, int], str]]:
        """The file's columns with the trace's string ids (interned here in the order the orjson
        loader used: names, categories, named pids, named tids), and its thread names."""
        if not self.parts:  # no events at all: empty columns
            self._add_fields([], [], [], [], [], [], [], list, lambda: arg_columns([]))
        maps = {key: interner.absorb(table) for key, table in
                (("name_id", self.names), ("cat_id", self.cats), ("pid", self.pid_names), ("tid", self.tid_names))}
        columns = {}
        for key in COLUMN_ORDER:  # one column at a time: its pieces and the whole, never all twice
            parts = self.parts.pop(key)
            columns[key] = parts[0] if len(parts) == 1 else np.concatenate(parts)
            del parts
            if self.rows >= TRIM_ROWS:
                give_back_freed_memory()
        for key in ("name_id", "cat_id"):
            columns[key] = maps[key][columns[key]]
        for key in ("pid", "tid"):
            for rows, ids in self.named[key]:
                columns[key][rows] = -(maps[key][ids].astype(np.int64) + 2)
        columns["rank"] = np.full(self.rows, rank, dtype=np.int32)
        return columns, thread_names(self.metadata_events, rank)


COLUMN_ORDER = ("name_id", "cat_id", "ph", "pid", "tid", "ts", "dur", "stream", "correlation", "external_id",
                "flow_id")


TRIM_ROWS = 1_000_000  # a file this big gives freed memory back after each column

_ARG_KEYS = (b'"stream"', b'"correlation"', b'"External id"')
SAMPLE_BYTES = 64 * 1024
# Fewer rows than this (in a sample) naming an arg column: only those are decoded. (Measured: a
# batch of Python frames, none naming one, 0.45-0.5x the full decode's time; 8% naming one, 1.6x.)
SPARSE_SHARE = 0.03


def _arg_columns_of_text(text: bytes, starts: np.ndarray, ends: np.ndarray) -> dict[str, np.ndarray]:
    """stream, correlation and External id of each event, from its args' JSON text (a JSON array
    of them, the row's args at ``text[starts[i]:ends[i]]``). Where few rows name them (Python
    frames' args never do), only the rows whose text does are decoded: found by searching the
    text, which is much faster than decoding it."""
    sampled = int(np.searchsorted(starts, SAMPLE_BYTES))
    # (A key written with escapes would not be found. A one-byte search first: a two-byte one
    # takes 25x as long on args text without any backslash, 7 ms on a 7 MB batch.)
    if sampled >= 32 and (b"\\" not in text or b"\\u" not in text):
        mentions = sum(text.count(key, 0, SAMPLE_BYTES) for key in _ARG_KEYS)
        if mentions < SPARSE_SHARE * sampled:
            sparse = _sparse_arg_columns(text, starts, ends)
            if sparse is not None:
                return sparse
    return _all_arg_columns(text, starts, ends)


def _sparse_arg_columns(text: bytes, starts: np.ndarray, ends: np.ndarray) -> dict[str, np.ndarray] | None:
    """The arg columns, decoding only the rows whose text names one (None: decode them all)."""
    positions: list[int] = []
    for key in _ARG_KEYS:
        find, at = text.find, text.find(key)
        while at >= 0:
            positions.append(at)
            at = find(key, at + 1)
    rows = distinct(np.searchsorted(starts, np.array(positions, dtype=np.int64), side="right") - 1)
    columns = {key: np.full(starts.size, -1, dtype=np.int64) for key in ("stream", "correlation", "external_id")}
    if rows.size == 0:
        return columns
    view = memoryview(text)
    pieces = [view[a:b] for a, b in zip(starts[rows].tolist(), ends[rows].tolist(), strict=True)]
    found = _arg_columns_of(b"".join((b"[", b",".join(pieces), b"]")))
    if found is None:
        return None
    for key, values in found.items():
        columns[key][rows] = values
    return columns


def _arg_columns_of(array_text: bytes) -> dict[str, np.ndarray] | None:
    """The arg columns of a JSON array of args objects, when each is an object of integers."""
    try:
        fields = _ARG_FIELDS.decode(array_text)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError, OverflowError):
        return None
    n = len(fields)
    return {"stream": np.fromiter([a.stream for a in fields], dtype=np.int64, count=n),
            "correlation": np.fromiter([a.correlation for a in fields], dtype=np.int64, count=n),
            "external_id": np.fromiter([a.external_id for a in fields], dtype=np.int64, count=n)}


def _all_arg_columns(text: bytes, starts: np.ndarray, ends: np.ndarray) -> dict[str, np.ndarray]:
    columns = _arg_columns_of(text)
    if columns is not None:
        return columns
    # Not all integers (or args that are not objects): converted as from orjson's values, the
    # whole array in one call (row by row only when it does not decode).
    try:
        values = orjson.loads(text)
    except orjson.JSONDecodeError:
        values = None
    if not isinstance(values, list) or len(values) != starts.size:
        values = [_decoded(text[s:e]) for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]
    return arg_columns([value or NO_ARGS for value in values])


def _decoded(text: Any) -> Any:
    try:
        return orjson.loads(memoryview(text))
    except orjson.JSONDecodeError:
        return None
