"""Which request the code running on a thread serves, for automatic phases.

First the middleware's contextvar (set on the serving loop, copied into worker threads by
``asyncio.to_thread`` / ``anyio.to_thread``); then the id a thread inherited when a request
started it (``threading.Thread(target=model.generate, ...).start()`` in a handler, as
transformers' ``TextIteratorStreamer`` recipe does: plain threads do not copy contextvars).
The inheritance is a patch of ``threading.Thread.start``, put in when the middleware is
created (a thread started before a session must carry its request into it; the patch costs
one contextvar read per thread start), and an inherited id holds only while its request is in flight (an engine thread a
first request happened to start lazily does not carry that request's id for ever). Pool
threads (``concurrent.futures`` workers, anyio's worker threads) inherit nothing: they
serve many requests over their life. A job does: ``ThreadPoolExecutor.submit`` (what
``loop.run_in_executor`` calls, which, unlike ``asyncio.to_thread``, copies no contextvars) is
patched alongside, so that a job submitted while serving a request carries that request for as
long as it runs (one contextvar read per submit).
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from servprof.request_context import request_id_var, request_record_var

_ATTRIBUTE = "_servprof_request_record"
_POOL_MODULES = ("concurrent.futures.thread", "multiprocessing.pool")
_original_start = threading.Thread.start


def _start_with_request(self: threading.Thread, *args: Any, **kwargs: Any) -> Any:
    record = request_record_var.get()
    if record is not None:
        target = getattr(self, "_target", None)  # CPython's private field; absent: nothing inherited
        if target is not None and getattr(target, "__module__", None) not in _POOL_MODULES:
            setattr(self, _ATTRIBUTE, record)
    return _original_start(self, *args, **kwargs)


_original_submit = ThreadPoolExecutor.submit


def _submit_with_request(self: ThreadPoolExecutor, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    record = request_record_var.get()
    if record is None:
        record = getattr(threading.current_thread(), _ATTRIBUTE, None)  # a job submitting another
    if record is not None:
        fn = functools.partial(_run_for, record, fn)
    return _original_submit(self, fn, *args, **kwargs)


def _run_for(record: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run one pool job as the request that submitted it; the worker thread forgets it after."""
    thread = threading.current_thread()
    before = getattr(thread, _ATTRIBUTE, None)
    setattr(thread, _ATTRIBUTE, record)
    try:
        return fn(*args, **kwargs)
    finally:
        setattr(thread, _ATTRIBUTE, before)


def install_thread_inheritance() -> None:
    if threading.Thread.start is _original_start:
        threading.Thread.start = _start_with_request  # type: ignore[method-assign]
    if ThreadPoolExecutor.submit is _original_submit:
        ThreadPoolExecutor.submit = _submit_with_request  # type: ignore[method-assign]


def remove_thread_inheritance() -> None:
    # Only our own patches are undone; someone who wrapped one since keeps theirs (ours passes through).
    if threading.Thread.start is _start_with_request:
        threading.Thread.start = _original_start  # type: ignore[method-assign]
    if ThreadPoolExecutor.submit is _submit_with_request:
        ThreadPoolExecutor.submit = _original_submit  # type: ignore[method-assign]


class _MarkedStep(threading.local):
    """The step phase (``prefill`` / ``decode_step``) the server itself marked and has open on
    this thread, while a profiler runs. An automatic step of the same kind inside it is not
    recorded: the analysis drops automatic phases where explicit ones exist, so the range would
    only add to stop()'s cost (a light session's budget is counted in ranges)."""

    phase: str | None = None


marked_step = _MarkedStep()


def request_id_here() -> str | None:
    """The request this thread is serving, if it can be known."""
    request_id = request_id_var.get()
    if request_id is not None:
        return request_id
    record = getattr(threading.current_thread(), _ATTRIBUTE, None)
    if record is None or record.end_ns is not None:  # that request has ended
        return None
    return record.request_id
