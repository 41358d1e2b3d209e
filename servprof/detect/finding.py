"""The one result type every detector returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Severity = Literal["info", "warning", "critical"]
KINDS = ("tokenization_stall", "decode_gap", "bandwidth_bound_decode", "loop_stall", "memory_growth",
         "memory_fragmentation", "memory_near_limit", "recompilation", "graph_break", "queue_wait", "after_last_step",
         "shape_setup", "decode_without_kv_cache")
SEVERITY_ORDER = {"info": 0, "warning": 1, "critical": 2}
# evidence["scope"] of a finding about the trace as a whole (no step, no request): it belongs to the
# session (its analysis span), not to each sampled request.
WHOLE_TRACE = "whole trace"
# A cost's severity from its share of the time judged (step time, or the trace's span); a cost
# under CRITICAL_MIN_MS in all is never critical, and under WARNING_MIN_MS only info, whatever its
# share: a share of almost nothing (a trace of a few µs of device work) is not worth fixing.
CRITICAL_SHARE, WARNING_SHARE = 0.2, 0.05
CRITICAL_MIN_MS, WARNING_MIN_MS = 1.0, 0.1


def severity_for_share(share: float, cost_ms: float) -> Severity:
    """Critical from a fifth of the time judged, warning from a twentieth, floored by the cost."""
    severity: Severity = "critical" if share >= CRITICAL_SHARE else "warning" if share >= WARNING_SHARE else "info"
    if severity == "critical" and cost_ms < CRITICAL_MIN_MS:
        severity = "warning"
    if cost_ms < WARNING_MIN_MS:
        severity = "info"
    return severity


@dataclass
class Finding:
    """A named cause of slowness, with what it cost and the evidence for it."""

    kind: str
    severity: Severity
    cost_ms: float
    start_us: float
    end_us: float
    title: str
    request_ids: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    # What to do about it: one or two concrete sentences. Every finding carries one.
    fix: str = ""
    # Of request_ids, those the session sampled (the analysis fills it in; a batch's phase markers
    # also name requests that were not sampled).
    sampled_request_ids: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "severity": self.severity,
            "cost_ms": round(float(self.cost_ms), 4),
            "start_us": float(self.start_us),
            "end_us": float(self.end_us),
            "request_ids": list(self.request_ids),
            "sampled_request_ids": list(self.sampled_request_ids),
            "title": self.title,
            "evidence": self.evidence,
            "fix": self.fix,
        }


def severity_for(cost_ms: float, warning_ms: float, critical_ms: float) -> Severity:
    if cost_ms >= critical_ms:
        return "critical"
    if cost_ms >= warning_ms:
        return "warning"
    return "info"
