"""Turning the values a chrome trace holds (any JSON, as written by any exporter) into numpy
columns: integers with -1 for absent, floats with a default, and strings interned to ids."""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import islice
from typing import Any

import numpy as np
import orjson

from servprof.trace.meta import MAX_RANK, claimed_rank

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_NO_ROWS = np.zeros(0, dtype=np.int64)


def int_or(value: Any, default: int) -> int:
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


def as_array(values: Sequence[Any], dtype: Any) -> np.ndarray | None:
    """``values`` as a 1-D array of ``dtype`` when numpy takes them as they are, else None."""
    try:  # (np.fromiter converts as np.array does, a little faster, and never makes a 2-D array)
        return np.fromiter(values, dtype=dtype, count=len(values))
    except (TypeError, ValueError, OverflowError):
        return None


def int_column(values: Sequence[Any]) -> np.ndarray:
    """Integers with -1 for absent; odd values (strings, floats, bools) are converted one by one."""
    column = as_array(values, np.int64)
    return column if column is not None else np.array([int_or(v, -1) for v in values], dtype=np.int64)


def float_column(values: Sequence[Any], default: float) -> np.ndarray:
    column = as_array(values, np.float64)
    return column if column is not None else np.array([_float_or(v, default) for v in values], dtype=np.float64)


def _float_or(value: Any, default: float) -> float:
    if isinstance(value, float):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an integer literal past 1e308
            return default
    return default


def phase_codes(phases: Sequence[Any]) -> np.ndarray:
    """ord() of each chrome-trace phase's first character; 0 for anything that does not start with an
    ASCII letter. (Worked out once per distinct phase: a trace has a handful.)"""
    n = len(phases)
    try:  # Every phase one ASCII character (as written): joined with NULs, one C-level pass.
        joined = "\0".join(phases)
    except TypeError:  # a phase that is not a string
        joined = ""
    if n and len(joined) == 2 * n - 1 and joined.isascii():
        codes = np.frombuffer(joined.encode("ascii"), dtype=np.uint8)
        # NULs exactly between the phases: then each phase is one character (none was "" or longer).
        if not codes[1::2].any() and codes[0::2].all():
            return codes[0::2].copy()
    try:
        codes = {p: _phase_code(p) for p in set(phases)}
    except TypeError:  # an unhashable phase (a list, a dict)
        return np.array([_phase_code(p) for p in phases], dtype=np.uint8)
    return np.fromiter(map(codes.__getitem__, phases), dtype=np.uint8, count=len(phases))


def _phase_code(phase: Any) -> int:
    return ord(phase[0]) if isinstance(phase, str) and phase and phase[0] < "\x80" else 0


class _Ids(dict):  # type: ignore[type-arg]
    """value -> id; a value not seen yet gets the next id as it is looked up."""

    def __missing__(self, key: Any) -> int:
        value = self[key] = len(self)
        return value


class Interner:
    """Strings to ids in order of first appearance; ``strings`` holds each id's text (kept only
    with ``texts``: a file's own tables need the order alone)."""

    def __init__(self, texts: bool = True) -> None:
        self.lookup: dict[Any, int] = _Ids()
        self.strings: list[str] = []
        self._texts = texts

    def ids(self, values: Sequence[Any]) -> np.ndarray:
        lookup = self.lookup
        try:
            # One C-level pass; only values not seen yet cost a Python call (__missing__).
            ids = np.fromiter(map(lookup.__getitem__, values), dtype=np.int32, count=len(values))
        except TypeError:  # an unhashable name (a list, a dict): that one becomes its text, the rest
            # stay as they are (None, a number), so that each gets the same id in every batch
            ids = np.fromiter(map(lookup.__getitem__, (str(v) if type(v).__hash__ is None else v for v in values)),
                              dtype=np.int32, count=len(values))
        known = len(self.strings)
        if self._texts and known < len(lookup):
            # Only the names this call added (dicts keep insertion order): the work stays
            # proportional to what is new, however many calls come.
            added = list(islice(lookup, known, None))
            # Non-string names (numbers, None) were interned as themselves; store their text.
            self.strings.extend(v if isinstance(v, str) else "" if v is None else str(v) for v in added)
        return ids

    def absorb(self, other: Interner) -> np.ndarray:
        """Intern everything ``other`` holds, in its order; returns its ids mapped to ours."""
        return self.ids(list(other.lookup))

    def process_ids(self, values: Sequence[Any]) -> np.ndarray:
        """pid/tid: integers stay, anything else (e.g. "Spans") becomes -(id+2) of its text."""
        column, named_rows, named_ids = process_column(values, self)
        column[named_rows] = -(named_ids.astype(np.int64) + 2)
        return column


def process_column(values: Sequence[Any], names: Interner) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """pid/tid values as int64, with the rows holding a name (or an int past int64) and those
    names' ids in ``names``; the column holds 0 on those rows until the caller sets them.

    Each value is what numpy makes of it as an int64, whatever else its batch holds: a tid written
    as text ("25738", as 2021 Kineto traces write their runtime events' tids, beside the int
    25738 of the same thread's ops) is that thread; a value numpy cannot take ("stream 7",
    "Spans", null, an int past int64) is a name."""
    column = as_array(values, np.int64)
    if column is not None:
        return column, _NO_ROWS, _NO_ROWS
    # Usually a handful of named processes among thousands of integer ones: find them by type in
    # one C-level pass, then ask numpy of those (as the whole batch was asked above): all at once,
    # else once per distinct value.
    types = np.fromiter(map(type, values), dtype=object, count=len(values))
    patched = list(values)
    named: list[int] = []
    others = np.flatnonzero(np.not_equal(types, int)).tolist()
    numbers = as_array([values[i] for i in others], np.int64)  # all numbers as text: one call
    if numbers is not None:
        for i, number in zip(others, numbers.tolist(), strict=True):
            patched[i] = number
        others = []
    seen: dict[tuple[type, Any], int | None] = {}  # (a tid repeats on every event of its thread)
    for i in others:
        value = values[i]
        key = (type(value), value) if type(value).__hash__ is not None else None
        if key is None or key not in seen:
            number = as_array((value,), np.int64)
            converted = None if number is None else int(number[0])
            if key is not None:
                seen[key] = converted
        else:
            converted = seen[key]
        if converted is None:
            named.append(i)
            patched[i] = 0
        else:
            patched[i] = converted
    column = as_array(patched, np.int64)
    if column is None:  # an int past int64 among them: a name too
        big = [i for i, v in enumerate(patched) if type(v) is int and not INT64_MIN <= v <= INT64_MAX]
        for i in big:
            patched[i] = 0
        named = sorted(named + big)
        column = np.array(patched, dtype=np.int64)
    return column, np.array(named, dtype=np.int64), names.ids([str(values[i]) for i in named])


NO_ARGS: dict[str, Any] = {}


def arg_columns(args: list[Any]) -> dict[str, np.ndarray]:
    """stream, correlation and External id from each event's args (dicts; others count as none)."""
    try:
        return {
            "stream": int_column([a.get("stream", -1) for a in args]),
            "correlation": int_column([a.get("correlation", -1) for a in args]),
            "external_id": int_column([a.get("External id", -1) for a in args]),
        }
    except AttributeError:  # an "args" that is not an object: treated as no args
        for i, a in enumerate(args):
            if not isinstance(a, dict):
                args[i] = NO_ARGS
        return arg_columns(args)


def thread_names(events: list[Any], rank: int) -> dict[tuple[int, int, int], str]:
    """(rank, pid, tid) -> name, from the ``thread_name`` metadata events."""
    names = {}
    for event in events:
        if isinstance(event, dict) and event.get("ph") == "M" and event.get("name") == "thread_name":
            args = event.get("args")
            label = args.get("name") if isinstance(args, dict) else None
            if isinstance(label, str):
                names[(rank, int_or(event.get("pid"), -1), int_or(event.get("tid"), -1))] = label
    return names


def normalise_metadata(document: dict[str, Any]) -> dict[str, Any]:
    """A file's top-level keys (without traceEvents), with servprof's session metadata decoded
    where ``add_metadata_json`` stored it as JSON text."""
    servprof_meta = document.get("servprof")
    if isinstance(servprof_meta, (str, bytes)):
        try:
            document["servprof"] = orjson.loads(servprof_meta)
        except orjson.JSONDecodeError:
            document["servprof"] = {}
    return document


def file_rank(document: dict[str, Any], index: int, taken: Sequence[int]) -> int:
    """The rank a file's ``distributedInfo.rank`` names (servprof.trace.meta.claimed_rank): its
    index in the directory when that names none; a rank two files claim goes to the second as the
    next free one (the analysis warns about it)."""
    claimed = claimed_rank(document)
    rank = index if claimed is None else claimed
    if rank in taken:
        rank = max(taken) + 1
        if rank > MAX_RANK:
            rank = next(r for r in range(len(taken) + 1) if r not in taken)
    return rank
