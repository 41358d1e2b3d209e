"""Per-request phases recovered from servprof's phase markers in a trace."""

from __future__ import annotations

from typing import NamedTuple
from weakref import WeakKeyDictionary

import numpy as np

from servprof.trace.model import DEVICE_MIRROR_CATEGORY, Trace

PHASE_PREFIX = "servprof:"  # what servprof.phases.phase_event_name writes before every phase
# Phases servprof marked by itself (zero-touch: module forward hooks, tokenizer patches) are
# written as ``servprof:auto.<phase>|ids``; explicit ``servprof.phase`` markers win over them.
AUTO_PHASE_PREFIX = "auto."


def parse_phase_event_name(event_name: str) -> tuple[str, list[str]] | None:
    """(phase, request ids) of a ``servprof:<phase>|<id>,<id>`` range; None for other events.
    The inverse of servprof.phases.phase_event_name; here so that reading a trace never
    imports torch."""
    if not event_name.startswith(PHASE_PREFIX):
        return None
    name, _, ids = event_name[len(PHASE_PREFIX):].partition("|")
    return name, [i for i in ids.split(",") if i]


class PhaseEvent(NamedTuple):
    row: int
    phase: str  # without the auto. prefix
    request_ids: tuple[str, ...]
    start_us: float
    end_us: float
    tid: int
    auto: bool = False  # marked by servprof's automatic instrumentation, not by the server


def split_auto(phase: str) -> tuple[str, bool]:
    """(phase name, marked automatically?) of a parsed phase name."""
    if phase.startswith(AUTO_PHASE_PREFIX):
        return phase[len(AUTO_PHASE_PREFIX):], True
    return phase, False


# Each trace's phase events, found once: the step search, tokenization and loop stalls all ask.
_FOUND: WeakKeyDictionary[Trace, list[PhaseEvent]] = WeakKeyDictionary()


def phase_events(trace: Trace) -> list[PhaseEvent]:
    """Every ``servprof:<phase>|<ids>`` range, in start order. Automatic phases
    (``servprof:auto.<phase>``) are left out on a rank where the server marked that phase
    itself: explicit markers win."""
    found = _FOUND.get(trace)
    if found is None:
        found = _FOUND[trace] = _phase_events(trace)
    return list(found)  # (a list of its own: a caller may change it)


def _phase_events(trace: Trace) -> list[PhaseEvent]:
    ids = trace.ids_matching(lambda s: s.startswith(PHASE_PREFIX))
    if ids.size == 0:
        return []
    parsed: dict[int, tuple[str, list[str]] | None] = {int(i): parse_phase_event_name(trace.names[int(i)]) for i in ids}
    # The host range is the phase: its device mirror would count it twice.
    rows = np.flatnonzero(trace.has_id(trace.name_id, ids) & trace.complete()
                          & ~trace.mask_category(DEVICE_MIRROR_CATEGORY))
    rows = rows[np.argsort(trace.ts[rows], kind="stable")]
    out, ranks = [], []
    # (Columns as lists: one conversion each, not a numpy scalar per row and column.)
    for row, name_id, start, dur, tid, rank in zip(rows.tolist(), trace.name_id[rows].tolist(),
                                                   trace.ts[rows].tolist(), trace.dur[rows].tolist(),
                                                   trace.tid[rows].tolist(), trace.rank[rows].tolist(), strict=True):
        parsed_name = parsed[name_id]
        if parsed_name is None:
            continue
        name, request_ids = parsed_name
        name, auto = split_auto(name)
        out.append(PhaseEvent(row, name, tuple(request_ids), start, start + dur, tid, auto))
        ranks.append(rank)
    explicit = {(rank, e.phase) for e, rank in zip(out, ranks, strict=True) if not e.auto}
    return [e for e, rank in zip(out, ranks, strict=True) if not e.auto or (rank, e.phase) not in explicit]


def request_phases(trace: Trace) -> dict[str, list[dict[str, float | str]]]:
    """request id -> its phases ``{"name", "start_us", "end_us"}`` in start order.

    ``queue`` is inferred (end of the request's last tokenize -> start of its first
    prefill) when the server did not mark it.
    """
    per_request: dict[str, list[dict[str, float | str]]] = {}
    for event in phase_events(trace):
        for rid in event.request_ids:
            per_request.setdefault(rid, []).append(
                {"name": event.phase, "start_us": event.start_us, "end_us": event.end_us}
            )
    for phases in per_request.values():
        names = {p["name"] for p in phases}
        if "queue" in names or "tokenize" not in names or "prefill" not in names:
            continue
        tokenize_end = max(float(p["end_us"]) for p in phases if p["name"] == "tokenize")
        prefill_start = min(float(p["start_us"]) for p in phases if p["name"] == "prefill")
        if prefill_start > tokenize_end:
            phases.append({"name": "queue", "start_us": tokenize_end, "end_us": prefill_start})
        phases.sort(key=lambda p: float(p["start_us"]))
    return per_request
