"""cat and stack: their result, the bytes they move, the element type of their parts, which the
profiler does not record for a list of tensors ("TensorList"), and whether a cat grows a tensor.

The first op after the cat on its thread (among the next LOOK_AHEAD) whose args hold a tensor of
exactly the cat's result shape gives its type: a KV cache grown by torch.cat goes straight to
attention (transformers' DynamicCache), the rows cat joins go to the op that uses them. None when
no such op follows: the cat stays unmodelled, and the summary says so.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np

from servprof.detect.byte_models import ELEMENT_BYTES, Cost, arg_at, int_of
from servprof.trace.model import Trace, distinct

LOOK_AHEAD = 16
FIRST_LOOK = 3
CHUNK = 4096
# A join is "growing" a tensor when one part holds this share of the result: a cache extended by cat.
GROWN_SHARE = 0.9


def mark_growing(groups: list[dict[str, Any]], cats_seen: list[Any]) -> None:
    """Relabel "join" groups that grow one tensor call after call as "grow": a cat of a big part and
    a small one whose result is the big part of another cat seen (``cats_seen``: every cat's Input
    Dims, those above peak and out of every group too), or whose big part another one's result (a
    KV cache torch.cat extends by a position each decode step). One cat of a big and a small part (a
    ViT's class token and its patches) is a join."""
    splits = [split for split in map(_big_and_small, cats_seen) if split is not None]
    bigs = {tuple(big) for big, _ in splits}
    results = {tuple(_extended(*split)) for split in splits}
    for group in groups:
        if group.get("family") != "join" or group.get("op") != "aten::cat":
            continue
        split = _big_and_small(group.get("shapes"))
        if split is not None and (tuple(_extended(*split)) in bigs or tuple(split[0]) in results):
            group["family"] = "grow"  # grown again after it, or it grows what a cat before it made


def _big_and_small(dims: Any) -> tuple[list[int], list[int]] | None:
    """A cat's two parts, the big one first, when it holds GROWN_SHARE of the result and they differ
    in one dim only (the one joined)."""
    parts = _list_parts(arg_at(dims, 0))
    if not parts or len(parts) != 2 or len(parts[0]) != len(parts[1]):
        return None
    big, small = sorted(parts, key=math.prod, reverse=True)
    if math.prod(big) < GROWN_SHARE * (math.prod(big) + math.prod(small)):
        return None
    if sum(b != s for b, s in zip(big, small, strict=True)) != 1:
        return None
    return big, small


def _extended(big: list[int], small: list[int]) -> list[int]:
    return [b + s if b != s else b for b, s in zip(big, small, strict=True)]


def _list_parts(value: Any) -> list[list[int]] | None:
    """A TensorList's dims ([[8, 4, 788, 32], [8, 4, 1, 32]]), or None when it is not one."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(p, list) and all(type(d) is int and d >= 0 for d in p) for p in value):
        return None
    return value


def list_output_dims(name: str, dims: Any, concrete: Any) -> list[int] | None:
    """The shape cat / stack return, from their parts' dims and the `dim` argument (0 when not recorded)."""
    parts = _list_parts(arg_at(dims, 0))
    if not parts:
        return None
    dim = int_of(arg_at(concrete, 1)) or 0
    if name == "aten::stack":
        rank = len(parts[0])
        if any(p != parts[0] for p in parts) or not -rank - 1 <= dim <= rank:
            return None
        at = dim % (rank + 1)
        return [*parts[0][:at], len(parts), *parts[0][at:]]
    # cat skips legacy empty 1-D parts ([0]); the others share every dim but the one joined
    parts = [p for p in parts if p != [0]] or parts[:1]
    rank = len(parts[0])
    if rank == 0 or not -rank <= dim < rank or any(len(p) != rank for p in parts):
        return None
    at = dim % rank
    if any(p[:at] + p[at + 1:] != parts[0][:at] + parts[0][at + 1:] for p in parts):
        return None
    return [*parts[0][:at], sum(p[at] for p in parts), *parts[0][at + 1:]]


def list_cost(result_dims: list[int], type_name: str) -> Cost | None:
    """cat / stack (list_output_dims gives their result) of parts of element type ``type_name``:
    every part read, the result written."""
    elem = ELEMENT_BYTES.get(type_name)
    nbytes = 2 * math.prod(result_dims) * elem if elem is not None else 0
    return (0.0, float(nbytes)) if nbytes > 0 else None


class _Inputs(msgspec.Struct, gc=False):
    dims: Any = msgspec.field(default=None, name="Input Dims")
    types: Any = msgspec.field(default=None, name="Input type")


_INPUTS = msgspec.json.Decoder(list[_Inputs])


class ListTypes:
    """Element types of list ops' results, looked up on their threads. ``lists``: the rows of the
    list ops to be asked about, in the order they will be asked; the first FIRST_LOOK ops after
    each are decoded in one pass for CHUNK of them at a time (one call per op costs more than the
    decoding; a chunk at a time keeps what is decoded small on a trace of millions of cats), the
    rest of LOOK_AHEAD only when those do not say."""

    def __init__(self, trace: Trace, lists: np.ndarray) -> None:
        self.trace = trace
        self._rows = np.zeros(0, dtype=np.int64)  # the host rows of the lists' threads, by thread and time
        self._position: dict[int, int] = {}  # list op row -> its index in ``lists``
        self._first = np.zeros(0, dtype=np.int64)  # per list op: the index in _rows of the op after it
        self._stop = np.zeros(0, dtype=np.int64)  # ... and the end of its thread's rows there
        self._prepared = (0, 0)  # the list ops whose first ops after are decoded
        self._inputs: dict[int, tuple[Any, Any]] = {}  # row -> its (Input Dims, Input type), decoded
        if lists.size:
            self._index(lists)

    def element_type(self, row: int, result_dims: list[int]) -> str | None:
        i = self._position.get(row)
        if i is None:
            return None
        if not self._prepared[0] <= i < self._prepared[1]:
            self._prepare(i)
        after = self._rows[int(self._first[i]):min(int(self._first[i]) + LOOK_AHEAD, int(self._stop[i]))]
        for number, at in enumerate(after.tolist()):
            if number == FIRST_LOOK:  # the first ones did not say: decode the rest
                self._decode(after[FIRST_LOOK:])
            found = _type_of(result_dims, *self._inputs[at])
            if found is not None:
                return found
        return None

    def _index(self, lists: np.ndarray) -> None:
        trace = self.trace
        host = np.flatnonzero(trace.complete() & (trace.stream < 0))
        # The lists' threads, and any sharing a tid (a few: np.isin would import numpy.ma, which
        # the analysis path keeps out)
        on = np.zeros(host.size, dtype=bool)
        for tid in set(trace.tid[lists].tolist()):
            on |= trace.tid[host] == tid
        host = host[on]
        host = host[np.lexsort((trace.ts[host], trace.tid[host], trace.pid[host], trace.rank[host]))]
        self._rows, host_ts = host, trace.ts[host]
        keys = np.stack([trace.rank[host], trace.pid[host], trace.tid[host]], axis=1)
        starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]).any(axis=1)])
        stops = np.r_[starts[1:], host.size]
        slices = {tuple(keys[b].tolist()): (b, e) for b, e in zip(starts.tolist(), stops.tolist(), strict=True)}
        list_keys = np.stack([trace.rank[lists], trace.pid[lists], trace.tid[lists]], axis=1).tolist()
        ends = (trace.ts[lists] + trace.dur[lists]).tolist()
        self._first = np.zeros(lists.size, dtype=np.int64)
        self._stop = np.zeros(lists.size, dtype=np.int64)
        for i, (row, key, end) in enumerate(zip(lists.tolist(), list_keys, ends, strict=True)):
            begin, stop = slices[tuple(key)]
            self._position[row] = i
            self._first[i] = begin + int(np.searchsorted(host_ts[begin:stop], end, side="left"))
            self._stop[i] = stop

    def _prepare(self, i: int) -> None:
        """Decode the first ops after list ops i .. i + CHUNK (what was decoded before is let go)."""
        j = min(i + CHUNK, self._first.size)
        self._inputs.clear()
        firsts = [self._rows[f:min(f + FIRST_LOOK, stop)]
                  for f, stop in zip(self._first[i:j].tolist(), self._stop[i:j].tolist(), strict=True)]
        self._decode(distinct(np.concatenate(firsts)) if firsts else np.zeros(0, dtype=np.int64))
        self._prepared = (i, j)

    def _decode(self, rows: np.ndarray) -> None:
        rows = np.array([r for r in rows.tolist() if r not in self._inputs], dtype=np.int64)
        if not rows.size:
            return
        for at, inputs in zip(rows.tolist(), self.trace.arg_fields_each(rows, _INPUTS), strict=True):
            if inputs is None:  # args held as values: read in full
                args = self.trace.args_once(at)
                self._inputs[at] = (args.get("Input Dims"), args.get("Input type"))
            else:
                self._inputs[at] = (inputs.dims, inputs.types)


def _type_of(result_dims: list[int], dims: Any, types: Any) -> str | None:
    if not isinstance(dims, list) or not isinstance(types, list):
        return None
    for shape, type_name in zip(dims, types, strict=False):
        if shape == result_dims and isinstance(type_name, str) and type_name in ELEMENT_BYTES:
            return type_name
    return None
