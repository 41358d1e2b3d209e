"""servprof.budget: the event estimate a running session is stopped by, and what it learns."""

from __future__ import annotations

import pytest

from servprof import budget as budget_module
from servprof.budget import (
    BASE_STOP_US_PER_EVENT,
    CUDA_DEEP_EVENTS_FACTOR,
    LIGHT_CUDA_EVENTS_PER_MODULE_CALL,
    PER_STEP_FADE,
    PRIOR_EVENTS_PER_MODULE_CALL,
    SHAPES_COST_FACTOR,
    STEPLESS_GRACE_S,
    STOP_AT,
    EventBudget,
    LiveSignals,
)
from servprof.settings import Settings

SETTINGS = Settings(max_session_events=2000, assumed_events_per_s=100_000.0)


def test_the_first_session_counts_module_calls_and_running_steps() -> None:
    budget = EventBudget()
    live = LiveSignals(hooks_active=True, steps=2, open_steps=1, module_calls=40, discovering=True)
    # 40 calls in 2 steps, one more step running: 60 calls' worth of events.
    assert budget.estimate(0.5, 0, live, 100_000.0) == 60 * PRIOR_EVENTS_PER_MODULE_CALL
    # Time plays no part while the step signal is there: a tokenizer before the first step does
    # not end the session (unless no module call at all comes within the step-less grace).
    assert budget.estimate(5.0, 0, live, 100_000.0) == 60 * PRIOR_EVENTS_PER_MODULE_CALL
    assert budget.estimate(STEPLESS_GRACE_S * 0.9, 0, LiveSignals(hooks_active=True), 100_000.0) == 0.0
    assert budget.call_limit(SETTINGS, live) == int(2000 * STOP_AT / PRIOR_EVENTS_PER_MODULE_CALL)


def test_the_first_deep_session_on_cuda_counts_the_device_timeline_too(monkeypatch) -> None:
    # A deep CUDA trace holds each op's kernels, launches and flows besides the ops (~2.1x the op
    # events on the H100 fixtures): the prior counts them before a session has measured the model.
    # (No GPU here: CUDA's presence is all that is stood in for.)
    monkeypatch.setattr(budget_module, "_cuda_available", lambda: True)
    deep, light = EventBudget(), EventBudget(light=True)
    assert deep.prior_per_call == PRIOR_EVENTS_PER_MODULE_CALL * CUDA_DEEP_EVENTS_FACTOR
    assert light.prior_per_call == LIGHT_CUDA_EVENTS_PER_MODULE_CALL  # the device timeline alone: no op
    monkeypatch.setattr(budget_module, "_cuda_available", lambda: False)
    on_cpu = EventBudget()
    assert on_cpu.prior_per_call == PRIOR_EVENTS_PER_MODULE_CALL
    # The same budget stops a CUDA session after fewer module calls.
    assert deep.call_limit(SETTINGS, LiveSignals()) == int(deep.budget(SETTINGS) * STOP_AT / deep.prior_per_call)
    assert deep.call_limit(SETTINGS, LiveSignals()) < on_cpu.call_limit(SETTINGS, LiveSignals())


def test_a_server_without_modules_falls_back_to_time_after_a_grace() -> None:
    budget = EventBudget()
    nothing = LiveSignals(hooks_active=True)
    assert budget.estimate(STEPLESS_GRACE_S / 2, 0, nothing, 100_000.0) == 0.0
    assert budget.estimate(STEPLESS_GRACE_S, 0, nothing, 100_000.0) == 100_000.0 * STEPLESS_GRACE_S
    # Automatic phases off: time x the assumed rate from the start.
    assert budget.estimate(0.01, 0, LiveSignals(hooks_active=False), 100_000.0) == 1000.0


def test_events_per_step_bound_the_next_session_with_running_steps_counted() -> None:
    budget = EventBudget()
    budget.learn(1500.0, SETTINGS, busy_s=0.4, steps=5, chunks=0)
    assert budget.per_step == 300.0
    live = LiveSignals(hooks_active=True, steps=3, open_steps=2)
    assert budget.estimate(0.1, 0, live, 100_000.0) == 300.0 * 5
    assert budget.step_limit(SETTINGS, live) == int(2000 * STOP_AT / 300.0)
    # Long steps (20 ms against a ~5 ms stop): a running thread gets through a quarter of its next one.
    long_steps = LiveSignals(hooks_active=True, steps=3, open_steps=2, next_step_share=0.25)
    assert budget.estimate(0.1, 0, long_steps, 100_000.0) == 300.0 * 3.5
    # A load ten times higher: ten times the steps, ten times the estimate (time is not used).
    assert budget.estimate(0.1, 0, LiveSignals(hooks_active=True, steps=30, open_steps=20), 100_000.0) == 300.0 * 50


def test_module_calls_bound_a_budget_of_a_step_or_two_and_count_steps_begun_before_the_session() -> None:
    """The transformers test server on a loaded machine: ~455 ops a decode step, a budget its stop
    time shrank to 936, and three streams each in a step when the session began (no hook saw
    those start; their ops were recorded from there on). Counted in steps, a session held 1682
    events: the calls made, at the events per call a session measured, bound it inside a step."""
    budget = EventBudget()
    budget.learn(1519.0, SETTINGS, busy_s=0.1, steps=2.2, chunks=0, running_steps=1, calls=98)
    assert budget.per_call == pytest.approx(1519.0 / 98)
    assert budget.per_step == pytest.approx(1519.0 / 2.2)
    # Three streams' steps running when the session began: calls counted, no step yet.
    begun_before = LiveSignals(hooks_active=True, steps=0, module_calls=60, discovering=True, calls_per_step=32)
    assert budget.estimate(0.0, 0, begun_before, 0.0) == pytest.approx(60 * 1519.0 / 98)
    # One step started on top: the step counted whole, or the calls, whichever is more.
    one_step = LiveSignals(hooks_active=True, steps=1, open_steps=1, module_calls=70, calls_per_step=32)
    assert budget.estimate(0.0, 0, one_step, 0.0) == pytest.approx(max(1519.0 / 2.2 * 2, (70 + 70) * 1519.0 / 98))
    assert budget.call_limit(SETTINGS, one_step) == int(2000 * STOP_AT / (1519.0 / 98))
    # Without a measured figure per call: a step's events over its calls.
    derived = EventBudget()
    derived.learn(3000.0, SETTINGS, busy_s=0.1, steps=6, chunks=0)
    assert derived.per_call is None
    assert derived.call_limit(SETTINGS, one_step) == int(2000 * STOP_AT / (500.0 / 32))
    # Calls counted while nothing is recorded (a count that ended) teach nothing; few calls neither.
    budget.learn(5000.0, SETTINGS, busy_s=0.1, steps=5, chunks=0, calls=None)
    budget.learn(5000.0, SETTINGS, busy_s=0.1, steps=5, chunks=0, calls=5)
    budget.learn(5000.0, SETTINGS, busy_s=0.1, steps=1, chunks=0, calls=40)  # a tokenizer's session: no step
    assert budget.per_call == pytest.approx(1519.0 / 98)
    # And a session measuring fewer lowers the figure by PER_STEP_FADE at most.
    budget.learn(500.0, SETTINGS, busy_s=0.1, steps=5, chunks=0, calls=100)
    assert budget.per_call == pytest.approx(1519.0 / 98 * PER_STEP_FADE)


def test_a_session_too_small_to_tell_teaches_no_rate() -> None:
    budget = EventBudget()
    budget.learn(21.0, SETTINGS, busy_s=0.03, steps=0, chunks=1)  # the first session: 21 events
    # Not 700 events/s: the assumed rate only halves, so the next session opens at most twice as wide.
    assert budget.per_second == SETTINGS.assumed_events_per_s / 2
    assert budget.per_step is None and budget.per_chunk is None
    budget.learn(21.0, SETTINGS, busy_s=0.03, steps=0, chunks=1)
    assert budget.per_second == SETTINGS.assumed_events_per_s / 4


def test_rates_fade_by_half_at_most_per_session_and_events_per_step_by_a_fifth() -> None:
    budget = EventBudget()
    budget.learn(2000.0, SETTINGS, busy_s=0.1, steps=10, chunks=10)
    assert budget.per_step == 200.0 and budget.per_chunk == 200.0
    budget.learn(600.0, SETTINGS, busy_s=0.1, steps=10, chunks=10)  # a quiet session
    assert budget.per_chunk == 100.0
    # Events per step are the model's: a session measuring fewer lowers the figure by PER_STEP_FADE at most.
    assert budget.per_step == 200.0 * PER_STEP_FADE


def test_a_session_of_mostly_running_steps_teaches_no_events_per_step() -> None:
    """Four threads each in its first long step when the session ended: counted as two steps (half
    each), but how much of each was recorded is not known (the transformers test server: 776 events
    taught 388 per step against ~650, and the next session passed its budget 1.5x)."""
    budget = EventBudget()
    budget.learn(776.0, SETTINGS, busy_s=0.1, steps=4 - 4 / 2, chunks=0, running_steps=4)
    assert budget.per_step is None
    budget.learn(2941.0, SETTINGS, busy_s=0.1, steps=5 - 1 / 2, chunks=0, running_steps=1)  # four whole steps
    assert budget.per_step == pytest.approx(2941.0 / 4.5)


def test_dearer_events_shrink_the_budget_in_events() -> None:
    budget = EventBudget()
    assert budget.budget(SETTINGS) == 2000
    shapes = Settings(max_session_events=3000, record_shapes=True)
    assert budget.budget(shapes) == 3000 / SHAPES_COST_FACTOR  # assumed until a stop was timed
    assert budget.budget(Settings(max_session_events=3000, record_shapes=True, with_stack=True)) == \
        3000 / SHAPES_COST_FACTOR / 2
    # A timed stop(): 600 events in 18 ms is 30 µs per event, 5x the nominal 6 µs.
    budget.learn(600.0, shapes, busy_s=0.1, steps=3, chunks=0, stop_s=0.018)
    assert budget.budget(shapes) == 3000 / (30.0 / BASE_STOP_US_PER_EVENT)
    assert budget.status()["stop_us_per_event"] == {"shapes": 30.0}
    # Cheap events never raise the budget above the setting; one cheap stop only halves the cost.
    budget.learn(600.0, shapes, busy_s=0.1, steps=3, chunks=0, stop_s=0.0006)
    assert budget.budget(shapes) == 3000 / (15.0 / BASE_STOP_US_PER_EVENT)
    budget.learn(2000.0, SETTINGS, busy_s=0.1, steps=3, chunks=0, stop_s=0.004)
    assert budget.budget(SETTINGS) == 2000
    assert budget.status()["last_sessions"][-1] == {"events": 2000, "budget": 2000, "ratio": 1.0}


def test_steps_running_at_a_cut_count_for_what_they_got_through_and_at_most_half() -> None:
    """Real step hooks around a real model: a step that just started (the one whose start made the
    stop due) has next to nothing recorded, one running for a while at most half a step."""
    import threading
    import time

    import torch

    from servprof.auto.steps import StepHooks

    inside, leave = threading.Event(), threading.Event()

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.hold = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.hold:  # a step that runs until the test lets it go
                inside.set()
                leave.wait(30)
            return self.linear(x)

    hooks, model = StepHooks(), Model()
    hooks.start(list, None)
    try:
        for _ in range(3):  # whole steps: the typical step time is learned from them
            model(torch.ones(1, 4))
        assert hooks.steps == 3 and hooks.open_steps == 0 and hooks.running_done(time.perf_counter_ns()) == 0.0
        model.hold = True
        thread = threading.Thread(target=model, args=(torch.ones(1, 4),))
        thread.start()
        assert inside.wait(30) and hooks.open_steps == 1
        opened, step_ns = hooks.open_started_ns, int(hooks.step_s * 1e9)
        assert hooks.running_done(opened) == 0.0  # cut the moment it started: none of it recorded
        assert hooks.running_done(opened + step_ns // 4) == pytest.approx(0.25, abs=0.01)
        assert hooks.running_done(opened + step_ns * 10) == 0.5  # never more than half
        leave.set()
        thread.join(30)
        assert hooks.open_steps == 0 and hooks.open_started_ns == 0
    finally:
        leave.set()
        hooks.stop()
        hooks.remove()


def _ended(events: int, started: int, running: int, whole_in_trace: int | None,
           calls: int | None = None) -> tuple[object, dict]:
    """A finished session as learn_session reads it: the step hooks' counts at the stop, and the
    analysis' count of steps that ended before stop() was called."""
    from types import SimpleNamespace

    session = SimpleNamespace(
        instruments=SimpleNamespace(summary={"auto": {"steps": started, "running_at_stop": running},
                                             "module_calls_recorded": calls}),
        trace_raw_bytes=0, perf_end_ns=0, capture_end_ns=0, settings=SETTINGS, busy_ns=100_000_000,
        steps_captured=0)
    steps = {"count": whole_in_trace or 0, "whole_before_stop": whole_in_trace}
    return session, {"summary": {"event_count": events, "detect": {"steps": steps}}}


def test_steps_running_at_the_stop_that_ended_before_it_teach_events_per_step() -> None:
    """Two concurrent requests start their first steps at once: the estimate (two started, one more
    each while the stop lands) passes the budget, so the hooks ask for the stop with both running.
    Counted half each, one step's worth teaches nothing, and every later session stopped as early
    (speculative decoding behind a def endpoint: deep windows of two prefills, never a decode step).
    They ended before stop() was called, whole in the trace: they teach."""
    budget = EventBudget()
    budget.learn_session(*_ended(532, started=2, running=2, whole_in_trace=None))  # no trace count: as before
    assert budget.per_step is None
    budget.learn_session(*_ended(532, started=2, running=2, whole_in_trace=2))
    assert budget.per_step == pytest.approx(532 / 2)
    # Cut off in the trace (still running at stop()): half each, and no lesson from mostly-running steps.
    cut = EventBudget()
    cut.learn_session(*_ended(776, started=4, running=4, whole_in_trace=0))
    assert cut.per_step is None
    # One of three running ones ended in time: two whole steps and two halves.
    partly = EventBudget()
    partly.learn_session(*_ended(1200, started=4, running=3, whole_in_trace=2))
    assert partly.per_step == pytest.approx(1200 / 3)


def test_a_session_teaches_events_per_module_call_from_the_calls_counted_while_it_recorded() -> None:
    counted = EventBudget()
    counted.learn_session(*_ended(1200, started=4, running=1, whole_in_trace=3, calls=96))
    assert counted.per_call == pytest.approx(1200 / 96)
    ended_first = EventBudget()  # the discovery window closed before the session did: no lesson
    ended_first.learn_session(*_ended(1200, started=4, running=1, whole_in_trace=3, calls=None))
    assert ended_first.per_call is None and ended_first.per_step is not None
