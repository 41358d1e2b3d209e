"""nesting.parents' two searches (a table of maxima, pointer jumping) give the parent the
definition names, the last earlier event not ended by an event's start, on random nestings
with ties, zero lengths, NaNs and infinities, and on public traces' threads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from servprof.detect import nesting
from servprof.detect.host_stacks import HostStacks
from servprof.detect.nesting import parents, start_order
from servprof.trace import load_trace

PUBLIC = Path(__file__).parent / "fixtures" / "public"


def _by_definition(start: np.ndarray, end: np.ndarray, closed: bool) -> list[int]:
    out = []
    for k in range(start.size):
        j = k - 1
        # (ended: end <= start, < when closed; a comparison with a NaN is false: never ended)
        while j >= 0 and (end[j] < start[k] if closed else end[j] <= start[k]):
            j -= 1
        out.append(j)
    return out


def _random_thread(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    start = np.sort(rng.integers(0, 40, size)).astype(float)
    end = start + rng.integers(0, 25, size)
    odd = rng.random(size)
    end[odd < 0.05] = np.nan
    end[(odd >= 0.05) & (odd < 0.08)] = -np.inf
    end[(odd >= 0.08) & (odd < 0.1)] = np.inf
    start[rng.random(size) < 0.03] = np.nan
    return start, end


@pytest.mark.parametrize("closed", [False, True])
def test_both_searches_find_the_defined_parent(closed: bool) -> None:
    rng = np.random.default_rng(7)
    for size in [0, 1, 2, 3, *rng.integers(4, 300, 400).tolist()]:
        start, end = _random_thread(rng, size)
        want = _by_definition(start, end, closed)
        assert nesting._parents_by_table(start, end, closed).tolist() == want
        assert nesting._parents_by_jumping(start, end, closed).tolist() == want


@pytest.mark.parametrize("name", ["sglang_qwen3_8b_decode_bs32_mi300x", "resnet_ddp_training_v100"])
def test_both_searches_agree_on_public_threads(name: str) -> None:
    trace = load_trace(PUBLIC / f"{name}.json.gz")
    for rows in HostStacks(trace, trace.ranks[0])._rows.values():
        rows = rows[start_order(trace.ts[rows], trace.dur[rows])]
        start, end = trace.ts[rows], trace.ts[rows] + trace.dur[rows]
        table = nesting._parents_by_table(start, end, False)
        assert table.tolist() == nesting._parents_by_jumping(start, end, False).tolist()
        assert table.dtype == nesting.INDEX


def test_large_threads_take_the_jumping_search(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    start, end = _random_thread(rng, 200)
    monkeypatch.setattr(nesting, "TABLE_EVENTS", 100)
    calls: list[str] = []
    monkeypatch.setattr(nesting, "_parents_by_table", lambda *a: calls.append("table"))
    parents(start, end)
    assert calls == []
    monkeypatch.setattr(nesting, "TABLE_EVENTS", 200)
    parents(start, end)
    assert calls == ["table"]
