"""One pass of every detector over a trace: findings plus the summary the reports show."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from servprof.detect.bandwidth_bound_decode import detect_bandwidth_bound
from servprof.detect.decode_gap import detect_decode_gaps, find_gaps
from servprof.detect.finding import Finding
from servprof.detect.loop_stall import detect_loop_stalls
from servprof.detect.steps import Step, find_steps
from servprof.detect.tokenization_stall import detect_tokenization_stalls
from servprof.trace.loader import paused_gc
from servprof.trace.model import Trace


@dataclass
class Analysis:
    findings: list[Finding]
    summary: dict[str, Any]
    steps: list[Step] = field(default_factory=list)
    gaps: list[Any] = field(default_factory=list)
    kernels: list[dict[str, Any]] = field(default_factory=list)  # roofline points


def analyse(trace: Trace, requests: list[dict[str, Any]] | None = None, device: str | None = None) -> Analysis:
    with paused_gc():  # the trace's args are a large object graph the collector would rescan
        return _analyse(trace, requests, device)


def _analyse(trace: Trace, requests: list[dict[str, Any]] | None, device: str | None) -> Analysis:
    steps = find_steps(trace)
    gaps, gap_stats = find_gaps(trace, steps)
    gap_findings, gap_summary = detect_decode_gaps(trace, steps, (gaps, gap_stats))
    token_findings, token_summary = detect_tokenization_stalls(trace, steps, gaps)
    bw_findings, bw_summary, kernels = detect_bandwidth_bound(trace, steps, device)
    stall_findings, stall_summary = detect_loop_stalls(trace, token_findings)
    findings = sorted([*gap_findings, *token_findings, *bw_findings, *stall_findings], key=lambda f: f.cost_ms,
                      reverse=True)
    _attribute_to_session(findings, requests)
    summary = {
        "source": trace.source,
        "events": len(trace),
        "ranks": trace.ranks,
        "device_events": bool(trace.has_device_events()),
        "steps": {
            "count": len(steps),
            "by_kind": {k: sum(1 for s in steps if s.kind == k) for k in sorted({s.kind for s in steps})},
            "source": sorted({s.source for s in steps}),
        },
        "findings": {k: sum(1 for f in findings if f.kind == k) for k in
                     ("tokenization_stall", "decode_gap", "bandwidth_bound_decode", "loop_stall")},
        "decode_gap": gap_summary,
        "tokenization": token_summary,
        "bandwidth": bw_summary,
        "loop_stalls": stall_summary,
        "requests_given": len(requests or []),
    }
    return Analysis(findings, summary, steps, gaps, kernels)


def _attribute_to_session(findings: list[Finding], requests: list[dict[str, Any]] | None) -> None:
    """Traces without phase markers (e.g. vLLM's worker traces) name no request: a gap or a
    slow kernel in the session's window then concerns the requests the session sampled."""
    sampled = [str(r["request_id"]) for r in requests or [] if isinstance(r, dict) and r.get("request_id")]
    if not sampled:
        return
    for finding in findings:
        if not finding.request_ids and finding.kind != "tokenization_stall":
            finding.request_ids = sampled[:100]
            finding.evidence["request_ids_from"] = "session records (the trace carries no phase markers)"
