"""Steps of one model call per request, each on its own thread (a thread pool running generate()):
a thread's gap between its steps while other threads ran theirs is named for them, from the step
ranges alone (so on a light trace too), and a gap's share is of its own thread's time, never over
100%. Synthetic CPU traces with known answers (tests/_kineto_builder.py); the real server case is
tests/test_concurrent_requests.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from _kineto_builder import KinetoTrace, covered_in, union

from servprof.detect.analysis import analyse
from servprof.trace import load_trace

STEP_US, EVERY_US, STEPS = 2000.0, 10_000.0, 5


def _threads(offsets: dict[int, float], tier: str) -> tuple[KinetoTrace, dict[int, list[tuple[float, float]]]]:
    """Per thread (tid -> offset): STEPS decode steps (a prefill first) of STEP_US, one every EVERY_US."""
    trace = KinetoTrace(metadata={"servprof": {"tier": tier, "request_ids": [f"r{t}" for t in offsets]}})
    steps: dict[int, list[tuple[float, float]]] = {}
    for tid, offset in offsets.items():
        for k in range(STEPS):
            start = offset + k * EVERY_US
            kind = "prefill" if k == 0 else "decode_step"
            trace.host(f"servprof:auto.{kind}|r{tid}", start, STEP_US, tid=tid, cat="user_annotation")
            steps.setdefault(tid, []).append((start, start + STEP_US))
    return trace, steps


@pytest.mark.parametrize("tier", ["light", "deep"])
def test_a_gap_filled_by_other_threads_steps_is_named_for_them(tmp_path: Path, tier: str) -> None:
    # Thread 1 steps every 10 ms; threads 2-4 step in between, so each of its gaps is mostly theirs.
    offsets = {1: 0.0, 2: 2500.0, 3: 5000.0, 4: 7500.0}
    trace, steps = _threads(offsets, tier)
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    gaps = [g for g in analysis.gaps if g.where == "between_steps"]
    assert len(gaps) == len(offsets) * (STEPS - 1)
    for gap in gaps:
        tid = gap.evidence["thread"]
        others = union([s for t, mine in steps.items() if t != tid for s in mine])
        expected = covered_in(others, gap.start_us, gap.end_us)
        assert gap.cause == "concurrent_steps"
        assert gap.evidence["other_steps"]["us"] == pytest.approx(expected, abs=0.2)
        threads = sum(1 for t, mine in steps.items() if t != tid and covered_in(union(mine), gap.start_us, gap.end_us) > 0)
        assert gap.evidence["other_steps"]["threads"] == threads
    (finding,) = [f for f in analysis.findings if f.kind == "decode_gap"]
    assert finding.evidence["cause"] == "concurrent_steps" and "batch" in finding.fix
    # Judged per thread: each thread's gaps against its own span (first step's start to last's end).
    spans = sum(mine[-1][1] - mine[0][0] for mine in steps.values())
    idle = sum(g.idle_us for g in gaps if g.step >= 0 and analysis.steps[g.step].kind == "decode")
    assert finding.evidence["share_of_step_time"] == pytest.approx(idle / spans, abs=1e-4)
    assert finding.evidence["share_of_step_time"] < 1.0


def test_a_gap_no_other_step_ran_in_is_not_blamed_on_them(tmp_path: Path) -> None:
    # Thread 2's steps all come after thread 1's last one: nothing of thread 1's gaps is theirs.
    trace, _steps = _threads({1: 0.0, 2: STEPS * EVERY_US + 1000.0}, "light")
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    causes = {g.cause for g in analysis.gaps}
    assert causes and "concurrent_steps" not in causes
    assert causes == {"needs_deep_window"}


@pytest.mark.parametrize("loop_tid", [1, 2, None])
def test_a_gap_between_steps_on_the_event_loop_is_the_loops_own_work(tmp_path: Path, loop_tid: int | None) -> None:
    """The model on the serving loop's thread (servprof's metadata names it): what that thread did
    unrecorded between two steps is the loop's other work, said so; with the loop on another
    thread (2) or not known, the gap stays 'recorded nothing'."""
    trace, _steps = _threads({1: 0.0}, "deep")
    trace.metadata["servprof"]["event_loop_tid"] = loop_tid
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    causes = {g.cause for g in analysis.gaps}
    if loop_tid != 1:
        assert causes == {"untraced_host_time"}
        return
    assert causes == {"event_loop_work"}
    (finding,) = [f for f in analysis.findings if f.kind == "decode_gap"]
    assert "event loop" in finding.title and finding.evidence["worst_gaps"][0]["event_loop_tid"] == loop_tid
    assert "off the event loop" in finding.fix
