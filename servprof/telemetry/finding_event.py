"""A finding as the attributes of a `servprof.finding` span event.

`servprof.finding.evidence` is the evidence as JSON, at most MAX_EVIDENCE_CHARS characters (or
OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT, where the SDK is told to cut event attributes shorter).
Evidence that does not fit is summarised until it does -- long lists keep their first items
and say how many there were, long strings are shortened, deep objects and then the largest
fields are dropped (named in `_dropped`) -- so the value is always whole, parseable JSON,
never text cut mid-string. `servprof.finding.evidence_truncated` says when that happened.
"""

from __future__ import annotations

from typing import Any

import orjson
from opentelemetry.sdk.trace import SpanLimits

MAX_EVIDENCE_CHARS = 1024
FINDING_EVENT = "servprof.finding"


def evidence_limit() -> int:
    """The cap on the evidence JSON: 1,024 characters, lower when the SDK cuts attribute values shorter."""
    sdk = SpanLimits().max_attribute_length  # OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT (None: no limit)
    return min(MAX_EVIDENCE_CHARS, sdk) if isinstance(sdk, int) and sdk >= 0 else MAX_EVIDENCE_CHARS


def _dumps(value: Any) -> str:
    return orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS).decode()


def _shrunk(value: Any, items: int, chars: int, depth: int) -> Any:
    """``value`` with lists cut to ``items`` (plus a count), strings to ``chars``, objects below ``depth``
    replaced by a note of their size."""
    if isinstance(value, str):
        return value if len(value) <= chars else value[: max(chars - 1, 0)] + "…"
    if isinstance(value, dict):
        if depth <= 0:
            return f"<object of {len(value)} fields>"
        return {str(k): _shrunk(v, items, chars, depth - 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        if depth <= 0:
            return f"<list of {len(value)}>"
        kept = [_shrunk(v, items, chars, depth - 1) for v in list(value)[:items]]
        return kept + [f"... {len(value) - items} more"] if len(value) > items else kept
    return value


def fit_evidence(evidence: Any, limit: int) -> tuple[str | None, bool]:
    """(JSON of at most ``limit`` characters, whether it was summarised); None when not even ``{}`` fits."""
    text = _dumps(evidence)
    if len(text) <= limit:
        return text, False
    for items, chars, depth in ((10, 200, 6), (5, 120, 4), (3, 60, 3), (2, 40, 2), (1, 24, 2), (0, 16, 1)):
        text = _dumps(_shrunk(evidence, items, chars, depth))
        if len(text) <= limit:
            return text, True
    if isinstance(evidence, dict):  # drop the largest fields until the rest fits
        kept = {str(k): _shrunk(v, 0, 16, 1) for k, v in evidence.items()}
        dropped: list[str] = []
        while kept:
            largest = max(kept, key=lambda k: len(_dumps(kept[k])))
            del kept[largest]
            dropped.append(largest)
            text = _dumps({**kept, "_dropped": dropped})
            if len(text) <= limit:
                return text, True
    for fallback in ('{"_dropped":"all: over the size limit"}', "{}"):
        if len(fallback) <= limit:
            return fallback, True
    return None, True


def finding_event_attributes(finding: dict[str, Any], limit: int = MAX_EVIDENCE_CHARS) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "servprof.finding.kind": str(finding.get("kind", "unknown")),
        "servprof.finding.severity": str(finding.get("severity", "info")),
        "servprof.finding.cost_ms": _float(finding.get("cost_ms")),
    }
    for key in ("title", "fix"):
        if finding.get(key):
            attributes[f"servprof.finding.{key}"] = str(finding[key])
    sampled = finding.get("sampled_request_ids")
    if isinstance(sampled, list) and sampled:
        attributes["servprof.finding.sampled_requests"] = len(sampled)
    if finding.get("evidence"):
        text, summarised = fit_evidence(finding["evidence"], limit)
        if text is not None:
            attributes["servprof.finding.evidence"] = text
        if summarised:
            attributes["servprof.finding.evidence_truncated"] = True
    return attributes


def _float(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0
