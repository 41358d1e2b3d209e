"""What a request's thread recorded over some windows outside model steps (a deep trace): its
time by class and its top frames, and, when recorded work does not cover most of those windows,
why the trace cannot name it.

queue_wait reads the handler's way to its model call with it, after_last_step the handler's work
after the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servprof.detect.cause_texts import THREAD_STARTED_LATE
from servprof.detect.host_classes import BUSY_CLASSES, CLASSES, DETOKENIZE, TOKENIZE, WAIT
from servprof.detect.host_stacks import HostStacks
from servprof.detect.intervals import outside
from servprof.trace.model import Trace

# Recorded work on the thread (ops, Python, runtime calls), not the request's own tokenize phases.
HANDLER_BUSY = tuple(c for c in BUSY_CLASSES if c not in (TOKENIZE, DETOKENIZE))
ASYNC_HANDLER = ("an async handler runs its code before and after the model on the event loop's thread (or on another "
                 "executor thread), not on the thread that ran the model; code on the loop also blocks it (see "
                 "loop_stall).")
# What the windows show: the threads computing (named), waiting (their Python recorded, most of the
# time in waits or nothing), no frames anywhere (a light window, or no SERVPROF_WITH_STACK), or
# no frames on these threads though others have them (started after the profiler).
COMPUTING, WAITED, NOT_RECORDED, STARTED_LATE = "computing", "waited", "not_recorded", "started_after_the_profiler"


@dataclass
class ThreadWork:
    seen: str
    busy_ms: float = 0.0
    window_ms: float = 0.0
    self_ms: dict[str, float] = field(default_factory=dict)
    top_frames: list[dict[str, Any]] = field(default_factory=list)
    waits: list[dict[str, Any]] = field(default_factory=list)
    late_threads: int = 0  # threads left out: no frames of theirs where the trace has others'
    # Where these threads did not compute: other threads that did over the same windows (an async
    # handler's work runs on the event loop's thread, not on the executor thread that ran the model).
    elsewhere: list[dict[str, Any]] = field(default_factory=list)

    def evidence(self) -> dict[str, Any]:
        """The finding's ``handler_threads``: what the threads did (the frames named only when
        they were computing; the wait frames when they waited)."""
        out: dict[str, Any] = {"seen": self.seen}
        if self.seen in (COMPUTING, WAITED) or self.ops_only:
            out.update(busy_ms=self.busy_ms, window_ms=self.window_ms, self_ms=self.self_ms)
        if self.seen == COMPUTING or self.ops_only:
            out["top_frames"] = self.top_frames
        if self.seen == WAITED and self.waits:
            out["wait_frames"] = self.waits
        if self.late_threads:
            out["threads_started_after_the_profiler"] = self.late_threads
        if self.elsewhere:
            out["computing_elsewhere"] = self.elsewhere
        return out

    @property
    def ops_only(self) -> bool:
        """No Python recorded, but ops on these threads covered part (under half) of the windows: a
        measure kept, not the whole story (the rest may be Python between ops or a wait for a CPU)."""
        return self.seen == NOT_RECORDED and "op" in self.self_ms and bool(self.top_frames)

    def title_part(self) -> str:
        names = ", ".join(f["name"][:60] for f in self.top_frames[:3])
        if self.seen == COMPUTING:
            return (f"; their threads were computing outside the model for {self.busy_ms:.1f} of {self.window_ms:.1f} "
                    f"ms ({names})")
        if self.ops_only:
            return f"; their threads ran ops outside the model for {self.busy_ms:.1f} of {self.window_ms:.1f} ms ({names})"
        if self.elsewhere:  # (only a thread seen waiting is known not to have computed)
            other = self.elsewhere[0]
            names = ", ".join(f["name"][:60] for f in other["top_frames"][:3])
            who = f"not their threads but {_label(other)}" if self.seen == WAITED else _label(other)
            return f"; meanwhile {who} computed, for {other['busy_ms']:.1f} of {other['window_ms']:.1f} ms ({names})"
        return ""

    def unseen_text(self, not_recorded: str) -> str:
        """Why the trace names no work there (empty when it does); ``not_recorded``: the caller's
        advice where the trace recorded no Python at all."""
        if self.seen == STARTED_LATE:
            text = (" What they did is not in this trace: torch's Python tracer recorded other threads' Python but none "
                    "of these requests' threads': " + THREAD_STARTED_LATE.format(which="these"))
        elif self.seen == WAITED and self.elsewhere:
            return (" The threads that ran these requests' model steps waited over that time; "
                    f"{_label(self.elsewhere[0])} computed (named in the title): {ASYNC_HANDLER}")
        elif self.seen == WAITED:
            where = ", ".join(f["name"][:60] for f in self.waits[:2])
            return (f" Their threads' Python was recorded, and they computed for {self.busy_ms:.1f} of "
                    f"{self.window_ms:.1f} ms of it: the rest they waited"
                    + (f" ({where})" if where else "")
                    + ", for another thread, process or service, a lock, or a CPU (too few cores for the server's "
                      "threads); what the handler waited for there is where the time went.")
        elif self.ops_only:
            text = (f" Their threads' ops were recorded (named in the title: {self.busy_ms:.1f} of {self.window_ms:.1f} "
                    "ms); what they did for the rest is not: Python between ops, a wait, or a wait for a CPU (too few "
                    "cores for the server's threads)." + not_recorded)
        else:
            text = not_recorded if self.seen == NOT_RECORDED else ""
        if self.elsewhere:
            text += (f" Meanwhile {_label(self.elsewhere[0])} computed (named in the title): if these are async "
                     f"handlers, that may be their work: {ASYNC_HANDLER}")
        return text


def thread_work(trace: Trace, windows: list[tuple[int, int, float, float]], steps_start: np.ndarray,
                steps_end: np.ndarray) -> ThreadWork:
    """``windows``: (rank, thread, from µs, to µs), read where no model step ran (on any thread).
    COMPUTING where recorded work covers at least half of them. Where the rank's trace has Python
    frames, a thread without any (started after the profiler) is left out: its unrecorded Python
    would read as waiting."""
    stacks: dict[int, HostStacks] = {}
    window_us, by_class, frames, late = 0.0, np.zeros(len(CLASSES)), {}, set()
    framed = False
    cuts: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}  # per rank: each window outside the steps
    for rank, tid, start_us, end_us in windows:
        ranked = stacks.get(rank)
        if ranked is None:  # (built once per rank: it reads the whole trace)
            ranked = stacks[rank] = HostStacks(trace, rank)
        a, b = outside(float(start_us), float(end_us), steps_start, steps_end)
        cuts.setdefault(rank, []).append((a, b))
        if ranked.has_frames and tid in ranked.unframed:
            late.add((rank, tid))
            continue
        framed = framed or ranked.has_frames
        stack = ranked.thread(tid)
        window_us += float((b - a).sum())
        by_class += stack.class_times(a, b).sum(axis=0)
        _window, keys, spent = stack.top_keys(a, b, limit=8)
        for key, us in zip(keys.tolist(), spent.tolist(), strict=True):
            frames[key] = frames.get(key, 0.0) + us
    if window_us <= 0:
        work = ThreadWork(STARTED_LATE if late else NOT_RECORDED, late_threads=len(late))
    else:
        busy_us = float(by_class[list(HANDLER_BUSY)].sum())
        seen = COMPUTING if busy_us >= 0.5 * window_us else WAITED if framed else NOT_RECORDED
        work = ThreadWork(seen, round(busy_us / 1e3, 3), round(window_us / 1e3, 3),
                          {CLASSES[c]: round(float(v) / 1e3, 3) for c, v in enumerate(by_class) if v >= 50.0},
                          named_frames(trace, frames, HANDLER_BUSY), named_frames(trace, frames, (WAIT,)), len(late))
    if work.seen != COMPUTING:
        work.elsewhere = _computing_elsewhere(trace, stacks, cuts, {(r, t) for r, t, _a, _b in windows})
    return work


def _computing_elsewhere(trace: Trace, stacks: dict[int, HostStacks],
                         cuts: dict[int, list[tuple[np.ndarray, np.ndarray]]],
                         own_threads: set[tuple[int, int]]) -> list[dict[str, Any]]:
    """The other threads (not servprof's, not ``own_threads``) that computed for at least half of
    the windows (``cuts``: per rank, each window outside every step), busiest first."""
    out: list[dict[str, Any]] = []
    for rank, cut in sorted(cuts.items()):
        ranked = stacks[rank]
        a, b = np.concatenate([c[0] for c in cut]), np.concatenate([c[1] for c in cut])
        window_us = float((b - a).sum())
        if window_us <= 0:
            continue
        own = {t for r, t in own_threads if r == rank} | ranked.servprof_threads
        for tid in ranked.tids:
            if tid in own:
                continue
            stack = ranked.thread(tid)
            busy_us = float(stack.class_times(a, b)[:, list(HANDLER_BUSY)].sum())
            if busy_us < 0.5 * window_us:
                continue
            _window, keys, spent = stack.top_keys(a, b, limit=8)
            frames: dict[int, float] = {}
            for key, us in zip(keys.tolist(), spent.tolist(), strict=True):
                frames[key] = frames.get(key, 0.0) + us
            out.append({"rank": rank, "thread": tid, "thread_name": _thread_name(trace, rank, tid),
                        "busy_ms": round(busy_us / 1e3, 3), "window_ms": round(window_us / 1e3, 3),
                        "top_frames": named_frames(trace, frames, HANDLER_BUSY)})
    return sorted(out, key=lambda x: -x["busy_ms"])


def _thread_name(trace: Trace, rank: int, tid: int) -> str | None:
    return next((name for (r, _pid, t), name in trace.thread_names.items() if r == rank and t == tid), None)


def _label(other: dict[str, Any]) -> str:
    """"thread 12 (MainThread)"; torch names a thread "thread 12 (python)" itself."""
    name = other.get("thread_name")
    return name if name and str(other["thread"]) in name else f"thread {other['thread']}" + (f" ({name})" if name else "")


def named_frames(trace: Trace, frames: dict[int, float], classes: tuple[int, ...]) -> list[dict[str, Any]]:
    """The five frames of ``classes`` with the most own time (``frames``: HostStacks key -> µs), named."""
    ranked = sorted((kv for kv in frames.items() if kv[0] % len(CLASSES) in classes), key=lambda kv: -kv[1])
    return [{"name": trace.names[key // len(CLASSES)], "class": CLASSES[key % len(CLASSES)], "self_ms": round(us / 1e3, 3)}
            for key, us in ranked[:5]]
