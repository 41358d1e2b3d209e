"""The one place where automatic phases become profiler ranges.

Every automatic phase (model steps, tokenizer calls) is opened with ``open_range`` and
closed with ``close_range``; which kind of RecordFunction range that is is chosen here
and nowhere else:

* ``"user"`` (default): ``torch._C._autograd._record_function_with_args_enter/_exit`` (what
  ``torch.profiler.record_function`` uses underneath, without its Python object), ~2.5 µs
  per range while a profiler runs, cat ``user_annotation``, kept by a profiler limited to
  ``RecordScope.USER_SCOPE`` (the light sessions of issue 17).
* ``"fast"``: ``torch._C._profiler._RecordFunctionFast``, ~1 µs per range, cat ``cpu_op``; *not*
  a user-scope range (a user-scope-only profiler drops it). Not the default: with
  ``record_shapes`` and other threads running ops, stop()/export segfaulted the transformers
  test server in 2 of 2 benchmark runs ("Tensor metadata exhausted prematurely" first), against
  0 of 2 with "user" ranges (torch 2.13 CPU); and an ``__exit__`` after a profiler started
  between enter and exit raises an internal assert.

Measured on torch 2.13 CPU (20,000 ranges, profiler active): fast 0.7-1.0 µs, user
2.5-2.6 µs, ``torch.profiler.record_function`` 9.7-10.7 µs.
"""

from __future__ import annotations

from typing import Any, Literal

from torch._C._autograd import _record_function_with_args_enter, _record_function_with_args_exit
from torch._C._profiler import _RecordFunctionFast

from servprof.trace.phases import AUTO_PHASE_PREFIX, PHASE_PREFIX

RangeKind = Literal["fast", "user"]
_NO_ARGS: tuple[Any, ...] = ()
_kind: RangeKind = "user"


def set_range_kind(kind: RangeKind) -> None:
    """Choose the range kind for every automatic phase opened from now on."""
    global _kind
    if kind not in ("fast", "user"):
        raise ValueError(f"range kind must be 'fast' or 'user', got {kind!r}")
    _kind = kind


def range_kind() -> RangeKind:
    return _kind


def auto_phase_name(phase: str, request_ids: list[str] | tuple[str, ...]) -> str:
    """``servprof:auto.<phase>|<id>,<id>`` (docs/CONTRACTS.md)."""
    return f"{PHASE_PREFIX}{AUTO_PHASE_PREFIX}{phase}|{','.join(request_ids)}"


# The ranges open now, on every thread (set.add / discard are atomic under the GIL): before a
# profiler's stop, servprof waits for those open when collection went off to end (tiers.drain_ops),
# since a range's end callback that runs during torch 2.13's stop() writes into freed memory.
_open: set[int] = set()


def open_range(name: str) -> Any:
    """Open one range; returns the handle close_range needs."""
    if _kind == "fast":
        # input_values must be a tuple: None aborts the process in torch 2.13.
        handle = _RecordFunctionFast(name, _NO_ARGS, {})
        handle.__enter__()
    else:
        handle = _record_function_with_args_enter(name)
    _open.add(id(handle))
    return handle


def close_range(handle: Any) -> None:
    try:
        if isinstance(handle, _RecordFunctionFast):
            handle.__exit__(None, None, None)
        else:
            _record_function_with_args_exit(handle)
    finally:
        _open.discard(id(handle))


def open_ranges() -> frozenset[int]:
    """The ranges open right now (their handles' ids)."""
    return frozenset(_open)


def still_open(ranges: frozenset[int]) -> bool:
    """Whether any of these ranges has not ended yet."""
    return not ranges.isdisjoint(_open)
