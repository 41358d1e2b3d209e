"""Each event's ``args``, kept as JSON text and decoded only for the rows a detector reads.

Decoding every event's args into dicts was most of a trace's memory and a large share of its
load time, while detectors read the args of a few rows (kernels' shapes, thread names). A small
trace keeps each batch's whole text instead (BatchText): where each row's args lie in it is
found only when a row of that batch is first read, which most loads (an idle split) never do.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import numpy as np
import orjson


class _ArgsOnly(msgspec.Struct, gc=False):
    args: msgspec.Raw = msgspec.Raw(b"{}")


ARGS_ONLY = msgspec.json.Decoder(list[_ArgsOnly])
Segment = tuple[bytes, np.ndarray, np.ndarray]


def args_text(raws: list[Any]) -> Segment:
    """Raw args as one JSON array (its text, and each one's start and end in it)."""
    text = b"".join((b"[", b",".join(raws), b"]"))
    lengths = np.fromiter(map(len, raws), dtype=np.int64, count=len(raws))
    ends = np.cumsum(lengths + 1)
    return text, ends - lengths, ends


def raw_args_of(text: Any) -> list[Any]:
    """Each event's raw args in a JSON array of events the typed decoder took (so this cannot fail)."""
    return [event.args for event in ARGS_ONLY.decode(text)]


class BatchText:
    """A batch's JSON text (an array of events) and the rows of it kept (None: all); its args'
    text is found on first read, after which the batch's text is let go."""

    __slots__ = ("text", "keep", "_segment")

    def __init__(self, text: Any, keep: np.ndarray | None) -> None:
        self.text, self.keep = text, keep
        self._segment: Segment | None = None

    def segment(self) -> Segment:
        if self._segment is None:
            text, keep = self.text, self.keep
            if text is None:  # another thread found them meanwhile (it sets _segment first)
                return self._segment  # type: ignore[return-value]
            raws = raw_args_of(text)
            if keep is not None:
                raws = [raw for raw, kept in zip(raws, keep.tolist(), strict=True) if kept]
            self._segment = _offsets(*args_text(raws))
            self.text = self.keep = None
        return self._segment


def _offsets(text: bytes, starts: np.ndarray, ends: np.ndarray) -> Segment:
    offsets = np.uint32 if len(text) < 2**32 else np.int64  # (8 bytes a row instead of 16)
    return text, starts.astype(offsets), ends.astype(offsets)


class RawArgs(Sequence[Any]):
    """Row -> that event's args (a dict, or whatever the trace held there), decoded on first
    read and then kept. Built in segments: JSON text with each row's start and end in it, or
    values already decoded."""

    def __init__(self) -> None:
        self._first_rows: list[int] = []  # first row of each segment
        self._segments: list[Segment | BatchText | list[Any]] = []
        self._rows = 0
        self._decoded: dict[int, Any] = {}

    def add_text(self, text: bytes, starts: np.ndarray, ends: np.ndarray) -> None:
        """Rows whose args are ``text[starts[i]:ends[i]]``."""
        self._add(_offsets(text, starts, ends), len(starts))

    def add_batch(self, text: Any, rows: int, keep: np.ndarray | None) -> None:
        """The ``rows`` events kept (``keep``; None: all) of a JSON array of events."""
        self._add(BatchText(text, keep), rows)

    def let_go_of_batches(self) -> None:
        """Keep only the args' text of every batch (what a big trace can afford)."""
        for segment in self._segments:
            if isinstance(segment, BatchText):
                segment.segment()

    def add_values(self, values: list[Any]) -> None:
        self._add(values, len(values))

    def extend(self, other: RawArgs) -> None:
        """Append another store's rows after these."""
        for first, segment in zip(other._first_rows, other._segments, strict=True):
            self._first_rows.append(self._rows + first)
            self._segments.append(segment)
        self._rows += other._rows

    def _add(self, segment: Segment | BatchText | list[Any], rows: int) -> None:
        if rows:
            self._first_rows.append(self._rows)
            self._segments.append(segment)
            self._rows += rows

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, row: int) -> Any:  # type: ignore[override]
        row = self._row(row)
        if row in self._decoded:
            return self._decoded[row]
        value, decoded = self._value(row)
        if decoded:
            self._decoded[row] = value
        return value

    def read(self, row: int) -> Any:
        """Row's args, decoded without keeping them (for one pass over many rows: kept, a trace's
        decoded args would grow with it)."""
        row = self._row(row)
        return self._decoded[row] if row in self._decoded else self._value(row)[0]

    def read_many(self, rows: np.ndarray) -> list[Any]:
        """read() of each row, the text of one segment decoded in one call."""
        out: list[Any] = [None] * len(rows)
        for members, rows_here, segment, offsets in self._by_segment(rows):
            if isinstance(segment, list):
                values = [segment[o] for o in offsets.tolist()]
            else:
                values = self._decode_many(segment, offsets)
            for i, row, value in zip(members.tolist(), rows_here.tolist(), values, strict=True):
                out[i] = self._decoded.get(row, value)
        return out

    def read_fields(self, rows: np.ndarray, decoder: msgspec.json.Decoder) -> list[Any]:
        """Some fields of each row's args, by ``decoder`` (of a list of Structs naming them, read
        as msgspec.Raw to stay text): much faster than decoding whole args where a pass needs a
        few of them. None for a row held as a value (not text), or of a segment's rows whose
        text the decoder refuses (args that are not objects): the caller reads those in full."""
        out: list[Any] = [None] * len(rows)
        for members, _, segment, offsets in self._by_segment(rows):
            if isinstance(segment, list):
                continue
            try:
                values = decoder.decode(_joined(segment, offsets))
            except (msgspec.DecodeError, RecursionError):
                continue
            for i, value in zip(members.tolist(), values, strict=True):
                out[i] = value
        return out

    def _by_segment(self, rows: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray, Segment | list[Any], np.ndarray]]:
        """The rows grouped by the segment holding them: (their indices in ``rows``, the rows, the
        segment (its text found), their offsets in it)."""
        rows = np.asarray(rows, dtype=np.int64) % max(self._rows, 1)
        segment_of = np.searchsorted(np.asarray(self._first_rows, dtype=np.int64), rows, side="right") - 1
        order = np.argsort(segment_of, kind="stable")
        bounds = np.flatnonzero(np.diff(segment_of[order])) + 1
        for members in np.split(order, bounds) if rows.size else []:
            index = int(segment_of[members[0]])
            segment = self._segments[index]
            if isinstance(segment, BatchText):
                segment = segment.segment()
            yield members, rows[members], segment, rows[members] - self._first_rows[index]

    @staticmethod
    def _decode_many(segment: Segment, offsets: np.ndarray) -> list[Any]:
        try:
            return orjson.loads(_joined(segment, offsets))  # type: ignore[no-any-return]
        except orjson.JSONDecodeError:  # one row's text is not JSON (not UTF-8, too deep): each on its own
            text, starts, ends = segment
            view = memoryview(text)
            return [_loads_or_none(view[a:b]) for a, b in zip(starts[offsets].tolist(), ends[offsets].tolist(),
                                                                 strict=True)]

    def _value(self, row: int) -> tuple[Any, bool]:
        """(the row's args, whether they were decoded from text)."""
        index = bisect_right(self._first_rows, row) - 1
        segment, offset = self._segments[index], row - self._first_rows[index]
        if isinstance(segment, list):
            return segment[offset], False
        text, starts, ends = segment.segment() if isinstance(segment, BatchText) else segment
        return _loads_or_none(memoryview(text)[int(starts[offset]):int(ends[offset])]), True

    def _row(self, row: int) -> int:
        row = int(row)
        if row < 0:
            row += self._rows
        if not 0 <= row < self._rows:
            raise IndexError(row)
        return row

    def __iter__(self) -> Iterator[Any]:
        return (self[row] for row in range(self._rows))


def _joined(segment: Segment, offsets: np.ndarray) -> bytes:
    """The args of some rows of a segment as one JSON array."""
    text, starts, ends = segment
    view = memoryview(text)
    pieces = [view[a:b] for a, b in zip(starts[offsets].tolist(), ends[offsets].tolist(), strict=True)]
    return b"".join((b"[", b",".join(pieces), b"]"))


def _loads_or_none(text: Any) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:  # text the event decoder let through unchecked (not UTF-8)
        return None
