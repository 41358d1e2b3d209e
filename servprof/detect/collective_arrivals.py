"""Which rank a collective waited for, where the trace holds the other ranks too.

A rank whose collective kernel ran far longer than its median waited in it for a slower rank
(gaps.py's ``collective_straggler``). With the other ranks' traces loaded (a folder of rank
files), the same call on each rank is found by when it ended: members of one collective finish
it together, so a rank's call of the same kernel name that ended within ``END_TOLERANCE_US`` (or
``END_TOLERANCE_SHARE`` of the waiting call) of this one's is its part in it, on a clock that
agrees (one host's ranks, or hosts in sync). Matching by end, not by the k-th call of the name,
keeps ranks whose profilers started or stopped a few calls apart (each vLLM worker starts its own
on an RPC). The last of them to start it arrived last: the rank everyone waited for. A rank with
no call ending then (another process group's calls of the same kernel, a host whose clock is
off) is left out, and with none left no rank is named. What the named rank did in the meantime,
where its trace had begun by then, is read by late_rank.py: its device still busy, or idle while
its host had not launched the call (and what that host thread ran instead).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from servprof.detect.gap import Gap
from servprof.detect.late_rank import LateRanks, held_fix, held_text
from servprof.trace.meta import claimed_world_size

END_TOLERANCE_US = 10.0
END_TOLERANCE_SHARE = 0.02
CAUSE = "collective_straggler"


def name_last_arrivals(trace: Any, gaps: list[Gap]) -> list[dict[str, str]]:
    """Add the rank that arrived last to each straggler gap's explanation and evidence
    (``arrived_last``), where the trace shows it. Returns summary["missing"] entries: waits whose
    rank's peers the trace does not hold."""
    waits = [g for g in gaps if g.cause == CAUSE and not callable(g.description)]
    if not waits:
        return []
    sizes = [size for document in trace.metadata.values() if (size := claimed_world_size(document)) is not None]
    if len(trace.ranks) < max(sizes, default=2):
        return [_peers_missing(waits, len(trace.ranks), max(sizes, default=None))]
    calls: dict[int, dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    first_event: dict[int, float] = {}
    late = LateRanks(trace)
    ids = {name: trace.string_id(name) for name in {g.evidence["collective"] for g in waits}}
    for gap in waits:
        text, evidence = gap.description  # type: ignore[misc]
        name_id = ids[evidence["collective"]]
        if name_id < 0:
            continue
        if name_id not in calls:
            calls[name_id] = _calls_by_rank(trace, name_id)
        end = gap.end_us
        start = end - evidence["duration_us"]  # (the kernel's own start: the gap begins after its median)
        arrived = _last_arrival(calls[name_id], gap.rank, start, end)
        if arrived is None:
            continue
        call_rows = arrived.pop("call_rows")
        evidence["arrived_last"] = arrived
        ranks = arrived["ranks"]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        text += (f"; {who} arrived last, {arrived['after_us'] / 1000:.2f} ms after this rank (of the "
                 f"{arrived['ranks_compared']} ranks whose call ended with this one's)")
        # What held the late rank up is in its trace only if its trace had begun by then.
        for rank in ranks:
            if rank not in first_event:
                first_event[rank] = float(trace.ts[trace.rank == rank].min())
        began = max(first_event[rank] for rank in ranks)
        if began > start:
            arrived["trace_began_us"] = began
            text += (f"; its trace begins {(began - start) / 1000:.2f} ms after this rank's call did, so what "
                     "held it up is before its trace")
        else:
            before = late.before_arrival(ranks[0], call_rows[ranks[0]], start, arrived["at_us"])
            if before is not None:
                arrived["before_arrival"] = {"rank": ranks[0], **before}
                text += held_text(before)
        gap.description = (text, evidence)
    return []


def _peers_missing(waits: list[Gap], ranks: int, world_size: int | None) -> dict[str, str]:
    held = f"{ranks} of the job's {world_size} ranks" if world_size else f"{ranks} rank(s) and names no world size"
    return {"what": "other ranks", "message": (
        f"{len(waits)} collective call(s) waited {sum(g.idle_us for g in waits) / 1000:.2f} ms in all for a slower rank, "
        f"and this trace holds {held}: with every rank's trace file in one folder (`servprof analyze DIR`), "
        "servprof names the rank each call waited for (the last to start it).")}


def _calls_by_rank(trace: Any, name_id: int) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per rank, the (starts, ends, rows) of its device calls of this kernel, in order of their ends."""
    rows = np.flatnonzero(trace.device_mask() & (trace.name_id == name_id))
    out = {}
    for rank in np.unique(trace.rank[rows]).tolist():
        mine = rows[trace.rank[rows] == rank]
        ends = trace.ts[mine] + trace.dur[mine]
        order = np.argsort(ends, kind="stable")
        out[int(rank)] = (trace.ts[mine][order], ends[order], mine[order])
    return out


def _last_arrival(by_rank: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]], rank: int, start: float,
                  end: float) -> dict[str, Any] | None:
    """The ranks that started this call last (within the tolerance of the latest), among those
    with a call of it that ended with this rank's, and (``call_rows``) each rank's call; None when
    no other rank's did."""
    tolerance = max(END_TOLERANCE_US, END_TOLERANCE_SHARE * (end - start))
    together: dict[int, tuple[float, int]] = {}
    for other, (starts, ends, rows) in by_rank.items():
        if other == rank or not ends.size:
            continue
        at = int(np.searchsorted(ends, end))
        nearest = min((i for i in (at - 1, at) if 0 <= i < ends.size), key=lambda i: abs(float(ends[i]) - end))
        if abs(float(ends[nearest]) - end) <= tolerance:
            together[other] = (float(starts[nearest]), int(rows[nearest]))
    if not together:
        return None
    latest = max(s for s, _ in together.values())
    if latest - start <= tolerance:  # (no one arrived measurably later than this rank)
        return None
    return {"ranks": sorted(r for r, (s, _) in together.items() if latest - s <= tolerance),
            "after_us": round(latest - start, 1), "at_us": latest, "ranks_compared": len(together) + 1,
            "call_rows": {r: row for r, (_, row) in together.items()}}


def last_arrivals_text(gaps: list[Gap]) -> str:
    """The rank these waits were for most often, for a finding's fix ("" when none was named)."""
    counts: dict[int, int] = {}
    unseen: dict[int, int] = {}  # of those, the waits that began before that rank's trace did
    for gap in gaps:
        arrived = gap.evidence.get("arrived_last", {})
        for rank in arrived.get("ranks", []):
            counts[rank] = counts.get(rank, 0) + 1
            unseen[rank] = unseen.get(rank, 0) + ("trace_began_us" in arrived)
    if not counts:
        return ""
    rank, times = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))
    text = f"Rank {rank} arrived last at {times} of these {len(gaps)} collectives: "
    if 2 * unseen[rank] >= times:
        return text + ("its trace began after most of these calls had, so what held it up is not in it: record "
                       "more steps (a longer `active` in the profiler's schedule) so that the time before them is in "
                       "every rank's trace. ")
    befores = [g.evidence["arrived_last"]["before_arrival"] for g in gaps
               if g.evidence.get("arrived_last", {}).get("before_arrival", {}).get("rank") == rank]
    return text + (held_fix(rank, befores) or "start from its trace, in the time before each of them. ")
