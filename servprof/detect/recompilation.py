"""torch.compile stalls inside serving: compiles and recompiles in model steps, graph breaks.

In a trace, Dynamo and Inductor mark their work with ranges: ``entire_frame_compile``,
``backend_compile``, ``inductor_compile``, ``*(dynamo_timed)`` (every version since 2.1),
``*_data: ... compile_id=F/R`` annotations (frame F, its R-th recompile), and with stacks
the ``torch/_dynamo/convert_frame.py`` frames. Compiled code runs as ``Torch-Compiled
Region: F/R``. Each stretch of compile ranges on a thread is one stall; the step it sits
in names the requests it delayed. The reason comes from torch's own compile records when
the session metadata has them (servprof.probes.compile): the guard that failed (a new size
of a dimension, a new batch size, a changed value). Graph breaks per step are the compiled
regions a step runs whose frame is a resume function (``torch_dynamo_resume_in_*``).

Findings: ``recompilation`` (one per function and cause, cost = the stalls' length) and
``graph_break`` (cost = eager time between the compiled regions of the steps).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from servprof.detect.compile_causes import classify, describe_cause, fix_for
from servprof.detect.compile_ranges import (
    CUDAGRAPH_RANGES,
    STRONG_LITERALS,
    WEAK_COMPILE_NAMES,
    is_compile_range,
)
from servprof.detect.finding import Finding, severity_for
from servprof.detect.intervals import covered_within, merge
from servprof.detect.name_scan import host_name_text, ids_holding
from servprof.detect.step_compiled import REGION, REGION_LITERAL
from servprof.detect.steps import Step, step_index
from servprof.detect.tier import DEEP_WINDOW_HOW, is_light
from servprof.trace.model import Trace, median
from servprof.trace.phases import request_phases

COMPILE_ID_ARG = re.compile(r"compile_id=\[?(\d+)/(\d+)")
MAX_STALLS_LISTED = 20
WARNING_MS, CRITICAL_MS = 50.0, 500.0

# A compiled graph's own run inside a region: Inductor's generated code, AOTAutograd's function.
GRAPH_CALL = re.compile(r"^## Call CompiledFxGraph|^CompiledFunction$")
GRAPH_CALL_LITERALS = ("## Call CompiledFxGraph", "CompiledFunction")
NO_GRAPH_CALLS = ("the eager time between graphs is not in this trace (no compiled graph's own run is marked, as "
                  "with Dynamo's eager backend)")
GRAPH_BREAK_FIX = ("torch._dynamo.explain(fn)(*inputs) lists each break and its cause; remove it from the "
                   "compiled code (print/logging, .item() or .tolist(), data-dependent Python branches, "
                   "unsupported calls) or wrap the call with torch.compiler.allow_in_graph / a custom op.")


def _compile_rows(trace: Trace) -> np.ndarray:
    ids, text = host_name_text(trace)
    strong = ids[text.holding(STRONG_LITERALS, is_compile_range)]
    return np.flatnonzero(np.isin(trace.name_id, strong) & trace.complete() & (trace.stream < 0))


def compile_stalls(trace: Trace) -> list[dict[str, Any]]:
    """Each stretch of compile ranges on one thread: start, end, and the compile id it names."""
    rows = _compile_rows(trace)
    if rows.size == 0:
        return []
    weak = np.flatnonzero(np.isin(trace.name_id, trace.ids_matching(lambda s: s in WEAK_COMPILE_NAMES))
                          & trace.complete() & (trace.stream < 0))
    ids = trace.ids_matching(lambda s: "compile_id=" in s)
    id_rows = np.flatnonzero(np.isin(trace.name_id, ids)) if ids.size else np.zeros(0, dtype=np.int64)
    recording = trace.ids_matching(lambda s: s.startswith(CUDAGRAPH_RANGES))
    stalls = []
    keys = np.stack([trace.rank[rows].astype(np.int64), trace.pid[rows], trace.tid[rows]], axis=1)
    for key in sorted({tuple(k) for k in keys.tolist()}):
        on_thread = (trace.rank == key[0]) & (trace.pid == key[1]) & (trace.tid == key[2])
        mine = rows[on_thread[rows]]
        mine = mine[np.argsort(trace.ts[mine], kind="stable")]
        first, last = merge(trace.ts[mine], trace.ts[mine] + trace.dur[mine])  # overlapping or touching: one
        wrappers = weak[on_thread[weak]]
        # Only a wrapper around one of the stretches can widen any (each it widens contains one).
        first_after = np.searchsorted(first, trace.ts[wrappers], side="left")
        around = first_after < first.size
        around[around] = last[first_after[around]] <= (trace.ts[wrappers] + trace.dur[wrappers])[around]
        wrappers = wrappers[around]
        for start, end in zip(trace.ts[wrappers].tolist(), (trace.ts[wrappers] + trace.dur[wrappers]).tolist(),
                              strict=True):  # "dynamo" wraps a compile: widen the stretch it contains
            wrapped = (start <= first) & (last <= end)
            first[wrapped], last[wrapped] = start, end
        intervals = zip(first.tolist(), last.tolist(), strict=True)
        thread_ids = id_rows[on_thread[id_rows]]
        for start, end in intervals:
            inside = thread_ids[(trace.ts[thread_ids] >= start) & (trace.ts[thread_ids] <= end)]
            match = next((m for m in (COMPILE_ID_ARG.search(trace.name(int(r))) for r in inside) if m), None)
            ranges = mine[(trace.ts[mine] >= start) & (trace.ts[mine] <= end)]
            stalls.append({"rank": int(key[0]), "tid": int(key[2]), "start_us": start, "end_us": end,
                           "ms": (end - start) / 1e3,
                           "compile_id": f"{match.group(1)}/{match.group(2)}" if match else None,
                           # cudagraph trees recording a graph, and no compile range around it
                           "graph_recording": bool(np.isin(trace.name_id[ranges], recording).all())})
    # Inductor compiles files on worker threads while the compiling thread waits: a stretch that
    # lies within a longer one on another thread of the rank is part of that compile.
    return [s for s, inside in zip(stalls, _within_longer_elsewhere(stalls), strict=True) if not inside]


def _within_longer_elsewhere(stalls: list[dict[str, Any]], block: int = 512) -> list[bool]:
    """Per stall: does a longer one on another thread of its rank contain it (pairs compared a
    block at a time)?"""
    rank = np.array([s["rank"] for s in stalls], dtype=np.int64)
    tid = np.array([s["tid"] for s in stalls], dtype=np.int64)
    start = np.array([s["start_us"] for s in stalls], dtype=float)
    end = np.array([s["end_us"] for s in stalls], dtype=float)
    length = end - start
    out: list[bool] = []
    for first in range(0, len(stalls), block):
        part = slice(first, first + block)
        contained = ((rank[part, None] == rank) & (tid[part, None] != tid) & (start <= start[part, None])
                     & (end[part, None] <= end) & (length > length[part, None]))
        out.extend(contained.any(axis=1).tolist())
    return out


def _records(trace: Trace) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """(compile records of the session, frame table, the compile metadata), type-checked."""
    compile_meta = trace.servprof_metadata().get("compile")
    if not isinstance(compile_meta, dict):
        return [], {}, {}
    records = [r for r in compile_meta.get("compiles") or [] if isinstance(r, dict)
               and isinstance(r.get("start_time_us"), int) and isinstance(r.get("duration_us"), int)]
    frames = compile_meta.get("frames") if isinstance(compile_meta.get("frames"), dict) else {}
    return records, {k: v for k, v in frames.items() if isinstance(v, dict)}, compile_meta


def _match_record(stall: dict[str, Any], records: list[dict[str, Any]], base_ns: float | None) -> dict[str, Any] | None:
    for record in records:
        if stall["compile_id"] and isinstance(record.get("compile_id"), str) and \
                record["compile_id"].strip("[]") == stall["compile_id"]:
            return record
    if base_ns is None:
        return None
    for record in records:  # by time: torch's record is in unix µs
        start = record["start_time_us"] - base_ns / 1e3
        if start <= stall["end_us"] and start + record["duration_us"] >= stall["start_us"]:
            return record
    return None


def detect_recompilation(trace: Trace, steps: list[Step]) -> tuple[list[Finding], dict[str, Any]]:
    records, frames, meta = _records(trace)
    base = next((m.get("baseTimeNanoseconds") for m in trace.metadata.values()
                 if isinstance(m.get("baseTimeNanoseconds"), (int, float))), None)
    light = is_light(trace)
    stalls = compile_stalls(trace)
    if light and not stalls:  # a light session records no compile range: torch's own records place them
        stalls = _stalls_from_records(records, base, float(trace.ts.min()) if len(trace) else None)
    stop_ns = trace.servprof_metadata().get("stop_wall_ns")
    stop_us = (stop_ns - base) / 1e3 if isinstance(stop_ns, int) and base is not None else None
    for stall in stalls:  # a compile still running when the capture stopped lasted at least this long
        stall["cut_at_stop"] = stop_us is not None and stall["end_us"] >= stop_us - 1e3
    index = step_index(steps, np.array([s["rank"] for s in stalls]), np.array([s["start_us"] for s in stalls])) \
        if stalls and steps else np.full(len(stalls), -1)
    groups: dict[tuple[str | None, str], list[dict[str, Any]]] = {}
    windows = _request_windows(trace) if stalls else {}
    for stall, where in zip(stalls, index.tolist(), strict=True):
        step = steps[where] if where >= 0 else None
        record = _match_record(stall, records, base)
        in_step = list(step.request_ids) if step else []
        # Requests in flight across the stall (queued, or between their steps) waited for it too.
        waiting = [rid for rid, (lo, hi) in windows.items()
                   if lo < stall["start_us"] and hi > stall["end_us"] and rid not in in_step]
        stall.update({"in_step": step is not None, "step": where, "step_kind": step.kind if step else None,
                      "batch": step.batch if step else None, "request_ids": in_step + waiting,
                      "waiting_request_ids": waiting,
                      "function": (record or {}).get("co_name"),
                      "torch_ms": record["duration_us"] / 1e3 if record else None,
                      "reason": (record or {}).get("recompile_reason")})
        stall["compile_id"] = stall["compile_id"] or (record or {}).get("compile_id")
        stall["detail"] = classify(stall["reason"], stall["compile_id"], stall["batch"],
                                   stall.get("graph_recording", False))
        function = stall["function"] or (f"frame {stall['compile_id'].split('/')[0]}" if stall["compile_id"] else None)
        groups.setdefault((function, stall["detail"]["cause"]), []).append(stall)
    # Outside servprof's sessions nothing says the trace is of a server serving: a first compile or
    # CUDA-graph recording in a rank's first step may be its warm-up (a one-step trace of a first call).
    first_steps = {} if trace.servprof_metadata() else _first_step_per_rank(steps)
    findings = [_recompile_finding(function, group, first_step=_in_first_steps(group, first_steps))
                for (function, _), group in groups.items()]
    before = _before_session(meta, float(trace.ts.min()) if len(trace) else 0.0)
    findings.extend(_recompile_finding(function, group, before_session=True) for (function, _), group in before.items())
    regions = _regions_per_step(trace, steps, frames) if not light else {"steps_with_compiled_code": None}
    graph_breaks = regions.pop("graph_break_finding", None)
    if graph_breaks is not None:
        findings.append(graph_breaks)
    summary = {
        "compiles": len(stalls), "in_steps": sum(1 for s in stalls if s["in_step"]),
        "stall_ms": sum(s["ms"] for s in stalls), "stall_ms_in_steps": sum(s["ms"] for s in stalls if s["in_step"]),
        "torch_reported_ms": sum(r["duration_us"] for r in records) / 1e3 if records else None,
        "compile_records": len(records),
        "before_session": {"compiles": sum(len(g) for g in before.values()),
                           "ms": sum(s["ms"] for g in before.values() for s in g)},
        "counters_start": meta.get("counters_start"),
        "counters_end": meta.get("counters_end"), "graph_break_reasons": meta.get("graph_break_reasons"),
        **regions, "missing": _missing(stalls, regions, bool(meta), light),
    }
    return findings, summary


def _first_step_per_rank(steps: list[Step]) -> dict[int, int]:
    """rank -> the index of its first step (steps are in (rank, start) order)."""
    first: dict[int, int] = {}
    for i, step in enumerate(steps):
        first.setdefault(step.rank, i)
    return first


def _in_first_steps(group: list[dict[str, Any]], first_steps: dict[int, int]) -> bool:
    """Every stall a first compile or graph recording inside its rank's first step."""
    return bool(first_steps) and all(
        s["detail"]["cause"] in ("first_compile", "cudagraph_record") and s["step"] >= 0
        and first_steps.get(s["rank"]) == s["step"] for s in group)


def _request_windows(trace: Trace) -> dict[str, tuple[float, float]]:
    """Each marked request's first phase start and last phase end."""
    return {rid: (min(float(p["start_us"]) for p in phases), max(float(p["end_us"]) for p in phases))
            for rid, phases in request_phases(trace).items() if phases}


def _before_session(meta: dict[str, Any], at_us: float) -> dict[tuple[str | None, str], list[dict[str, Any]]]:
    """Compiles torch recorded while serving before this session (not in the trace): shown at
    the trace's start, with torch's own durations and reasons."""
    groups: dict[tuple[str | None, str], list[dict[str, Any]]] = {}
    for record in meta.get("before_session") or []:
        if not isinstance(record, dict) or not isinstance(record.get("duration_us"), int):
            continue
        compile_id = record.get("compile_id") if isinstance(record.get("compile_id"), str) else None
        reason = record.get("recompile_reason") if isinstance(record.get("recompile_reason"), str) else None
        function = record.get("co_name") if isinstance(record.get("co_name"), str) else None
        stall = {"start_us": at_us, "end_us": at_us, "ms": record["duration_us"] / 1e3, "compile_id": compile_id,
                 "in_step": False, "step_kind": None, "batch": None, "request_ids": [], "tid": None,
                 "torch_ms": record["duration_us"] / 1e3, "reason": reason,
                 "unix_start_us": record.get("start_time_us"), "detail": classify(reason, compile_id, None)}
        groups.setdefault((function, stall["detail"]["cause"]), []).append(stall)
    return groups


def _recompile_finding(function: str | None, stalls: list[dict[str, Any]], before_session: bool = False,
                       first_step: bool = False) -> Finding:
    in_steps = [s for s in stalls if s["in_step"]]
    cost = sum(s["ms"] for s in stalls)
    detail = stalls[0]["detail"]
    sizes = sorted({s["detail"]["actual"] for s in stalls if "actual" in s["detail"]})
    requests = list(dict.fromkeys(r for s in stalls for r in s["request_ids"]))
    what = describe_cause(detail)
    if sizes and detail["cause"] in ("batch_size", "dimension"):
        what += f"; sizes seen: {', '.join(map(str, sizes))}"
    subject = f"`{function}`" if function else "a function the trace does not name"
    did = "recorded a CUDA graph of" if detail["cause"] == "cudagraph_record" else "compiled"
    if before_session:
        title = (f"torch.compile {did} {subject} {len(stalls)} time(s) while serving before this session "
                 f"({cost:,.0f} ms stalled, torch's own records): {what}")
    elif first_step:
        title = (f"torch.compile {did} {subject} {len(stalls)} time(s) in the trace's first model step (its first "
                 f"run here: a warm-up, or the first request of this shape), {cost:,.0f} ms stalled")
    else:
        where = f"{len(in_steps)} inside model steps" if in_steps else "outside any model step found"
        cut = " (at least: still compiling when the capture stopped)" if any(s.get("cut_at_stop") for s in stalls) else ""
        title = (f"torch.compile {did} {subject} {len(stalls)} time(s) while serving ({where}), "
                 f"{cost:,.0f} ms stalled{cut}: {what}")
    torch_ms = [s["torch_ms"] for s in stalls if s["torch_ms"] is not None]
    evidence = {
        "function": function, "where": "before_session" if before_session else "in_trace",
        "cause": detail["cause"], "detail": detail, "compiles": len(stalls),
        "in_steps": len(in_steps), "stall_ms": cost, "torch_reported_ms": sum(torch_ms) if torch_ms else None,
        "reasons": list(dict.fromkeys(s["reason"] for s in stalls if s["reason"]))[:5],
        "stalls": [{k: s[k] for k in ("start_us", "ms", "compile_id", "step_kind", "batch", "request_ids",
                                      "waiting_request_ids", "tid", "unix_start_us", "cut_at_stop") if k in s}
                   for s in stalls[:MAX_STALLS_LISTED]],
    }
    severity = severity_for(cost, WARNING_MS, CRITICAL_MS) if in_steps or before_session else "info"
    fix = fix_for(detail)
    if first_step:  # at most a warning: a warm-up's compile is where it belongs
        evidence["first_step_only"] = True
        severity = "warning" if severity == "critical" else severity
        fix += (" If this trace is of the server's warm-up, the compile is where it belongs; if a request paid "
                "it, warm that shape up before taking traffic.")
    return Finding("recompilation", severity, cost, min(s["start_us"] for s in stalls),
                   max(s["end_us"] for s in stalls), title, request_ids=requests[:100], evidence=evidence, fix=fix)


def _regions_per_step(trace: Trace, steps: list[Step], frames: dict[str, Any]) -> dict[str, Any]:
    """Compiled regions each step runs, and the graph breaks among them (resume functions)."""
    ids = ids_holding(trace, (REGION_LITERAL,), lambda s: REGION.match(s) is not None)
    if ids.size == 0 or not steps:
        return {"steps_with_compiled_code": 0}
    rows = np.flatnonzero(np.isin(trace.name_id, ids) & trace.complete())
    where = step_index(steps, trace.rank[rows], trace.ts[rows])
    per_step: dict[int, list[int]] = {}
    for row, index in zip(rows.tolist(), where.tolist(), strict=True):
        if index >= 0:
            per_step.setdefault(index, []).append(row)
    if not per_step:
        return {"steps_with_compiled_code": 0}
    graph_calls = _graph_calls(trace)
    counts, breaks, eager_us, step_us = [], [], 0.0, 0.0
    for index, mine in per_step.items():
        mine.sort(key=lambda r: trace.ts[r])
        frame_ids = [REGION.match(trace.name(r)).group(1) for r in mine]  # type: ignore[union-attr]
        counts.append(len(mine))
        known = [frames.get(f) for f in frame_ids]
        breaks.append(sum(1 for f in known if f and f.get("resume")) if all(known) else None)
        if graph_calls is not None:
            eager_us += _eager_us(trace, mine, graph_calls)
        step_us += steps[index].dur_us
    known_breaks = [b for b in breaks if b is not None]
    eager = eager_us if graph_calls is not None else None
    summary: dict[str, Any] = {
        "steps_with_compiled_code": len(per_step), "compiled_regions_per_step": median(counts),
        "graph_breaks_per_step": median(known_breaks) if known_breaks else None,
        "eager_ms_between_regions": None if eager is None else eager / 1e3,
    }
    if known_breaks and median(known_breaks) >= 1:
        share = eager / step_us if eager is not None and step_us else None
        resumes = sorted({f["name"] for f in frames.values() if f.get("resume")})
        eager_text = (f"{eager / 1e3:,.1f} ms ({share:.0%} of those steps) ran eagerly between compiled graphs"
                      if eager is not None and share is not None else NO_GRAPH_CALLS)
        summary["graph_break_finding"] = Finding(
            "graph_break", "warning" if share is not None and share >= 0.1 else "info", (eager or 0.0) / 1e3,
            min(steps[i].start_us for i in per_step), max(steps[i].end_us for i in per_step),
            f"{median(known_breaks):g} graph break(s) per step in {len(per_step)} steps: {eager_text}",
            request_ids=list(dict.fromkeys(r for i in per_step for r in steps[i].request_ids))[:100],
            evidence={"steps": len(per_step), "graph_breaks_per_step": median(known_breaks),
                      "compiled_regions_per_step": median(counts),
                      "eager_ms": None if eager is None else eager / 1e3,
                      "share_of_steps": share, "resume_functions": resumes[:10]},
            fix=GRAPH_BREAK_FIX)
    return summary


def _graph_calls(trace: Trace) -> np.ndarray | None:
    """Rows of the compiled graphs' own runs (time-sorted), or None where the trace names none
    (Dynamo's eager backend runs a graph's ops bare): then the eager time between graphs is unknown."""
    ids = ids_holding(trace, GRAPH_CALL_LITERALS, lambda s: GRAPH_CALL.match(s) is not None)
    if ids.size == 0:
        return None
    rows = np.flatnonzero(np.isin(trace.name_id, ids) & trace.complete())
    return rows[np.argsort(trace.ts[rows], kind="stable")]


def _eager_us(trace: Trace, regions: list[int], graph_calls: np.ndarray) -> float:
    """Time inside a step's compiled regions (from the first to start to the last to end) that no
    graph ran in, on their thread. A graph break's resume frame runs inside the frame it broke
    (its region nests in the first), so the eager code lies inside a region, between two graphs."""
    start = min(float(trace.ts[r]) for r in regions)
    end = max(float(trace.ts[r] + trace.dur[r]) for r in regions)
    tid = trace.tid[regions[0]]
    lo, hi = np.searchsorted(trace.ts[graph_calls], [start, end], side="left")
    inside = graph_calls[lo:hi]
    inside = inside[trace.tid[inside] == tid]
    ran = covered_within(trace.ts[inside], trace.ts[inside] + trace.dur[inside], start, end)
    return max(end - start - ran, 0.0)


def _stalls_from_records(records: list[dict[str, Any]], base_ns: float | None,
                         trace_start_us: float | None) -> list[dict[str, Any]]:
    """Compile stalls where the trace has no compile range (a light session): torch's records
    of compiles that ran while the session captured, at their recorded times. The thread is not
    recorded: the step they sit in is found by time on rank 0."""
    if base_ns is None or trace_start_us is None:
        return []
    stalls = []
    for record in records:
        start = record["start_time_us"] - base_ns / 1e3
        if start < trace_start_us:
            continue  # began before the capture: torch's figure, not the trace's
        stalls.append({"rank": 0, "tid": None, "start_us": start, "end_us": start + record["duration_us"],
                       "ms": record["duration_us"] / 1e3, "from_records": True,
                       "compile_id": str(record["compile_id"]).strip("[]") if record.get("compile_id") else None})
    return stalls


def _missing(stalls: list[dict[str, Any]], regions: dict[str, Any], have_metadata: bool,
             light: bool = False) -> list[dict[str, str]]:
    missing = []
    if light:
        missing.append({"what": "compiled regions and graph breaks", "message": (
            "A light session records no compiled region, so graph breaks per step are not counted and compiles "
            f"are placed from torch's own records (no thread); {DEEP_WINDOW_HOW}.")})
    if stalls and not have_metadata:
        missing.append({"what": "recompile reasons", "message": (
            "This trace shows compiles but not why: servprof's own sessions carry torch's compile records; "
            "elsewhere run with TORCH_LOGS=recompiles to see the failing guard.")})
    if regions.get("compiled_regions_per_step", 0) >= 2 and regions.get("graph_breaks_per_step") is None:
        missing.append({"what": "graph breaks", "message": (
            f"Steps run {regions['compiled_regions_per_step']:g} compiled regions each: graph breaks or separately "
            "compiled modules. torch's compile records (in servprof's session metadata) tell which; "
            "torch._dynamo.explain(fn)(*inputs) lists the breaks.")})
    return missing
