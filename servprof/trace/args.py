"""Each event's ``args``, kept as JSON text and decoded only for the rows a detector reads.

Decoding every event's args into dicts was most of a trace's memory and a large share of its
load time, while detectors read the args of a few rows (kernels' shapes, thread names).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import orjson


class RawArgs(Sequence[Any]):
    """Row -> that event's args (a dict, or whatever the trace held there), decoded on first
    read and then kept. Built in segments: JSON text with each row's start and end in it, or
    values already decoded."""

    def __init__(self) -> None:
        self._first_rows: list[int] = []  # first row of each segment
        self._segments: list[tuple[bytes, np.ndarray, np.ndarray] | list[Any]] = []
        self._rows = 0
        self._decoded: dict[int, Any] = {}

    def add_text(self, text: bytes, starts: np.ndarray, ends: np.ndarray) -> None:
        """Rows whose args are ``text[starts[i]:ends[i]]``."""
        offsets = np.uint32 if len(text) < 2**32 else np.int64  # (8 bytes a row instead of 16)
        self._add((text, starts.astype(offsets), ends.astype(offsets)), len(starts))

    def add_values(self, values: list[Any]) -> None:
        self._add(values, len(values))

    def extend(self, other: RawArgs) -> None:
        """Append another store's rows after these."""
        for first, segment in zip(other._first_rows, other._segments, strict=True):
            self._first_rows.append(self._rows + first)
            self._segments.append(segment)
        self._rows += other._rows

    def _add(self, segment: tuple[bytes, np.ndarray, np.ndarray] | list[Any], rows: int) -> None:
        if rows:
            self._first_rows.append(self._rows)
            self._segments.append(segment)
            self._rows += rows

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, row: int) -> Any:  # type: ignore[override]
        row = int(row)
        if row < 0:
            row += self._rows
        if not 0 <= row < self._rows:
            raise IndexError(row)
        if row in self._decoded:
            return self._decoded[row]
        index = bisect_right(self._first_rows, row) - 1
        segment, offset = self._segments[index], row - self._first_rows[index]
        if isinstance(segment, list):
            return segment[offset]
        text, starts, ends = segment
        try:
            value = orjson.loads(memoryview(text)[int(starts[offset]):int(ends[offset])])
        except orjson.JSONDecodeError:  # text the event decoder let through unchecked (not UTF-8)
            value = None
        self._decoded[row] = value
        return value

    def __iter__(self) -> Iterator[Any]:
        return (self[row] for row in range(self._rows))
