"""Every finding says what to do about it (`fix`), on every vendored public trace and fixture.

Needs every detector's fixes: decode_gap and tokenization_stall get theirs on branch i19a, so this
test passes once that branch is merged (bandwidth_bound_decode's are here)."""

from __future__ import annotations

from _analyze_helpers import PUBLIC_TRACES, fixture

from servprof.detect.analysis import analyse
from servprof.trace import load_trace


def test_every_finding_has_a_fix():
    paths = sorted(PUBLIC_TRACES.glob("*.json.gz")) + sorted(fixture("clean").parent.glob("*.json.gz"))
    without = [(path.name, f.kind, f.title[:80]) for path in paths for f in analyse(load_trace(path)).findings
               if not f.fix.strip()]
    assert without == []
