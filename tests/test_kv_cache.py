"""detect/kv_cache.py on steps whose times are known: the cost is the median slope of step time
against sequence length (one stalled step does not move it), never more than the steps' time, and
nothing is claimed for a slope at or under zero or for too few steps. The recorded loops are in
tests/test_hand_written_loops.py."""

from __future__ import annotations

import pytest

from servprof.detect.kv_cache import KIND, detect_no_kv_cache
from servprof.detect.step_forms import Step


def steps(times_by_length: list[tuple[int, float]]) -> list[Step]:
    out, start = [], 0.0
    for tokens, time_us in times_by_length:
        step = Step(0, 0, 1, start, start + time_us, "decode", "embedding", "aten::embedding", batch=1)
        step.recomputes_prefix, step.tokens = True, tokens
        out.append(step)
        start += time_us + 10.0
    return out


def test_the_cost_is_the_measured_growth_and_a_stall_does_not_move_it() -> None:
    run = [(n, 100.0 + 5.0 * n) for n in range(10, 51)]
    run[20] = (run[20][0], 20_000.0)  # a step that also slept
    (finding,), summary = detect_no_kv_cache(steps(run))
    assert finding.kind == KIND and summary["us_per_earlier_token"] == pytest.approx(5.0)
    assert finding.cost_ms == pytest.approx(sum(5.0 * (n - 1) for n, _t in run) / 1e3)
    assert finding.cost_ms * 1e3 <= sum(t for _n, t in run)
    assert "41 decode steps" in finding.title and "(10 to 50 tokens)" in finding.title


def test_no_growth_costs_nothing_now_and_few_steps_say_nothing() -> None:
    (finding,), _summary = detect_no_kv_cache(steps([(n, 300.0 - n) for n in range(10, 20)]))
    assert finding.cost_ms == 0 and finding.severity == "info" and "will as sequences grow" in finding.title
    assert detect_no_kv_cache(steps([(10, 100.0), (11, 105.0)]))[0] == []
    # A step's recomputation is at most its time.
    (finding,), _summary = detect_no_kv_cache(steps([(1000, 10.0), (1001, 20.0), (1002, 30.0)]))
    assert finding.cost_ms * 1e3 <= 60.0
