"""Memory: peak, growth step over step and between sessions, fragmentation, room left.

Findings (each with its evidence and a fix):
- ``memory_growth``: memory that keeps rising with the work: inside the trace (allocator
  events or CUDA allocator samples, level after each step) or between sessions (servprof's
  memory history: levels while no profiler runs, with the model requests served meanwhile).
  The process's RSS *inside* a session is never used for this: the profiler's own buffers
  grow with every captured event there.
- ``memory_fragmentation``: the CUDA caching allocator holds much more than is allocated at
  the peak (reserved - allocated), memory no other allocation of another size can use.
- ``memory_near_limit``: the peak comes within a margin of the device's (or the host's)
  memory, or the allocator had to free its cache and retry, or hit an OOM.
The summary has, per device, the peak allocated/reserved, the baseline held throughout
(weights, KV cache, caches), the transient part on top (activations), the cached-unused
part, and where allocator events exist, the ops, phases and requests that allocated most.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from servprof.detect.finding import Finding
from servprof.detect.memory_attribution import attribution, enclosing_ops_by_series
from servprof.detect.memory_series import MemorySeries, memory_series
from servprof.detect.steps import Step
from servprof.trace.model import Trace

MIB = 1024**2
GROWTH_MIN_BYTES = 8 * MIB
GROWTH_MIN_SHARE = 0.005  # of the level it grows from
HISTORY_GROWTH_MIN_BYTES = 16 * MIB  # RSS between sessions moves by a few MiB on its own
GROWTH_MIN_RISES = 3  # separate rises: one jump is an allocation, not a trend
GROWTH_KEPT_SHARE = 0.5  # of what rose, at least this much stays
GROWTH_LATE_SHARE = 0.25  # of the growth, at least this much in the later half (a warm-up levels off)
FRAGMENTATION_SHARE = 0.25
FRAGMENTATION_MIN_BYTES = 512 * MIB
NEAR_LIMIT_WARNING, NEAR_LIMIT_CRITICAL = 0.90, 0.97

GROWTH_FIX = ("Find what keeps a reference per request or per step: a list or dict of tensors, a cache "
              "without a size bound (prefix/KV/session caches), tensors kept in logs or results. Bound "
              "caches (LRU, max entries) and drop per-request tensors when the request ends. On CUDA, "
              "SERVPROF_MEMORY_SNAPSHOT=1 and POST /servprof/memory-snapshot give a snapshot whose stack "
              "traces name the allocating line (open it at https://pytorch.org/memory_viz). Growth that "
              "levels off after start-up is a cache warming up: warm it at start-up instead.")
FRAGMENTATION_FIX = ("Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so segments grow in place instead of "
                     "leaving gaps; keep tensor sizes steady (pad batch and sequence lengths to a few buckets); "
                     "do not call torch.cuda.empty_cache() while serving (the memory is reserved again at once).")
NEAR_LIMIT_FIX = {
    "cuda": ("Give the peak room: lower the KV-cache share (vLLM --gpu-memory-utilization, SGLang "
             "--mem-fraction-static), the largest batch (--max-num-seqs) or the context length; check other "
             "processes on the GPU. SERVPROF_MEMORY_SNAPSHOT=1 writes a snapshot before the OOM, not after."),
    "process": ("Give the process room: fewer concurrent requests or workers, a smaller batch or context, "
                "or a higher container memory limit; the peak includes servprof's profiler buffers only while "
                "a session runs."),
}


# A device peak this much of which was held throughout the window is a preallocated pool (weights and
# an engine's KV cache), not pressure: without an allocator retry or OOM it is not a warning.
POOL_SHARE = 0.9
POOL_FIX = ("Nothing to lower while the allocator neither retries nor runs out: a pool held near the limit is how "
            "engines size their KV cache (vLLM reserves --gpu-memory-utilization of the device, SGLang "
            "--mem-fraction-static), and shrinking it shrinks the batch the cache holds. If a session shows "
            "allocator retries or an OOM, leave activations more room (a lower share, a smaller "
            "--max-num-batched-tokens or batch) and check for other processes on the GPU.")


def _mib(value: float) -> str:
    return f"{value / MIB:,.1f} MiB"


def detect_memory(trace: Trace, steps: list[Step]) -> tuple[list[Finding], dict[str, Any]]:
    findings: list[Finding] = []
    devices: dict[str, Any] = {}
    all_series = memory_series(trace)
    for series, enclosing in zip(all_series, enclosing_ops_by_series(trace, all_series), strict=True):
        key = series.device if len(trace.ranks) == 1 else f"rank{series.rank}/{series.device}"
        info = describe(trace, series, steps, enclosing)
        devices[key] = info
        findings.extend(_near_limit(series, info, key))
        findings.extend(_fragmentation(series, info, key))
        if series.source != "process_rss":
            findings.extend(_growth_in_trace(series, steps, info, key))
    history = _history(trace)
    history_summary: dict[str, Any] = {}
    if history is not None:
        for device, levels in history["levels"].items():
            history_summary[device] = between_sessions(history["points"], levels)
            at = float(trace.ts.min()) if len(trace) else 0.0  # the stretches are before the trace: shown at its start
            findings.extend(_growth_between_sessions(device, history_summary[device], devices.get(device, {}), at))
    missing = []
    if not devices and not history_summary:
        missing.append({"what": "memory", "message": (
            "No memory readings: the trace has no allocator events ([memory], from profile_memory=True on the "
            "thread that runs the model) and no servprof memory samples (SERVPROF_MEMORY_SAMPLES=1, on by "
            "default in servprof's own sessions).")})
    elif any(f.kind == "memory_growth" for f in findings) and not any("top_ops" in d for d in devices.values()):
        missing.append({"what": "memory attribution", "message": (
            "Which ops and phases keep the memory is not in this trace: torch 2.13's profiler records no "
            "allocator events under profile_all_threads. On CUDA, a memory snapshot "
            "(SERVPROF_MEMORY_SNAPSHOT=1) names the allocating stack.")})
    summary = {"devices": devices, "between_sessions": history_summary, "missing": missing,
               "findings": len(findings)}
    return findings, summary


# --- what each series shows ------------------------------------------------------------------


def describe(trace: Trace, series: MemorySeries, steps: list[Step], enclosing: np.ndarray | None = None
             ) -> dict[str, Any]:
    allocated, reserved = series.allocated, series.reserved
    peak = int(np.argmax(allocated))
    info: dict[str, Any] = {
        "source": series.source, "readings": len(series),
        "peak_allocated_bytes": int(allocated[peak]), "peak_allocated_at_us": float(series.t_us[peak]),
        "baseline_bytes": int(allocated.min()),  # held throughout: weights, KV cache, caches
        "transient_bytes": int(allocated[peak] - allocated.min()),  # on top at the peak: activations
        "first_bytes": int(allocated[0]), "last_bytes": int(allocated[-1]),
        "window_ms": float(series.t_us[-1] - series.t_us[0]) / 1e3,
        "total_bytes": series.total_bytes, "total_from": series.total_from,
    }
    if series.has_reserved:
        top = int(np.nanargmax(reserved))
        info.update({"peak_reserved_bytes": int(reserved[top]), "peak_reserved_at_us": float(series.t_us[top]),
                     "cached_unused_at_peak_bytes": int(reserved[top] - allocated[top])})
    if series.stats_start or series.stats_end:
        info["allocator_stats"] = {"start": series.stats_start, "end": series.stats_end}
    if series.source == "process_rss":
        info["note"] = "resident memory of the whole process, servprof's profiler buffers included while capturing"
    elif series.source == "profiler_events" and series.device == "cpu":
        info["note"] = "CPU allocator totals count only what was allocated while memory profiling was on"
    if series.rows is not None and series.delta is not None:
        info.update(attribution(trace, series, steps, enclosing))
    return info


# --- findings --------------------------------------------------------------------------------


def _device_kind(device: str) -> str:
    return "process" if device in ("process", "cpu") else "cuda"


def _near_limit(series: MemorySeries, info: dict[str, Any], key: str) -> list[Finding]:
    stats_start, stats_end = series.stats_start, series.stats_end
    retries = stats_end.get("num_alloc_retries", 0) - stats_start.get("num_alloc_retries", 0)
    ooms = stats_end.get("num_ooms", 0) - stats_start.get("num_ooms", 0)
    peak = info.get("peak_reserved_bytes", info["peak_allocated_bytes"])
    total = series.total_bytes
    share = peak / total if total else None
    device_free = stats_end.get("device_free_bytes")
    if not ((share is not None and share >= NEAR_LIMIT_WARNING) or retries > 0 or ooms > 0):
        return []
    critical = ooms > 0 or (share is not None and share >= NEAR_LIMIT_CRITICAL)
    what = "reserved" if "peak_reserved_bytes" in info else "resident" if series.source == "process_rss" else "allocated"
    baseline = int(info.get("baseline_bytes") or 0)
    # Device memory held all through the window, with nothing retried or run out: a preallocated pool.
    pool = _device_kind(series.device) == "cuda" and retries <= 0 and ooms <= 0 and baseline >= POOL_SHARE * peak
    parts = []
    if share is not None:
        parts.append(f"peak {what} {_mib(peak)} is {share:.0%} of {_mib(total or 0)}")
    if pool:
        parts.append(f"{_mib(baseline)} of it allocated all through the trace (weights and a preallocated pool such "
                     f"as an engine's KV cache), {_mib(max(0, peak - baseline))} on top at the peak, no allocator "
                     "retry or out-of-memory error")
    if retries > 0:
        parts.append(f"the allocator freed its cache and retried {retries} time(s)")
    if ooms > 0:
        parts.append(f"{ooms} out-of-memory error(s)")
    evidence = {"device": key, "peak_bytes": peak, "measure": what, "total_bytes": total, "preallocated_pool": pool,
                "total_from": series.total_from, "share": share, "alloc_retries": retries, "ooms": ooms,
                "device_free_bytes_at_end": device_free, "peak_at_us": info.get("peak_reserved_at_us",
                                                                              info["peak_allocated_at_us"])}
    at = float(evidence["peak_at_us"])
    severity = "info" if pool else "critical" if critical else "warning"
    return [Finding("memory_near_limit", severity, 0.0, at, at, f"{key}: memory near its limit: {'; '.join(parts)}",
                    evidence=evidence, fix=POOL_FIX if pool else NEAR_LIMIT_FIX[_device_kind(series.device)])]


def _fragmentation(series: MemorySeries, info: dict[str, Any], key: str) -> list[Finding]:
    if "peak_reserved_bytes" not in info:
        return []
    reserved, unused = info["peak_reserved_bytes"], info["cached_unused_at_peak_bytes"]
    share = unused / reserved if reserved else 0.0
    floor = max(FRAGMENTATION_MIN_BYTES, 0.05 * (series.total_bytes or 0))
    if share < FRAGMENTATION_SHARE or unused < floor:
        return []
    inactive = series.stats_end.get("inactive_split_bytes.all.current")
    evidence = {"device": key, "reserved_bytes": reserved, "allocated_bytes": reserved - unused,
                "cached_unused_bytes": unused, "share": share, "inactive_split_bytes_at_end": inactive}
    at = float(info["peak_reserved_at_us"])
    near = series.total_bytes and reserved / series.total_bytes >= NEAR_LIMIT_WARNING
    return [Finding("memory_fragmentation", "critical" if near else "warning", 0.0, at, at,
                    f"{key}: {share:.0%} of reserved memory ({_mib(unused)}) is cached but unused at the peak",
                    evidence=evidence, fix=FRAGMENTATION_FIX)]


def trend(levels: np.ndarray, work: np.ndarray | None = None) -> dict[str, float]:
    """Growth, rises and how much of it stays, over a sequence of levels; ``late_growth_bytes``
    is the growth over the later half of the work (steps by default, or the cumulative
    ``work`` done at each level, e.g. requests served): a warm-up grows early and levels off,
    a leak keeps growing with the work."""
    deltas = np.diff(levels)
    growth = float(levels[-1] - levels[0]) if levels.size else 0.0
    ups = float(deltas[deltas > 0].sum()) if deltas.size else 0.0
    rises = int((deltas > 0.02 * growth).sum()) if growth > 0 else 0
    if work is None:
        work = np.arange(levels.size, dtype=np.float64)
    half = int(np.searchsorted(work, work[-1] / 2)) if levels.size else 0
    late = float(levels[-1] - levels[min(half, levels.size - 1)]) if levels.size else 0.0
    return {"growth_bytes": growth, "rose_bytes": ups, "rises": rises, "late_growth_bytes": late}


def _is_growth(shape: dict[str, float], floor: float) -> bool:
    growth = shape["growth_bytes"]
    return (growth >= floor and growth >= GROWTH_KEPT_SHARE * shape["rose_bytes"]
            and shape["rises"] >= GROWTH_MIN_RISES and shape["late_growth_bytes"] >= GROWTH_LATE_SHARE * growth)


def _admitted(steps: list[Step], start_us: float, end_us: float) -> int:
    """Requests that entered a prefill in the window (by id, else by prefill batch)."""
    prefills = [s for s in steps if s.kind in ("prefill", "mixed") and start_us <= s.start_us <= end_us]
    ids = {rid for s in prefills for rid in s.request_ids}
    return len(ids) if ids else sum(s.batch or 0 for s in prefills if s.kind == "prefill")


def _growth_in_trace(series: MemorySeries, steps: list[Step], info: dict[str, Any], key: str) -> list[Finding]:
    mine = [s for s in steps if s.rank == series.rank and series.t_us[0] <= s.end_us and s.start_us <= series.t_us[-1]]
    if len(mine) >= 4:
        start, end = mine[0].start_us, mine[-1].end_us
        levels = np.concatenate([series.level_at(np.array([start])), series.level_at(np.array([s.end_us for s in mine]))])
        shape = trend(levels)
        # Requests admitted so far, after each step: a leak per request grows with admissions,
        # however early in the window they came.
        admissions = np.cumsum([0] + [1 if s.kind in ("prefill", "mixed") else 0 for s in mine], dtype=np.float64)
        if admissions[-1] >= GROWTH_MIN_RISES:
            shape["late_growth_bytes"] = max(shape["late_growth_bytes"], trend(levels, admissions)["late_growth_bytes"])
    else:
        start, end = float(series.t_us[0]), float(series.t_us[-1])
        levels = series.allocated
        shape = trend(levels)
    if not _is_growth(shape, max(GROWTH_MIN_BYTES, GROWTH_MIN_SHARE * info["baseline_bytes"])):
        return []
    growth = shape["growth_bytes"]
    later = series.allocated[series.t_us > end]
    if later.size and later[-1] - levels[0] < GROWTH_KEPT_SHARE * growth:
        # Given back before the trace ended (results a benchmark kept until it finished): held for
        # a while, not kept; a leak is never given back.
        info["released_after_steps_bytes"] = int(levels[-1] - later[-1])
        return []
    admitted = _admitted(steps, start, end)
    window_s = max((end - start) / 1e6, 1e-6)
    evidence: dict[str, Any] = {
        "device": key, "where": "in_trace", "source": series.source, **{k: int(v) for k, v in shape.items()},
        "window_ms": window_s * 1e3, "steps": len(mine), "per_step_bytes": growth / len(mine) if mine else None,
        "requests_admitted": admitted, "per_request_bytes": growth / admitted if admitted else None,
        "bytes_per_s": growth / window_s, **_projection(series.total_bytes, levels[-1], growth / window_s),
    }
    for name in ("by_phase", "top_ops"):
        if name in info:
            evidence[name] = info[name]
    per = f", {_mib(growth / admitted)} per request admitted" if admitted else ""
    title = f"{key}: memory grew {_mib(growth)} over {len(mine) or len(levels)} steps in {window_s:.1f} s{per}"
    return [Finding("memory_growth", _growth_severity(evidence), 0.0, start, end, title,
                    request_ids=[r["request_id"] for r in info.get("top_requests", [])], evidence=evidence,
                    fix=GROWTH_FIX)]


def _projection(total: int | None, level: float, bytes_per_s: float) -> dict[str, Any]:
    if not total or bytes_per_s <= 0:
        return {"hours_to_limit": None}
    return {"hours_to_limit": max(total - float(level), 0.0) / bytes_per_s / 3600}


def _growth_severity(evidence: dict[str, Any]) -> Any:
    hours = evidence.get("hours_to_limit")
    if hours is not None and hours < 1:
        return "critical"
    return "warning" if hours is None or hours < 24 else "info"


# --- between sessions: servprof's memory history ----------------------------------------------


def _history(trace: Trace) -> dict[str, Any] | None:
    memory = trace.servprof_metadata().get("memory")
    history = memory.get("history") if isinstance(memory, dict) else None
    if not isinstance(history, dict) or not isinstance(history.get("points"), list):
        return None
    points = history["points"]
    if not all(isinstance(p, list) and len(p) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in p)
               for p in points):
        return None
    levels = history.get("levels")
    if not isinstance(levels, dict):
        return None
    clean = {}
    for device, values in levels.items():
        if isinstance(device, str) and isinstance(values, list) and len(values) == len(points):
            clean[device] = [v[0] if isinstance(v, list) and v and isinstance(v[0], int) else None for v in values]
    return {"points": points, "levels": clean}


def between_sessions(points: list[list[int]], levels: list[int | None]) -> dict[str, Any]:
    """Growth over the stretches with no session in them (consecutive readings with the same
    session count), with the model requests served over those stretches."""
    growth_levels: list[float] = []  # the level, chained over the quiet stretches only
    served: list[float] = []  # model requests served, at each of those levels
    running = 0.0
    requests = 0
    seconds = 0.0
    stretches = 0
    for (t0, r0, s0), (t1, r1, s1), a, b in zip(points, points[1:], levels, levels[1:], strict=False):
        if s0 != s1 or a is None or b is None or t1 <= t0:
            continue
        if not growth_levels:
            growth_levels.append(0.0)
            served.append(0.0)
        running += b - a
        requests += max(r1 - r0, 0)
        growth_levels.append(running)
        served.append(float(requests))
        seconds += (t1 - t0) / 1e9
        stretches += 1
    shape = trend(np.array(growth_levels), np.array(served)) if growth_levels else trend(np.zeros(0))
    last = next((v for v in reversed(levels) if v is not None), None)
    return {**{k: int(v) for k, v in shape.items()}, "readings": len(points), "quiet_stretches": stretches,
            "quiet_s": seconds, "model_requests": requests, "last_bytes": last}


def _growth_between_sessions(device: str, history: dict[str, Any], info: dict[str, Any],
                             at_us: float) -> list[Finding]:
    last = history.get("last_bytes") or 0
    floor = max(HISTORY_GROWTH_MIN_BYTES if device == "process" else GROWTH_MIN_BYTES, GROWTH_MIN_SHARE * last)
    if history["model_requests"] < GROWTH_MIN_RISES or not _is_growth(history, floor):
        return []
    growth, requests, seconds = history["growth_bytes"], history["model_requests"], max(history["quiet_s"], 1e-6)
    evidence = {"device": device, "where": "between_sessions", **history, "per_request_bytes": growth / requests,
                "bytes_per_s": growth / seconds,
                **_projection(info.get("total_bytes"), last, growth / seconds)}
    what = "process resident memory" if device == "process" else f"{device} allocated memory"
    title = (f"{what} grew {_mib(growth)} over {requests} model requests between sessions "
             f"({_mib(growth / requests)} per request, {_mib(growth / seconds * 60)} per minute)")
    return [Finding("memory_growth", _growth_severity(evidence), 0.0, at_us, at_us, title, evidence=evidence,
                    fix=GROWTH_FIX)]
