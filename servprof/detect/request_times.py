"""When each sampled request arrived, sent its first byte and ended, in the trace's µs, from the
session's request records (docs/CONTRACTS.md): wall-clock arrival, the rest on the perf clock.
(``end``: the app's call returned, after any background task; ``last_byte``: the response sent.)"""

from __future__ import annotations

from typing import Any, NamedTuple

from servprof.trace.meta import base_time_ns, whole_int
from servprof.trace.model import Trace
from servprof.trace.phases import phase_events

OWN_PHASES = ("tokenize", "detokenize")  # a request's own phases (they have their own finding)


class RequestTimes(NamedTuple):
    arrival_us: float
    first_byte_us: float | None  # None: no byte sent (yet)
    end_us: float  # inf while it still streamed
    last_byte_us: float | None = None  # its response's last byte (before any background task runs); None: not sent


def request_times(trace: Trace, requests: list[dict[str, Any]] | None) -> dict[str, RequestTimes]:
    base = base_time_ns(trace.metadata)
    out: dict[str, RequestTimes] = {}
    for record in requests or []:
        if base is None or not isinstance(record, dict) or not record.get("request_id"):
            continue
        arrival, arrival_perf = whole_int(record.get("arrival_ns")), whole_int(record.get("arrival_perf_ns"))
        if arrival is None or arrival_perf is None:
            continue
        # The perf-clock times, moved onto the wall clock by the arrival's pair of readings.
        first_byte, end, last_byte = (whole_int(record.get(k)) for k in ("first_byte_ns", "end_ns", "last_byte_ns"))
        shift = arrival - arrival_perf - base
        out[str(record["request_id"])] = RequestTimes(
            (arrival - base) / 1e3, None if first_byte is None else (first_byte + shift) / 1e3,
            float("inf") if end is None else (end + shift) / 1e3,
            None if last_byte is None else (last_byte + shift) / 1e3)
    return out


def own_phase_spans(trace: Trace) -> dict[str, list[tuple[float, float, int]]]:
    """Per request id: its own tokenize / detokenize phases, as (start µs, end µs, thread)."""
    own: dict[str, list[tuple[float, float, int]]] = {}
    for event in phase_events(trace):
        if event.phase in OWN_PHASES:
            for rid in event.request_ids:
                own.setdefault(rid, []).append((event.start_us, event.end_us, event.tid))
    return own
