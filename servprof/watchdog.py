"""Event-loop stall watchdog: names what blocks the serving loop by its Python frames.

While a session runs, a heartbeat callback on the serving loop stamps the time every
``BEAT_S``, and a ``servprof-watchdog`` thread looks at the stamp once per threshold while
the loop keeps time. When the loop is late, the watchdog samples the loop thread's Python
stack (``sys._current_frames()``) every ``POLL_S`` until it ticks again, so a blocking call
is named by function and file even with ``with_stack`` off and no torch op in it. Stalls
of at least the threshold are kept; a stall's length is the late heartbeat's lag (it began
at most ``BEAT_S`` earlier).

Every wake of the watchdog thread takes the GIL from whoever holds it, and on a busy
machine a forced GIL hand-off waits for the OS to run the other thread: hence the slow
pace while the loop is healthy (measured: bench/bench_zero_touch.py).

A function that holds the GIL inside C code for the whole stall leaves no sample (the
watchdog cannot run meanwhile): the stall is still reported, with its length, and the
trace shows what ran on the loop thread then. servprof's own ``stop()``/export are never
watched: the capture thread stops the watchdog first.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import sysconfig
import threading
import time
from collections import Counter
from typing import Any

BEAT_S = 0.005
POLL_S = 0.004
SAMPLE_FROM = 0.25  # sampling starts when the loop is this share of the threshold late (the start
# of a stall names the blocking call as well as its end); only stalls past the threshold are kept
MAX_STALLS = 200  # per session: the longest are kept
MAX_FRAMES = 40
MAX_STACKS = 4  # distinct stacks kept per stall

_SERVPROF_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARY_DIRS = tuple({sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")})
# Innermost frames that mean "the loop is in its selector or its C core (uvloop), waiting for
# I/O or for the GIL", not blocked in a call.
_IDLE_FUNCTIONS = {"select", "poll", "_run_once", "run_forever", "run_until_complete", "run"}
_IDLE_FILES = (os.sep + "selectors.py", os.sep + "base_events.py", os.sep + "runners.py",
               "uvloop" + os.sep + "__init__.py")


def is_idle(stack: list[tuple[str, str, int]]) -> bool:
    return not stack or (stack[-1][0] in _IDLE_FUNCTIONS and stack[-1][1].endswith(_IDLE_FILES))


def frame_origin(filename: str) -> str:
    """'servprof', 'library' (stdlib / site-packages) or 'app'."""
    if filename.startswith(_SERVPROF_DIR):
        return "servprof"
    if filename.startswith(_LIBRARY_DIRS) or filename.startswith("<"):
        return "library"
    return "app"


def stack_of(frame: Any, limit: int = MAX_FRAMES) -> list[tuple[str, str, int]]:
    """(function, file, line), outermost first."""
    out = []
    while frame is not None and len(out) < limit:
        code = frame.f_code
        out.append((code.co_name, code.co_filename, frame.f_lineno))
        frame = frame.f_back
    out.reverse()
    return out


def _responder_request_id(frame: Any) -> str | None:
    """The request whose handler is on the blocked stack: ServprofMiddleware's responder
    frame (``_RequestResponder.run``) holds its id. Best effort: a streamed body runs in
    its own task, without that frame."""
    from servprof.middleware import _RequestResponder

    code = _RequestResponder.run.__code__
    while frame is not None:
        if frame.f_code is code:
            value = frame.f_locals.get("request_id")
            return value if isinstance(value, str) else None
        frame = frame.f_back
    return None


class _Stall:
    __slots__ = ("since_beat_ns", "stacks", "weights_ns", "last_sample_ns", "samples", "idle_samples", "request_id")

    def __init__(self, since_beat_ns: int):
        self.since_beat_ns = since_beat_ns
        self.stacks: Counter[tuple[tuple[str, str, int], ...]] = Counter()
        # The time each stack stands for: the watchdog wakes only when it gets the GIL, so code
        # that holds it (pure Python) is sampled less often than a call that releases it (sleep,
        # I/O, some C); each sample stands for the time since the one before it.
        self.weights_ns: Counter[tuple[tuple[str, str, int], ...]] = Counter()
        self.last_sample_ns = since_beat_ns
        self.samples = 0
        self.idle_samples = 0  # the loop was in its selector: waiting for the GIL or a CPU, not blocked
        self.request_id: str | None = None


class LoopWatchdog:
    """One per session. ``attach`` runs on the serving loop; the rest on the capture thread."""

    def __init__(self, threshold_ms: float, in_flight: Any = None, open_request_ids: Any = None):
        self.threshold_ns = int(threshold_ms * 1e6)
        self._in_flight = in_flight or (lambda: None)
        self._open_request_ids = open_request_ids or list
        self.loop: asyncio.AbstractEventLoop | None = None
        self.foreign_loop: str | None = None  # the async library serving requests, when not asyncio (trio)
        self.loop_ident: int | None = None
        self.loop_native_id: int | None = None
        self._last_beat_ns = 0
        self._running = False
        self._thread: threading.Thread | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._stall: _Stall | None = None
        self.stalls: list[dict[str, Any]] = []
        self.beats = 0
        self.samples = 0
        self.started_ns = 0
        self.watched_ns = 0

    # --- on the serving loop ----------------------------------------------------------------------

    def attach(self) -> None:
        """Start watching the running loop (call from the loop's thread)."""
        if self.loop is not None or self.threshold_ns <= 0 or self.foreign_loop is not None:
            return
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:  # another async library's loop (Hypercorn on trio): nothing here to watch
            self.foreign_loop = _async_library()
            return
        self.loop_ident = threading.get_ident()
        self.loop_native_id = threading.get_native_id()
        self._running = True
        self.started_ns = self._last_beat_ns = time.perf_counter_ns()
        self._handle = self.loop.call_later(BEAT_S, self._beat)
        self._thread = threading.Thread(target=self._watch, name="servprof-watchdog", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        now = time.perf_counter_ns()
        last, self._last_beat_ns = self._last_beat_ns, now
        self.beats += 1
        stall, self._stall = self._stall, None
        lag = now - last - int(BEAT_S * 1e9)
        if self._running:
            self._handle = self.loop.call_later(BEAT_S, self._beat) if self.loop is not None else None
        if lag >= self.threshold_ns:
            self._record(last, now, lag, stall)

    # --- the watchdog thread ----------------------------------------------------------------------

    def _watch(self) -> None:
        beat_ns = int(BEAT_S * 1e9)
        sample_from_ns = max(int(POLL_S * 1e9), int(self.threshold_ns * SAMPLE_FROM))
        healthy_s = max(POLL_S, self.threshold_ns / 1e9)
        late = False
        while self._running:
            time.sleep(POLL_S if late else healthy_s)
            last = self._last_beat_ns
            late = time.perf_counter_ns() - last - beat_ns >= sample_from_ns
            if not late or not self._running:
                continue
            stall = self._stall
            if stall is None or stall.since_beat_ns != last:
                stall = self._stall = _Stall(last)
            frame = sys._current_frames().get(self.loop_ident or 0)
            if frame is None or self._last_beat_ns != last:
                continue  # the loop ticked meanwhile: this sample would be from after the stall
            stack = stack_of(frame)
            del frame
            sampled_ns = time.perf_counter_ns()
            if is_idle(stack):
                stall.idle_samples += 1
                stall.last_sample_ns = sampled_ns
                continue  # back in the selector: waiting for the GIL, not blocked in a call
            self.samples += 1
            stall.samples += 1
            key = tuple(stack)
            stall.stacks[key] += 1
            stall.weights_ns[key] += sampled_ns - max(stall.last_sample_ns, last + beat_ns)
            stall.last_sample_ns = sampled_ns
            if stall.request_id is None and stall.samples == 1:
                loop_frame = sys._current_frames().get(self.loop_ident or 0)
                stall.request_id = _responder_request_id(loop_frame)

    # --- capture thread ---------------------------------------------------------------------------

    def stop(self) -> list[dict[str, Any]]:
        """Stop watching (before the profiler's stop(): what follows is servprof's own work)
        and return the stalls, longest first."""
        self._running = False
        if self.loop is not None:
            # A stall still going on now is the app's (the profiler has not been stopped yet).
            last, now = self._last_beat_ns, time.perf_counter_ns()
            lag = now - last - int(BEAT_S * 1e9)
            if lag >= self.threshold_ns:
                self._record(last, now, lag, self._stall, ongoing=True)
            handle = self._handle
            if handle is not None:
                with contextlib.suppress(RuntimeError):  # the loop is closed
                    self.loop.call_soon_threadsafe(handle.cancel)
            self.watched_ns = time.perf_counter_ns() - self.started_ns
        return sorted(self.stalls, key=lambda s: -s["duration_ms"])

    def summary(self) -> dict[str, Any]:
        return {"attached": self.loop is not None, "threshold_ms": self.threshold_ns / 1e6,
                "beats": self.beats, "samples": self.samples, "stalls": len(self.stalls),
                "watched_s": round(self.watched_ns / 1e9, 3), "loop_tid": self.loop_native_id}

    def _record(self, last_ns: int, now_ns: int, lag_ns: int, stall: _Stall | None, ongoing: bool = False) -> None:
        # perf -> wall clock once, on the loop, so the analysis can place the stall in the trace.
        offset = time.time_ns() - time.perf_counter_ns()
        stacks = []
        if stall is not None and stall.since_beat_ns != last_ns:
            stall = None  # samples of an earlier stall
        if stall is not None:
            for stack, weight_ns in stall.weights_ns.most_common(MAX_STACKS):
                stacks.append({"count": stall.stacks[stack], "ms": round(weight_ns / 1e6, 3), "frames": [
                    {"function": f, "file": path, "line": line, "origin": frame_origin(path)} for f, path, line in stack]})
        entry = {
            "start_wall_ns": now_ns - lag_ns + offset,
            "end_wall_ns": now_ns + offset,
            "duration_ms": round(lag_ns / 1e6, 3),
            "samples": stall.samples if stall is not None else 0,
            "idle_samples": stall.idle_samples if stall is not None else 0,
            "stacks": stacks,
            "blocking_request_id": stall.request_id if stall is not None else None,
            "in_flight": self._in_flight(),
            "request_ids": list(self._open_request_ids())[:100],
            "loop_tid": self.loop_native_id,
            "ongoing_at_stop": ongoing,
        }
        if len(self.stalls) < MAX_STALLS:
            self.stalls.append(entry)
        else:
            shortest = min(range(len(self.stalls)), key=lambda i: self.stalls[i]["duration_ms"])
            if self.stalls[shortest]["duration_ms"] < entry["duration_ms"]:
                self.stalls[shortest] = entry


def _async_library() -> str:
    """The async library running the current task, when it is not asyncio: trio, or "unknown"."""
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_task()
            return "trio"
        except RuntimeError:
            pass
    return "unknown"
