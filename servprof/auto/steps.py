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

Prefill or decode is read from the input's shape: ``decoder_input_ids`` (an encoder-decoder's
decoder step), ``input_ids`` / ``inputs_embeds`` keyword (transformers' ``generate`` passes them
so) or the first tensor argument; an encoder's pass over its input reads as prefill.
Sequence length 1 is a decode step (KV-cached decode, ``[B, 1]`` batches). So is a step of
several tokens over a KV cache that already holds tokens, read from a dynamic cache's shapes
(a draft's tokens verified: assisted generation, prompt lookup), unless ``generate()`` makes it
as its prefill (a prompt prefilled in chunks, a new turn over a conversation's cache). With no cache to read, a 2-D attention mask longer than the input, or a
length one more than the previous step's on the same thread (a loop without a KV cache), is a
decode step. Any other length > 1 is a prefill. A 1-D batch of decode tokens (``[B]``, no
sequence dimension) cannot be told from a prompt and reads as prefill.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules import module as torch_module

from servprof.auto.context import marked_step, request_id_here
from servprof.auto.emit import auto_phase_name, close_range, open_range
from servprof.budget import STOP_LATENCY_S

_UNRECORDED = object()  # a step counted but not recorded: the server's own marker covers it
DISCOVERY_STEPS = 4  # completed outermost forwards watched with global hooks per session
# ... and at most this many, however many sampled requests arrive still waiting for a step.
MAX_DISCOVERY_STEPS = 16
_SEQUENCE_KEYWORDS = ("decoder_input_ids", "decoder_inputs_embeds", "input_ids", "inputs_embeds")
_Tensor = torch.Tensor


class _ThreadState(threading.local):
    generation = -1
    window = -1  # the discovery window depth and pending belong to
    depth = 0  # module calls open on this thread (global hooks only)
    handle: Any = None  # the open step range
    owner: Any = None  # the module whose post-hook closes it
    pending: Any = None  # outermost module whose own kwargs hook will open the range
    last_seq = -1  # sequence length of this thread's previous step
    opened_ns = 0


def _sequence_length(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> int | None:
    tensor = None
    if kwargs:
        for keyword in _SEQUENCE_KEYWORDS:
            tensor = kwargs.get(keyword)
            if tensor is not None:
                break
    if tensor is None:
        for value in args[:4]:
            if isinstance(value, _Tensor):
                tensor = value
                break
        else:
            if kwargs:
                tensor = next((v for v in kwargs.values() if isinstance(v, _Tensor)), None)
    if not isinstance(tensor, _Tensor):
        return None
    shape = tensor.shape
    if tensor.is_floating_point():
        # [B, T, D] embeddings; a 1-D/2-D float input has no sequence dimension to read.
        return int(shape[1]) if len(shape) >= 3 else None
    if len(shape) == 0:
        return 1
    return int(shape[-1]) if len(shape) <= 2 else int(shape[1])


def _extends(seq: int, last_seq: int, kwargs: dict[str, Any] | None) -> bool:
    """A step of several tokens that continues a sequence: over a KV cache that holds tokens (a
    draft's tokens verified, as in assisted generation or prompt lookup), or, with no cache to
    read, under a 2-D attention mask longer than the input (``generate()`` passes the whole
    sequence's when it pads) or one token longer than the thread's previous step (a loop
    without a KV cache). A cache that holds none is a prefill's."""
    cached = _cached_tokens(kwargs) if kwargs else None
    if cached is not None:
        return cached > 0 and not _in_prefill_call()
    mask = kwargs.get("attention_mask") if kwargs else None
    if isinstance(mask, _Tensor) and mask.dim() == 2 and int(mask.shape[-1]) > seq:
        return True
    return last_seq > 0 and seq == last_seq + 1


def _in_prefill_call() -> bool:
    """Called from transformers' ``generate()`` prefill (its ``_prefill``: a ``generate()``'s first
    forward), other than an assistant model's in assisted generation (its ``generate()`` runs again
    for every draft, from the tokens accepted since: a step of the request's decoding). Such a
    prefill can go over a cache that holds tokens: a prompt prefilled in chunks
    (``prefill_chunk_size``), a new turn over a conversation's cache passed back in."""
    frame = sys._getframe(2)
    prefill = False
    for _ in range(32):
        if frame is None:
            break
        code = frame.f_code
        if "transformers" in code.co_filename:
            if code.co_name == "_prefill":
                prefill = True
            elif code.co_name == "get_candidates":
                return False
        frame = frame.f_back
    return prefill


def _cached_tokens(kwargs: dict[str, Any]) -> int | None:
    """Tokens the step's ``past_key_values`` holds, where its shapes say so (None: no cache, or one
    that cannot be read without waiting for the device, as a static cache allocated whole)."""
    past = kwargs.get("past_key_values")
    if past is None:
        return None
    if isinstance(past, (tuple, list)):  # per-layer (key, value) tuples: a hand-written loop, older transformers
        if not past:
            return 0
        key = past[0][0] if isinstance(past[0], (tuple, list)) and past[0] else None
    else:  # transformers' Cache: its first layer's keys, where they grow with the sequence
        layers = getattr(past, "layers", None)
        if isinstance(layers, list) and not layers:
            return 0  # (a dynamic cache before its first step)
        layer = layers[0] if isinstance(layers, list) else None
        if not type(layer).__name__.startswith("Dynamic"):
            return None
        if getattr(layer, "is_initialized", True) is False:
            return 0
        key = getattr(layer, "keys", None)
    return int(key.shape[-2]) if isinstance(key, _Tensor) and key.dim() >= 2 else None


def _frame_kwargs() -> dict[str, Any] | None:
    """The keyword arguments of the module call a global pre-hook is running for (global
    pre-hooks get no kwargs): ``_call_impl``'s ``kwargs``, two frames up. Only used for a
    module's first outermost call; its own kwargs hook covers the later ones."""
    try:
        frame = sys._getframe(2)
        for _ in range(3):
            if frame is None:
                return None
            kwargs = frame.f_locals.get("kwargs")
            if isinstance(kwargs, dict):
                return kwargs
            frame = frame.f_back
    except (ValueError, AttributeError):
        pass
    return None


_CALL_CODES = frozenset(c for c in (getattr(torch.nn.Module._call_impl, "__code__", None),
                                    getattr(torch.nn.Module._wrapped_call_impl, "__code__", None)) if c is not None)


def _inside_module_call(depth_to_skip: int) -> bool:
    """A module call is already running on this thread below the current one: one that began
    before the hooks were registered (a forward in flight when the session started)."""
    frame = sys._getframe(depth_to_skip)
    seen = 0
    while frame is not None:
        if frame.f_code in _CALL_CODES:
            seen += 1
            if seen > 2:  # the current call's own _wrapped_call_impl and _call_impl
                return True
        frame = frame.f_back
    return False


def _is_model(module: torch.nn.Module) -> bool:
    return bool(module._modules) and next(module.parameters(), None) is not None


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
        self.threads_without_request: set[int] = set()  # threads whose steps named the session's requests

    def stop(self) -> None:
        """No new step opens; ranges still open close when their forward returns."""
        self.active = False
        self._end_discovery()

    def remove(self) -> None:
        """Take every hook away (after the profiler stopped)."""
        self.active = False
        self._end_discovery()
        with self._lock:
            handles, self._module_handles = self._module_handles, []
            self._hooked = set()
        for handle in handles:
            handle.remove()

    # --- discovery windows ------------------------------------------------------------------------

    def request_joined(self, request_id: str) -> None:
        """A sampled request arrived (serving loop): global hooks watch again until a step serves
        it, in case it runs a model no step of this session has shown yet."""
        if not self.active:
            return
        self._awaiting.add(request_id)
        if not self.discovering and self.discovery_steps < MAX_DISCOVERY_STEPS:
            self._begin_discovery()

    def _begin_discovery(self) -> None:
        with self._lock:
            if self.discovering or not self.active:
                return
            self._window += 1  # threads' depths restart: calls open now began unwatched
            self.discovering = True
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

    def _end_discovery(self) -> None:
        with self._lock:
            self.discovering = False
            self._counting = False
            handles, self._global_handles = self._global_handles, []
        for handle in handles:
            handle.remove()

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

    def _global_pre(self, module: Any, args: tuple[Any, ...]) -> None:
        if not self.discovering:
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
        if id(module) in self._hooked:
            state.pending = module  # its own hook sees the kwargs and opens the range
            return
        if not self._remember(module):
            return
        self._hook_module(module)  # from its next call on
        self._open(state, module, args, _frame_kwargs(), discovered=True)

    def _global_post(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        state = self._thread_state()
        if state.depth > 0:
            state.depth -= 1
        if state.depth == 0 and state.owner is module:
            self._close(state)
            self.discovery_steps += 1
            if self.discovering and self._discovered():
                if self._counting:
                    self.calls_per_step = self.module_calls / max(1, self.steps)
                self._end_discovery()

    def _module_pre(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
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

    def _module_post(self, module: Any, args: tuple[Any, ...], output: Any) -> None:
        state = self._state
        if state.owner is module and state.generation == self._generation and \
                (not self.discovering or state.depth == 0):
            self._close(state)

    # --- helpers ----------------------------------------------------------------------------------

    def _remember(self, module: Any) -> bool:
        key = id(module)
        entry = self._known.get(key)
        if entry is not None and entry[0]() is module:
            return entry[1]
        is_model = _is_model(module)
        if is_model and _inside_module_call(3):
            # Nested in a forward that began before the window opened: a part, not a model, this
            # time (not remembered: an encoder is also called on its own by its model's generate).
            return False
        with self._lock:
            self._known[key] = (weakref.ref(module, lambda _r, k=key: self._known.pop(k, None)), is_model)
        return is_model

    def _hook_module(self, module: Any) -> None:
        key = id(module)
        with self._lock:
            if key in self._hooked or not self.active:
                return
            self._hooked.add(key)
            self._module_handles.append(module.register_forward_pre_hook(self._module_pre, with_kwargs=True))
            self._module_handles.append(module.register_forward_hook(self._module_post, always_call=True))

    def _open(self, state: _ThreadState, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None,
              discovered: bool = False) -> None:
        """A step begins (``discovered``: its model found by this very call)."""
        seq = _sequence_length(args, kwargs)
        if seq is None or seq == 1 or _extends(seq, state.last_seq, kwargs):
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
