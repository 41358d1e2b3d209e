"""Gaps in the model's work between and inside steps, each found once, with its cause.

On a trace with device events, a gap is device idle time (the holes in the union of
every kernel, copy and memset on the rank), each hole counted once: the timeline is
cut into disjoint zones, inside each step's device span and between consecutive
steps (device_segments), and every hole belongs to exactly one. Holes under
max(50 µs, 2% of the step's device span) are summed per step and cause rather than
listed one by one (1,000 tiny launch gaps are one cause: launch-bound). A collective
kernel far longer than its median on the rank is time spent waiting for a slower
rank (a straggler), listed beside the idle time. On a CPU-only trace, a gap is the
host time between consecutive steps on the step's thread, and the part of a step in which
that thread recorded no work (stalled_steps.py; not on a light trace, whose threads record no
work by design: tier.py). Causes: causes.py. A gap: gap.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

from servprof.detect.causes import CAUSES, Explained, GapExplainer
from servprof.detect.collective_arrivals import name_last_arrivals
from servprof.detect.concurrency import other_steps_during
from servprof.detect.gap import CPU_MIN_GAP_US, RELATIVE_MIN_GAP, STEP_KIND_HINT, Description, Gap
from servprof.detect.graph_capture import (
    NO_WINDOWS,
    capture_windows,
    count_captures,
    inside_captures,
    launches_inside,
)
from servprof.detect.host_classes import CLASSES, GRAPH_LAUNCH, NameClasses
from servprof.detect.host_stacks import HostStacks
from servprof.detect.intervals import merge
from servprof.detect.name_guard import Guarded
from servprof.detect.name_scan import host_ids_matching
from servprof.detect.overhead import stop_cutoffs
from servprof.detect.stalled_steps import stalled_steps
from servprof.detect.steps import Step, device_segments
from servprof.detect.tier import NEEDS_DEEP_CAUSE, is_light
from servprof.trace.meta import loop_thread
from servprof.trace.model import distinct, median

GPU_MIN_GAP_US = 50.0  # device idle below 50 µs is launch latency: summed per step, not listed
# Device idle is listed one by one from this share of the step's device span (inside) or of
# the median span (between); shorter holes are summed per step and cause.
DEVICE_RELATIVE_MIN_GAP = 0.02
# A collective kernel this many times its median on the rank waited for another rank.
STRAGGLER_FACTOR = 3.0
COLLECTIVE_KERNEL = Guarded(re.compile(r"nccl|rccl|AllReduce|AllGather|ReduceScatter|all_reduce|allreduce|cross_device_reduce",
                                       re.IGNORECASE), "ccl", "allreduce", "allgather", "reducescatter", "all_reduce",
                            "cross_device_reduce")
MAX_NAMED_SUMS = 100
STREAM_WAIT = Guarded(re.compile(r"^(cuda|hip|cu)StreamWaitEvent"), "StreamWaitEvent")
EVENT_LOOP_WORK = "event_loop_work"
CONTINUING_KINDS = ("decode", "mixed", "step", "train")  # a gap before one of these is the engine's own


def find_gaps(trace: Any, steps: list[Step], requests_us: list[tuple[float, float]] | None = None
              ) -> tuple[list[Gap], dict[str, Any]]:
    """Idle between and inside steps, with causes. ``requests_us``: (arrival, end) of each sampled
    request (a session's records): a step whose kind the trace does not say may be the first of a
    request that arrived in the gap before it, and that wait is not the engine's (after_arrival)."""
    gaps: list[Gap] = []
    stats: dict[str, Any] = {"steps": len(steps), "mode": "cpu"}
    fresh = after_arrival(steps, requests_us)
    stats["unknown_steps_after_arrival"] = len(fresh)
    if not requests_us:  # (with a session's records, after_arrival tells the waits apart)
        parallel = parallel_calls(steps)
        stats["unknown_steps_in_parallel"] = len(parallel)
        if parallel:
            fresh |= parallel
            stats.setdefault("missing", []).append(parallel_missing(steps, parallel))
    light = is_light(trace)
    classes = NameClasses(trace) if steps else None
    cutoffs = stop_cutoffs(trace)
    index = {id(s): i for i, s in enumerate(steps)}
    captures = capture_windows(trace) if steps else {}
    for rank in trace.ranks:
        rank_steps = [s for s in steps if s.rank == rank]
        if not rank_steps:
            continue
        stacks = HostStacks(trace, rank, classes)
        on_device = any(s.on_device for s in rank_steps)
        explainer = GapExplainer(stacks, light, on_device)
        windows = captures.get(rank, NO_WINDOWS)
        if windows[0].size:
            count_captures(stats, windows[0].size, launches_inside(trace, rank, *windows))
        if on_device:
            stats["mode"] = "device"
            gaps.extend(_device_gaps(trace, rank, rank_steps, index, explainer, cutoffs.get(rank, np.inf), fresh,
                                     stats, windows))
        else:
            gaps.extend(_on_the_loop(trace, steps, _host_gaps(rank_steps, index, explainer, fresh)))
            if not light:  # a light trace records no work inside a step: no stall can be told from work
                gaps.extend(stalled_steps(rank_steps, index, explainer, stats))
    # (a folder of ranks: the one each straggler waited for; else that the other ranks are missing)
    peers_missing = name_last_arrivals(trace, gaps)
    if peers_missing:
        stats.setdefault("missing", []).extend(peers_missing)
    stats["median_step_us"] = round(median([s.time_us for s in steps]), 1) if steps else None
    return gaps, stats


def after_arrival(steps: list[Step], requests_us: list[tuple[float, float]] | None) -> set[int]:
    """id() of each step of unknown kind ("step") that may be the first of a request which arrived
    in the gap before it on its thread, when that thread had nothing else to run: the sampled
    requests in flight all through the gap are no more than the other threads running steps in it
    (a thread runs one request's steps at a time, an engine's one thread all of them; a request in
    flight beyond those was this thread's, and the gap its own). ``requests_us``: (arrival, end) of
    each sampled request."""
    if not requests_us or not any(s.kind == "step" for s in steps):
        return set()
    arrivals = np.sort(np.array([a for a, _ in requests_us], dtype=float))
    by_thread: dict[tuple[int, int], list[Step]] = {}
    for step in sorted(steps, key=lambda s: s.start_us):
        by_thread.setdefault((step.rank, step.tid), []).append(step)
    fresh: set[int] = set()
    for (rank, tid), mine in by_thread.items():
        for before, step in zip(mine, mine[1:], strict=False):
            a, b = before.end_us, step.start_us
            if step.kind != "step" or b <= a or \
                    np.searchsorted(arrivals, b, side="right") == np.searchsorted(arrivals, a, side="right"):
                continue
            in_flight = sum(1 for arrival, end in requests_us if arrival <= a and end > b)
            others_busy = sum(1 for (r, t), theirs in by_thread.items() if r == rank and t != tid
                              and any(s.start_us < b and s.end_us > a for s in theirs))
            if in_flight <= others_busy:
                fresh.add(id(step))
    return fresh


def parallel_calls(steps: list[Step]) -> set[int]:
    """id() of each step of unknown kind ("step") on a rank where such steps ran on two threads or
    more at once: a pool whose threads each run one call per step (a request's model call, a task),
    where the time between two steps on one thread is its wait for the next call as often as the
    loop's own. Threads whose transformers generate() calls say where each call begins (a step
    that opens a request) keep their steps' gaps judged. For traces without request records."""
    out: set[int] = set()
    by_rank: dict[int, list[Step]] = {}
    for step in steps:
        by_rank.setdefault(step.rank, []).append(step)
    for mine in by_rank.values():
        told = {s.tid for s in mine if s.opens_request}
        unknown = sorted((s for s in mine if s.kind == "step" and s.tid not in told), key=lambda s: s.start_us)
        if _threads_overlap(unknown):
            out.update(id(s) for s in unknown)
    return out


def _threads_overlap(steps: list[Step]) -> bool:
    """Two of these steps (in start order), on different threads, overlap by half the shorter one
    at least (not a hand-off between threads, which clocks may show a few µs over)."""
    open_steps: dict[int, Step] = {}  # per thread, its step that ends last so far, while it runs
    for step in steps:
        for tid in [t for t, other in open_steps.items() if other.end_us <= step.start_us]:
            del open_steps[tid]  # (ended before this one began: none after it can overlap it)
        for tid, other in open_steps.items():
            if tid != step.tid and min(other.end_us, step.end_us) - step.start_us >= 0.5 * min(other.dur_us, step.dur_us) > 0:
                return True
        latest = open_steps.get(step.tid)
        if latest is None or step.end_us > latest.end_us:
            open_steps[step.tid] = step
    return False


def parallel_missing(steps: list[Step], parallel: set[int]) -> dict[str, str]:
    """summary["missing"] entry for the gaps parallel_calls() left unjudged."""
    threads = {(s.rank, s.tid) for s in steps if id(s) in parallel}
    return {"what": "step kinds", "message": (
        f"{len(parallel)} step(s) of unknown kind ran on {len(threads)} threads at once (a pool's calls, each "
        "maybe a whole request's): the time between two of them on one thread was not judged, since without "
        "step kinds or servprof's request records the wait for the next request cannot be told from the "
        f"loop's own time. {STEP_KIND_HINT}")}


def continues(step: Step, fresh: set[int]) -> bool:
    """Whether the gap before this step is the engine's own (not the wait for a new request)."""
    return step.kind in CONTINUING_KINDS and not step.opens_request and id(step) not in fresh


# --- device timelines -------------------------------------------------------------------------


def device_rows(trace: Any, rank: int, cutoff: float = np.inf) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, starts, ends) of the rank's device events in start order, cut at servprof's stop."""
    rows = np.flatnonzero(trace.device_mask() & (trace.rank == rank))
    rows = rows[np.argsort(trace.ts[rows], kind="stable")]
    start = trace.ts[rows]
    keep = start < cutoff
    rows, start = rows[keep], start[keep]
    return rows, start, np.minimum(start + trace.dur[rows], cutoff)


def zones(steps: list[Step]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The rank's timeline cut into disjoint zones: (start, end, step position, inside?) in time
    order; a between-steps zone belongs to the step after it."""
    on_device = sorted((s for s in steps if s.on_device), key=lambda s: s.device_start_us or 0.0)
    zs, ze, zi, inside = [], [], [], []
    previous_end = None
    for pos, segment in enumerate(device_segments(on_device)):
        assert segment is not None
        if previous_end is not None and segment[0] > previous_end:
            zs.append(previous_end), ze.append(segment[0]), zi.append(pos), inside.append(False)
        zs.append(segment[0]), ze.append(segment[1]), zi.append(pos), inside.append(True)
        previous_end = segment[1]
    return np.array(zs), np.array(ze), np.array(zi, dtype=np.int64), np.array(inside, dtype=bool)


def _device_gaps(trace: Any, rank: int, steps: list[Step], index: dict[int, int], explainer: GapExplainer,
                 cutoff: float, fresh: set[int], stats: dict[str, Any],
                 windows: tuple[np.ndarray, np.ndarray]) -> list[Gap]:
    on_device = sorted((s for s in steps if s.on_device), key=lambda s: s.device_start_us or 0.0)
    rows, dev_start, dev_end = device_rows(trace, rank, cutoff)
    block_start, block_end = merge(dev_start, dev_end)
    hole_a, hole_b = block_end[:-1], block_start[1:]
    zs, ze, zstep, zinside = zones(on_device)
    if hole_a.size == 0 or zs.size == 0:
        return _stragglers(trace, rank, on_device, index, rows, dev_start, dev_end)
    mid = (hole_a + hole_b) / 2
    z = np.searchsorted(zs, mid, side="right") - 1
    ok = (z >= 0) & (mid < ze[np.maximum(z, 0)])
    hole_a, hole_b, z = hole_a[ok], hole_b[ok], z[ok]
    # Idle while a graph was captured is by design (its kernels were recorded, not run): not judged.
    if windows[0].size:
        capturing = inside_captures(*windows, hole_a, hole_b)
        count_captures(stats, idle_us=float((hole_b - hole_a)[capturing].sum()))
        hole_a, hole_b, z = hole_a[~capturing], hole_b[~capturing], z[~capturing]
        if hole_a.size == 0:
            return _stragglers(trace, rank, on_device, index, rows, dev_start, dev_end)
    step_pos, inside = zstep[z], zinside[z]
    spans = np.array([s.time_us for s in on_device])
    median_span = median(spans)
    limit = np.maximum(GPU_MIN_GAP_US, DEVICE_RELATIVE_MIN_GAP * np.where(inside, spans[step_pos], median_span))
    small = (hole_b - hole_a) < limit
    # The device work that ended each hole: its launch says whether the device was starved.
    nxt = rows[np.minimum(np.searchsorted(dev_start, hole_b, side="left"), rows.size - 1)]
    launch = trace.launch_row_for(nxt)
    has_launch = launch >= 0
    lrow = np.maximum(launch, 0)
    launch_ts = np.where(has_launch, trace.ts[lrow], -np.inf)
    launch_end = np.where(has_launch, trace.ts[lrow] + trace.dur[lrow], hole_b)
    # Starved: the device's queue was empty when the hole began (the launch was still to come or in
    # progress) and the work started within launch latency of the launch returning. Work queued
    # before the hole, or launched and then held back longer (a wait on another stream), was not
    # waiting for the host.
    held_back = hole_b - launch_end
    starved = ~has_launch | ((launch_end > hole_a) & (held_back < np.maximum(GPU_MIN_GAP_US, launch_end - hole_a)))
    tid = np.where(has_launch, trace.tid[lrow], np.array([on_device[p].tid for p in step_pos]))
    graph = has_launch & np.isin(trace.name_id[lrow], host_ids_matching(trace, GRAPH_LAUNCH))  # (launches)
    waited, wait_rows = _stream_waits(trace, rank, rows, dev_start, hole_a, hole_b, launch_ts)
    # Steps on several threads (one model call per request, each on its own thread): other requests'
    # steps running through a hole of this step's, read against the step's own thread.
    step_tid = np.array([s.tid for s in on_device], dtype=np.int64)
    concurrent = other_steps_during(on_device, hole_a, hole_b, step_tid[step_pos]) \
        if distinct(step_tid).size > 1 else None
    explained = explainer.explain(hole_a, hole_b, tid, starved, small, graph, launch_end, waited,
                                  concurrent=concurrent)
    out: list[Gap] = []
    continuing = np.array([continues(s, fresh) for s in on_device])
    # Idle before a new request's prefill: the engine had nothing to run.
    counted = inside | continuing[step_pos]
    # np.unique of the causes (sorted names, each gap's index among them) without an object array's sort.
    cause_names = sorted(set(explained.cause))
    cause_code = np.fromiter(map({c: i for i, c in enumerate(cause_names)}.__getitem__, explained.cause),
                             dtype=np.int64, count=len(explained.cause))
    # Summed per step, place, cause and the thread they were read from: a sum's frames are all on
    # the thread it names (a training step's gaps come from the main and the autograd thread).
    summed: dict[tuple[int, bool, str, int], np.ndarray] = {}
    short = np.flatnonzero(counted & small)
    if short.size:
        threads, thread_code = np.unique(explained.tid[short], return_inverse=True)
        key = ((step_pos[short] * 2 + inside[short]) * len(cause_names) + cause_code[short]) * threads.size \
            + thread_code
        order = np.argsort(key, kind="stable")
        keys, first = np.unique(key[order], return_index=True)
        for k, members in zip(keys.tolist(), np.split(short[order], first[1:]), strict=True):
            rest, thread = divmod(k, threads.size)
            pos_inside, code = divmod(rest, len(cause_names))
            summed[(pos_inside // 2, bool(pos_inside % 2), str(cause_names[code]), int(threads[thread]))] = members
    listed = np.flatnonzero(counted & ~small)
    described = explained.subset(listed)
    for j, i in enumerate(listed.tolist()):
        step = on_device[int(step_pos[i])]
        where = "inside_step" if inside[i] else "between_steps"
        a, b = float(hole_a[i]), float(hole_b[i])
        later = _describe_device_gap(trace, explainer, described, j, a, b, int(wait_rows[i]))
        out.append(Gap(rank, a, b, b - a, where, explained.cause[i], later, list(step.request_ids),
                       step=index[id(step)]))
    # Frames are named for the largest sums only (those a finding shows), from their 20 longest
    # gaps: one batched search per thread for all of them.
    named = sorted(summed, key=lambda key: -float((hole_b[summed[key]] - hole_a[summed[key]]).sum()))[:MAX_NAMED_SUMS]
    longest = [summed[key][np.argsort(hole_a[summed[key]] - hole_b[summed[key]])[:20]] for key in named]
    frames = dict(zip(named, explainer.top_frames(explained, longest, hole_a, hole_b), strict=True))
    for key, idx in summed.items():
        pos, is_inside, cause, thread = key
        step = on_device[pos]
        idle = float((hole_b[idx] - hole_a[idx]).sum())
        label = CAUSES[cause][0]
        longest_us = float((hole_b[idx] - hole_a[idx]).max())
        # (The longest, not the limit that made them short: "each under 2449 µs" of gaps of at most 0.4 ms misleads.)
        text = f"{idx.size} short device gaps (the longest {longest_us:.0f} µs), {idle:.0f} µs in all: {label}"
        by_class = explained.class_us[idx].sum(axis=0)
        evidence = {"gaps_summed": int(idx.size), "thread": thread,
                    "self_us": {CLASSES[c]: round(float(v), 1) for c, v in enumerate(by_class) if v >= 0.05},
                    "longest_us": round(longest_us, 1), "short_limit_us": round(float(limit[idx[0]]), 1),
                    "top_frames": frames.get(key, [])}
        out.append(Gap(rank, float(hole_a[idx].min()), float(hole_b[idx].max()), idle,
                       "inside_step" if is_inside else "between_steps", cause, (text, evidence),
                       list(step.request_ids), count=int(idx.size), step=index[id(step)]))
    out.extend(_stragglers(trace, rank, on_device, index, rows, dev_start, dev_end))
    return out


def _describe_device_gap(trace: Any, explainer: GapExplainer, explained: Explained, i: int, a: float, b: float,
                         wait_row: int) -> Callable[[], Description]:
    """What describes a listed device gap when it is first read (its frames, the stream wait)."""
    def describe() -> Description:
        text, evidence = explainer.describe(explained, i, a, b)
        if explained.cause[i] == "stream_wait" and wait_row >= 0:
            w = wait_row
            evidence["stream_wait"] = {"call": trace.name(w), "thread": int(trace.tid[w]), "ts": float(trace.ts[w])}
            lead = (a - float(trace.ts[w])) / 1000
            text += f" ({trace.name(w)} on thread {trace.thread_label(int(trace.tid[w]))}, {abs(lead):.3f} ms " \
                    f"{'before' if lead >= 0 else 'after'} the device went idle)"
        return text, evidence
    return describe


def _stream_waits(trace: Any, rank: int, rows: np.ndarray, dev_start: np.ndarray, hole_a: np.ndarray,
                  hole_b: np.ndarray, next_launch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per hole: was a stream-wait-event enqueued between the launch of the last work before the
    hole and the launch of the work after it (the row of that call, -1 when none)?"""
    waits = np.flatnonzero(trace.complete() & (trace.rank == rank) & (trace.stream < 0)
                           & trace.has_id(trace.name_id, host_ids_matching(trace, STREAM_WAIT)))
    found = np.full(hole_a.size, -1, dtype=np.int64)
    if waits.size == 0:
        return found >= 0, found
    waits = waits[np.argsort(trace.ts[waits])]
    before = rows[np.maximum(np.searchsorted(dev_start, hole_a, side="left") - 1, 0)]
    launch = trace.launch_row_for(before)
    lower = np.where(launch >= 0, trace.ts[np.maximum(launch, 0)], hole_a - (hole_b - hole_a))
    upper = np.where(np.isfinite(next_launch), next_launch, hole_b)
    pos = np.searchsorted(trace.ts[waits], upper, side="right") - 1
    ok = (pos >= 0) & (trace.ts[waits[np.maximum(pos, 0)]] > lower)
    found[ok] = waits[pos[ok]]
    return ok, found


def _stragglers(trace: Any, rank: int, steps: list[Step], index: dict[int, int], rows: np.ndarray,
                start: np.ndarray, end: np.ndarray) -> list[Gap]:
    """Collective kernels far longer than their median on this rank: the excess is time spent
    waiting for a slower rank (busy on the timeline, but not work)."""
    if rows.size == 0 or not steps:
        return []
    collective = np.isin(trace.name_id[rows], trace.ids_matching(lambda s: COLLECTIVE_KERNEL.search(s) is not None,
                                                                 distinct(trace.name_id[rows])))
    out: list[Gap] = []
    spans = [(s.device_start_us or 0.0, s.device_end_us or 0.0) for s in steps]
    for name_id in distinct(trace.name_id[rows[collective]]).tolist():
        sel = np.flatnonzero(collective & (trace.name_id[rows] == name_id))
        if sel.size < 3:
            continue
        dur = end[sel] - start[sel]
        typical_us = median(dur)
        for j in sel[dur >= STRAGGLER_FACTOR * max(typical_us, 1.0)].tolist():
            excess = float(end[j] - start[j]) - typical_us
            pos = next((k for k, (a, b) in enumerate(spans) if a <= start[j] < b), None)
            if pos is None or excess < max(GPU_MIN_GAP_US, DEVICE_RELATIVE_MIN_GAP * (spans[pos][1] - spans[pos][0])):
                continue
            name = trace.names[name_id]
            text = (f"{CAUSES['collective_straggler'][0]}: {name[:80]} ran {(end[j] - start[j]) / 1000:.2f} ms "
                    f"against a median of {typical_us / 1000:.3f} ms over {sel.size} calls")
            evidence = {"collective": name, "duration_us": round(float(end[j] - start[j]), 1),
                        "median_us": round(typical_us, 1), "calls": int(sel.size)}
            out.append(Gap(rank, float(start[j] + typical_us), float(end[j]), excess, "inside_step", "collective_straggler",
                           (text, evidence), list(steps[pos].request_ids), step=index[id(steps[pos])]))
    return out


# --- CPU-only traces --------------------------------------------------------------------------


def _host_gaps(steps: list[Step], index: dict[int, int], explainer: GapExplainer, fresh: set[int]) -> list[Gap]:
    threshold = max(CPU_MIN_GAP_US, RELATIVE_MIN_GAP * median([s.dur_us for s in steps]))
    pairs = []
    by_thread: dict[int, list[Step]] = {}
    for s in steps:
        by_thread.setdefault(s.tid, []).append(s)
    for thread_steps in by_thread.values():
        for prev, nxt in zip(thread_steps, thread_steps[1:], strict=False):
            if continues(nxt, fresh) and nxt.start_us - prev.end_us >= threshold:
                pairs.append((prev, nxt))
    if not pairs:
        return []
    a = np.array([p.end_us for p, _ in pairs])
    b = np.array([n.start_us for _, n in pairs])
    tid = np.array([n.tid for _, n in pairs], dtype=np.int64)
    ones = np.ones(a.size, dtype=bool)
    explained = explainer.explain(a, b, tid, ones, ~ones, ~ones, concurrent=other_steps_during(steps, a, b, tid))
    return [Gap(nxt.rank, float(a[i]), float(b[i]), float(b[i] - a[i]), "between_steps", explained.cause[i],
                explainer.described_later(explained, i, float(a[i]), float(b[i])), list(nxt.request_ids),
                step=index[id(nxt)]) for i, (_, nxt) in enumerate(pairs)]


def _on_the_loop(trace: Any, steps: list[Step], gaps: list[Gap]) -> list[Gap]:
    """Between two steps on the server's event loop thread (the model runs on the loop:
    model_on_loop.py), what the thread did unrecorded is the loop's own work: this and other
    requests' coroutines, HTTP writes. Said so, instead of only "recorded nothing"."""
    loop_tid = loop_thread(trace.servprof_metadata())
    for gap in gaps if loop_tid is not None else []:
        if gap.cause not in ("untraced_host_time", NEEDS_DEEP_CAUSE) or not 0 <= gap.step < len(steps) \
                or steps[gap.step].tid != loop_tid:
            continue
        described = gap.description

        def on_loop(described: Any = described, tid: int = loop_tid) -> Description:
            text, evidence = described() if callable(described) else described
            return (f"{CAUSES[EVENT_LOOP_WORK][0]} (thread {tid}); {text}", {**evidence, "event_loop_tid": tid})

        gap.cause, gap.description = EVENT_LOOP_WORK, on_loop
    return gaps
