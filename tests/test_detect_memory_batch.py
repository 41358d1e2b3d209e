"""Allocator events' enclosing ops found for all of a trace's memory series at once
(memory_attribution.enclosing_ops_by_series) are each series' own answer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from servprof.detect.memory_attribution import enclosing_ops, enclosing_ops_by_series
from servprof.detect.memory_series import memory_series
from servprof.trace import load_trace

FIXTURES = Path(__file__).parent / "fixtures"
TRACES = sorted((FIXTURES / "public").glob("*.json.gz")) + sorted(FIXTURES.glob("*.json.gz"))


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name)
def test_batched_enclosing_ops_match_each_series(path: Path) -> None:
    trace = load_trace(path)
    series = memory_series(trace)
    for one, found in zip(series, enclosing_ops_by_series(trace, series), strict=True):
        if one.rows is None or one.delta is None:
            assert found is None
        else:
            assert np.array_equal(found, enclosing_ops(trace, one.rows))
