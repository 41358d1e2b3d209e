"""What one session switches on around the profiler: automatic phases, the loop watchdog,
and the step hooks' call for a stop when the event budget is spent.

The capture thread calls ``start`` right after the profiler's start(), ``stop`` right
before its stop() (the watchdog's stalls and the serving side's ``missing`` go into the
trace's ``servprof`` metadata then), and ``remove`` right after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson

from servprof.auto import AutoInstrumentation
from servprof.auto.gc_ranges import GcRanges
from servprof.budget import CUT_AT, EventBudget, LiveSignals
from servprof.tiers import pause_collection
from servprof.watchdog import LoopWatchdog

AUTO_OFF = ("Automatic phases are off (SERVPROF_AUTO_INSTRUMENT=0): model steps and tokenization are found only "
            "where the server marks them with `servprof.phase(...)`; unset it to have servprof mark them.")
WATCHDOG_OFF = ("The event-loop watchdog is off (SERVPROF_LOOP_STALL_MS=0): a call that blocks the serving loop "
                "is not named; set it to e.g. 10.")
NO_LOOP = ("No sampled request ran on an asyncio event loop in this session, so loop stalls were not watched.")
FOREIGN_LOOP = ("The sampled requests ran on an event loop that is not asyncio's (its library: {}), and servprof's "
                "loop watchdog watches asyncio loops only: loop stalls were not watched (tokenization on the loop's thread is still "
                "timed). Serve with asyncio (uvicorn, or Hypercorn's asyncio worker) to have them watched.")


_UNSAFE = str.maketrans({"\\": "/", '"': "'", **{chr(c): " " for c in range(32)}})


def metadata_safe(value: Any) -> Any:
    """``value`` with no character JSON must escape: the profiler's add_metadata_json turns
    a backslash into '/', which breaks every escape (``\\"`` -> ``/"``) and the trace file."""
    if isinstance(value, str):
        return value.translate(_UNSAFE)
    if isinstance(value, dict):
        return {metadata_safe(k): metadata_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [metadata_safe(v) for v in value]
    return value


def trace_metadata_json(metadata: dict[str, Any]) -> str:
    """servprof's metadata as the profiler's add_metadata_json can carry it into a valid trace
    file (every string made safe: a recompile's guard text holds quotes and newlines)."""
    return orjson.dumps(metadata_safe(metadata)).decode()


class SessionInstruments:
    def __init__(self, settings: Any, auto: AutoInstrumentation, budget: EventBudget,
                 open_request_ids: Callable[[], list[str]], in_flight: Callable[[], int],
                 wake: Callable[[], None]):
        self.settings = settings
        self.auto = auto if settings.auto_instrument else None
        self.gc = GcRanges()  # the garbage collector's older collections, marked (with the automatic phases)
        self.budget = budget
        self._open_request_ids = open_request_ids
        self._wake = wake
        self._step_limit: int | None = None
        self._cut_limit: int | None = None
        self._asked_stop = False
        self.collection_cut = False  # collection switched off: budget (hooks at CUT_AT, or the stop) or drain
        self.steps_at_cut: float | None = None  # steps recorded before the cut (later ones are not)
        self.running_at_cut = 0  # of which still running then (counted for what they had done)
        self.calls_at_cut: int | None = None  # module calls counted then (None: the count had ended)
        self.cut_wall_ns: int | None = None  # when collection went off (the trace shows nothing of the app after)
        self.cut_perf_ns: int | None = None
        self.watchdog = LoopWatchdog(settings.loop_stall_ms, in_flight, open_request_ids)
        self.summary: dict[str, Any] = {}
        self._calls_cut: int | None = None

    # --- capture thread ---------------------------------------------------------------------------

    def start(self) -> None:
        if self.auto is None:
            return
        self.gc.start()
        try:
            live = self.auto.live()  # (calls per step: from an earlier session's discovery)
            self._calls_cut = self.budget.call_limit(self.settings, live, CUT_AT)
            self.auto.start(self._open_request_ids, self._on_step, self._on_calls,
                            self.budget.call_limit(self.settings, live))
        except Exception as exc:  # noqa: BLE001 - a hook that cannot go in must not fail the session
            self.auto.remove()
            self.auto.problem = f"automatic phases could not be installed: {type(exc).__name__}: {exc}"
            self.auto.hooks_active = False

    def attach_loop(self) -> None:
        """On the serving loop (the first sampled request's join)."""
        self.watchdog.attach()

    def request_joined(self, request_id: str) -> None:
        """A sampled request arrived (serving loop)."""
        if self.auto is not None and self.auto.hooks_active:
            self.auto.steps.request_joined(request_id)

    def live(self) -> LiveSignals:
        return self.auto.live() if self.auto is not None else LiveSignals()

    def stop(self, budget_spent: bool = False, drain: bool = False) -> dict[str, Any]:
        """Before the profiler's stop(): what goes into the trace's servprof metadata. A session
        ended by its event budget and already past it stops collecting first: at a high event
        rate even the milliseconds until stop() add steps' worth of events. So does a deep session
        (``drain``), whose ops in flight must end before the stop (tiers.drain_ops): CPU ops only,
        the device's still recorded. (Only then: torch logs a warning line for every such cut.)"""
        self.gc.stop_opening()  # (a collection's range open now is waited for before the stop: drain_ops)
        if drain or (budget_spent and self.auto is not None and
                     self.budget.estimate(0.0, 0, self.auto.live(), 0.0) >= self.budget.budget(self.settings)):
            self._cut(device=not drain)
        stalls = self.watchdog.stop()
        # The module calls the recorded events came from: those counted until the cut, or until now.
        calls = self.calls_at_cut if self.collection_cut else \
            self.auto.steps.counted_calls() if self.auto is not None else None
        if self.auto is not None:
            self.auto.stop()
        missing = []
        if self.auto is None:
            missing.append({"what": "automatic phases", "message": AUTO_OFF})
        else:
            missing.extend(self.auto.missing(budget_spent))
        if self.watchdog.threshold_ns <= 0:
            missing.append({"what": "event-loop stalls", "message": WATCHDOG_OFF})
        elif self.watchdog.foreign_loop is not None:
            missing.append({"what": "event-loop stalls", "message": FOREIGN_LOOP.format(self.watchdog.foreign_loop)})
        elif self.watchdog.loop is None:
            missing.append({"what": "event-loop stalls", "message": NO_LOOP})
        self.summary = metadata_safe({
            "event_budget": round(self.budget.budget(self.settings)),
            "collection_cut": self.collection_cut,
            "steps_at_cut": self.steps_at_cut,
            "running_at_cut": self.running_at_cut,
            "module_calls_recorded": calls,
            "cut_wall_ns": self.cut_wall_ns,
            "auto": self.auto.summary() if self.auto is not None else {"enabled": False},
            "watchdog": self.watchdog.summary(),
            "gc_collections": self.gc.collections,
            "missing": missing,
        })
        return {**self.summary, "loop_stalls": metadata_safe(stalls)}

    def remove(self) -> None:
        """After the profiler's stop() (also on a failed session)."""
        self.watchdog.stop()
        self.gc.remove()
        if self.auto is not None:
            self.auto.remove()

    # --- the step hooks (serving threads) ---------------------------------------------------------

    def _on_calls(self, calls: int) -> bool:
        """Module calls (counted in the session's discovery window), running steps counted whole,
        passed the stop share of the budget; False once there is nothing more to do."""
        if not self._asked_stop:
            self._asked_stop = True
            self._wake()
        if self._calls_cut is not None and calls > self._calls_cut:
            self._cut()  # the calls made so far already hold the cut share of the budget
        return not self.collection_cut

    def _on_step(self, steps: int) -> None:
        if self.collection_cut or self.auto is None:
            return
        if self._step_limit is None:
            live = self.auto.live()
            self._step_limit = self.budget.step_limit(self.settings, live)
            self._cut_limit = self.budget.step_limit(self.settings, live, CUT_AT)
            if self._step_limit is None:
                return
        hooks = self.auto.steps
        if steps + hooks.open_steps * hooks.next_step_share >= self._step_limit and not self._asked_stop:
            self._asked_stop = True
            self._wake()  # the capture thread checks the budget now, not at its next poll
        # Steps started so far hold at most steps x per-step events: the one starting now would
        # pass the cut share, so nothing from here on is recorded.
        if self._cut_limit is not None and steps > self._cut_limit:
            self._cut()

    def _cut(self, device: bool = True) -> None:
        # Stop collecting now: the hooks (the capture thread has not stopped the profiler in time),
        # or the capture thread before its stop (budget spent, a deep session's drain).
        if not self.collection_cut:
            self.gc.stop_opening()
            self.collection_cut = pause_collection(device)
            if self.collection_cut:
                self.cut_perf_ns, self.cut_wall_ns = time.perf_counter_ns(), time.time_ns()
            if self.collection_cut and self.auto is not None and self.auto.running:
                # Recorded: whole steps, and of those still running what they got through (one
                # starting now: none).
                hooks = self.auto.steps
                self.running_at_cut = hooks.open_steps
                self.steps_at_cut = max(0.0, hooks.steps - hooks.open_steps + hooks.running_done(self.cut_perf_ns))
                self.calls_at_cut = hooks.counted_calls()
            self._wake()
