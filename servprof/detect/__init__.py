"""Detectors: a Trace (plus the middleware's request records) in, Findings out."""

from __future__ import annotations

from typing import Any

from servprof.detect.finding import KINDS, Finding, severity_for
from servprof.trace.model import Trace

__all__ = ["Finding", "KINDS", "run_detectors", "severity_for"]


def run_detectors(trace: Trace, requests: list[dict[str, Any]] | None = None, device: str | None = None) -> list[Finding]:
    """Every detector over one trace, findings ordered by cost (largest first).

    ``requests`` are the middleware's request records as dicts (optional: they add
    request ids where the trace has no phase markers). ``device`` names a row of
    servprof.detect.devices (or "calibrated"); None picks one from the trace.
    """
    from servprof.detect.analysis import analyse

    return analyse(trace, requests, device).findings
