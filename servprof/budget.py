"""The event budget: how many events a session has captured, estimated while it runs.

A session's event count cannot be read while the profiler runs, and ``stop()``/export
hold the GIL a few µs per event, so the count is estimated from live signals and the
session stopped before it passes the budget:

* **model steps** counted by the automatic step hooks (servprof.auto.steps), times the
  events per step measured from earlier sessions' stored traces. Before a session has
  measured it, a prior from the module calls seen in the first steps:
  ``PRIOR_EVENTS_PER_MODULE_CALL`` per nested module call (transformers' Llama makes ~18-21
  events per module call, a hand-written model ~11), ``CUDA_DEEP_EVENTS_FACTOR`` times that
  where CUDA is there (the device timeline comes on top of the ops). While those first steps
  run, the module-call estimate below counts them at that prior.
  Steps scale with load (more threads or more requests step more), so a load that jumps
  mid-session moves the estimate with it; events per step do not depend on batch size.
* **module calls**, counted while the first steps of every session are watched (the
  discovery window), times the events per module call a session measured (or events per step
  over calls per step, or the prior). A step's events are counted when it starts, but a small
  budget holds only a step or two (a tiny model's ~450 ops a step against a budget a loaded
  machine shrank to ~900), and steps that began before the session (one per stream in flight:
  no hook saw them start) are recorded from their middle on: only module calls count those,
  and let the hooks cut collection inside a step.
* **streamed chunks** of the sampled requests (the old decode-step estimate) times the
  events per chunk a reliable session measured.
* **busy time** x an event rate, only where no step signal exists (automatic phases off,
  a torch.compile'd model, or no module call at all after ``STEPLESS_GRACE_S`` of busy
  time). The rate starts at ``Settings.assumed_events_per_s`` and is never lowered by more
  than half per session, so a session too small to tell (the first one of a quiet server)
  cannot talk the next one into a long capture.

A rate per second or per chunk is learned only from a session that captured
``MIN_LEARN_EVENTS`` (or a quarter of a smaller budget); events per step from any session
with ``MIN_LEARN_STEPS`` steps (a step running at its end counted for what it got through, at
most half: StepHooks.running_done), unless those running steps are more than its whole ones;
events per module call from such a session that counted ``MIN_LEARN_CALLS`` calls while it recorded;
and a figure learned is never lowered by more than ``PER_STEP_FADE`` per session. Events per
step are the model's, they do not change with load: a figure too low lets the next session pass
its budget by as much (the step hooks' cut at ``CUT_AT`` counts steps at that figure too).

A light session (servprof.tiers) records no op: on the CPU its events are the ranges of
servprof's phases, about ``LIGHT_EVENTS_PER_STEP`` per model step before a session has measured
them, and module calls cost nothing; on CUDA the device timeline (kernels, copies, their runtime
launches) comes on top, ``LIGHT_CUDA_EVENTS_PER_MODULE_CALL`` per module call until measured.
Where no step can be counted its rate starts at ``assumed_events_per_s / LIGHT_RATE_DIVISOR`` on
the CPU. Each tier learns its own figures (a light trace teaches nothing about a deep one). A
light session's ``stop()`` costs less per range than a deep one's per op: once measured, the
light budget holds more events for the same stop time (up to ``1 / LIGHT_MIN_COST_FACTOR`` x),
where a deep budget only ever shrinks from its nominal count.

What bounds the loop's stall is ``stop()``'s time, not the event count: ``max_session_events``
is a count of events at ``BASE_STOP_US_PER_EVENT`` each (what the default of 2000 was measured
at: ~12 ms). Sessions measure what ``stop()`` really took per event, per capture mode, and the
budget in events shrinks by that ratio when events cost more: ``record_shapes`` made them 1.5-7x
dearer on the two unmarked test servers (5x is assumed until measured), a busy machine too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PRIOR_EVENTS_PER_MODULE_CALL = 24.0
MIN_LEARN_EVENTS = 500
RELIABLE_SHARE = 0.25  # of the budget: a session with fewer events than this and MIN_LEARN_EVENTS teaches no rate
MIN_LEARN_STEPS = 1.5  # events per step are a property of the model: a step or two tell them
PER_STEP_FADE = 0.8  # the most a session lowers the events-per-step figure: 1.2 x 1/0.8 = 1.5x the budget at worst
STEPLESS_GRACE_S = 0.25
MIN_LEARN_CALLS = 20
STOP_AT = 0.9  # the share of the budget at which the step hooks ask for the stop
# ... and at which they switch the profiler's collection off themselves, when the capture thread
# has not stopped it yet (on a busy machine it may wait tens of ms for a CPU): a hard bound.
CUT_AT = 1.2
STOP_LATENCY_S = 0.005  # how long a stop asked for by the hooks takes to land (a GIL switch interval)
BASE_STOP_US_PER_EVENT = 6.0  # stop() per event on the demo at the default budget (2000 events: ~12 ms)
SHAPES_COST_FACTOR = 5.0  # assumed until measured: record_shapes made stop()+export 1.5-7x dearer per event
STACK_COST_FACTOR = 2.0  # with_stack adds a Python event per call
MIN_COST_EVENTS = 300  # smaller sessions are dominated by stop()'s fixed costs
# Light sessions, until measured. A step on the CPU is one automatic step range per model call
# plus the phases the server marks (the demo: ~3 per step); set high so a first session errs short.
LIGHT_EVENTS_PER_STEP = 8.0
# A module call's kernels, their launches, copies and the flows between launch and kernel: 22.7 per
# call on the demo's 1B model (866 kernels in 163 module calls per decode step, ~4 events each) and
# ~26 on its tiny one (sampling kernels outside any module included), H100 traces (tests/fixtures).
LIGHT_CUDA_EVENTS_PER_MODULE_CALL = 24.0
# A deep trace on CUDA holds, besides every op, its kernels, their runtime launches and the flow
# between them: 2.03-2.18x the op events on the demo engine's H100 traces (tests/fixtures/cuda_*,
# tests/fixtures/gpu_decode). Until a session has measured the model, the prior counts them too.
CUDA_DEEP_EVENTS_FACTOR = 2.2
LIGHT_RATE_DIVISOR = 20.0
# A light range measured cheaper to stop than the nominal event lets the budget hold up to 1/this
# more (at most 3x: export, not timed in the budget, costs ~3 µs per range on top).
LIGHT_MIN_COST_FACTOR = 1 / 3
RAW_BYTES_PER_EVENT = 260  # chrome-trace JSON per CPU event, used when the analysis gave no count


@dataclass
class LiveSignals:
    """What the automatic instrumentation counted in the running session."""

    hooks_active: bool = False  # step hooks installed (auto on, torch present, no compiled model)
    steps: int = 0
    open_steps: int = 0  # steps running now: each thread in one may start another before a stop lands
    next_step_share: float = 1.0  # ... as much of one as it gets through in STOP_LATENCY_S
    module_calls: int = 0
    discovering: bool = False
    calls_per_step: float | None = None


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - no torch: no device timeline
        return False


def _mode(settings: Any) -> tuple[bool, bool]:
    return bool(getattr(settings, "record_shapes", False)), bool(getattr(settings, "with_stack", False))


def cost_factor(settings: Any) -> float:
    """How much dearer an event is than the budget's nominal one, before any was measured."""
    factor = 1.0
    if getattr(settings, "record_shapes", False):
        factor *= SHAPES_COST_FACTOR
    if getattr(settings, "with_stack", False):
        factor *= STACK_COST_FACTOR
    return factor


class EventBudget:
    def __init__(self, light: bool = False) -> None:
        self.light = light
        # Recorded per module call: every op under it (deep), its device work (light on CUDA), or
        # nothing (light on the CPU: only the step's own range, counted per step).
        cuda = _cuda_available()
        self.prior_per_call = PRIOR_EVENTS_PER_MODULE_CALL * (CUDA_DEEP_EVENTS_FACTOR if cuda else 1.0)
        self.prior_per_step: float | None = None
        if light:
            self.prior_per_call = LIGHT_CUDA_EVENTS_PER_MODULE_CALL if cuda else 0.0
            self.prior_per_step = None if cuda else LIGHT_EVENTS_PER_STEP
        self.per_step: float | None = None  # events per model step (step hooks)
        self.per_call: float | None = None  # events per module call counted (steps begun before the session too)
        self.per_chunk: float | None = None  # events per streamed chunk of the busiest sampled request
        self.per_second: float | None = None  # events per busy second
        self.stop_us: dict[tuple[bool, bool], float] = {}  # stop() µs per event, per (shapes, stack)
        self.history: list[dict[str, Any]] = []  # last sessions: events / budget (status)

    def _mode(self, settings: Any) -> tuple[bool, bool]:
        return (False, False) if self.light else _mode(settings)  # a light session records no shape or stack

    def budget(self, settings: Any) -> float:
        measured = self.stop_us.get(self._mode(settings))
        if self.light:
            # The budget is a stop() time: a light session's ranges cost less each than ops
            # (bench/bench_light_sessions.py: ~2 µs), so once measured it holds more of them.
            factor = max(LIGHT_MIN_COST_FACTOR, measured / BASE_STOP_US_PER_EVENT) if measured else 1.0
        else:
            factor = max(1.0, measured / BASE_STOP_US_PER_EVENT) if measured else cost_factor(settings)
        return settings.max_session_events / factor

    def assumed_per_s(self, settings: Any) -> float:
        """The event rate assumed where no step is counted and none was measured."""
        rate = float(getattr(settings, "assumed_events_per_s", 0.0))
        return rate / LIGHT_RATE_DIVISOR if self.light and not self.prior_per_call else rate

    def _per_step(self, live: LiveSignals) -> float | None:
        if self.per_step:
            return self.per_step
        if self.prior_per_step:
            return self.prior_per_step
        if live.calls_per_step and self.prior_per_call:
            return live.calls_per_step * self.prior_per_call
        return None

    def step_limit(self, settings: Any, live: LiveSignals, share: float = STOP_AT) -> int | None:
        """Steps (started, plus those running now) after which the hooks ask for the stop, or
        (``share=CUT_AT``) cut collection (None while unknown)."""
        per_step = self._per_step(live)
        if not per_step:
            return None
        return max(1, int(self.budget(settings) * share / per_step))

    def _per_call(self, live: LiveSignals) -> float | None:
        """Events per module call: measured, else a measured step's over its calls, else the prior
        (none for a light session on the CPU: its module calls record nothing)."""
        if not self.prior_per_call:
            return None
        if self.per_call:
            return self.per_call
        if self.per_step and live.calls_per_step:
            return self.per_step / live.calls_per_step
        return self.prior_per_call

    def call_limit(self, settings: Any, live: LiveSignals, share: float = STOP_AT) -> int | None:
        """Module calls (counted while the step hooks discover the model) after which the
        hooks ask for the stop (or cut collection)."""
        per_call = self._per_call(live)
        if not per_call:
            return None
        return max(1, int(self.budget(settings) * share / per_call))

    @staticmethod
    def steps_ahead(live: LiveSignals) -> float:
        """Steps counted against the budget: those started, plus one more for every thread in
        a step now (it can start its next one while the stop waits for the GIL)."""
        return live.steps + live.open_steps * live.next_step_share

    def estimate(self, busy_s: float, chunks: int, live: LiveSignals, assumed_per_s: float) -> float:
        terms = [0.0]
        per_step = self._per_step(live)
        if live.hooks_active:
            if per_step:
                terms.append(per_step * self.steps_ahead(live))
            per_call = self._per_call(live)
            if per_call:  # module calls counted live, and the steps running now counted as whole
                # ones (at the calls per step seen so far)
                per_step_calls = live.module_calls / max(1, live.steps)
                terms.append((live.module_calls + live.open_steps * live.next_step_share * per_step_calls) * per_call)
        if self.per_chunk:
            terms.append(self.per_chunk * chunks)
        stepless = not live.hooks_active or (live.steps == 0 and live.module_calls == 0 and busy_s >= STEPLESS_GRACE_S)
        if stepless:
            terms.append((self.per_second or assumed_per_s) * busy_s)
        return max(terms)

    def learn_session(self, session: Any, result: dict[str, Any]) -> None:
        """Learn from a finished session (servprof.session.Session) and its analysis result."""
        count = (result.get("summary") or {}).get("event_count")
        if not isinstance(count, (int, float)) or count <= 0:
            count = session.trace_raw_bytes / RAW_BYTES_PER_EVENT
        summary = session.instruments.summary if session.instruments is not None else {}
        auto = summary.get("auto") or {}
        # A step still running at the stop left only part of its events: half a step each; after
        # a cut (collection switched off by the step hooks) steps went on uncounted in the trace.
        running = auto.get("running_at_stop") or 0
        model_steps = (auto.get("steps") or 0) - running / 2
        calls = summary.get("module_calls_recorded")
        if summary.get("steps_at_cut") is not None:
            model_steps, running = summary["steps_at_cut"], summary.get("running_at_cut") or 0
        else:
            # Steps running when the hooks asked for the stop often end before stop() is called
            # (a few ms later): the trace holds them whole. Counted so, they teach; counted half,
            # a session whose every step was running then (concurrent requests all starting
            # theirs at once) never would, and every later one would stop as early again.
            detected = ((result.get("summary") or {}).get("detect") or {}).get("steps")
            whole = detected.get("whole_before_stop") if isinstance(detected, dict) else None
            complete = model_steps - running / 2  # ended before the hooks asked for the stop
            if isinstance(whole, int) and whole > complete:
                finished = min(running, whole - complete)
                running -= finished
                model_steps = complete + finished + running / 2
        # Busy capture time only (stop() holds the GIL, so next to nothing is captured during it);
        # chunks at the stop, not now: the sampled streams went on after it.
        stop_s = (session.perf_end_ns - session.capture_end_ns) / 1e9 \
            if session.perf_end_ns and session.capture_end_ns else None
        self.learn(count, session.settings, session.busy_ns / 1e9, model_steps, session.steps_captured, stop_s,
                   running, calls if isinstance(calls, (int, float)) else None)

    def learn(self, events: float, settings: Any, busy_s: float, steps: float, chunks: int,
              stop_s: float | None = None, running_steps: float = 0.0, calls: float | None = None) -> None:
        """``steps``: whole steps, plus what the ``running_steps`` still running at the end had done
        (at most half of each). ``calls``: the module calls counted while the events were recorded
        (None when the count ended before them: the discovery window closed)."""
        budget = self.budget(settings)
        self.history = [*self.history[-9:], {"events": round(events), "budget": round(budget),
                                              "ratio": round(events / budget, 3) if budget else None}]
        if events <= 0:
            return
        if stop_s is not None and stop_s > 0 and events >= MIN_COST_EVENTS:
            mode = self._mode(settings)
            old = self.stop_us.get(mode)
            # As the rates: one cheap stop does not halve the cost the next session is planned with.
            self.stop_us[mode] = max(stop_s * 1e6 / events, (old or 0.0) / 2)
        reliable = events >= min(MIN_LEARN_EVENTS, RELIABLE_SHARE * budget)
        if busy_s > 0:
            # Never below half the last rate: a quiet or tiny session cannot open the next one wide.
            self.per_second = max(events / busy_s, (self.per_second or self.assumed_per_s(settings)) / 2)
        # Each running step counted at most half: at least as many whole steps as running ones.
        if steps >= MIN_LEARN_STEPS and events >= 100 and steps >= 1.5 * running_steps:
            self.per_step = max(events / steps, (self.per_step or 0.0) * PER_STEP_FADE)
        # (From sessions that ran steps: a quiet one's calls may be a tokenizer's handful beside other work.)
        if calls is not None and calls >= MIN_LEARN_CALLS and steps >= MIN_LEARN_STEPS and events >= 100 \
                and self.prior_per_call:
            self.per_call = max(events / calls, (self.per_call or 0.0) * PER_STEP_FADE)
        if not reliable:
            return
        if chunks >= 2:
            self.per_chunk = max(events / chunks, (self.per_chunk or 0.0) / 2)

    def status(self) -> dict[str, Any]:
        return {"events_per_step": self.per_step, "events_per_module_call": self.per_call,
                "events_per_chunk": self.per_chunk,
                "events_per_second": self.per_second,
                "stop_us_per_event": {("shapes" if s else "plain") + ("+stack" if k else ""): round(v, 2)
                                      for (s, k), v in self.stop_us.items()},
                "last_sessions": list(self.history)}
