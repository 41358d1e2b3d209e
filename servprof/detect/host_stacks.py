"""What each host thread was doing at every instant, by self time.

A thread's recorded events (Python frames, ops, runtime calls, annotations) nest. At
any instant the thread is in its innermost event: that event's *self* time is what the
instant is spent on. One sweep per thread turns the nested events into disjoint
segments, each labelled with a class (a device sync, tokenization, Python, an op, a
kernel launch, waiting, ...) and the name of the innermost frame that says something
(generic wrappers such as ``_call_impl``, ``decorate_context`` or ``__call__`` give their
time to the frame that called them). Questions about a window are then binary searches:
never more time than the window, and nothing counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from servprof.detect.host_classes import (
    CLASSES,
    COMPILE,
    DEVICE_TO_HOST,
    GC,
    HOST_CATEGORIES,
    OP,
    PYTHON,
    SERVPROF_THREAD_FRAMES,
    SYNC,
    UNTRACED,
    NameClasses,
    base_classes,
    in_categories,
)
from servprof.detect.intervals import covered, intersect, merge
from servprof.detect.name_scan import host_ids_matching
from servprof.detect.nesting import depths, extend_ends, levels, nearest, parents, segments, start_order
from servprof.trace.allocator import give_back_freed_memory
from servprof.trace.model import Trace, distinct, distinct_first_inverse

# torch's Python tracer, at its start: the most between two threads' first frames, and between a
# frame of a thread's stack and the next (measured: 15-42 µs and 0.3-1.7 µs).
TRACER_THREAD_GAP_US, STACK_STAMP_US = 200.0, 20.0
TRIM_ROWS = 256 * 1024  # a thread with this many events gives its freed temporaries back as it is swept
TOP_CHUNK = 1 << 14  # ThreadStack.top_keys reads windows of about so many segments in all at a time (~1 MB)


@dataclass
class ThreadStack:
    """One thread's time cut into disjoint segments at ``bounds``, each in one event (its self
    time) with a class and a name id, or in none (a hole: name -1, class untraced)."""

    tid: int
    bounds: np.ndarray  # segment i is [bounds[i], bounds[i + 1])
    cls: np.ndarray
    name: np.ndarray  # int32 id of the innermost frame that is not a generic wrapper; -1: a hole
    compiled: np.ndarray

    def __post_init__(self) -> None:
        self.start, self.end = self.bounds[:-1], self.bounds[1:]  # (views)
        # Per class: its segments (indices, in time order) and the time they cover before each.
        # Indices into the thread's arrays rather than copies of them: a thread of millions of
        # events has about two segments per event.
        none = (np.zeros(0, dtype=np.int32), np.zeros(1))
        self._by_class = [none]  # untraced: what the others leave
        # The segments by class, in time order within one (a stable sort): class c's are
        # by_class[first[c]:first[c + 1]], their lengths summed in that order.
        by_class = np.argsort(self.cls, kind="stable").astype(np.int32)
        length = self.end[by_class]
        length -= self.start[by_class]
        first = [0, *np.cumsum(np.bincount(self.cls, minlength=len(CLASSES))).tolist()]
        for c in range(1, len(CLASSES)):
            lo, hi = first[c], first[c + 1]
            if lo == hi:  # (most threads show a few classes: the others cost nothing)
                self._by_class.append(none)
                continue
            cum = np.empty(hi - lo + 1)
            cum[0] = 0.0
            np.cumsum(length[lo:hi], out=cum[1:])
            self._by_class.append((by_class[lo:hi], cum))

    def _covered_before(self, c: int, t: np.ndarray, segments_started: np.ndarray) -> np.ndarray:
        """Time class c covers before each t; ``segments_started``: how many of all the thread's
        segments start at or before t (so many of class c's come first: a binary search)."""
        return self._subset_before(self._by_class[c], t, segments_started)

    def _subset_before(self, subset: tuple[np.ndarray, np.ndarray], t: np.ndarray,
                       segments_started: np.ndarray) -> np.ndarray:
        """_covered_before for any ``subset`` of the segments: (their indices in time order, the
        time they cover before each)."""
        mine, cum = subset
        if mine.size == 0:
            return np.zeros(t.shape)
        i = np.searchsorted(mine, segments_started) - 1
        ok = i >= 0
        i = np.maximum(i, 0)
        j = mine[i]
        partial = np.clip(t - self.start[j], 0.0, self.end[j] - self.start[j])
        return np.where(ok, cum[i] + partial, 0.0)

    def class_times(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """[len(a), len(CLASSES)]: self time of each class inside each window [a, b];
        "untraced" is the rest of the window (nothing recorded on the thread)."""
        out = np.zeros((a.size, len(CLASSES)))
        started_a = np.searchsorted(self.start, a, side="right")
        started_b = np.searchsorted(self.start, b, side="right")
        for c in range(1, len(CLASSES)):
            if self._by_class[c][0].size:  # (a class the thread never shows covers nothing)
                out[:, c] = self._covered_before(c, b, started_b) - self._covered_before(c, a, started_a)
        out[:, UNTRACED] = np.maximum((b - a) - out[:, 1:].sum(axis=1), 0.0)
        return out

    def short_holes(self, a: np.ndarray, b: np.ndarray, below_us: float) -> np.ndarray:
        """Per window [a, b], the time in stretches with no recorded work (holes, and a range's own time
        between the ops inside it), each shorter than ``below_us``: the interpreter between two ops,
        where no Python frame is recorded."""
        mine = np.flatnonzero((self.cls == UNTRACED) & (self.end - self.start < below_us))
        cum = np.zeros(mine.size + 1)
        np.cumsum(self.end[mine] - self.start[mine], out=cum[1:])
        subset = (mine.astype(np.int32), cum)
        return (self._subset_before(subset, b, np.searchsorted(self.start, b, side="right"))
                - self._subset_before(subset, a, np.searchsorted(self.start, a, side="right")))

    def class_at(self, t: np.ndarray) -> np.ndarray:
        return self.class_and_start_at(t)[0]

    def class_and_start_at(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The class of the segment each time falls in (UNTRACED outside every one), and when that
        segment began (the time itself outside)."""
        i = np.searchsorted(self.start, t, side="right") - 1
        j = np.maximum(i, 0)
        inside = (i >= 0) & (t < self.end[j]) if self.start.size else np.zeros(t.shape, dtype=bool)
        if not self.start.size:
            return np.full(t.shape, UNTRACED), t.copy()
        return np.where(inside, self.cls[j], UNTRACED), np.where(inside, self.start[j], t)

    def segments_of(self, *classes: int) -> tuple[np.ndarray, np.ndarray]:
        """(starts, ends) of the thread's segments of these classes, in time order."""
        mine = np.sort(np.concatenate([self._by_class[c][0] for c in classes]))
        return self.start[mine], self.end[mine]

    def compiled_at(self, t: np.ndarray) -> np.ndarray:
        if self.start.size == 0:
            return np.zeros(t.shape, dtype=bool)
        i = np.searchsorted(self.start, t, side="right") - 1
        j = np.maximum(i, 0)
        j -= self.name[j] < 0  # in a hole: the segment before it (it counts up to its end)
        return (i >= 0) & (t <= self.end[j]) & self.compiled[j]

    def top(self, a: float, b: float, names: list[str], limit: int = 5) -> list[dict[str, object]]:
        """The frames with the most self time inside [a, b], with their class."""
        lo = int(np.searchsorted(self.end, a, side="right"))
        hi = int(np.searchsorted(self.start, b, side="left"))
        if hi <= lo:
            return []
        clip = np.minimum(self.end[lo:hi], b) - np.maximum(self.start[lo:hi], a)
        spent = (clip > 0) & (self.name[lo:hi] >= 0)
        key = self.name[lo:hi][spent].astype(np.int64) * len(CLASSES) + self.cls[lo:hi][spent]
        if key.size == 0:
            return []
        # Self time per (frame, class), summed in time order; the most first, ties in order of appearance.
        keys, first, which = distinct_first_inverse(key)
        totals = np.bincount(which, weights=clip[spent])
        ranked = np.lexsort((first, -totals))[:limit]
        return [{"name": names[int(k) // len(CLASSES)], "class": CLASSES[int(k) % len(CLASSES)],
                 "self_us": round(float(us), 1)} for k, us in zip(keys[ranked], totals[ranked], strict=True)]

    def top_keys(self, a: np.ndarray, b: np.ndarray, limit: int = 5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """top() of many windows at once (a handful of numpy calls, not a handful per window):
        (window, key, self_us) of each window's ranked frames, by window, then as top() ranks
        them; key = name id * len(CLASSES) + class. Each total is summed in the same order as
        top() sums it (bincount adds in input order), so it is the same float."""
        lo = np.searchsorted(self.end, a, side="right")
        size = np.maximum(np.searchsorted(self.start, b, side="left") - lo, 0)
        if int(size.sum()) <= TOP_CHUNK:
            return self._top_keys(a, b, lo, size, limit)
        # Windows in chunks of about TOP_CHUNK segments: long windows on a thread of millions of
        # events keep the temporaries near one window's, as top() does.
        chunk = (np.cumsum(size) - size) // TOP_CHUNK
        parts = []
        for c in distinct(chunk).tolist():
            mine = np.flatnonzero(chunk == c)
            window, key, us = self._top_keys(a[mine], b[mine], lo[mine], size[mine], limit)
            parts.append((mine[window], key, us))
        window, key, us = (np.concatenate(column) for column in zip(*parts, strict=True))
        return window, key, us

    def _top_keys(self, a: np.ndarray, b: np.ndarray, lo: np.ndarray, size: np.ndarray, limit: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        window = np.repeat(np.arange(a.size), size)
        # Each window's segments lo..hi-1, concatenated.
        seg = np.arange(window.size) + np.repeat(lo - (np.cumsum(size) - size), size)
        clip = np.minimum(self.end[seg], b[window]) - np.maximum(self.start[seg], a[window])
        name = self.name[seg]
        spent = (clip > 0) & (name >= 0)
        window, seg, clip = window[spent], seg[spent], clip[spent]
        if window.size == 0:
            return window, np.zeros(0, dtype=np.int64), clip
        key = name[spent].astype(np.int64) * len(CLASSES) + self.cls[seg]
        per_window = int(key.max()) + 1
        key += window * per_window
        keys, first, which = distinct_first_inverse(key)
        totals = np.bincount(which, weights=clip)
        owner = keys // per_window
        # Per window: the most first, ties in order of appearance; then its first ``limit``.
        ranked = np.lexsort((first, -totals, owner))
        owner = owner[ranked]
        keep = np.arange(ranked.size) - np.searchsorted(owner, owner) < limit  # (the rank within its window)
        ranked, owner = ranked[keep], owner[keep]
        return owner, keys[ranked] % per_window, totals[ranked]


class HostStacks:
    """The host threads of one rank, swept lazily (only the threads a question is about)."""

    def __init__(self, trace: Trace, rank: int, classes: NameClasses | None = None):
        self.trace = trace
        self.rank = rank
        self.classes = classes or NameClasses(trace)
        mask = (trace.complete() & (trace.rank == rank) & (trace.stream < 0) & (trace.dur > 0)
                & trace.mask_category(*HOST_CATEGORIES))
        rows = np.flatnonzero(mask).astype(np.int32 if len(trace) < 2**31 else np.int64)
        tids = trace.tid[rows]
        self.tids: list[int] = distinct(tids).tolist()
        self._rows = {tid: rows[tids == tid] for tid in self.tids}  # a thread's rows, until it is swept
        # Threads torch's Python tracer did not follow where it followed others (it takes the threads
        # alive when the profiler started: one started later records ops but no frame). Their time
        # with nothing recorded may be their own Python: never read as another thread's GIL.
        python = trace.mask_category("python_function")[rows]
        framed = distinct(tids[python]).tolist()
        self.has_frames = bool(framed)  # torch's Python tracer was on (with_stack)
        self.unframed: set[int] = set(self.tids) - set(framed)
        # servprof's own threads, by their entry frames (the names searched once per trace).
        own = trace.has_id(trace.name_id[rows[python]], host_ids_matching(trace, SERVPROF_THREAD_FRAMES))
        self.servprof_threads: set[int] = set(distinct(tids[python][own]).tolist())
        self._d2h = _device_to_host_launches(trace)
        self._stacks: dict[int, ThreadStack] = {}
        self._crowded_blocks: tuple[np.ndarray | None, np.ndarray | None] | None = None
        self._waits: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # per thread: its Python beside another's
        # torch's Python tracer records the frames on every thread's stack when it starts, thread
        # after thread (tens of µs apart): where that burst of threads' first frames ends.
        framed_ts, framed_tids = trace.ts[rows[python]], tids[python]
        self.tracer_started_by_us = _tracer_start_burst(
            [float(framed_ts[framed_tids == tid].min()) for tid in framed]) if framed else None

    def thread(self, tid: int) -> ThreadStack:
        if tid not in self._stacks:
            self._stacks[tid] = self._sweep(tid, self._rows.pop(tid, np.zeros(0, dtype=np.int64)))
        return self._stacks[tid]

    def gil_wait(self, tid: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Per window [a, b], the time thread ``tid`` was in a Python frame's own time while another
        thread (not servprof's) was in one too, or collecting garbage. Only one thread runs Python
        at a time (the GIL), and the tracer cannot see a thread waiting for it: the wait is in the
        frame's own time. So for that time one of the two waited; for the thread whose steps it
        slowed, all of it but the little Python it ran (zeros when fewer than two threads' frames
        were recorded)."""
        crowded = self._crowded()
        if crowded is None or tid in self.unframed or tid in self.servprof_threads:
            return np.zeros(np.shape(a))
        both = self._waits.get(tid)
        if both is None:  # (made once per thread: stalls and gaps ask it for many windows, in batches)
            both = self._waits[tid] = intersect(*self.thread(tid).segments_of(PYTHON), *crowded)
        return covered(*both, np.asarray(a, dtype=float), np.asarray(b, dtype=float))

    def _crowded(self) -> tuple[np.ndarray, np.ndarray] | None:
        """When two or more framed threads (not servprof's) were in Python or a collection at once:
        disjoint blocks, made once (a thread's own segments are disjoint, so inside one of its
        Python segments another thread is in Python exactly where two are)."""
        if self._crowded_blocks is None:
            threads = [t for t in self.tids if t not in self.servprof_threads and t not in self.unframed]
            blocks = (np.zeros(0), np.zeros(0))
            if self.has_frames and len(threads) > 1:
                spans = [self.thread(t).segments_of(PYTHON, GC) for t in threads]
                starts = np.concatenate([s for s, _ in spans])
                ends = np.concatenate([e for _, e in spans])
                at = np.concatenate([starts, ends])
                step = np.concatenate([np.ones(starts.size, dtype=np.int32), -np.ones(ends.size, dtype=np.int32)])
                order = np.lexsort((step, at))  # (an end before a start at the same time: touching is not at once)
                at, level = at[order], np.cumsum(step[order])
                two = np.flatnonzero(level[:-1] >= 2)  # from each such change to the next, two or more
                keep = at[two + 1] > at[two]
                blocks = merge(at[two][keep], at[two + 1][keep])
            self._crowded_blocks = blocks if blocks[0].size else (None, None)
        return None if self._crowded_blocks[0] is None else self._crowded_blocks  # type: ignore[return-value]

    def _sweep(self, tid: int, rows: np.ndarray) -> ThreadStack:
        """The thread's self-time segments: at every instant, the innermost event open (nesting.py)."""
        trace, nc = self.trace, self.classes
        # A thread of millions of events: freed temporaries go back to the OS between the steps
        # (glibc keeps them in its heap otherwise, and the peak would count them again).
        trim = give_back_freed_memory if rows.size >= TRIM_ROWS else _nothing
        rows = rows[start_order(trace.ts[rows], trace.dur[rows])]
        start = trace.ts[rows]
        end = start + trace.dur[rows]
        trim()
        parent = parents(start, end)
        trim()
        depth = depths(parent)
        trim()
        by_depth = levels(depth)
        extend_ends(end, parent, by_depth)
        trim()
        bounds, seg_event = segments(start, end, parent, depth)
        del start, end, depth
        trim()
        hole = seg_event < 0
        seg_event[hole] = 0
        name_ids = trace.name_id[rows]
        specific = nc.specific[name_ids]
        specific[np.isin(rows, self._d2h)] = SYNC  # a copy to the host blocks until the device is done
        # What an event inherits from the events around it: the innermost specific class (a sync,
        # tokenization, ...), the innermost frame that is not a generic wrapper, a compiled region.
        region = nc.compiled_region[name_ids]
        if rows.size < TRIM_ROWS:  # the three in one pass over the levels (a level's numpy calls shared)
            inherit = nearest(parent, np.stack((specific >= 0, ~nc.generic[name_ids], region)), by_depth)
            specific, named, region = specific[inherit[0]], name_ids[inherit[1]], region[inherit[2]]
            del inherit
        else:  # one at a time: one pointer per event alive, not three
            specific = specific[nearest(parent, specific >= 0, by_depth)]
            named = name_ids[nearest(parent, ~nc.generic[name_ids], by_depth)]
            region = region[nearest(parent, region, by_depth)]
        del by_depth
        python = in_categories(trace, rows, "python_function")
        cls = base_classes(trace, rows, name_ids, nc, python)
        cls[(nc.compile[name_ids] | nc.compile[named]) & ((cls == PYTHON) | (cls == OP))] = COMPILE
        inherited = specific >= 0
        cls[inherited] = specific[inherited]
        at_start = self._call_at_start(rows, parent, python)
        del rows, name_ids, specific, inherited, parent, python
        cls, named, region = cls[seg_event], named[seg_event], region[seg_event]
        if at_start >= 0:  # the time until its first recorded call: in a call the tracer never saw begin
            first = np.flatnonzero((seg_event == at_start) & ~hole)[:1]
            first = first[cls[first] == PYTHON]
            cls[first], named[first] = UNTRACED, -1  # (as a hole: nothing recorded names it)
        del seg_event
        cls[hole], named[hole], region[hole] = UNTRACED, -1, False
        del hole
        trim()
        stack = ThreadStack(tid, bounds, cls, named, region)
        trim()
        return stack


    def _call_at_start(self, rows: np.ndarray, parent: np.ndarray, python: np.ndarray) -> int:
        """The innermost frame of the stack the thread had when torch's Python tracer started (its
        row, -1 for none): the time from its start to the first call recorded inside it was a C
        call in progress then (a socket read, an accept, a wait), which the tracer never saw
        begin. That time is the thread's, unrecorded: not Python that held the GIL (a client
        thread blocked in a read is not another thread's GIL). That stack is the thread's first
        rows (in start order), each begun right after its parent."""
        if self.tracer_started_by_us is None or not python.any():
            return -1
        start = self.trace.ts[rows]
        i = int(np.argmax(python))  # the thread's first frame
        if start[i] > self.tracer_started_by_us:
            return -1  # a thread started later: its frames are new calls
        while i + 1 < rows.size and parent[i + 1] == i and python[i + 1] and start[i + 1] - start[i] <= STACK_STAMP_US:
            i += 1
        return i


def _nothing() -> None:
    return None


def _device_to_host_launches(trace: Trace) -> np.ndarray:
    """Rows of runtime calls whose copy went device -> host into pageable memory: the host waits
    for the device (a copy into pinned memory with non_blocking=True does not)."""
    copies = np.flatnonzero(trace.device_mask() & trace.mask_category("gpu_memcpy", "Memcpy"))
    to_host = trace.ids_matching(lambda s: bool(DEVICE_TO_HOST.search(s)) and "Pinned" not in s,
                                 distinct(trace.name_id[copies]))
    copies = copies[trace.has_id(trace.name_id[copies], to_host)]
    launches = trace.launch_row_for(copies)
    return launches[launches >= 0]


def _tracer_start_burst(firsts: list[float]) -> float:
    """When torch's Python tracer had recorded every thread's stack at its start: the threads' first
    frames (``firsts``) in time order, as long as each follows the one before within TRACER_THREAD_GAP_US."""
    ordered = np.sort(np.array(firsts))
    apart = np.flatnonzero(np.diff(ordered) > TRACER_THREAD_GAP_US)
    return float(ordered[apart[0]] if apart.size else ordered[-1])
