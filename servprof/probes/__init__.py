"""What the capture thread reads beside the profiler while a session runs.

torch 2.13's profiler records no allocator events under ``profile_all_threads`` (the only
mode that sees a server's engine threads), so servprof samples memory levels itself
(``memory``); torch.compile's own counters and compile records say what compiled during
a session and why (``compile``). Both end up in the session trace's ``servprof``
metadata, where the detectors (servprof.detect.memory, servprof.detect.recompilation)
read them. ``snapshot`` keeps CUDA memory history and writes near-OOM snapshots.
"""

from __future__ import annotations

import contextlib
from typing import Any

import orjson

from servprof.probes.compile import compile_state, compile_summary
from servprof.probes.memory import HISTORY_INTERVAL_S, MemorySampler, memory_history

IDLE_TICK_S = HISTORY_INTERVAL_S  # how often the idle capture thread wakes to read memory levels


def tick_memory_history(model_requests: int, sessions: int, force: bool = False) -> None:
    """One reading of the between-sessions memory history (rate-limited unless forced); never raises."""
    with contextlib.suppress(Exception):  # a failed reading is simply missing from the history
        memory_history().tick(model_requests, sessions, force)


class SessionProbes:
    """The probes of one session: started with it, sampled on the capture thread's polls,
    finished into the metadata just before the profiler stops. Never raises: a probe that
    fails is left out and says why in the metadata."""

    def __init__(self, memory: bool, model_requests: int = 0, sessions: int = 0) -> None:
        self.errors: list[str] = []
        self.memory: MemorySampler | None = None
        if memory:
            # The level just before the profiler starts ends the quiet stretch since the last session.
            tick_memory_history(model_requests, sessions, force=True)
            try:
                self.memory = MemorySampler()
            except Exception as exc:  # noqa: BLE001 - a probe never stops a session
                self.errors.append(f"memory sampler: {type(exc).__name__}: {exc}")
        self.compile_start = _safe(compile_state, self.errors)

    def sample(self) -> None:
        if self.memory is None:
            return
        try:
            self.memory.sample()
        except Exception as exc:  # noqa: BLE001
            self.errors.append(f"memory sample: {type(exc).__name__}: {exc}")
            self.memory = None

    def finish(self, session_wall_start_ns: int | None, serving_since_ns: int | None = None) -> dict[str, Any]:
        """Keys for the session's ``servprof`` metadata (``serving_since_ns``: when the first model
        request arrived, so that start-up compiles are not taken for serving ones)."""
        out: dict[str, Any] = {}
        if self.memory is not None:
            memory = _safe(self.memory.finish, self.errors)
            if memory:
                out["memory"] = memory
        compile_end = _safe(compile_state, self.errors)
        if self.compile_start is not None or compile_end is not None:
            summary = _safe(lambda: compile_summary(self.compile_start, compile_end, session_wall_start_ns,
                                                    serving_since_ns), self.errors)
            if summary:
                out["compile"] = summary
        for key in list(out):  # the session's metadata must stay JSON whatever a probe returned
            try:
                orjson.dumps(out[key])
            except TypeError as exc:
                self.errors.append(f"{key}: not JSON: {exc}")
                del out[key]
        if self.errors:
            out["probe_errors"] = self.errors[:5]
        return out


def _safe(read: Any, errors: list[str]) -> Any:
    try:
        return read()
    except Exception as exc:  # noqa: BLE001
        errors.append(f"{getattr(read, '__name__', 'probe')}: {type(exc).__name__}: {exc}")
        return None


__all__ = ["IDLE_TICK_S", "SessionProbes", "MemorySampler", "compile_state", "compile_summary",
           "tick_memory_history"]
