"""What a handler's thread did in a window outside the model, read from a real torch.profiler trace
of real threads: computing (named), waiting (its Python recorded, the waits named), started after
the profiler (no frames of its own where others have them), and a trace without Python frames.
These are the four answers queue_wait and after_last_step give about a request's own thread."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from servprof.detect.thread_work import COMPUTING, NOT_RECORDED, STARTED_LATE, WAITED, ThreadWork, thread_work
from servprof.trace import load_trace

WINDOW_S = 0.06


def _compute() -> None:
    x, until = torch.ones(64), time.perf_counter() + WINDOW_S
    while time.perf_counter() < until:
        sum(i * i for i in range(300))
        x = x + 1


def _trace(tmp_path: Path, with_stack: bool) -> tuple[Path, dict[str, int], dict[str, tuple[float, float]]]:
    """Three threads over one window each: one alive at the start computes, one alive at the start
    waits on an event (three times as long: most of its wait, no other thread computes), one
    started during the capture computes."""
    go, release, spans, tids = threading.Event(), threading.Event(), {}, {}

    def run(name: str, body: object) -> None:
        tids[name] = threading.get_native_id()
        go.wait()
        start = time.time_ns() / 1e3
        body()  # type: ignore[operator]
        spans[name] = (start, time.time_ns() / 1e3)

    early = [threading.Thread(target=run, args=("computing", _compute)),
             threading.Thread(target=run, args=("waiting", lambda: release.wait(3 * WINDOW_S)))]
    for thread in early:
        thread.start()
    with profile(activities=[ProfilerActivity.CPU]):
        pass  # (Kineto's first start, out of the capture)
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], with_stack=with_stack, experimental_config=config) as prof:
        late = threading.Thread(target=run, args=("late", _compute))
        late.start()
        go.set()
        for thread in (*early, late):
            thread.join()
    path = tmp_path / f"threads_{with_stack}.json"
    prof.export_chrome_trace(str(path))
    return path, tids, spans


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, tuple]:
    folder = tmp_path_factory.mktemp("thread_work")
    return {stack: _trace(folder, stack) for stack in (True, False)}


def _work(traces: dict[bool, tuple], with_stack: bool, *names: str, over: str | None = None):
    """thread_work of the named threads, each over its own span (``over``: that thread's span)."""
    path, tids, spans = traces[with_stack]
    trace = load_trace(path)
    # Window times are wall-clock µs; the trace's are the profiler's: shift by the trace's own offset.
    shift = float(trace.ts.min()) - min(a for a, _b in spans.values())
    windows = [(int(trace.rank.min()), tids[name], spans[over or name][0] + shift + 2e3,
                spans[over or name][1] + shift - 2e3) for name in names]
    return thread_work(trace, windows, np.zeros(0), np.zeros(0))


def test_a_computing_thread_is_named_and_a_waiting_one_says_it_waited(traces: dict[bool, tuple]) -> None:
    computing = _work(traces, True, "computing")
    assert computing.seen == COMPUTING, computing
    assert computing.busy_ms <= computing.window_ms and any("_compute" in f["name"] for f in computing.top_frames)
    assert "computing outside the model" in computing.title_part() and computing.unseen_text("X") == ""
    waiting = _work(traces, True, "waiting")
    assert waiting.seen == WAITED, waiting
    assert any("acquire" in f["name"] and f["class"] == "wait" for f in waiting.waits), waiting.waits  # Event.wait
    assert waiting.title_part() == "" and "they waited" in waiting.unseen_text("X")
    assert "top_frames" not in waiting.evidence() and waiting.evidence()["wait_frames"]
    assert "computing_elsewhere" not in waiting.evidence()  # (the computing thread ran a third of it)


def test_where_a_thread_waited_the_thread_that_computed_meanwhile_is_named(traces: dict[bool, tuple]) -> None:
    """The waiting thread over the time the computing thread ran (an executor thread idle while the
    event loop runs the handler's code)."""
    _path, tids, _spans = traces[True]
    waiting = _work(traces, True, "waiting", over="computing")
    assert waiting.seen == WAITED, waiting
    (other,) = [t for t in waiting.elsewhere if t["thread"] == tids["computing"]]
    assert other["busy_ms"] <= other["window_ms"] and any("_compute" in f["name"] for f in other["top_frames"])
    assert waiting.elsewhere[0] is other
    assert f"not their threads but thread {tids['computing']}" in waiting.title_part()
    assert "_compute" in waiting.title_part() and "event loop" in waiting.unseen_text("X")
    assert waiting.evidence()["computing_elsewhere"][0]["thread"] == tids["computing"]


def test_a_thread_started_after_the_profiler_is_named_so_not_read_as_waiting(traces: dict[bool, tuple]) -> None:
    late = _work(traces, True, "late")
    assert late.seen == STARTED_LATE and late.late_threads == 1, late
    text = late.unseen_text("X")
    assert "began later" in text and "SERVPROF_WITH_STACK" not in text
    # The thread that computed meanwhile is named, without saying the late one did not (it may have).
    _path, tids, _spans = traces[True]
    assert late.elsewhere[0]["thread"] == tids["computing"]
    assert "Meanwhile thread" in text and "not their threads" not in late.title_part()
    # Beside a thread with frames, the late one is left out of the figures, and counted.
    both = _work(traces, True, "computing", "late")
    assert both.seen == COMPUTING and both.late_threads == 1
    assert both.window_ms == pytest.approx(_work(traces, True, "computing").window_ms)
    assert both.evidence()["threads_started_after_the_profiler"] == 1


def test_without_python_frames_the_callers_advice_is_given(traces: dict[bool, tuple]) -> None:
    work = _work(traces, False, "waiting")
    assert work.seen == NOT_RECORDED, work
    assert work.unseen_text("take a deep window") == "take a deep window"
    assert work.evidence() == {"seen": NOT_RECORDED}


def test_without_python_frames_the_ops_recorded_are_kept_and_named_as_part(traces: dict[bool, tuple]) -> None:
    """The computing thread traced without stacks: its ops (``x + 1``) cover a small part of the
    window (the rest is Python, unrecorded); that measure is kept, named as ops, and the rest is said
    to be unknown, not called computing."""
    for name in ("computing", "late"):  # (without stacks, a thread started late has its ops recorded)
        _ops_kept(_work(traces, False, name))


def _ops_kept(work: ThreadWork) -> None:
    assert work.seen == NOT_RECORDED and work.ops_only, work
    evidence = work.evidence()
    assert 0 < evidence["busy_ms"] < 0.5 * evidence["window_ms"], evidence
    assert "aten::add" in [f["name"] for f in evidence["top_frames"]] and evidence["self_ms"]["op"] > 0
    assert "ran ops outside the model" in work.title_part() and evidence["top_frames"][0]["name"] in work.title_part()
    text = work.unseen_text(" take a deep window")
    assert "ops were recorded" in text and text.endswith(" take a deep window")
