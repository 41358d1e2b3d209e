"""The ``traceEvents`` array of a chrome trace, decoded a batch at a time as its text streams in.

A trace is never held whole: the text arrives in chunks (source.read_chunks), the top-level
keys before the array are parsed once the array's opening bracket is seen, and the array is
cut after an event that is followed by another (``}`` ``,`` ``{``), every few MB. A candidate
cut can fall inside a string or a nested object; the text up to it is then not valid JSON
and the decoder fails in its last event, so the cut moves back one event (the next batch
starts there). A failure before the last event is the file's own error. When the array
closes, the rest of the file (the keys after the array) is parsed with the last events.

Each batch is decoded by the typed decoder when one is given (``typed``: args' stream,
correlation and External id read in the same pass) and the batch's text comes with it; a batch
that decoder refuses (an odd args value) goes to the raw-args decoder, as every batch does once
``typed`` is set to None (a big trace: its batches' text is not kept).

A file this cannot follow (``traceEvents`` not within the first 64 MiB, or a run of false
cuts) raises NotStreamable: the caller parses it whole, as the loader always did.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import orjson

from servprof.trace.errors import TraceError
from servprof.trace.source import UTF8_BOM

BATCH_BYTES = 1024**2  # (with 1 MiB reads: batches of 1-2 MiB, which stay in cache while decoded)
HEADER_SCAN_BYTES = 64 * 1024**2  # traceEvents further in than this: parse the file whole
# A tail (the text after the last cut) is parsed twice, its keys and then its events; one this
# short costs less so than another batch's fixed costs.
TAIL_BYTES = 128 * 1024
MAX_FALSE_CUTS = 32  # per file; past that the text is not worth cutting (parsed whole)
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
# Whitespace between events is bounded so that a search never rescans a long run of it (a file
# padded with megabytes of blanks): events further apart than this are simply not cut there.
_BOUNDARY = re.compile(rb"\}\s{0,256},\s{0,256}(?=\{)")
_BOUNDARY_SPAN = 600
_MSGSPEC_BYTE = re.compile(r"\(byte (\d+)\)")
_POSITION = re.compile(r": line \d+ column \d+ \(char \d+\)| \(byte \d+\)")
_LITERAL_SLACK = 8  # a decoder may place an error at the start of a literal cut short (``tr``)
_NOT_SPACE = re.compile(rb"\S")
_TAIL_KEYS = msgspec.json.Decoder(dict[str, msgspec.Raw])


class NotStreamable(Exception):
    """This file's text cannot be cut into batches; parse it whole."""


class _CutError(Exception):
    """The text up to a candidate cut is not valid JSON in its last event: the cut is wrong."""


class _ArrayClosed(Exception):
    """The batch holds the end of the events array: the rest of the file is the tail."""


# What a batch's events are: ``typed`` decoder's Structs, ``decoder``'s (args as raw text), or
# the dicts orjson makes (a batch both refuse: odd values, deep nesting).
TYPED, STRUCTS, DICTS = "typed", "structs", "dicts"
Batch = tuple[list[Any], str, Any]  # (events, which of the above, the text they were decoded from)


class EventBatches:
    """Iterate to get a Batch per batch of events. ``metadata`` holds the top-level keys other
    than traceEvents once iteration ends."""

    def __init__(self, path: Path, chunks: Iterator[bytes], decoder: msgspec.json.Decoder,
                 batch_bytes: int = BATCH_BYTES, typed: msgspec.json.Decoder | None = None) -> None:
        self.path = path
        self.decoder = decoder
        self.typed = typed
        self.batch_bytes = batch_bytes
        self.metadata: dict[str, Any] = {}
        self._chunks = chunks
        self._buf = bytearray()
        self._offset = 0  # file offset of _buf[0], for error messages
        self._read = 0  # bytes of text read
        self._eof = False
        self._false_cuts = 0
        self._searched = 0  # the buffer up to here holds no cut (until the buffer is dropped)

    # -- the buffer ------------------------------------------------------------------------

    def _fill(self, size: int) -> None:
        """Read until the buffer holds ``size`` bytes or the text ends."""
        while not self._eof and len(self._buf) < size:
            chunk = next(self._chunks, None)
            if chunk is None:
                self._eof = True
            else:
                self._buf += chunk
                self._read += len(chunk)

    def _drop(self, upto: int) -> None:
        del self._buf[:upto]
        self._offset += upto
        self._searched = 0

    # -- the document ----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        start = self._events_start()
        self._drop(start)
        yield from self._batches()

    def _events_start(self) -> int:
        """Position just after the events array's ``[``, with the keys before it parsed."""
        self._fill(64 * 1024)
        if self._buf.startswith(UTF8_BOM):  # (a trace re-saved by a Windows editor)
            self._drop(len(UTF8_BOM))
        first = _NOT_SPACE.search(self._buf)
        self._array_format = first is not None and self._buf[first.start()] == ord("[")
        if self._array_format:  # the chrome-trace "JSON Array Format": no keys, events only
            return first.start() + 1
        if first is None or self._buf[first.start()] != ord("{"):
            raise NotStreamable  # blank or not JSON: the whole-file parse says which
        searched = 0
        while True:
            for match in _EVENTS_KEY.finditer(self._buf, searched):
                # The key is the top level's when the text before it, closed, is a valid object
                # (inside a string or a nested value, the text cannot close with "]}").
                try:
                    head = orjson.loads(bytes(self._buf[:match.end()]) + b"]}")
                except orjson.JSONDecodeError:
                    continue
                if isinstance(head, dict):
                    head.pop("traceEvents", None)
                    self.metadata.update(head)
                    return match.end()
            if self._eof or len(self._buf) > HEADER_SCAN_BYTES:
                raise NotStreamable
            searched = max(0, len(self._buf) - 64)
            self._fill(len(self._buf) + self.batch_bytes)

    def _batches(self) -> Iterator[Batch]:
        floor = 0  # cuts at or before this position are known to be wrong
        probe_at = 4 * self.batch_bytes
        while True:
            self._fill(self.batch_bytes + floor)
            if self._eof and len(self._buf) < TAIL_BYTES:
                break
            # (Past that, the text is cut at its end too: the tail, parsed twice, is then one event.)
            cuts = self._cuts(floor)
            batch = None
            while cuts:
                cut = cuts.pop()
                last_start = cuts[-1].end() if cuts else 0
                try:
                    text = b"".join((b"[", memoryview(self._buf)[:cut.start() + 1], b"]"))
                    batch = self._decode(text, last_start + 1)
                    break
                except _CutError:
                    floor = max(floor, cut.start()) if not cuts else floor
                    self._false_cuts += 1
                    if self._false_cuts > MAX_FALSE_CUTS:
                        raise NotStreamable from None
                except _ArrayClosed:
                    self._fill(2**62)  # the rest of the file is the keys after the array
                    break
            if batch is None:
                if self._eof:
                    break
                # One event (or one false cut) longer than the buffer: read on, but make sure
                # now and then that what is read is JSON at all (a file of NULs is not).
                if len(self._buf) >= probe_at:
                    probe_at *= 2
                    self._probe()
                self._fill(len(self._buf) + self.batch_bytes)
                continue
            yield batch
            self._drop(cut.end())
            floor = 0
        yield from self._tail()

    def _cuts(self, floor: int) -> list[re.Match[bytes]]:
        """Candidate cuts after ``floor``, the last few of the buffer (searched from its end)."""
        lowest = max(floor + 1, self._searched - _BOUNDARY_SPAN)
        window = 64 * 1024
        while True:
            start = max(lowest, len(self._buf) - window)
            cuts = list(_BOUNDARY.finditer(self._buf, start))
            if len(cuts) >= 2 or start == lowest:
                break
            window *= 8
        if not cuts:
            self._searched = len(self._buf)
        return cuts

    def _tail(self) -> Iterator[Batch]:
        """The last events and the keys after the array (the text has ended)."""
        text = (b"[" if self._array_format else b'{"traceEvents":[') + self._buf
        self._buf = bytearray()
        if self._array_format:
            yield self._decode(_closed_array(text), None)
            return
        try:
            keys = _TAIL_KEYS.decode(text)
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
            keys = None
        if keys is None:  # deep nesting or an error: orjson decides (and words the error)
            try:
                document = orjson.loads(text)
            except orjson.JSONDecodeError as exc:
                raise self._invalid(str(exc).splitlines()[0]) from None
            events = document.pop("traceEvents")
            self.metadata.update(document)
            yield events, DICTS, None
            return
        events_raw = keys.pop("traceEvents")
        try:
            self.metadata.update({key: orjson.loads(memoryview(value)) for key, value in keys.items()})
        except orjson.JSONDecodeError as exc:  # e.g. not UTF-8 (the key scan does not check)
            raise self._invalid(str(exc).splitlines()[0]) from None
        del keys
        yield self._decode(memoryview(events_raw), None)

    # -- decoding --------------------------------------------------------------------------

    def _decode(self, text: bytes | memoryview, last_start: int | None) -> Batch:
        """Decode one JSON array of events. ``last_start``: where its last event begins (errors
        from there on may be a wrong cut); None when the text is not a cut (its end is the file's)."""
        if self.typed is not None:
            try:
                return self.typed.decode(text), TYPED, text
            except msgspec.DecodeError as exc:
                if last_start is not None and "trailing" in str(exc):
                    raise _ArrayClosed from None  # (the whole array was valid: so it is for any decoder)
            except (RecursionError, UnicodeDecodeError):
                pass  # the raw-args decoder decides, as for every batch of a big trace
        try:
            return self.decoder.decode(text), STRUCTS, text
        except msgspec.ValidationError:
            pass  # an event that is not an object: orjson's values, and the columns say so
        except msgspec.DecodeError as exc:
            message = str(exc)
            if last_start is not None:
                if "trailing" in message:
                    raise _ArrayClosed from None
                position = _MSGSPEC_BYTE.search(message)
                if position is None or int(position.group(1)) >= last_start:
                    raise _CutError from None
        except (RecursionError, UnicodeDecodeError):
            pass  # nested deeper than the recursion limit, or not UTF-8: orjson decides
        try:
            return orjson.loads(text), DICTS, text
        except orjson.JSONDecodeError as exc:
            message = str(exc).splitlines()[0]
            if last_start is not None:
                if "unexpected content after document" in message:
                    raise _ArrayClosed from None
                if exc.pos >= last_start or "unexpected end of data" in message:
                    raise _CutError from None
            raise self._invalid(message) from None

    def _probe(self) -> None:
        """Raise TraceError when the buffered text is not the start of valid JSON."""
        text = b"[" + self._buf + b"]"
        try:
            msgspec.json.decode(text, type=list[msgspec.Raw])
        except msgspec.DecodeError as exc:
            position = _MSGSPEC_BYTE.search(str(exc))
            if position is not None and int(position.group(1)) < len(text) - _LITERAL_SLACK:
                raise self._invalid(str(exc)) from None
        except RecursionError:
            pass

    def _invalid(self, message: str) -> TraceError:
        """The file's own JSON error (positions in a batch's text mean nothing to the user)."""
        reason = _POSITION.sub("", message).replace("JSON is malformed: ", "")
        if any(words in reason for words in _TRUNCATED):
            return TraceError(f"{self.path}: the text ends before the trace does (its events array or object is "
                              f"never closed, after {self._read} bytes): the file was cut off "
                              "while it was written or copied (a profiler stopped before its export finished, a "
                              "full disk, a partial download); record or copy it again")
        where = f", in the text past byte {self._offset}" if self._offset else ""
        return TraceError(f"{self.path}: not valid JSON ({reason}{where})")


_TRUNCATED = ("unexpected end of data", "Input data was truncated")


def _closed_array(text: bytes) -> bytes:
    """The chrome-trace array format's text, with the closing ``]`` the format lets a writer leave
    out (after the last event, and a trailing comma, if any)."""
    body = text.rstrip()
    if body.endswith(b"]"):
        return text
    return (body[:-1] if body.endswith(b",") else body) + b"]"
