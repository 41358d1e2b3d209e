"""Detectors: a Trace (plus the middleware's request records) in, Findings out."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from servprof.trace.model import Trace

if TYPE_CHECKING:
    from servprof.detect.finding import KINDS, Finding, severity_for

__all__ = ["Finding", "KINDS", "run_detectors", "severity_for"]


def __getattr__(name: str) -> Any:
    """Finding and friends, imported when first asked for (loading a trace in a fresh process
    imports this package for one detector: it need not pay for dataclasses)."""
    if name in ("Finding", "KINDS", "severity_for"):
        from servprof.detect import finding

        return getattr(finding, name)
    raise AttributeError(f"module 'servprof.detect' has no attribute {name!r}")


def run_detectors(trace: Trace, requests: list[dict[str, Any]] | None = None, device: str | None = None) -> list[Finding]:
    """Every detector over one trace, findings ordered by cost (largest first).

    ``requests`` are the middleware's request records as dicts (optional: they add
    request ids where the trace has no phase markers). ``device`` names a row of
    servprof.detect.devices (or "calibrated"); None picks one from the trace.
    """
    from servprof.detect.analysis import analyse

    return analyse(trace, requests, device).findings
