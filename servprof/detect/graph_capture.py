"""CUDA / HIP graph capture in a trace: while a stream captures, the kernels launched on it are
recorded into a graph, not run, so the device idles by design. A trace of start-up (vLLM and
SGLang capture their decode graphs there; SGLang's ``--enable-profile-cuda-graph`` records it)
or of a first ``torch.compile(mode="reduce-overhead")`` call holds such windows: the device's idle
inside them is not the serving loop's and is not judged as a gap.

A window runs on its thread from a ``*StreamBeginCapture`` call to the next ``*StreamEndCapture``.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from servprof.detect.host_classes import LAUNCH_NAMES
from servprof.detect.intervals import covered, merge
from servprof.detect.name_guard import Guarded
from servprof.detect.name_scan import host_ids_matching
from servprof.detect.step_forms import host_rows
from servprof.trace.model import RUNTIME_CATEGORIES, Trace

BEGIN_CAPTURE = Guarded(re.compile(r"^(cuda|hip)StreamBeginCapture"), "StreamBeginCapture")
END_CAPTURE = Guarded(re.compile(r"^(cuda|hip)StreamEndCapture"), "StreamEndCapture")
MISSING_WHAT = "device time while capturing graphs"


Windows = tuple[np.ndarray, np.ndarray]  # (starts, ends) in µs, in time order
NO_WINDOWS: Windows = (np.empty(0), np.empty(0))


def capture_windows(trace: Trace) -> dict[int, Windows]:
    """Per rank, its graph captures (a begin without its end runs to the end of the trace); ranks
    without one are absent. The names are read once for all ranks."""
    begins = host_rows(trace, BEGIN_CAPTURE)
    if begins.size == 0:
        return {}
    ends = host_rows(trace, END_CAPTURE)
    trace_end = float(trace.end.max())
    out: dict[int, Windows] = {}
    for rank, tid in sorted(set(zip(trace.rank[begins].tolist(), trace.tid[begins].tolist(), strict=True))):
        mine = begins[(trace.rank[begins] == rank) & (trace.tid[begins] == tid)]
        end_at = trace.end[ends[(trace.rank[ends] == rank) & (trace.tid[ends] == tid)]]
        at = np.searchsorted(end_at, trace.ts[mine], side="left")
        stops = np.full(mine.size, trace_end)
        found = at < end_at.size
        stops[found] = end_at[at[found]]
        previous = out.get(rank, NO_WINDOWS)
        out[rank] = (np.concatenate([previous[0], trace.ts[mine].astype(float)]), np.concatenate([previous[1], stops]))
    for rank, (starts, stops) in out.items():
        order = np.argsort(starts, kind="stable")
        out[rank] = (starts[order], stops[order])
    return out


def inside_captures(starts: np.ndarray, ends: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Which windows [a, b] lie at least half inside a capture."""
    if starts.size == 0 or a.size == 0:
        return np.zeros(a.size, dtype=bool)
    merged_start, merged_end = merge(starts, ends)
    return covered(merged_start, merged_end, a, b) >= 0.5 * (b - a)


def launches_inside(trace: Trace, rank: int, starts: np.ndarray, ends: np.ndarray) -> int:
    """The rank's kernel launches (and async copies, memsets) made inside capture windows."""
    if starts.size == 0:
        return 0
    rows = np.flatnonzero(trace.has_id(trace.name_id, host_ids_matching(trace, LAUNCH_NAMES))
                          & trace.mask_category(*RUNTIME_CATEGORIES) & (trace.rank == rank))
    merged_start, merged_end = merge(starts, ends)
    at = np.searchsorted(merged_start, trace.ts[rows], side="right") - 1
    return int(np.count_nonzero((at >= 0) & (trace.ts[rows] < merged_end[np.maximum(at, 0)])))


def missing_entry(captures: int, launches: int, idle_us: float) -> dict[str, str]:
    idle = (f", and the device's {idle_us / 1000:.2f} ms idle inside them is not judged as a gap" if idle_us > 0
            else "")
    return {"what": MISSING_WHAT, "message": (
        f"This trace records {captures} CUDA/HIP graph capture(s) (start-up, or a first torch.compile "
        f"'reduce-overhead' call): the {launches} launch(es) made while capturing were recorded into graphs, not "
        f"run{idle}. Profile the serving steps that replay the graphs to judge the device's time.")}


def count_captures(stats: dict[str, Any], captures: int = 0, launches: int = 0, idle_us: float = 0.0) -> None:
    """Graph captures, the launches they recorded and the device idle inside them (not judged), in
    gaps.find_gaps' stats, with the summary's "missing" entry that says so."""
    seen = stats.setdefault("graph_capture", {"captures": 0, "launches": 0, "idle_us_not_judged": 0.0})
    seen["captures"] += captures
    seen["launches"] += launches
    seen["idle_us_not_judged"] = round(seen["idle_us_not_judged"] + idle_us, 1)
    stats["missing"] = [missing_entry(seen["captures"], seen["launches"], seen["idle_us_not_judged"])]
