"""The detectors' faster helpers give exactly what the code they replaced gave."""

from __future__ import annotations

import random
import subprocess
import sys
from array import array
from pathlib import Path

import numpy as np
import pytest

from servprof.detect.bandwidth_points import percentile
from servprof.detect.memory_attribution import NO_OP, _top_labelled
from servprof.trace import load_trace
from servprof.trace.model import distinct, distinct_first_inverse, median
from servprof.trace.phases import _phase_events, phase_events

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("values", [
    np.zeros(0, dtype=np.int32), np.array([3], dtype=np.int32), np.array([2, -1, 2, 7, -1, 0], dtype=np.int64),
    np.array([1.5, -0.0, 0.0, 1.5, -3.25]), np.repeat(np.arange(5, dtype=np.int32), 3)[::-1],
])
def test_distinct_is_np_unique(values: np.ndarray) -> None:
    got = distinct(values)
    assert got.dtype == np.unique(values).dtype
    assert got.tolist() == np.unique(values).tolist()


@pytest.mark.parametrize("values", [
    np.zeros(0, dtype=np.int64), np.array([3], dtype=np.int32), np.array([2, -1, 2, 7, -1, 0, 2], dtype=np.int64),
    np.repeat(np.arange(5, dtype=np.int64), 3)[::-1], np.random.default_rng(11).integers(-4, 4, 500),
])
def test_distinct_first_inverse_is_np_unique(values: np.ndarray) -> None:
    got = distinct_first_inverse(values)
    want = np.unique(values, return_index=True, return_inverse=True)
    for mine, numpy_s in zip(got, want, strict=True):
        assert mine.tolist() == numpy_s.ravel().tolist()


def test_distinct_random() -> None:
    rng = np.random.default_rng(7)
    for size in (1, 2, 50, 1000):
        values = rng.integers(-5, 5, size)
        assert distinct(values).tolist() == np.unique(values).tolist()


def test_median_is_numpys() -> None:
    rng = np.random.default_rng(11)
    for size in (1, 2, 3, 50, 1001):
        values = rng.normal(size=size) * 1000
        assert median(values) == float(np.median(values))
        assert median(values.tolist()) == float(np.median(values))


def test_analysis_does_not_import_numpy_ma() -> None:
    """np.unique imports numpy.ma (~5 ms of a fresh process): the trace model's ranks, the step
    search and the bandwidth and memory detectors must not need it."""
    code = ("import sys; from servprof.trace import load_trace; from servprof.detect.steps import find_steps; "
            "from servprof.detect.bandwidth_bound_decode import detect_bandwidth_bound; "
            "from servprof.detect.memory import detect_memory; "
            f"t = load_trace({str(FIXTURES / 'public' / 'hf_qwen1.5_0.5b_prefill_h100.json.gz')!r}); "
            "s = find_steps(t); detect_bandwidth_bound(t, s, None); detect_memory(t, s); t.ranks; "
            "print('numpy.ma' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _top_by_object_unique(keys: list[str], sizes: np.ndarray) -> list[tuple[str, float]]:
    """memory_attribution._top as it was: np.unique over an object array of the keys."""
    if not keys:
        return []
    names, first, which = np.unique(np.array(keys, dtype=object), return_index=True, return_inverse=True)
    totals = np.bincount(which, weights=sizes, minlength=len(names))
    return [(str(names[i]), float(totals[i])) for i in np.lexsort((first, -totals))[:5]]


def test_top_as_before() -> None:
    rand = random.Random(3)
    for size in (0, 1, 4, 40, 400):
        keys = [rand.choice(["b", "a", "c", "zz", "(no op)", "é"]) for _ in range(size)]
        # Ties on purpose: integral sizes from a small set.
        sizes = np.array([float(rand.choice([1, 2, 3, 1e9, 0.1])) for _ in range(size)])
        # (_top, which took the keys themselves, is now _top_labelled of their positions: the
        # per-request tally calls it so.)
        assert _top_labelled(np.arange(size), sizes, keys.__getitem__) == _top_by_object_unique(keys, sizes)


def test_top_labelled_as_top_of_labels() -> None:
    rand = random.Random(5)
    # Ids 1 and 4 share a text (two interned strings of one text); -1: no op.
    texts = {0: "aten::mm", 1: "aten::add", 2: "aten::mul", 3: "aten::empty", 4: "aten::add"}

    def label(i: int) -> str:
        return texts[i] if i >= 0 else NO_OP

    for size in (0, 1, 5, 60, 600):
        ids = np.array([rand.choice([-1, 0, 1, 2, 3, 4]) for _ in range(size)], dtype=np.int64)
        sizes = np.array([float(rand.choice([1, 2, 5, 3e8])) for _ in range(size)])
        want = _top_by_object_unique([label(i) for i in ids.tolist()], sizes)
        assert _top_labelled(ids, sizes, label) == want


def test_phase_events_found_once_each_list_its_own() -> None:
    trace = load_trace(FIXTURES / "demo_slow_tokenizer.json.gz")
    first = phase_events(trace)
    assert first and first == _phase_events(trace)
    first.clear()  # a caller changing its list changes no other caller's
    assert phase_events(trace) == _phase_events(trace)


def test_percentile_is_numpys() -> None:
    rng = np.random.default_rng(11)
    for n in (1, 2, 3, 19, 20, 21, 37, 100, 101, 999, 4000):
        for values in (rng.random(n) * 100, rng.integers(0, 4, n).astype(float), np.round(rng.lognormal(2, 2, n), 3)):
            for q in (0, 5, 50, 95, 100, 33.3):
                assert percentile(values, q) == float(np.percentile(values, q)), (n, q)
    assert percentile(array("d", [3.0, 1.0, 2.0] * 10), 5) == float(np.percentile([3.0, 1.0, 2.0] * 10, 5))
