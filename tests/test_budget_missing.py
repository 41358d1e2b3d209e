"""A session its event budget ended after a step or two says so, and why, instead of letting the
report read as if the gaps between steps had been judged. On a GPU the CUDA activity of every
request (kernels, their launches and links) is what fills it: the H100 runs of the test servers
(bench/gpu/wild_checks.sh) stopped light sessions of a 16-layer model after one step.
Synthetic traces (tests/_kineto_builder.py), the real analysis."""

from __future__ import annotations

from pathlib import Path

import pytest
from _kineto_builder import KinetoTrace, eager_step

from servprof.detect.analysis import analyse
from servprof.trace import load_trace

ENTRY = "model steps (event budget)"


def session_trace(tmp_path: Path, steps: int, stop_reason: str, budget: int, kernels: int = 40) -> tuple[Path, int]:
    """``steps`` light-session steps, each launching ``kernels`` kernels; returns the file and the
    number of CUDA events in it (every kernel and its launch)."""
    trace = KinetoTrace(metadata={"servprof": {"tier": "light", "stop_reason": stop_reason, "event_budget": budget}})
    start = 1000.0
    for i in range(steps):
        kind = "prefill" if i == 0 else "decode_step"
        end = eager_step(trace, start, kernels, annotation=f"servprof:{kind}|r1")
        start = end + 500.0
    return trace.write(tmp_path / "t.json"), 2 * len(trace.kernels)


def entry(path: Path) -> dict[str, str] | None:
    return next((m for m in analyse(load_trace(path)).summary["missing"] if m["what"] == ENTRY), None)


def test_a_session_cut_by_its_budget_after_one_step_says_so_and_what_filled_it(tmp_path: Path):
    path, cuda = session_trace(tmp_path, 1, "max_session_events", budget=100)
    found = entry(path)
    assert found is not None
    message = found["message"]
    assert "after 1 model step(s)" in message and "a budget of 100" in message
    assert f"{cuda} of those events are CUDA activity (40 kernels and copies" in message
    assert "Raise SERVPROF_MAX_SESSION_EVENTS" in message


def test_a_session_cut_well_short_of_its_budget_blames_the_estimate_not_the_budget(tmp_path: Path):
    path, _ = session_trace(tmp_path, 2, "max_session_events", budget=2000)
    message = entry(path)["message"]
    assert "the live estimate ran high" in message and "Raise SERVPROF_MAX_SESSION_EVENTS" not in message


@pytest.mark.parametrize(("steps", "stop_reason"), [(5, "max_session_events"), (1, "requests_done"), (2, "max_session_s")])
def test_enough_steps_or_another_end_needs_no_entry(tmp_path: Path, steps: int, stop_reason: str):
    path, _ = session_trace(tmp_path, steps, stop_reason, budget=100)
    assert entry(path) is None


def test_a_trace_not_from_a_servprof_session_has_none(tmp_path: Path):
    trace = KinetoTrace()
    eager_step(trace, 1000.0, 40, annotation="servprof:prefill|r1")
    assert entry(trace.write(tmp_path / "t.json")) is None
