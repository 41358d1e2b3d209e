"""The columnar trace: every timed event of one or more Kineto chrome traces as numpy columns.

Strings (names, categories) are interned to integer ids once at load time, so
selections like "all kernels" or "every event whose name starts with X" are
vector operations over ids rather than string compares per event.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

# Categories whose events ran on a device (GPU/accelerator) rather than on the host.
DEVICE_CATEGORIES = ("kernel", "Kernel", "gpu_memcpy", "Memcpy", "gpu_memset", "Memset", "mtia_ccp_events")
# Host-side runtime/driver calls that launch device work and carry a correlation id.
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver", "Runtime", "hip_runtime", "privateuse1_runtime",
                      "privateuse1_driver", "xpu_runtime", "xpu_driver")
# A record_function range recorded with CUDA activity is mirrored on the stream it launched onto
# (on a stream's pseudo-thread): the host range is the one to read.
DEVICE_MIRROR_CATEGORY = "gpu_user_annotation"


OBJECT_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _one_name_per_method(names: list[str], name_id: np.ndarray, lookup: dict[str, int]) -> np.ndarray:
    """torch's Python tracer names a built-in method by its object's repr, address included
    ("<built-in method sub of re.Pattern object at 0x7f...>"): the same call on 26 compiled patterns
    or on each request's lock was 26 frames, each with a 26th of the time, in every top-frames list.
    Names that differ only by that address become one (the first, without it); ``name_id`` is
    remapped, ``names`` and ``lookup`` gain the name without the address."""
    if " at 0x" not in "\n".join(names):  # (one C-level search: most traces have no Python frames)
        return name_id
    remap = np.arange(len(names), dtype=np.int64)
    for i, name in enumerate(names):
        plain = OBJECT_ADDRESS.sub("", name, count=1) if " at 0x" in name else name
        if plain == name:
            continue
        first = lookup.setdefault(plain, i)
        if first == i:
            names[i] = plain
        remap[i] = first
    return remap[name_id].astype(name_id.dtype, copy=False) if name_id.size else name_id


def distinct(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` of a 1-D array holding no NaN. Why: np.unique asks np.ma.is_masked of
    its input, which imports numpy.ma (~5 ms of a fresh process, more than a small trace's analysis)."""
    ordered = np.sort(values)
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))] if ordered.size else ordered


def median(values: Any) -> float:
    """``np.median`` of a non-empty sequence holding no NaN, without importing numpy.ma (which
    np.median does, ~5 ms of a fresh process)."""
    ordered = np.sort(np.asarray(values, dtype=float))
    mid = ordered.size // 2
    return float(ordered[mid]) if ordered.size % 2 else float((ordered[mid - 1] + ordered[mid]) / 2)


def distinct_first_inverse(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(values, return_index=True, return_inverse=True)`` of a 1-D array holding no
    NaN (each value's first index, and each element's place among the values), without numpy.ma."""
    order = np.argsort(values, kind="stable")  # (stable: the first of equal values comes first)
    ordered = values[order]
    new = np.concatenate(([True], ordered[1:] != ordered[:-1])) if ordered.size else np.zeros(0, dtype=bool)
    inverse = np.empty(values.size, dtype=np.intp)
    inverse[order] = np.cumsum(new) - 1
    return ordered[new], order[new], inverse


# Linux's PID_MAX_LIMIT: no OS thread id (Kineto writes those) is above it.
MAX_OS_TID = 4_194_304


class Trace:
    """Events of one or more ranks; row i of every column is the same event.

    (A plain class rather than a dataclass: loading a trace in a fresh process then needs no
    `dataclasses` import, which with `inspect` is a tenth of that process's imports.)"""

    def __init__(self, source: str, names: list[str], name_id: np.ndarray, cat_id: np.ndarray, ph: np.ndarray,
                 pid: np.ndarray, tid: np.ndarray, ts: np.ndarray, dur: np.ndarray, stream: np.ndarray,
                 correlation: np.ndarray, external_id: np.ndarray, flow_id: np.ndarray, rank: np.ndarray,
                 raw_args: Sequence[Any], metadata: dict[int, dict[str, Any]] | None = None,
                 thread_names: dict[tuple[int, int, int], str] | None = None,
                 _name_lookup: dict[str, int] | None = None) -> None:
        self.source = source
        self.names = names  # id -> string, shared by name_id and cat_id
        self._name_lookup = {} if _name_lookup is None else _name_lookup
        self.name_id = _one_name_per_method(names, name_id, self._name_lookup)  # int32
        self.cat_id = cat_id  # int32
        self.ph = ph  # uint8: ord of the chrome-trace phase letter
        self.pid = pid  # int64 (non-integer pids are interned: -(id+2))
        self.tid = tid  # int64 (same rule)
        self.ts = ts  # float64, µs as written by Kineto
        self.dur = dur  # float64, µs, never negative
        self.stream = stream  # int64, -1 where absent
        self.correlation = correlation  # int64, -1 where absent
        self.external_id = external_id  # int64, -1 where absent
        self.flow_id = flow_id  # int64, id of ph "s"/"f" flow events, -1 otherwise
        self.rank = rank  # int32, distributedInfo.rank of the file the event came from
        # args per row, read through args(): the loader keeps them as JSON text, decoded on first read.
        self.raw_args = raw_args
        self.metadata = {} if metadata is None else metadata  # rank -> top-level keys
        self.thread_names = {} if thread_names is None else thread_names  # (rank, pid, tid) -> name
        self._host_names: np.ndarray | None = None
        self._derived: dict[str, Any] = {}  # what several detectors ask for, worked out once
        from servprof.trace import xpu

        if xpu.is_xpu_trace(self):  # (an Intel GPU's device events name their queue, not a stream)
            self.stream = xpu.sycl_queue_streams(self, DEVICE_CATEGORIES)

    def __repr__(self) -> str:
        return f"Trace({self.source!r}, {len(self)} events, ranks {self.ranks})"

    def __len__(self) -> int:
        return int(self.ts.shape[0])

    @property
    def end(self) -> np.ndarray:
        return self.ts + self.dur

    @property
    def ranks(self) -> list[int]:
        """The distinct ranks, ascending (worked out once: several detectors ask, and it reads every row)."""
        if "ranks" not in self._derived:
            rank = self.rank
            one = rank.size and not (rank != rank[0]).any()  # (the usual single rank: no sort)
            self._derived["ranks"] = [int(rank[0])] if one else distinct(rank).tolist()
        return list(self._derived["ranks"])

    def name(self, row: int) -> str:
        return self.names[int(self.name_id[row])]

    def cat(self, row: int) -> str:
        return self.names[int(self.cat_id[row])]

    def thread_label(self, tid: int) -> str:
        """A thread as the trace itself names it: a tid the trace gave as text ("25738" in 2021
        Kineto traces, kept as -(string id + 2)) is that text, never servprof's negative id. A tid
        above any OS thread id that the trace names no thread: CUPTI's id for a thread whose CUDA
        calls Kineto could not map to one (it recorded nothing else: in a light session, a thread
        serving an unsampled request), said as such."""
        tid = int(tid)
        if tid <= -2 and -tid - 2 < len(self.names):
            return self.names[-tid - 2]
        if tid > MAX_OS_TID and not any(key[2] == tid for key in self.thread_names):
            return f"{tid} (an id the profiler gave a thread it could not name: one that recorded only CUDA calls)"
        return str(tid)

    def args(self, row: int) -> dict[str, Any]:
        value = self.raw_args[int(row)]
        # A fresh dict for rows without args: the loader shares one empty dict between them.
        return value if isinstance(value, dict) and value else {}

    def args_once(self, row: int) -> dict[str, Any]:
        """args(row), decoded without keeping it: for a pass that reads each of many rows once."""
        read = getattr(self.raw_args, "read", None)
        value = read(int(row)) if read is not None else self.raw_args[int(row)]
        return value if isinstance(value, dict) and value else {}

    def args_each(self, rows: np.ndarray, chunk: int = 4096) -> Iterator[dict[str, Any]]:
        """args(row) of each row in turn, decoded a chunk of rows at a time and not kept."""
        read_many = getattr(self.raw_args, "read_many", None)
        for first in range(0, len(rows), chunk):
            part = rows[first:first + chunk]
            values = read_many(part) if read_many is not None else [self.raw_args[int(r)] for r in part]
            yield from (v if isinstance(v, dict) and v else {} for v in values)

    def arg_fields_each(self, rows: np.ndarray, decoder: Any, chunk: int = 4096) -> Iterator[Any]:
        """Some fields of each row's args in turn (RawArgs.read_fields: a Struct, or None where
        the caller must read the row's args in full), a chunk of rows at a time."""
        read_fields = getattr(self.raw_args, "read_fields", None)
        for first in range(0, len(rows), chunk):
            part = rows[first:first + chunk]
            yield from read_fields(part, decoder) if read_fields is not None else [None] * len(part)

    def string_id(self, text: str) -> int:
        """The interned id of ``text``, or -1 when no event uses it."""
        return self._name_lookup.get(text, -1)

    def ids_matching(self, predicate: Any, among: np.ndarray | None = None) -> np.ndarray:
        """Ids of interned strings for which predicate(str) is true (one pass over the
        distinct strings, not over the events); ``among``: only these ids are tried (the names
        of the rows a question is about, host_names()), in increasing order."""
        if among is None:
            return np.flatnonzero(np.fromiter(map(predicate, self.names), dtype=bool, count=len(self.names)))
        names = self.names
        return among[np.fromiter((predicate(names[i]) for i in among.tolist()), dtype=bool, count=among.size)]

    def host_names(self) -> np.ndarray:
        """Ids of the names host events (not on a device stream) use, in increasing order: a
        question about host events need not try a pattern on the (long) kernel names."""
        if self._host_names is None:
            used = np.zeros(len(self.names) + 1, dtype=bool)
            used[self.name_id[self.stream < 0]] = True
            self._host_names = np.flatnonzero(used[:-1])
        return self._host_names

    def mask_category(self, *categories: str) -> np.ndarray:
        return self.has_id(self.cat_id, [self.string_id(c) for c in categories])

    def mask_name(self, predicate: Any, among: np.ndarray | None = None) -> np.ndarray:
        return self.has_id(self.name_id, self.ids_matching(predicate, among))

    def has_id(self, column: np.ndarray, ids: Any) -> np.ndarray:
        """``np.isin(column, ids)`` for a column of string ids (-1s in ``ids`` ignored), as one
        lookup per row in a table over the distinct strings rather than a sort of the rows."""
        table = np.zeros(len(self.names) + 1, dtype=bool)  # (+1: the slot -1 indexes stays False)
        table[np.asarray(ids, dtype=np.int64)] = True
        table[-1] = False
        return table[column]

    def complete(self) -> np.ndarray:
        """Rows of duration events (ph "X")."""
        return self.ph == ord("X")

    def device_mask(self) -> np.ndarray:
        if "device" not in self._derived:
            self._derived["device"] = self.complete() & self.mask_category(*DEVICE_CATEGORIES) & (self.stream >= 0)
        return self._derived["device"].copy()  # (a copy: callers combine masks in place)

    def launch_mask(self) -> np.ndarray:
        if "launch" not in self._derived:
            self._derived["launch"] = (self.complete() & self.mask_category(*RUNTIME_CATEGORIES)
                                       & (self.correlation >= 0))
        return self._derived["launch"].copy()

    def launch_row_for(self, device_rows: np.ndarray) -> np.ndarray:
        """Row of the host launch that enqueued each device event (-1 when not in the trace).

        Joined on (rank, correlation). A CUDA/HIP graph replay is one launch whose
        correlation is shared by every kernel of the graph, so many rows may map to one.
        """
        if "launches" not in self._derived:
            launches = np.flatnonzero(self.launch_mask())
            # One key per (rank, correlation): rank in the high bits.
            launch_keys = (self.rank[launches].astype(np.int64) << 40) | self.correlation[launches]
            order = np.argsort(launch_keys, kind="stable")
            self._derived["launches"] = (launches[order], launch_keys[order])
        launches, sorted_keys = self._derived["launches"]
        if launches.size == 0 or device_rows.size == 0:
            return np.full(device_rows.shape, -1, dtype=np.int64)
        wanted = (self.rank[device_rows].astype(np.int64) << 40) | self.correlation[device_rows]
        pos = np.searchsorted(sorted_keys, wanted)
        pos_clipped = np.minimum(pos, sorted_keys.size - 1)
        found = (sorted_keys[pos_clipped] == wanted) & (self.correlation[device_rows] >= 0)
        return np.where(found, launches[pos_clipped], -1)

    def servprof_metadata(self) -> dict[str, Any]:
        """servprof's session metadata (top-level key ``servprof``), {} when absent; its known
        fields are type-checked (servprof.trace.meta), so a reader never meets a wrong type."""
        from servprof.trace.meta import servprof_fields

        for meta in self.metadata.values():
            value = meta.get("servprof") if isinstance(meta, dict) else None
            if isinstance(value, dict):
                return servprof_fields(value)
        return {}

    def base_time_ns(self) -> int | None:
        """``baseTimeNanoseconds`` (unix ns of trace time 0, as Kineto writes it) of the first rank
        that has a usable one (servprof.trace.meta.base_time_ns); anything else is absent."""
        from servprof.trace.meta import base_time_ns

        return base_time_ns(self.metadata)

    def has_device_events(self) -> bool:
        return bool(self.device_mask().any())
