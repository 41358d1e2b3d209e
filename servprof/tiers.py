"""Capture tiers: a light session records annotations (and device activity), a deep window every op.

torch.profiler always records every ATen op on the CPU, and its ``stop()`` and export hold the
GIL a few µs per captured event: that, not the serving work, is what stalls the loop. The
profiler's C++ entry point takes a set of RecordFunction scopes that ``torch.profiler`` never
passes; with ``{RecordScope.USER_SCOPE}`` only ``record_function``-style ranges are recorded
(servprof's phases, its automatic steps and tokenizer phases, the engine's own annotations),
while CUPTI still delivers kernels, copies and runtime launches on CUDA
(../shared/facts/torch-profiler-in-a-server.md: 250 annotated steps -> stop() ~1 ms against
~115 ms with every op).

* ``light``: user-scope ranges + device activity. Many steps per session for the stall of a few.
* ``deep``: every op (with shapes when asked), bounded by steps and the event budget: what the
  op-level detectors (bandwidth roofline, op-level gap causes) need.

The scopes reach the profiler through a private API, checked once against the installed torch
(``light_problem``): where it is missing or changed, sessions fall back to deep capture with
the event budget, and the log and ``/servprof/status`` say so once.

Every profiler is drained before its stop (``drain_ops``): torch 2.13's ``stop()`` frees a
``profile_all_threads`` session's record queue while ops that began before it may still be running
on serving threads (the GIL released), and their end callbacks then write into freed memory:
SIGSEGV in ``_disable_profiler`` or heap corruption later in a serving thread (upstream:
pytorch/pytorch#185741, #187483 wait for those callbacks; 2.13 does not). So before its stop
servprof switches collection off (ops and ranges starting later run no profiler callback), waits
for the GPU work already queued (ops waiting on it end with it; not run on a GPU here) and lets
the ones in flight end for ``DRAIN_S``. bench/stress_restart.py: plain deep start/stop under 6
model threads crashed within seconds; drained, it ran thousands of sessions. Light sessions were
at first not drained (annotations only: a far smaller window): a transformers server under load
still lost 3 of 66 test runs to SIGSEGV, one inside a light session's ``stop()``; drained for
50 ms alone it still died, once in about 86 sessions. A range opened before the cut still runs
its end callback, and a step can outlast the drain: the drain also waits for servprof's ranges
open at the cut (``servprof.auto.emit``) to end, up to ``RANGE_WAIT_S`` (docs/middleware.md).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from typing import Any

import torch
import torch.autograd.profiler as autograd_profiler
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from servprof.auto.emit import open_ranges, still_open

try:  # torch >= 2.3: switch a running profiler's collection off from any thread, at once
    from torch._C._autograd import _toggle_collection_dynamic
except ImportError:  # pragma: no cover - older torch: the stop alone bounds the session
    _toggle_collection_dynamic = None

LIGHT, DEEP = "light", "deep"
# An op running when collection is switched off ends within this (a CPU op of a small model takes
# µs, a big matmul on a few cores tens of ms; GPU ops return at launch). Only the capture thread
# waits it out, without the GIL: serving goes on, its last DRAIN_S are not recorded.
DRAIN_S = 0.05
# ... and servprof's own ranges (steps, phases) open then are waited for up to this long.
RANGE_WAIT_S = 2.0
TIERS = (LIGHT, DEEP)
LOG = logging.getLogger("servprof")
KINETO_QUIET_LEVEL = "6"  # above USDT (5) and ERROR (4): Kineto prints nothing

_patch_lock = threading.Lock()
_problem: str | None = None
_checked = False


def _check() -> str | None:
    """Why the installed torch cannot take a user-scope-only profiler, or None when it can."""
    try:
        from torch._C._profiler import RecordScope

        RecordScope.USER_SCOPE  # noqa: B018 - only whether it exists
    except (ImportError, AttributeError):
        return "torch has no RecordScope.USER_SCOPE"
    enable = getattr(autograd_profiler, "_enable_profiler", None)
    if enable is None:
        return "torch.autograd.profiler has no _enable_profiler"
    if "scopes" not in (getattr(enable, "__doc__", "") or ""):
        return "torch's _enable_profiler takes no scopes"
    start = getattr(autograd_profiler.profile, "_start_trace", None)
    if start is None or "_enable_profiler" not in start.__code__.co_names:
        return "torch.autograd.profiler.profile._start_trace no longer calls _enable_profiler"
    if not callable(getattr(profile, "start_trace", None)):
        return "torch.profiler.profile has no start_trace"
    return None


def light_problem() -> str | None:
    """Checked once per process; logged once when light capture is not possible."""
    global _problem, _checked
    if not _checked:
        _problem = _check()
        _checked = True
        if _problem:
            LOG.warning("servprof: light sessions are not possible on torch %s (%s): every session captures "
                        "every op, bounded by the event budget", torch.__version__, _problem)
    return _problem


class LightProfile(profile):
    """``torch.profiler.profile`` whose start asks the profiler for user-scope ranges only."""

    def start_trace(self) -> None:
        from torch._C._profiler import RecordScope

        # torch's own _start_trace calls the module's _enable_profiler by name: for the length of
        # that call (on the capture thread, under a lock) the name takes the scopes too.
        with _patch_lock:
            original = autograd_profiler._enable_profiler
            autograd_profiler._enable_profiler = functools.partial(original, scopes={RecordScope.USER_SCOPE})
            try:
                super().start_trace()
            finally:
                autograd_profiler._enable_profiler = original


def profiler_class(tier: str) -> tuple[type[profile], str, str | None]:
    """(class, tier it gives, why it is not the tier asked for)."""
    if tier == LIGHT:
        problem = light_problem()
        if problem:
            return profile, DEEP, f"light capture not possible on this torch ({problem}): captured every op"
        return LightProfile, LIGHT, None
    return profile, DEEP, None


def new_profiler(settings: Any, tier: str = DEEP) -> tuple[profile, str, str | None]:
    """(profiler, the tier it captures, why that is not the tier asked for); ``settings`` None:
    the warm-up's profiler (no shapes, memory or stacks)."""
    # Kineto reads KINETO_LOG_LEVEL once, at the first profiler start in the process (not when
    # torch is imported): unless the user chose a level, its `USDT ... profiler_start/stop` lines
    # (one pair per session) stay out of the server's log. This level hides Kineto's own errors too.
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET_LEVEL)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    cls, tier, note = profiler_class(tier)
    light = tier == LIGHT  # shapes, memory and stacks are op-level detail: a deep window's
    prof = cls(activities=activities,
               record_shapes=bool(settings and settings.record_shapes and not light),
               profile_memory=bool(settings and settings.profile_memory and not light),
               with_stack=bool(settings and settings.with_stack and not light),
               experimental_config=_ExperimentalConfig(profile_all_threads=True))
    return prof, tier, note


def pause_collection(device: bool = True) -> bool:
    """Stop recording events in every thread now, the profiler still running (its stop() and
    export come later, on the capture thread). Ranges already open still get their end. Costs
    ~60 µs once; torch logs one warning line about GPU tracks for it. ``device=False``: CPU ops
    only (kernels still running are recorded until the stop)."""
    if _toggle_collection_dynamic is None:
        return False
    activities = {torch._C._profiler.ProfilerActivity.CPU}
    if device and torch.cuda.is_available():
        activities.add(torch._C._profiler.ProfilerActivity.CUDA)
    try:
        _toggle_collection_dynamic(False, activities)
    except Exception:  # noqa: BLE001 - the profiler stopped meanwhile: nothing left to pause
        return False
    return True


def drain_ops(tier: str, cut_perf_ns: int | None = None) -> None:
    """Before a profiler's stop(), light or deep: its collection off for DRAIN_S (switched off here
    unless ``cut_perf_ns`` says when it went off), so that no op or range still runs a profiler
    callback then. See the module's docstring. (``tier`` is kept for the callers' sake: both drain.)"""
    del tier
    if cut_perf_ns is None and pause_collection(device=False):
        cut_perf_ns = time.perf_counter_ns()
    if cut_perf_ns is None:
        return
    ranges = open_ranges()  # servprof's ranges open now: their ends still run a profiler callback
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # An op that waits for the GPU (.item(), a copy to the host) lasts as long as the work queued
        # before it: once that is done (the GIL released meanwhile), such a wait ends too.
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        # The kernels launched before the cut have run now, and are recorded. What serving launches
        # from here on belongs to no recorded op, yet CUPTI would record it until the stop: each
        # kernel with its launch and their flow (~4 events), for the whole drain and the wait for
        # open ranges. On an H100 that took a 2,000-event session to 18,946 and its stop to 122 ms.
        pause_collection(device=True)
    time.sleep(max(0.0, DRAIN_S - (time.perf_counter_ns() - cut_perf_ns) / 1e9))
    # A step that outlasts the drain (a slow forward on a loaded machine) ends while stop() runs
    # unless waited for: wait for servprof's ranges open at the cut, up to RANGE_WAIT_S.
    deadline = time.monotonic() + RANGE_WAIT_S
    while still_open(ranges) and time.monotonic() < deadline:
        time.sleep(0.002)


def stop_profiler(prof: profile, tier: str = DEEP, drain: bool = True) -> None:
    """``prof.stop()`` on a failure or warm-up path, drained first unless ``drain`` is False (the
    warm-up's light profiler, stopped the moment it started: no servprof range runs then, and a
    cut would put torch's 'Toggling CPU activity' line in every server's start-up log)."""
    if drain:
        drain_ops(tier)
    prof.stop()


def light_status() -> dict[str, object]:
    """What /servprof/status says about the tiers on this torch."""
    problem = light_problem()
    return {"light_available": problem is None, "light_problem": problem}
