"""Why the device (or the engine thread) sat idle: the cause of each gap, and what to do about it.

A gap is explained from the thread that launched the device work that ended it (on
CPU traces: the step's own thread), by self time in the gap (host_stacks.py): never
more than the gap, nothing nested counted twice, generic wrappers left out. When that
thread recorded nothing for most of the gap, the thread that ran instead (and so held
the GIL) is named; threads asleep (``threading.wait``, a tqdm monitor, a queue ``get``)
never are. A device sync or blocking copy running when the device went idle is the
cause of the whole gap: it emptied the device's queue; a thread inside a DataLoader's
``__next__`` for most of the gap waited for its input (data_loading.py). What each cause is,
and its fix: cause_texts.py. On a light trace (tier.py: no ops, no
Python recorded) no cause is read from what a thread did not record (Python or op time, the
GIL held elsewhere, nothing at all): such a gap's cause is ``needs_deep_window``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from servprof.detect.cause_texts import CAUSES, cause_fix, cause_label, collected_text
from servprof.detect.data_loading import loader_rows, loading_range, loading_us
from servprof.detect.host_classes import (
    BUSY_CLASSES,
    CLASSES,
    COLLECTIVE,
    COMPILE,
    COMPILING,
    DETOKENIZE,
    GC,
    LAUNCH,
    OP,
    PYTHON,
    RUNTIME,
    SYNC,
    TOKENIZE,
    TOKENIZER_NAMES,
    UNTRACED,
    WAIT,
)
from servprof.detect.host_stacks import HostStacks
from servprof.detect.tier import NEEDS_DEEP, NEEDS_DEEP_CAUSE
from servprof.trace.model import distinct
from servprof.trace.phases import parse_phase_event_name

__all__ = ["CAUSES", "Explained", "GapExplainer", "TOKENIZER_NAMES", "cause_fix"]

# A launch call (or the wait after it for its work to start) this long is not per-launch
# overhead (a few µs): the launch itself was slow, typically loading the kernel's code.
SLOW_LAUNCH_US = 50.0
TIMED_FRAMES = ("slow_launch", "runtime_calls")  # causes whose frames are named with the time each took
# What holds the GIL: Python frames' own time (tokenizers' and the compiler's included) and collections.
GIL_CLASSES = (PYTHON, COMPILE, TOKENIZE, DETOKENIZE, GC)
GIL_CLASS_NAMES = {CLASSES[c] for c in GIL_CLASSES}

@dataclass
class Explained:
    """Per gap: the cause, the thread it was read from, and self time by class (µs)."""

    cause: list[str]
    tid: np.ndarray  # the launching thread (or the step's thread on CPU)
    other_tid: np.ndarray  # the thread that ran instead (GIL), -1 when none
    class_us: np.ndarray  # [gaps, classes] on the launching thread
    other_us: np.ndarray  # [gaps, classes] on other_tid
    # µs of each gap other threads' model steps covered, and how many threads (concurrency.py)
    concurrent_us: np.ndarray | None = None
    concurrent_threads: np.ndarray | None = None
    # µs of the launching thread's Python while another thread ran Python (HostStacks.gil_wait): out
    # of class_us' "python", as the thread's own work is
    gil_wait_us: np.ndarray | None = None

    def subset(self, gaps: np.ndarray) -> Explained:
        """These gaps only (a copy: the whole set's arrays can then be freed)."""
        return Explained([self.cause[i] for i in gaps.tolist()], self.tid[gaps], self.other_tid[gaps],
                         self.class_us[gaps], self.other_us[gaps],
                         None if self.concurrent_us is None else self.concurrent_us[gaps],
                         None if self.concurrent_threads is None else self.concurrent_threads[gaps],
                         None if self.gil_wait_us is None else self.gil_wait_us[gaps])


class GapExplainer:
    """Causes of many gaps on one rank at once (vectorised per thread)."""

    def __init__(self, stacks: HostStacks, light: bool = False, on_device: bool = True):
        self.stacks = stacks
        self.names = stacks.trace.names
        self.light = light  # a light trace (tier.py): no cause is read from ops that were not recorded
        self.on_device = on_device  # the rank's steps have device work (else no device waited: host words)
        self.loader_rows = loader_rows(stacks.trace, stacks.rank)  # (once: every explain and describe reads them)

    def explain(self, a: np.ndarray, b: np.ndarray, tid: np.ndarray, starved: np.ndarray, small: np.ndarray,
                next_graph_launch: np.ndarray, launch_end: np.ndarray | None = None,
                stream_waited: np.ndarray | None = None, look_elsewhere: bool = False,
                concurrent: tuple[np.ndarray, np.ndarray] | None = None) -> Explained:
        """``a``/``b``: the gaps; ``tid``: the thread to read each from; ``starved``: the device's next
        work was launched only after the gap began (else it was queued: kernel_wait); ``small``: under
        the size that is reported one by one; ``next_graph_launch``: the work that ended the gap was a
        graph launch or launched inside a compiled forward; ``launch_end``: when that launch call
        returned (the host window to read ends there; the rest is launch latency); ``stream_waited``:
        a stream-wait-event call was enqueued before the queued work that ended the gap;
        ``concurrent``: (µs of each gap other threads' steps covered, how many threads);
        ``look_elsewhere``: find the thread that ran instead even when the launching thread recorded
        work for much of the window (a step that was slow only in part)."""
        n = a.size
        # A starved gap is read up to the end of the launch that ended it; after that the launch
        # was in flight (its latency). A queued gap is read whole: the host's part is evidence only.
        end = b if launch_end is None else np.where(starved, np.clip(launch_end, a, b), b)
        class_us = np.zeros((n, len(CLASSES)))
        at_start = np.full(n, UNTRACED)
        blocked = np.zeros(n)  # how long the call the thread was in when the gap began had run
        compiled = np.asarray(next_graph_launch, dtype=bool).copy()
        gil_wait = np.zeros(n)
        for t in distinct(tid).tolist():
            sel = np.flatnonzero(tid == t)
            stack = self.stacks.thread(int(t))
            class_us[sel] = stack.class_times(a[sel], end[sel])
            at_start[sel], since = stack.class_and_start_at(a[sel])
            blocked[sel] = a[sel] - since
            compiled[sel] |= stack.compiled_at(end[sel])
            gil_wait[sel] = self.stacks.gil_wait(int(t), a[sel], end[sel])
        class_us[:, PYTHON] -= gil_wait  # (its Python beside another thread's: a wait for the GIL, not work)
        class_us[:, LAUNCH] += b - end  # after the launch call returned: the launch's own latency
        loading = loading_us(self.stacks.trace, self.loader_rows, a, b, tid)
        other_tid, other_us = self._instead(a, b, tid, class_us, look_elsewhere, gil_wait)
        waited = np.zeros(n, dtype=bool) if stream_waited is None else np.asarray(stream_waited, dtype=bool)
        unframed = np.isin(tid, list(self.stacks.unframed)) if self.stacks.has_frames and self.stacks.unframed else None
        # A sync the device's idle began in explains no more of it than it blocked the host: without
        # it, the host's next work starts that much sooner, no more (a benchmark's sync after a 3 µs
        # kernel, then 47 ms of its own CPU ops before the next launch, is the host's work, not the
        # sync's). A decode loop's .item() blocks for the step's device work, longer than the gap.
        at_start = np.where((at_start == SYNC) & (blocked < 0.5 * (b - a)), UNTRACED, at_start)
        causes = self._decide(class_us, other_us, at_start, np.asarray(starved, dtype=bool),
                              np.asarray(small, dtype=bool), compiled, waited, b - a, self.light,
                              np.asarray(next_graph_launch, dtype=bool), loading,
                              None if concurrent is None else concurrent[0], unframed, gil_wait)
        return Explained(causes, tid, other_tid, class_us, other_us, *(concurrent or (None, None)), gil_wait)

    def busy_elsewhere(self, a: np.ndarray, b: np.ndarray, tid: np.ndarray) -> np.ndarray:
        """Per window, the work the busiest other thread (not servprof's) recorded in it."""
        _tid, other_us = self._instead(a, b, tid, np.zeros((a.size, len(CLASSES))), always=True, by_gil=False)
        return other_us[:, list(BUSY_CLASSES)].sum(axis=1)

    def _instead(self, a: np.ndarray, b: np.ndarray, tid: np.ndarray, class_us: np.ndarray, always: bool = False,
                 gil_wait: np.ndarray | None = None, by_gil: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """For gaps the launching thread recorded nothing for (or waited in Python beside another
        thread's): the busiest other (not sleeping) thread; ``by_gil``: the one that held the GIL
        longest, where the trace shows it."""
        best_tid = np.full(a.size, -1, dtype=np.int64)
        best_us = np.zeros((a.size, len(CLASSES)))
        quiet = class_us[:, UNTRACED] + (0.0 if gil_wait is None else gil_wait)
        need = np.arange(a.size) if always else np.flatnonzero(quiet >= 0.5 * (b - a))
        if need.size == 0:
            return best_tid, best_us
        best_busy = np.zeros(need.size)
        # With Python frames recorded, the thread that held the GIL is the one in Python the longest
        # (torch's ops run without it); without (or on a thread the tracer did not follow), its ops
        # are all that shows of it.
        by_gil = by_gil and self.stacks.has_frames
        for t in self.stacks.tids:
            ranked = list(GIL_CLASSES if by_gil and t not in self.stacks.unframed else BUSY_CLASSES)
            if t in self.stacks.servprof_threads:
                continue  # servprof's own work is its overhead, never the app's
            sel = need[tid[need] != t]
            if sel.size == 0:
                continue
            us = self.stacks.thread(t).class_times(a[sel], b[sel])
            busy = us[:, ranked].sum(axis=1)
            pos = np.searchsorted(need, sel)
            better = busy > best_busy[pos]
            best_busy[pos[better]] = busy[better]
            best_tid[sel[better]] = t
            best_us[sel[better]] = us[better]
        return best_tid, best_us

    @staticmethod
    def _decide(us: np.ndarray, other: np.ndarray, at_start: np.ndarray, starved: np.ndarray, small: np.ndarray,
                compiled: np.ndarray, waited: np.ndarray, length: np.ndarray, light: bool = False,
                graph_launch: np.ndarray | None = None, loading: np.ndarray | None = None,
                concurrent: np.ndarray | None = None, unframed: np.ndarray | None = None,
                gil_wait: np.ndarray | None = None) -> list[str]:
        """Each gap's cause: the first rule (most specific first) that holds, vectorised over gaps.
        A graph launch's cost grows with the graph: a long one is not a slow launch of a kernel.
        On a light trace the rules that read the absence of ops (a GIL held elsewhere while this
        thread recorded nothing, Python against op time) are skipped: what no rule explains from
        what was recorded needs a deep window."""
        busy_classes = np.array(BUSY_CLASSES)
        busy = us[:, busy_classes]
        top = busy_classes[np.argmax(busy, axis=1)] if len(us) else np.zeros(0, dtype=np.int64)
        other_busy = other[:, busy_classes].sum(axis=1)
        graph = np.zeros(len(us), dtype=bool) if graph_launch is None else graph_launch
        loading = np.zeros(len(us)) if loading is None else loading  # inside a DataLoader's __next__
        concurrent = np.zeros(len(us)) if concurrent is None else concurrent  # other threads' steps
        python = us[:, PYTHON] + us[:, COMPILE]
        host_busy = busy.sum(axis=1) >= 0.5 * length
        # Nothing recorded, or in Python while another thread was (gil_wait: out of "python" already).
        quiet = us[:, UNTRACED] + (0.0 if gil_wait is None else gil_wait)
        gil = (quiet >= 0.5 * length) & (other_busy >= 0.2 * length)
        if unframed is not None:  # its Python was not recorded: what it did not record may be its own
            gil &= ~unframed
        # (mask, cause, read from what the thread did not record: never concluded on a light trace)
        rules = [
            (~starved & waited, "stream_wait", False),
            (~starved, "kernel_wait", False),
            (loading >= 0.5 * length, "data_loading", False),
            ((at_start == SYNC) | ((top == SYNC) & (us[:, SYNC] >= 0.2 * length)), "synchronize", False),
            ((top == TOKENIZE) & (us[:, TOKENIZE] >= 0.2 * length), "tokenization", False),
            ((top == DETOKENIZE) & (us[:, DETOKENIZE] >= 0.2 * length), "detokenization", False),
            ((top == COLLECTIVE) & (us[:, COLLECTIVE] >= 0.2 * length), "collective_wait", False),
            ((top == COMPILING) & (us[:, COMPILING] >= 0.2 * length), "compiling", False),
            # Python's garbage collector, on this thread or holding the GIL on another.
            ((top == GC) & (us[:, GC] >= 0.2 * length), "python_gc", False),
            (us[:, WAIT] >= 0.5 * length, "waiting", False),
            (gil & (other[:, TOKENIZE] >= 0.5 * other_busy), "tokenization", True),
            (gil & (other[:, GC] >= 0.5 * other_busy), "python_gc", True),
            # The thread that held the GIL was in another request's step: the model calls compete.
            (gil & (concurrent >= 0.5 * length), "concurrent_steps", True),
            (gil, "gil_contention", True),
            # Recorded on a light trace too: other requests' steps, on their own threads, filled the gap.
            ((concurrent >= 0.5 * length) & ~host_busy, "concurrent_steps", False),
            (compiled & (python >= 0.5 * length) & (us[:, LAUNCH] + us[:, RUNTIME] < 0.1 * length), "compiled_dispatch",
             False),
            (host_busy & (top == LAUNCH) & (us[:, LAUNCH] >= SLOW_LAUNCH_US) & ~graph, "slow_launch", False),
            (small, "launch_bound", False),
            (host_busy & (top == RUNTIME), "runtime_calls", False),
            (host_busy & (top == LAUNCH), "launch_bound", False),
            (host_busy & (python > 0) & (python >= us[:, OP]), "host_python", True),
            (host_busy, "host_ops", True),
        ]
        cause = np.full(len(us), NEEDS_DEEP_CAUSE if light else "untraced_host_time", dtype=object)
        decided = np.zeros(len(us), dtype=bool)
        for mask, name, from_absence in rules:
            if light and from_absence:
                continue
            pick = mask & ~decided
            cause[pick] = name
            decided |= pick
        return cause.tolist()

    def top_frames(self, explained: Explained, groups: list[np.ndarray], a: np.ndarray, b: np.ndarray,
                   limit: int = 5) -> list[list[dict[str, Any]]]:
        """Per group of gaps: the frames with the most self time over its gaps (summed), on the
        thread each was read from."""
        if not groups:
            return []
        members = np.concatenate(groups)
        group = np.repeat(np.arange(len(groups)), [g.size for g in groups]).tolist()
        # Each gap's top frames (ThreadStack.top), all of a thread's gaps at once; summed in the
        # order of the gaps, then of each gap's ranking, as rounded self time (what top() gives).
        tids = explained.tid[members]
        parts = []
        for t in distinct(tids).tolist():
            mine = np.flatnonzero(tids == t)
            window, key, us = self.stacks.thread(int(t)).top_keys(a[members[mine]], b[members[mine]], limit)
            parts.append((mine[window], key, us))
        gap, key, us = (np.concatenate(column) for column in zip(*parts, strict=True)) if len(parts) > 1 else parts[0]
        order = np.argsort(gap, kind="stable")
        totals: list[dict[tuple[str, str], float]] = [{} for _ in groups]
        for i, k, v in zip(gap[order].tolist(), key[order].tolist(), us[order].tolist(), strict=True):
            frame, total = (self.names[k // len(CLASSES)], CLASSES[k % len(CLASSES)]), totals[group[i]]
            total[frame] = total.get(frame, 0.0) + round(v, 1)
        return [[{"name": n, "class": c, "self_us": round(us, 1)}
                 for (n, c), us in sorted(total.items(), key=lambda kv: -kv[1])[:limit]] for total in totals]

    def described_later(self, explained: Explained, i: int, a: float, b: float, inside_step: bool = False
                        ) -> Callable[[], tuple[str, dict[str, Any]]]:
        """describe(), when the gap's explanation is first read (a copy of its row: the rest of the
        gaps' arrays can be freed). ``inside_step``: a stall inside one of the thread's steps."""
        own = explained.subset(np.array([i]))
        return lambda: self.describe(own, 0, a, b, inside_step)

    def describe(self, explained: Explained, i: int, a: float, b: float,
                 inside_step: bool = False) -> tuple[str, dict[str, Any]]:
        """One gap's explanation (a sentence) and its evidence: self time by class on the thread it
        was read from, the top frames by self time, and the thread that ran instead."""
        cause = explained.cause[i]
        tid = int(explained.tid[i])
        stack = self.stacks.thread(tid)
        label_of = self.stacks.trace.thread_label  # (the thread as the trace names it, in the text)
        top = stack.top(a, b, self.names)
        evidence: dict[str, Any] = {
            "thread": tid,
            "self_us": {CLASSES[c]: round(float(v), 1) for c, v in enumerate(explained.class_us[i]) if v >= 0.05},
            "top_frames": top,
        }
        if self.stacks.has_frames:  # (what the fix for time nothing was recorded for can say: cause_texts)
            evidence["python_frames"] = "other_threads_only" if tid in self.stacks.unframed else "recorded"
        other = int(explained.other_tid[i])
        if other >= 0:
            evidence["ran_instead"] = {"thread": other, "top_frames": self.stacks.thread(other).top(a, b, self.names),
                                       "self_us": {CLASSES[c]: round(float(v), 1) for c, v in
                                                   enumerate(explained.other_us[i]) if v >= 0.05}}
        wanted = {"synchronize": "sync", "tokenization": "tokenize", "detokenization": "detokenize",
                  "compiled_dispatch": None, "collective_wait": "collective", "slow_launch": "launch",
                  "compiling": "compiling", "runtime_calls": "runtime"}.get(cause)
        elsewhere = cause in ("gil_contention",) or (cause in ("tokenization", "python_gc") and other >= 0)
        frames = evidence["ran_instead"]["top_frames"] if elsewhere else top
        if cause == "gil_contention" and self.stacks.has_frames:  # what held the GIL, not its ops
            held = [f for f in self.stacks.thread(other).top(a, b, self.names, limit=1 << 30)
                    if f["class"] in GIL_CLASS_NAMES][:3]
            frames = held or frames
        named = [f for f in frames if wanted is None or f["class"] == wanted]
        if wanted is not None and not named and not elsewhere:
            # The frame that makes the cause (a sync at the gap's start, a slow launch) can hold
            # less self time than the top five: name it from all the gap's frames.
            named = [f for f in stack.top(a, b, self.names, limit=1 << 30) if f["class"] == wanted][:3]
            if named:
                evidence["cause_frames"] = named
        named = named or frames
        names = ", ".join(_frame_text(f, cause) for f in named[:3]) or "nothing recorded"
        label = cause_label(cause, self.on_device)
        if cause == "python_gc":
            text = f"{label}: {collected_text(evidence, label_of(tid), label_of(other) if other >= 0 else '')}"
        elif elsewhere:
            text = f"{label}: thread {label_of(other)} ran {names} while thread {label_of(tid)} (the one driving the model) "
            text += _waited_text(explained, i, evidence)
        elif cause in ("kernel_wait", "stream_wait"):
            text = label
            blocked = [f for f in top if f["class"] == "sync"]
            if blocked:
                text += (f"; meanwhile thread {label_of(tid)} blocked in {blocked[0]['name']} "
                         f"({float(blocked[0]['self_us']) / 1000:.2f} ms)")
        elif cause == "launch_bound":
            text = label
        elif cause == "data_loading":
            spent = float(loading_us(self.stacks.trace, self.loader_rows, np.array([a]), np.array([b]),
                                     np.array([tid]))[0])
            name = loading_range(self.stacks.trace, self.loader_rows, tid, a, b)
            evidence["data_loading"] = {"range": name, "us": round(spent, 1)}
            text = f"{label} on thread {label_of(tid)}: {name} for {spent / 1000:.2f} of {(b - a) / 1000:.2f} ms"
        elif cause == "slow_launch":
            text = f"{label} on thread {label_of(tid)}: {names}"
            called = sum(float(f["self_us"]) for f in top if f["class"] == "launch")
            waited = float(explained.class_us[i][LAUNCH]) - called
            if waited >= SLOW_LAUNCH_US:
                text += f"; its work started {waited / 1000:.2f} ms after the call returned"
        elif cause == "untraced_host_time":
            quiet = float(explained.class_us[i][UNTRACED])
            text = f"{label}: thread {label_of(tid)} recorded nothing for {quiet / 1000:.2f} of {(b - a) / 1000:.2f} ms"
        elif cause == NEEDS_DEEP_CAUSE:
            text = _light_text(explained, i, a, b, evidence, label_of)
        elif cause == "concurrent_steps" and explained.concurrent_us is not None \
                and explained.concurrent_threads is not None:
            cover, threads = float(explained.concurrent_us[i]), int(explained.concurrent_threads[i])
            evidence["other_steps"] = {"us": round(cover, 1), "threads": threads}
            text = f"{label}: {threads} other thread(s) ran model steps for {cover / 1000:.2f} of {(b - a) / 1000:.2f} ms "
            text += (f"of a step of thread {label_of(tid)}'s, which {_waited_text(explained, i, evidence)}" if inside_step
                     else f"while thread {label_of(tid)} was between its own")
        else:
            text = f"{label} on thread {label_of(tid)}: {names}"
        if cause == "tokenization":
            ids = sorted({rid for f in frames for rid in _phase_ids(str(f["name"]))})
            if ids:
                evidence["tokenize_request_ids"] = ids[:20]
        return text, evidence


def _waited_text(explained: Explained, i: int, evidence: dict[str, Any]) -> str:
    """What the thread driving the model did meanwhile: recorded nothing, or was in Python frames
    at the same time as another thread (evidence "gil_wait_us": only one runs Python at a time)."""
    waited = 0.0 if explained.gil_wait_us is None else float(explained.gil_wait_us[i])
    if waited < 0.05:
        return "recorded nothing"
    evidence["gil_wait_us"] = round(waited, 1)
    quiet = float(explained.class_us[i][UNTRACED])
    text = (f"was in its Python frames for {waited / 1000:.2f} ms at the same time (only one thread runs Python at "
            "a time: for that time one of the two waited for the GIL)")
    return text + (f" and recorded nothing for {quiet / 1000:.2f} ms" if quiet >= 0.05 * waited else "")


def _frame_text(frame: dict[str, Any], cause: str) -> str:
    """A frame as a finding names it; a slow launch or runtime call with the time it took."""
    name = str(frame["name"])[:90]
    return f"{name} ({float(frame['self_us']) / 1000:.2f} ms)" if cause in TIMED_FRAMES else name


def _light_text(explained: Explained, i: int, a: float, b: float, evidence: dict[str, Any],
                label_of: Callable[[int], str]) -> str:
    """A light trace's gap: what was recorded (time only, never a cause), and that the cause needs a deep window."""
    quiet = float(explained.class_us[i][UNTRACED])
    text = (f"{NEEDS_DEEP}: thread {label_of(int(explained.tid[i]))} recorded no range for {quiet / 1000:.2f} of "
            f"{(b - a) / 1000:.2f} ms (a light trace records no ops)")
    instead = evidence.get("ran_instead")
    if instead and instead["top_frames"]:
        text += f"; meanwhile thread {label_of(instead['thread'])} was in {str(instead['top_frames'][0]['name'])[:90]}"
    return text


def _phase_ids(name: str) -> list[str]:
    parsed = parse_phase_event_name(name)
    return parsed[1] if parsed else []
