"""torch.compile's own record of what it compiled, read at a session's start and end.

``torch._dynamo.utils`` keeps counters (graphs, frames, graph breaks by reason) and one
CompilationMetrics record per compile (compile id, function, start, duration, and the
guard that failed for a recompile). servprof reads them only when the server has
imported torch._dynamo itself (importing it costs seconds) and copies what a session's
analysis needs: the compiles that ended during the session, and a table of every
compiled frame so that a trace's ``Torch-Compiled Region: F/R`` can be named (frame F,
its R-th recompile) and a graph break's resume function told apart.
"""

from __future__ import annotations

import re
import sys
from typing import Any

MAX_COMPILES = 64  # per session (torch itself keeps the last 64)
MAX_TEXT = 500  # characters of a reason kept
MAX_GRAPH_BREAK_REASONS = 10
RESUME_PREFIXES = ("torch_dynamo_resume_in_", "__resume_at_")  # graph-break continuations (2.1+, older)
# "F/R", "[F/R]", "F/R_A" (attempt A) or "!C/F/R" (compiled autograd): frame F, recompile R.
COMPILE_ID = re.compile(r"(\d+)/(\d+)(?:_\d+)?\]?\s*$")


def _dynamo_utils() -> Any:
    return sys.modules.get("torch._dynamo.utils")


def compile_state() -> dict[str, Any] | None:
    """Counters and compile records now; None when this process never imported torch._dynamo."""
    utils = _dynamo_utils()
    if utils is None:
        return None
    counters = utils.counters
    # dict() copies under the GIL in one C call: safe while a compile updates the counters.
    stats, frames, breaks = (dict(counters.get(key) or {}) for key in ("stats", "frames", "graph_break"))
    getter = getattr(utils, "get_compilation_metrics", None)
    metrics = list(getter()) if callable(getter) else []
    return {
        "unique_graphs": int(stats.get("unique_graphs", 0)),
        "calls_captured": int(stats.get("calls_captured", 0)),
        "frames_total": int(frames.get("total", 0)),
        "frames_ok": int(frames.get("ok", 0)),
        "graph_breaks": int(sum(breaks.values())),
        "graph_break_reasons": breaks,
        "metrics": metrics,
    }


def _metric_record(metric: Any) -> dict[str, Any] | None:
    start_us = getattr(metric, "start_time_us", None)
    if start_us is None and isinstance(getattr(metric, "start_time", None), (int, float)):
        start_us = int(metric.start_time * 1e6)
    duration_us = getattr(metric, "duration_us", None)
    if duration_us is None and isinstance(getattr(metric, "entire_frame_compile_time_s", None), (int, float)):
        duration_us = int(metric.entire_frame_compile_time_s * 1e6)
    if not isinstance(start_us, int) or not isinstance(duration_us, int):
        return None
    record: dict[str, Any] = {"start_time_us": start_us, "duration_us": duration_us}
    for name in ("compile_id", "co_name", "co_filename", "co_firstlineno", "recompile_reason", "fail_type",
                 "fail_reason", "cache_size", "accumulated_cache_size", "graph_op_count", "num_graph_breaks",
                 "backend_compile_time_s", "inductor_compile_time_s", "dynamo_time_before_restart_s"):
        value = getattr(metric, name, None)
        if isinstance(value, str):
            value = value[:MAX_TEXT]
        if value is not None and isinstance(value, (str, int, float, bool)):
            record[name] = value
    return record


def frame_table(metrics: list[Any]) -> dict[str, dict[str, Any]]:
    """frame id (the F of compile id F/R) -> the function Dynamo compiled for it."""
    frames: dict[str, dict[str, Any]] = {}
    for metric in metrics:
        compile_id = getattr(metric, "compile_id", None)
        name = getattr(metric, "co_name", None)
        if not isinstance(compile_id, str) or not isinstance(name, str):
            continue
        match = COMPILE_ID.search(compile_id)
        if match is None:
            continue
        frames[match.group(1)] = {"name": name[:200], "file": str(getattr(metric, "co_filename", "") or "")[:300],
                         "line": getattr(metric, "co_firstlineno", None),
                         "resume": name.startswith(RESUME_PREFIXES)}
    return frames


def compile_summary(start: dict[str, Any] | None, end: dict[str, Any] | None,
                    session_wall_start_ns: int | None, serving_since_ns: int | None = None) -> dict[str, Any] | None:
    """The ``compile`` key of the session metadata: the compiles that ended during the session,
    and those that ran while serving before it (after the first model request arrived; the
    compiles of a start-up warm-up are neither)."""
    if end is None:
        return None
    since_us = (session_wall_start_ns or 0) // 1000
    records = [r for r in (_metric_record(m) for m in end["metrics"]) if r is not None]
    compiles = [r for r in records if r["start_time_us"] + r["duration_us"] >= since_us][-MAX_COMPILES:]
    serving_us = serving_since_ns // 1000 if serving_since_ns else None
    before_session = [r for r in records if serving_us is not None and r["start_time_us"] >= serving_us
              and r["start_time_us"] + r["duration_us"] < since_us][-MAX_COMPILES:]
    counted = start or {}
    reasons = sorted(end["graph_break_reasons"].items(), key=lambda kv: -kv[1])[:MAX_GRAPH_BREAK_REASONS]
    counters = ("unique_graphs", "calls_captured", "frames_total", "frames_ok", "graph_breaks")
    return {
        "counters_start": {k: counted.get(k) for k in counters} if start else None,
        "counters_end": {k: end[k] for k in counters},
        "graph_break_reasons": [{"reason": str(text).strip().splitlines()[0][:MAX_TEXT] if str(text).strip() else "",
                                 "count": int(count)} for text, count in reasons],
        "compiles": compiles,
        "before_session": before_session,
        "serving_since_ns": serving_since_ns,
        "frames": frame_table(end["metrics"]),
    }
