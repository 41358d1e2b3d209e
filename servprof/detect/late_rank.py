"""What a rank did before it arrived last at a collective: the time between the waiting rank's
start of the call and its own, read from its trace (collective_arrivals names the rank).

Its device either still ran kernels over most of that time (it had more device work before the
collective than the rank that waited: an uneven split of the work, or a slower device) or sat
idle while its host had not yet launched the call: then the host thread that launched it is read
over the same time, its recorded frames ranked by their own time (the ops, Python, annotations
and waits it spent it in: data loading, Python between ops, a sync, a lock).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from servprof.detect.host_classes import CLASSES
from servprof.detect.host_stacks import HostStacks
from servprof.detect.intervals import merge
from servprof.detect.thread_work import named_frames
from servprof.trace.model import Trace

# What held the late rank: its device's own work, its host (the call not yet launched), or its
# device with the call launched and nothing running (a stream waiting on an event or a peer).
DEVICE, HOST, QUEUED = "device", "host", "launched"
BUSY_SHARE = 0.5  # the device ran kernels over at least this share of the time: it was the device's work
TOP = 3


class LateRanks:
    """Reads late ranks' traces (each rank's host stacks built once, on first use)."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self._stacks: dict[int, HostStacks] = {}
        self._device = np.flatnonzero(trace.device_mask())

    def before_arrival(self, rank: int, call_row: int, start_us: float, at_us: float) -> dict[str, Any] | None:
        """What ``rank`` did from ``start_us`` (when the waiting rank started the call) to ``at_us``
        (when it started its own, ``call_row``, on the device); None for an empty window."""
        window = at_us - start_us
        if window <= 0:
            return None
        trace = self.trace
        dev = self._device[trace.rank[self._device] == rank]
        dev = dev[(trace.ts[dev] < at_us) & (trace.ts[dev] + trace.dur[dev] > start_us) & (dev != call_row)]
        s, e = merge(np.maximum(trace.ts[dev], start_us), np.minimum(trace.ts[dev] + trace.dur[dev], at_us))
        busy = float((e - s).sum())
        out: dict[str, Any] = {"window_ms": round(window / 1e3, 3), "device_busy_ms": round(busy / 1e3, 3),
                               "held_by": DEVICE if busy >= BUSY_SHARE * window else HOST}
        if out["held_by"] == DEVICE:
            out["device_top"] = _top_kernels(trace, dev, start_us, at_us)
            return out
        launch = int(trace.launch_row_for(np.array([call_row]))[0])
        if launch < 0:  # (no launch recorded for it: which thread would have launched it is unknown)
            return out
        # (a launch stamped after its kernel began is a host and device clock apart: cut at the kernel)
        tid, launched = int(trace.tid[launch]), min(float(trace.ts[launch]), at_us)
        out["host_thread"] = tid
        if launched <= start_us:  # launched before the wait began: the device, not the host, held it
            out["held_by"], out["launched_before_ms"] = QUEUED, round((start_us - launched) / 1e3, 3)
            return out
        stacks = self._stacks.get(rank)
        if stacks is None:
            stacks = self._stacks[rank] = HostStacks(trace, rank)
        # The host's time until it launched the call
        _window, keys, spent = stacks.thread(tid).top_keys(np.array([start_us]), np.array([launched]), limit=TOP)
        out["launched_after_ms"] = round((launched - start_us) / 1e3, 3)
        out["host_top"] = named_frames(trace, dict(zip(keys.tolist(), spent.tolist(), strict=True)),
                                       tuple(range(len(CLASSES))))[:TOP]
        return out


def _top_kernels(trace: Trace, dev: np.ndarray, start_us: float, at_us: float) -> list[dict[str, Any]]:
    clipped = np.minimum(trace.ts[dev] + trace.dur[dev], at_us) - np.maximum(trace.ts[dev], start_us)
    by_name: dict[int, float] = {}
    for name_id, us in zip(trace.name_id[dev].tolist(), clipped.tolist(), strict=True):
        by_name[name_id] = by_name.get(name_id, 0.0) + us
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP]
    return [{"name": trace.names[name_id], "ms": round(us / 1e3, 3)} for name_id, us in ranked]


def held_text(before: dict[str, Any]) -> str:
    """"; its GPU was idle for 2.01 of those 2.14 ms: thread 59818 had not launched the call yet
    (DistributedDataParallel.forward 0.44 ms, ...)" for a gap's explanation."""
    window, busy = before["window_ms"], before["device_busy_ms"]
    if before["held_by"] == DEVICE:
        names = ", ".join(f"{k['name'][:60]} {k['ms']:.2f} ms" for k in before["device_top"])
        return f"; its device ran kernels for {busy:.2f} of those {window:.2f} ms ({names})"
    text = f"; its device was idle for {window - busy:.2f} of those {window:.2f} ms"
    if before["held_by"] == QUEUED:
        return text + (f", with the call launched {before['launched_before_ms']:.2f} ms before this rank's began: "
                       "its stream waited (on an event, another stream or a peer) before starting it")
    if "host_thread" not in before:
        return text
    text += f": thread {before['host_thread']} launched the call {before['launched_after_ms']:.2f} ms into them"
    if not before["host_top"]:
        return text + ", recording nothing before it"
    names = ", ".join(f"{f['name'][:60]} {f['self_ms']:.2f} ms" for f in before["host_top"])
    return text + f" (most of its own time before it in {names})"


def held_fix(rank: int, befores: list[dict[str, Any]]) -> str:
    """What held ``rank`` up before most of these collectives, for a finding's fix ("" when no wait
    of its was read)."""
    if not befores:
        return ""
    host = [b for b in befores if b["held_by"] == HOST]
    queued = [b for b in befores if b["held_by"] == QUEUED]
    if 2 * len(queued) > len(befores):
        return (f"Before {len(queued)} of them its host had launched the call in time but its device started it late, "
                "running nothing meanwhile: the collective's stream waited on an event or another stream (a "
                "dependency on a copy or on another process group's call). ")
    if 2 * len(host) >= len(befores):
        top = _summed([frame for before in host for frame in before.get("host_top", [])], "self_ms")
        names = f" (most of its own time in {top})" if top else ""
        return (f"Before {len(host)} of them its device sat idle: its host had not launched the call yet{names}. "
                f"Rank {rank}'s host work before the collective held everyone up: move it off that path (prefetch "
                "the next batch, overlap data movement, cut per-step Python and syncs there). ")
    device = [b for b in befores if b["held_by"] == DEVICE]
    if not device:
        return ""
    top = _summed([kernel for before in device for kernel in before["device_top"]], "ms")
    return (f"Before {len(device)} of them its device was still running kernels "
            f"({top}): rank {rank} had more device work before the "
            "collective than the others; split the work evenly across ranks (batch, sequence lengths, experts). ")


def _summed(entries: list[dict[str, Any]], field: str) -> str:
    """"name 1.20 ms, ..." of the TOP names with the most ``field`` summed over ``entries``."""
    spent: dict[str, float] = {}
    for entry in entries:
        spent[entry["name"]] = spent.get(entry["name"], 0.0) + entry[field]
    return ", ".join(f"{name[:60]} {ms:.2f} ms" for name, ms in sorted(spent.items(), key=lambda kv: -kv[1])[:TOP])
