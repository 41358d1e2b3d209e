"""Typed reads of a trace's top-level metadata: `baseTimeNanoseconds`, `distributedInfo`, and
servprof's own `servprof` session block. Traces come from anywhere (and fuzzers): a field of the
wrong type reads as absent, never as an exception further down."""

from __future__ import annotations

import math
from typing import Any

from servprof.trace.source import SOURCE_FILE_KEY

# servprof's session metadata (capture.py writes it): key -> the type it must have.
SERVPROF_FIELDS: dict[str, type] = {
    "session_id": str, "request_ids": list, "wall_start_ns": int, "perf_start_ns": int, "stop_reason": str,
    "reason": str, "event_loop_tid": int, "stop_wall_ns": int, "cut_wall_ns": int, "tier": str, "tier_note": str,
    "event_budget": int,
}

# The serving side's summary["missing"] entry for a session in which no forward ran in its process
# at all (servprof.auto writes it; the analysis lets it stand for the trace's "no model step").
NO_FORWARD_LEAD = "No torch.nn.Module forward ran in this process while the session captured"
# ... and for one in which forwards ran (begun before it) but no model step began before it ended.
NO_STEP_BEGAN_LEAD = "No model step began while this session captured"
SERVING_STEP_LEADS = (NO_FORWARD_LEAD, NO_STEP_BEGAN_LEAD)
# Why a GPU session's budget fills fast, and what to do about a session it ended too soon (the serving
# side and the analysis say both, in these words).
GPU_EVENTS_NOTE = ("on a GPU the trace holds every kernel the process launches, for sampled requests or not, with "
                   "its launch and their link (about 4 events a kernel)")
BUDGET_HOW = ("Raise SERVPROF_MAX_SESSION_EVENTS for longer sessions (stop() holds the GIL about 6 µs per event: "
              "the default 2,000 is about 12 ms)")


def whole_int(value: Any) -> int | None:
    """An int (or a float holding a whole number), never a bool, NaN or infinity."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def base_time_ns(metadata: dict[int, dict[str, Any]]) -> int | None:
    """The first rank's baseTimeNanoseconds (trace µs = (unix ns - base) / 1000), when it is a number."""
    for document in metadata.values():
        value = whole_int(document.get("baseTimeNanoseconds")) if isinstance(document, dict) else None
        if value is not None and 0 <= value < 2**63:  # ns since the epoch, in int64
            return value
    return None


MAX_RANK = 2**31 - 1  # ranks are stored as int32


def file_name(rank: int, document: Any) -> str:
    """The name of the file a rank was loaded from, for messages about it."""
    name = document.get(SOURCE_FILE_KEY) if isinstance(document, dict) else None
    return name if isinstance(name, str) else f"the file loaded as rank {rank}"


def files_by_claimed_rank(metadata: dict[int, dict[str, Any]]) -> dict[int, list[str]]:
    """distributedInfo.rank -> the files that claim it (one job's ranks each claim their own)."""
    claims: dict[int, list[str]] = {}
    for rank, document in sorted(metadata.items()):
        claimed = claimed_rank(document)
        if claimed is not None:
            claims.setdefault(claimed, []).append(file_name(rank, document))
    return claims


def claimed_rank(document: Any) -> int | None:
    """distributedInfo.rank of one file, when it names one: a whole number (or its digits as text)
    from 0 to 2**31 - 1. Anything else names no rank."""
    info = document.get("distributedInfo") if isinstance(document, dict) else None
    value = info.get("rank") if isinstance(info, dict) else None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    rank = whole_int(value)
    return rank if rank is not None and 0 <= rank <= MAX_RANK else None


def claimed_world_size(document: Any) -> int | None:
    """distributedInfo.world_size of one file, when it names a whole number."""
    info = document.get("distributedInfo") if isinstance(document, dict) else None
    return whole_int(info.get("world_size")) if isinstance(info, dict) else None


def servprof_fields(raw: Any) -> dict[str, Any]:
    """servprof's session block with every known field of the right type (others dropped); keys
    servprof does not know are passed on as they are."""
    if not isinstance(raw, dict):
        return {}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        wanted = SERVPROF_FIELDS.get(key)
        if wanted is None:
            out[key] = value
        elif wanted is int:
            number = whole_int(value)
            if number is not None:
                out[key] = number
        elif wanted is list:
            if isinstance(value, list):
                out[key] = [v for v in value if isinstance(v, str)]
        elif isinstance(value, wanted):
            out[key] = value
    return out


def loop_thread(servprof_meta: dict[str, Any]) -> int | None:
    """The serving event loop's thread id from a session's servprof metadata (``event_loop_tid``,
    else the watchdog's ``loop_tid``), or None: not a servprof session, or not an OS thread id (a
    damaged file's huge or negative number names no thread)."""
    watchdog = servprof_meta.get("watchdog") if isinstance(servprof_meta.get("watchdog"), dict) else {}
    tid = servprof_meta.get("event_loop_tid") or watchdog.get("loop_tid")
    return tid if isinstance(tid, int) and not isinstance(tid, bool) and 0 <= tid < 2**63 else None
