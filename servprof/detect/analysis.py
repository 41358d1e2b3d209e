"""One pass of every detector over a trace: findings plus the summary the reports show."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from servprof.detect.after_last_step import detect_after_last_step
from servprof.detect.bandwidth_bound_decode import detect_bandwidth_bound
from servprof.detect.decode_gap import detect_decode_gaps, find_gaps
from servprof.detect.finding import KINDS, SEVERITY_ORDER, WHOLE_TRACE, Finding
from servprof.detect.kv_cache import detect_no_kv_cache
from servprof.detect.loop_stall import detect_loop_stalls
from servprof.detect.memory import detect_memory
from servprof.detect.missing import merged_missing
from servprof.detect.model_on_loop import detect_model_on_loop
from servprof.detect.overhead import overhead_summary, whole_before_stop
from servprof.detect.queue_wait import detect_queue_wait
from servprof.detect.recompilation import detect_recompilation
from servprof.detect.refused import refused_missing
from servprof.detect.request_times import request_times
from servprof.detect.shape_setup import detect_shape_setup, explain_slow_host_ops
from servprof.detect.steps import Step, find_steps
from servprof.detect.tier import NEEDS_DEEP_CAUSE, budget_missing, light_missing, tier_of
from servprof.detect.tokenization_stall import detect_tokenization_stalls
from servprof.detect.utilisation import utilisation
from servprof.trace.loader import paused_gc
from servprof.trace.meta import files_by_claimed_rank
from servprof.trace.model import Trace


@dataclass
class Analysis:
    findings: list[Finding]
    summary: dict[str, Any]
    steps: list[Step] = field(default_factory=list)
    gaps: list[Any] = field(default_factory=list)
    # Roofline points, one per modelled op: the first 10,000, and the first 2,000 that can be plotted (the
    # summary and findings count every op; bandwidth_points.py).
    kernels: list[dict[str, Any]] = field(default_factory=list)


def analyse(trace: Trace, requests: list[dict[str, Any]] | None = None, device: str | None = None) -> Analysis:
    with paused_gc():  # the trace's args are a large object graph the collector would rescan
        return _analyse(trace, requests, device)


def _analyse(trace: Trace, requests: list[dict[str, Any]] | None, device: str | None) -> Analysis:
    steps = find_steps(trace)
    times = request_times(trace, requests)  # each sampled request's arrival, first byte and end, in trace µs
    gaps, gap_stats = find_gaps(trace, steps, [(t.arrival_us, t.end_us) for t in times.values()])
    gap_findings, gap_summary = detect_decode_gaps(trace, steps, (gaps, gap_stats))
    token_findings, token_summary = detect_tokenization_stalls(trace, steps, gaps)
    bw_findings, bw_summary, kernels = detect_bandwidth_bound(trace, steps, device)
    memory_findings, memory_summary = detect_memory(trace, steps)
    compile_findings, compile_summary = detect_recompilation(trace, steps)
    stall_findings, stall_summary = detect_loop_stalls(trace, token_findings)
    on_loop_findings, stall_summary["model_on_loop"] = detect_model_on_loop(trace, steps)
    wait_findings, wait_summary = detect_queue_wait(trace, steps, times)
    after_findings, after_summary = detect_after_last_step(trace, steps, times)
    setup_findings, setup_summary = detect_shape_setup(trace, steps)
    explain_slow_host_ops(gap_findings, setup_findings, setup_summary["unshaped_ops"])
    cache_findings, cache_summary = detect_no_kv_cache(steps)
    findings = sorted([*gap_findings, *token_findings, *bw_findings, *memory_findings, *compile_findings,
                       *stall_findings, *on_loop_findings, *wait_findings, *after_findings, *setup_findings,
                       *cache_findings], key=lambda f: (SEVERITY_ORDER[f.severity], f.cost_ms), reverse=True)
    sampled = sampled_request_ids(trace, requests)
    _attribute_to_session(findings, requests, trace)
    for finding in findings:
        finding.sampled_request_ids = [r for r in finding.request_ids if r in sampled]
    parts = (gap_summary, token_summary, bw_summary, memory_summary, compile_summary, stall_summary)
    # What the trace could not show, once, at the top (the detectors' own summaries keep no copy).
    # (The serving side's entries first: what it saw of the process says more than the trace can.)
    missing = merged_missing(trace.servprof_metadata().get("missing"), [
        *refused_missing(requests), *steps.missing(), *(m for part in parts for m in part.pop("missing", [])),
        *light_missing(trace, sum(g.count for g in gaps if g.cause == NEEDS_DEEP_CAUSE)),
        *budget_missing(trace, steps)])
    summary = {
        "source": trace.source,
        "tier": tier_of(trace),  # "light" | "deep" for servprof's sessions (detect/tier.py), else None
        "events": len(trace),
        "ranks": trace.ranks,
        "device_events": bool(trace.has_device_events()),
        "steps": {
            "count": len(steps),
            "by_kind": {k: sum(1 for s in steps if s.kind == k) for k in sorted({s.kind for s in steps})},
            "source": sorted({s.source for s in steps}),
            "median_step_ms": round(gap_summary["median_step_us"] / 1000, 4) if gap_summary.get("median_step_us") else None,
            "recompute_prefix": cache_summary["steps"],  # (no KV cache: kv_cache.py)
            "whole_before_stop": whole_before_stop(trace, steps),  # (what the event budget learns from)
        },
        "utilisation": utilisation(trace, steps),  # per-step busy / idle inside / idle between
        "servprof_overhead": overhead_summary(trace, steps, steps.dropped_after_stop),
        "missing": missing,
        "findings": {k: sum(1 for f in findings if f.kind == k) for k in KINDS},
        "decode_gap": gap_summary,
        "tokenization": token_summary,
        "bandwidth": bw_summary,
        "memory": memory_summary,
        "compile": compile_summary,
        "loop_stalls": stall_summary,
        "queue_wait": wait_summary,
        "after_last_step": after_summary,
        "shape_setup": setup_summary,
        "kv_cache": cache_summary,
        "requests_given": len(requests or []),
        "sampled_request_ids": sorted(sampled),
        # What the user must know to trust the figures (two files claiming one rank, a --device the
        # trace contradicts), and what the trace could not show.
        "warnings": [*rank_warnings(trace), *(w for part in parts for w in part.get("warnings", []))],
    }
    return Analysis(findings, summary, steps, gaps, kernels)


def sampled_request_ids(trace: Trace, requests: list[dict[str, Any]] | None) -> set[str]:
    """The requests the session sampled: the records given, else the trace's servprof metadata."""
    given = {str(r["request_id"]) for r in requests or [] if isinstance(r, dict) and r.get("request_id")}
    return given or set(trace.servprof_metadata().get("request_ids", []))


def rank_warnings(trace: Trace) -> list[str]:
    """Two files that claim the same distributedInfo.rank are not one run's ranks: say so."""
    claims = files_by_claimed_rank(trace.metadata)
    return [f"{len(files)} files claim rank {rank} ({', '.join(files)}): they were kept apart as separate ranks, not "
            "merged; if they come from different runs or sessions, analyse each file on its own"
            for rank, files in sorted(claims.items()) if len(files) > 1]


def _attribute_to_session(findings: list[Finding], requests: list[dict[str, Any]] | None, trace: Trace) -> None:
    """Traces without phase markers (e.g. vLLM's worker traces) name no request: a gap or a slow
    kernel then concerns the sampled requests in flight at that time (all of them when the records
    carry no times). A finding about the whole trace stays the session's, on no request."""
    sampled = [str(r["request_id"]) for r in requests or [] if isinstance(r, dict) and r.get("request_id")]
    if not sampled:
        return
    windows = {rid: (t.arrival_us, t.end_us) for rid, t in request_times(trace, requests).items()}
    for finding in findings:
        # Memory findings are about the process or the device, not about the requests sampled.
        if (finding.request_ids or finding.kind == "tokenization_stall" or finding.kind.startswith("memory_")
                or finding.evidence.get("scope") == WHOLE_TRACE):
            continue
        if finding.end_us <= finding.start_us:
            continue
        in_flight = [r for r in sampled if r not in windows
                     or (windows[r][0] < finding.end_us and windows[r][1] > finding.start_us)]
        if in_flight:
            finding.request_ids = in_flight
            finding.evidence["request_ids_from"] = "session records in flight at the time (the trace carries no phase markers)"
