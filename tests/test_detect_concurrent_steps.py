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


def _pool(threads: int, calls: int, step_us: float = 3000.0, every_us: float = 12_000.0) -> KinetoTrace:
    """A pool's threads, each running one call of unknown kind (a user's record_function range around
    a whole request's model call, with an op inside) every ``every_us``, the threads staggered by a
    third of a step: the calls overlap. No servprof metadata, no request records: a user's trace."""
    trace = KinetoTrace()
    for tid in range(1, threads + 1):
        for k in range(calls):
            start = (tid - 1) * step_us / 3 + k * every_us
            trace.annotation("Worker::run_task", start, step_us, tid=tid)
            trace.host("aten::linear", start + 10.0, step_us - 20.0, tid=tid)
    return trace


def test_the_time_between_a_pools_calls_of_unknown_kind_is_not_judged(tmp_path: Path) -> None:
    """Steps of unknown kind on several threads at once (a thread pool, each step maybe a whole
    request's call: an MTIA inference server's trace in HTA's tests): the time between two on one
    thread is as likely its wait for work as the loop's own, so it is not a decode gap, and the
    report says why. One thread running the same calls in a loop keeps its gaps judged."""
    analysis = analyse(load_trace(_pool(threads=4, calls=6).write(tmp_path / "pool.json")))
    assert all(s.kind == "step" for s in analysis.steps) and len(analysis.steps) == 24
    assert not [g for g in analysis.gaps if g.where == "between_steps"]
    assert not [f for f in analysis.findings if f.kind == "decode_gap"]
    assert analysis.summary["decode_gap"]["unknown_steps_in_parallel"] == 24
    (entry,) = [m for m in analysis.summary["missing"] if "at once" in m["message"]]
    assert entry["what"] == "step kinds" and "24 step(s) of unknown kind ran on 4 threads at once" in entry["message"]
    alone = analyse(load_trace(_pool(threads=1, calls=6).write(tmp_path / "alone.json")))
    assert len([g for g in alone.gaps if g.where == "between_steps"]) == 5
    assert alone.summary["decode_gap"]["unknown_steps_in_parallel"] == 0
    assert not [m for m in alone.summary["missing"] if "at once" in m["message"]]


def test_threads_handing_work_on_are_not_a_pool(tmp_path: Path) -> None:
    """Two threads whose calls follow one another (one hands the work to the next, a few µs of
    clock skew over) are one loop's, not a pool's: the gaps stay judged."""
    trace = KinetoTrace()
    for k in range(6):
        start = k * 12_000.0
        tid = 1 + k % 2
        trace.annotation("Worker::run_task", start, 3005.0, tid=tid)  # 5 µs past the next one's start
        trace.host("aten::linear", start + 10.0, 2980.0, tid=tid)
        trace.annotation("Worker::run_task", start + 3000.0, 3000.0, tid=3 - tid)
        trace.host("aten::linear", start + 3010.0, 2980.0, tid=3 - tid)
    analysis = analyse(load_trace(trace.write(tmp_path / "handoff.json")))
    assert analysis.summary["decode_gap"]["unknown_steps_in_parallel"] == 0
    assert [g for g in analysis.gaps if g.where == "between_steps"]
