"""Phase markers: serving code tags its work so a sampled trace shows which request it was for.

A phase becomes one profiler range named ``servprof:<phase>|<id>[,<id>...]`` (the
chrome-trace export drops record-function kwargs, so the ids travel in the name).
When no profiler is active a phase costs one global read, nothing more: the
serving path pays nothing while servprof is not sampling.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch.autograd.profiler as _autograd_profiler

from servprof.auto.context import marked_step
from servprof.auto.emit import close_range, open_range
from servprof.request_context import current_request_id

# The trace side's reader (torch-free, so loading a trace never imports torch) is the inverse.
from servprof.trace.phases import PHASE_PREFIX, parse_phase_event_name  # noqa: F401  (re-exported)

PHASES = ("tokenize", "queue", "prefill", "decode_step", "detokenize")
STEP_PHASES = frozenset(("prefill", "decode_step"))  # what the automatic step hooks would also mark
_NOT_A_STEP = object()

F = TypeVar("F", bound=Callable[..., Any])


def phase_event_name(name: str, request_ids: Iterable[str]) -> str:
    return f"{PHASE_PREFIX}{name}|{','.join(request_ids)}"


class phase:  # noqa: N801 - used like a function: `with servprof.phase("tokenize"):`
    """Mark a part of serving one request (or a batch of requests).

    ``with phase("tokenize"):`` tags the current request (from the middleware's
    contextvar); ``phase("decode_step", request_ids=[...])`` tags a batched step.
    Also usable as a decorator.
    """

    __slots__ = ("name", "request_id", "request_ids", "_range", "_outer_step")

    def __init__(self, name: str, request_id: str | None = None, request_ids: Iterable[str] | None = None):
        self.name = name
        self.request_id = request_id
        self.request_ids = request_ids
        self._range: Any = None
        self._outer_step: Any = _NOT_A_STEP

    def __enter__(self) -> phase:
        # _is_profiler_enabled is a plain Python global, true from every thread while
        # any profiler runs; everything else is skipped when it is false.
        if _autograd_profiler._is_profiler_enabled:
            if self.request_ids is not None:
                ids = list(self.request_ids)
            else:
                rid = self.request_id or current_request_id()
                ids = [rid] if rid else []
            # A user-scope range (servprof.auto.emit): kept by a light session, which records no op.
            self._range = open_range(phase_event_name(self.name, ids))
            if self.name in STEP_PHASES:
                self._outer_step, marked_step.phase = marked_step.phase, self.name
        return self

    def __exit__(self, *exc: object) -> None:
        if self._range is not None:
            close_range(self._range)
            self._range = None
            if self._outer_step is not _NOT_A_STEP:
                marked_step.phase, self._outer_step = self._outer_step, _NOT_A_STEP

    def __call__(self, func: F) -> F:
        name, request_id, request_ids = self.name, self.request_id, self.request_ids

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with phase(name, request_id, request_ids):
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]
