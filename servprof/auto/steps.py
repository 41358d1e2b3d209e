"""Model steps from the outermost ``torch.nn.Module`` forward on each thread.

While a session runs, one range ``servprof:auto.prefill|ids`` or ``servprof:auto.decode_step|ids``
covers each outermost forward of a model (a module that has child modules and parameters:
a lone ``lm_head`` or a parameter-free sampler called from a loop is not a step).

Cost matters: any *global* module hook sends every module call in the process down
``Module._call_impl``'s slow path (+3-5 µs per call measured here; a 32-layer model makes
~400 calls per step). So global hooks run only while the model is being discovered: the
first few steps of a session (which also count module calls per step for the event budget),
and again from each sampled request's arrival until a step serves it, so that a second model
(another endpoint's: embeddings beside chat, speech beside text) is found in a session the
first model's requests began; never for more than MAX_DISCOVERY_STEPS steps a session. Outside
those windows only the modules found carry hooks (per-module pre-hook with kwargs,
always-called post-hook) and nested modules go back to the fast path. Known outermost
modules are remembered across sessions (weakly). Nothing is registered between sessions.
What kind of step each is: step_kind.py.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules import module as torch_module

from servprof.auto.compiled import compiled_model_present
from servprof.auto.context import marked_step, request_id_here
from servprof.auto.emit import auto_phase_name, close_range, open_range
from servprof.auto.step_kind import (
    extends_sequence,
    forward_called_directly,
    frame_kwargs,
    inside_module_call,
    looks_like_model,
    sequence_length,
)
from servprof.budget import STOP_LATENCY_S

_compiling = torch.compiler.is_compiling
_UNSEEN: Any = object()
_UNRECORDED = object()  # a step counted but not recorded: the server's own marker covers it
DISCOVERY_STEPS = 4  # completed outermost forwards watched with global hooks per session
# ... and at most this many, however many sampled requests arrive still waiting for a step.
MAX_DISCOVERY_STEPS = 16


class _ThreadState(threading.local):
    generation = -1
    window = -1  # the discovery window depth and pending belong to
    depth = 0  # module calls open on this thread (global hooks only)
    handle: Any = None  # the open step range
    owner: Any = None  # the module whose post-hook closes it
    pending: Any = None  # outermost module whose own kwargs hook will open the range
    last_seq = -1  # sequence length of this thread's previous step
    opened_ns = 0


class StepHooks:
    """Counters are read by the capture thread (event budget) and by status."""

    def __init__(self) -> None:
        self._state = _ThreadState()
        self._generation = 0
        self._window = 0  # discovery windows opened (a thread's depth counts within one)
        self.active = False
        self.discovering = False
        self._counting = False  # module calls counted: the session's first discovery window only
        self._awaiting: set[str] = set()  # sampled requests that arrived and have had no step yet
        self._global_handles: list[Any] = []
        self._module_handles: list[Any] = []
        self._hooked: set[int] = set()
        self._unhookable: set[int] = set()  # models found that take no hooks of their own (this session)
        # id -> (weakref, is a model): modules seen as outermost, kept across sessions.
        self._known: dict[int, tuple[weakref.ref[Any], bool]] = {}
        self._lock = threading.Lock()  # module hooks are added on serving threads, removed on capture
        self._session_ids: Callable[[], list[str]] = list
        self._on_step: Callable[[int], None] | None = None
        # Told of every module call (while discovering) once calls, with the steps running now
        # counted whole, reach call_limit; returns False when it wants to hear no more.
        self._on_calls: Callable[[int], bool] | None = None
        self.call_limit = 1 << 62
        self.steps = self.prefill_steps = self.decode_steps = 0
        self.open_steps = 0  # threads inside a step now
        self.open_started_ns = 0  # the sum of their steps' start times (perf_counter_ns)
        # The share of a step a running thread gets through while a stop is on its way
        # (STOP_LATENCY_S / the typical step): threads in short steps start their next one.
        self.next_step_share = 1.0
        self.step_s: float | None = None  # typical step time (moving average, kept across sessions)
        self.module_calls = 0  # counted while discovering only
        self.discovery_steps = 0
        self.calls_per_step: float | None = None  # nested module calls per step, from discovery
        self.models: set[str] = set()  # class names of the modules marked as steps
        self.unhookable_models: set[str] = set()  # ... of those marked by the global hooks (no hooks of their own)
        self.failure: str | None = None  # a hook's error that ended marking steps this session
        # model class -> where its forward was called directly (no hooks run): its parts are not steps
        self.direct_forwards: dict[str, str] = {}

    # --- lifecycle (capture thread) ---------------------------------------------------------------

    def start(self, session_request_ids: Callable[[], list[str]], on_step: Callable[[int], None] | None,
              on_calls: Callable[[int], bool] | None = None, call_limit: int | None = None) -> None:
        self._generation += 1
        self._session_ids = session_request_ids
        self._on_step = on_step
        self._on_calls = on_calls
        self.call_limit = call_limit if call_limit is not None else 1 << 62
        self.clear()
        self.active = True
        with self._lock:
            known = [(ref(), is_model) for ref, is_model in self._known.values()]
        for module, is_model in known:
            if module is not None and is_model:
                self._hook_module(module)
        self._counting = True
        self._begin_discovery()

    def clear(self) -> None:
        """This session's counts from zero (also for a session that registers no hook)."""
        self.steps = self.prefill_steps = self.decode_steps = self.module_calls = self.discovery_steps = 0
        self.open_steps = self.open_started_ns = 0
        self._awaiting = set()
        self.models = set()
        self.unhookable_models = set()
        self.failure = None
        self.direct_forwards = {}
        self._direct_parts: dict[int, tuple[str, str] | None] = {}  # module id -> forward_called_directly()
        self.threads_without_request: set[int] = set()  # threads whose steps named the session's requests

    def stop(self) -> None:
        """No new step opens; ranges still open close when their forward returns."""
        self.active = False
        self._end_discovery()

    def remove(self) -> None:
        """Take every hook away (after the profiler stopped)."""
        self.active = False
        self._end_discovery(keep_for_unhookable=False)
        with self._lock:
            handles, self._module_handles = self._module_handles, []
            self._hooked = set()
            self._unhookable = set()
        for handle in handles:
            handle.remove()

    # --- discovery windows ------------------------------------------------------------------------

    def request_joined(self, request_id: str) -> None:
        """A sampled request arrived (serving loop): global hooks watch again until a step serves
        it, in case it runs a model no step of this session has shown yet."""
        if not self.active:
            return
        self._awaiting.add(request_id)
        # Not once the process has compiled a model: dynamo guards on the number of global hooks,
        # so each time they come or go, a frame compiled with the other number is compiled again.
        if not self.discovering and self.discovery_steps < MAX_DISCOVERY_STEPS and not compiled_model_present():
            self._begin_discovery()

    def _begin_discovery(self) -> None:
        with self._lock:
            if self.discovering or not self.active:
                return
            self._window += 1  # threads' depths restart: calls open now began unwatched
            self.discovering = True
            if not self._global_handles:  # (still on between windows for a model without hooks)
                self._global_handles = [
                    torch_module.register_module_forward_pre_hook(self._global_pre),
                    torch_module.register_module_forward_hook(self._global_post, always_call=True),
                ]

    def _discovered(self) -> bool:
        """Enough steps watched: the first few, and for every sampled request in flight that
        arrived during the session, a step of a model found before it (or the most a session watches)."""
        if self.discovery_steps >= MAX_DISCOVERY_STEPS:
            return True
        if self.discovery_steps < DISCOVERY_STEPS:
            return False
        if self._awaiting:
            self._awaiting &= set(self._session_ids())  # those that ended without a step wait no more
        return not self._awaiting

    def _end_discovery(self, keep_for_unhookable: bool = True) -> None:
        with self._lock:
            self.discovering = False
            self._counting = False
            if self._unhookable and keep_for_unhookable:  # they open and close its steps: on until remove()
                self._window += 1
                return
            handles, self._global_handles = self._global_handles, []
        for handle in handles:
            handle.remove()

    def counted_calls(self) -> int | None:
        """The module calls counted this session, while they still are (None once the count ended)."""
        return self.module_calls if self._counting and self.active else None

    def running_done(self, now_ns: int) -> float:
        """How many steps' worth the steps running now have got through, at the typical step time,
        never more than half of each: a step that just started (the one whose start made a stop
        due, most often) has next to nothing in the trace, and counting a running step as more
        done than it is would teach too few events per step."""
        running = self.open_steps
        if running <= 0:
            return 0.0
        if not self.step_s:
            return running / 2
        elapsed_s = (running * now_ns - self.open_started_ns) / 1e9
        return min(running / 2, max(0.0, elapsed_s / self.step_s))

    # --- hooks (serving threads) ------------------------------------------------------------------

    def _thread_state(self) -> _ThreadState:
        state = self._state
        if state.generation != self._generation:  # first call of this thread in this session
            state.generation = self._generation
            state.handle = state.owner = None
            state.last_seq = -1
        if state.window != self._window:  # first call of this thread in this discovery window
            state.window = self._window
            state.depth = 0
            state.pending = None
        return state

    # Every hook runs inside the server's model call: one that raises stops marking steps for the
    # session (_fail) and lets the call go on, as if servprof were not there. While torch.compile
    # traces a model (a first call, a new shape) the hooks it meets are traced too: each returns
    # at once there (dynamo reads _compiling() as True), so that no graph holds servprof's code
    # and no guard reads its counters (a guard on them recompiled every step; with
    # fullgraph=True, tracing them failed the call).

    def _global_pre(self, module: Any, args: tuple[Any, ...]) -> None:
        if _compiling():
            return
        try:
            if not self.discovering:  # kept on only for models that take no hooks of their own
                if id(module) in self._unhookable and self.active:  # (every other module call: one set lookup)
                    state = self._thread_state()
                    if state.handle is None:
                        self._open(state, module, args, frame_kwargs())
                return
            state = self._thread_state()
            if self._counting:
                calls = self.module_calls = self.module_calls + 1
                # Steps running now will make their remaining calls before a stop lands: count them whole.
                if calls + self.open_steps * self.next_step_share * (calls // (self.steps or 1)) >= self.call_limit \
                        and self._on_calls is not None \
                        and not self._on_calls(calls):
                    self.call_limit = 1 << 62
            state.depth += 1
            if state.depth != 1 or state.handle is not None or not self.active:
                return
            key = id(module)
            if key in self._hooked:
                state.pending = module  # its own hook sees the kwargs and opens the range
                return
            if key in self._unhookable:
                self._open(state, module, args, frame_kwargs())
                return
            if not self._remember(module):
                return
            self._hook_module(module)  # from its next call on
            self._open(state, module, args, frame_kwargs(), discovered=True)
        except Exception as exc:  # noqa: BLE001 - see above
            self._fail(exc)

    def _global_post(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        if _compiling():
            return
        try:
            if not self.discovering:
                if id(module) in self._unhookable:
                    state = self._thread_state()
                    if state.owner is module:
                        self._close(state)
                return
            state = self._thread_state()
            if state.depth > 0:
                state.depth -= 1
            if state.depth == 0 and state.owner is module:
                self._close(state)
                self.discovery_steps += 1
                if self._discovered():
                    if self._counting:
                        self.calls_per_step = self.module_calls / max(1, self.steps)
                    self._end_discovery()
        except Exception as exc:  # noqa: BLE001 - see above
            self._fail(exc)

    def _module_pre(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if _compiling():
            return
        try:
            if not self.active:
                return
            state = self._thread_state()
            if state.handle is not None:
                return  # inside another model's step
            if self.discovering and state.depth > 0:
                if state.pending is not module:
                    return  # called nested, not outermost
                state.pending = None
            self._open(state, module, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - see above
            self._fail(exc)

    def _module_post(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        if _compiling():
            return
        try:
            state = self._state
            if state.owner is module and state.generation == self._generation and \
                    (not self.discovering or state.depth == 0):
                self._close(state)
        except Exception as exc:  # noqa: BLE001 - see above
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        """A hook raised: no more steps are marked this session (status and the session's summary
        say why); the model's call goes on."""
        if self.failure is None:
            self.failure = f"{type(exc).__name__}: {exc}"
        self.active = False
        self.discovering = False

    # --- helpers ----------------------------------------------------------------------------------

    def _remember(self, module: Any) -> bool:
        key = id(module)
        entry = self._known.get(key)
        if entry is not None and entry[0]() is module:
            return entry[1]
        is_model = looks_like_model(module)
        if is_model and inside_module_call(3):
            # Nested in a forward that began before the window opened: a part, not a model, this
            # time (not remembered: an encoder is also called on its own by its model's generate).
            return False
        if is_model:
            direct = self._direct_parts.get(key, _UNSEEN)
            if direct is _UNSEEN:
                direct = self._direct_parts[key] = forward_called_directly(module, 3)
            if direct is not None:  # a part of a model whose forward runs without hooks: not a step
                if len(self.direct_forwards) < 8:
                    self.direct_forwards.setdefault(*direct)
                return False  # (not remembered across sessions: said again in each)
        with self._lock:
            self._known[key] = (weakref.ref(module, lambda _r, k=key: self._known.pop(k, None)), is_model)
        return is_model

    def _hook_module(self, module: Any) -> None:
        """Hooks of the module's own, so that its steps are marked outside discovery windows. A
        module that takes none (a TorchScript ``ScriptModule``) is marked by the global hooks,
        which then stay on for the session."""
        key = id(module)
        with self._lock:
            if key in self._hooked or key in self._unhookable or not self.active:
                return
            try:
                pre = module.register_forward_pre_hook(self._module_pre, with_kwargs=True)
            except Exception:  # noqa: BLE001 - RuntimeError: "... is not supported on ScriptModules"
                self._unhookable.add(key)
                self.unhookable_models.add(type(module).__qualname__)
                return
            self._hooked.add(key)
            self._module_handles.append(pre)
            self._module_handles.append(module.register_forward_hook(self._module_post, always_call=True))

    def _open(self, state: _ThreadState, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None,
              discovered: bool = False) -> None:
        """A step begins (``discovered``: its model found by this very call)."""
        seq = sequence_length(args, kwargs)
        if seq is None or seq == 1 or extends_sequence(seq, state.last_seq, kwargs):
            kind = "decode_step"
            self.decode_steps += 1
        else:
            kind = "prefill"
            self.prefill_steps += 1
        state.last_seq = seq if seq is not None else -1
        if marked_step.phase == kind:
            state.handle = _UNRECORDED
        else:
            request_id = request_id_here()
            if request_id is None:  # an engine's thread, or one of a pool: it serves whoever is in flight
                self.threads_without_request.add(threading.get_native_id())
            ids = [request_id] if request_id is not None else self._session_ids()
            if self._awaiting and not discovered:
                # A model found before this step serves them: what they run is known. (Served only
                # by one found just now, they may run more: an encoder-decoder's encoder is one
                # module, its decoder steps another.)
                self._awaiting.difference_update(ids)
            state.handle = open_range(auto_phase_name(kind, ids))
        state.owner = module
        state.opened_ns = time.perf_counter_ns()
        self.steps += 1
        self.open_steps += 1
        self.open_started_ns += state.opened_ns
        if len(self.models) < 8:
            self.models.add(type(module).__qualname__)
        if self._on_step is not None:
            self._on_step(self.steps)

    def _close(self, state: _ThreadState) -> None:
        handle, state.handle, state.owner = state.handle, None, None
        if handle is not None:
            self.open_steps = max(0, self.open_steps - 1)
            self.open_started_ns -= state.opened_ns
            if handle is not _UNRECORDED:
                close_range(handle)
            took = (time.perf_counter_ns() - state.opened_ns) / 1e9
            self.step_s = took if self.step_s is None else 0.8 * self.step_s + 0.2 * took
            self.next_step_share = min(1.0, STOP_LATENCY_S / max(self.step_s, 1e-6))
