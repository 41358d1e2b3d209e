"""The event-loop watchdog and the loop_stall detector: a real asyncio loop in a thread, real
blocking calls on it, the real profiler's trace with the stalls in its servprof metadata."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from servprof.auto.session import metadata_safe
from servprof.detect.loop_stall import UNSAMPLED, detect_loop_stalls
from servprof.trace import load_trace
from servprof.watchdog import LoopWatchdog


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> Any:
    async def call() -> Any:
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), loop).result(30)


def watch(loop: asyncio.AbstractEventLoop, threshold_ms: float = 10.0) -> LoopWatchdog:
    watchdog = LoopWatchdog(threshold_ms, in_flight=lambda: 3, open_request_ids=lambda: ["req-1", "req-2"])
    on_loop(loop, watchdog.attach)
    return watchdog


def blocking_report_writer(seconds: float) -> None:
    """Pure Python work that never yields: what a synchronous helper on the loop looks like."""
    end = time.perf_counter() + seconds
    total = 0
    while time.perf_counter() < end:
        total += sum(range(100))


def test_a_blocking_call_is_named_by_its_frames(loop: asyncio.AbstractEventLoop) -> None:
    watchdog = watch(loop)
    time.sleep(0.05)
    on_loop(loop, lambda: blocking_report_writer(0.12))
    time.sleep(0.05)
    stalls = watchdog.stop()
    assert len(stalls) == 1, stalls
    stall = stalls[0]
    assert stall["duration_ms"] >= 80 and stall["samples"] >= 1
    functions = [f["function"] for f in stall["stacks"][0]["frames"]]
    assert "blocking_report_writer" in functions
    assert stall["in_flight"] == 3 and stall["request_ids"] == ["req-1", "req-2"]
    assert stall["loop_tid"] == watchdog.loop_native_id and not stall["ongoing_at_stop"]


def test_an_idle_or_brief_loop_has_no_stall(loop: asyncio.AbstractEventLoop) -> None:
    watchdog = watch(loop, threshold_ms=30.0)
    for _ in range(5):
        on_loop(loop, lambda: blocking_report_writer(0.002))
        time.sleep(0.02)
    assert watchdog.stop() == []
    assert watchdog.summary()["attached"] is True and watchdog.summary()["beats"] > 5


def test_a_stall_still_going_at_stop_is_reported(loop: asyncio.AbstractEventLoop) -> None:
    watchdog = watch(loop)
    time.sleep(0.03)
    future = asyncio.run_coroutine_threadsafe(asyncio.to_thread(lambda: None), loop)  # loop is alive
    future.result(10)
    asyncio.run_coroutine_threadsafe(_block_async(0.3), loop)
    time.sleep(0.15)
    stalls = watchdog.stop()
    assert stalls and stalls[0]["ongoing_at_stop"] and stalls[0]["duration_ms"] >= 100


async def _block_async(seconds: float) -> None:
    time.sleep(seconds)  # a synchronous sleep inside a coroutine: the classic loop blocker


def _session_trace(tmp_path: Path, loop: asyncio.AbstractEventLoop, work: Callable[[], None],
                   extra_stall_after_stop: bool = False) -> Any:
    """A real profiler session with the watchdog's stalls written into its servprof metadata."""
    prof = profile(activities=[ProfilerActivity.CPU], experimental_config=_ExperimentalConfig(profile_all_threads=True))
    prof.start()
    watchdog = watch(loop)
    time.sleep(0.03)
    work()
    time.sleep(0.03)
    stalls = watchdog.stop()
    stop_wall_ns = time.time_ns()
    if extra_stall_after_stop:  # a stall stamped after the stop: servprof's own, never the app's
        stalls.append({**stalls[0], "start_wall_ns": stop_wall_ns + 1_000_000, "end_wall_ns": stop_wall_ns + 90_000_000})
    metadata = {"loop_stalls": metadata_safe(stalls), "watchdog": watchdog.summary(), "stop_wall_ns": stop_wall_ns,
                "event_loop_tid": watchdog.loop_native_id}
    prof.add_metadata_json("servprof", orjson.dumps(metadata).decode())
    prof.stop()
    path = tmp_path / "session.pt.trace.json"
    prof.export_chrome_trace(str(path))
    return load_trace(path)


def test_detector_names_the_function_with_a_fix(tmp_path: Path, loop: asyncio.AbstractEventLoop) -> None:
    trace = _session_trace(tmp_path, loop, lambda: on_loop(loop, lambda: blocking_report_writer(0.1)),
                           extra_stall_after_stop=True)
    findings, summary = detect_loop_stalls(trace)
    assert summary["stalls"] == 2 and summary["servprof_own"] == 1
    (finding,) = findings
    assert finding.kind == "loop_stall" and finding.evidence["function"] == "blocking_report_writer"
    assert "blocking_report_writer (test_loop_watchdog.py:" in finding.title
    assert finding.fix and "asyncio.to_thread" in finding.fix
    assert finding.request_ids == ["req-1", "req-2"] and finding.cost_ms >= 80
    assert finding.severity in ("warning", "critical")
    start_us = float(trace.ts.min())
    assert start_us <= finding.start_us < finding.end_us  # placed inside the trace's time


def spread_over_lines(seconds: float) -> None:
    """Pure Python whose time spreads evenly over several lines, as a per-character loop does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = sum(range(60))
        b = sum(range(60))
        c = sum(range(60))
        d = sum(range(60))
        e = sum(range(60))
        del a, b, c, d, e


def handler_with_a_c_call() -> None:
    spread_over_lines(0.12)
    time.sleep(0.05)  # a C call: all of its samples sit on this one line of the caller


def test_a_function_counts_its_samples_whatever_line_they_were_at(tmp_path: Path,
                                                                    loop: asyncio.AbstractEventLoop) -> None:
    trace = _session_trace(tmp_path, loop, lambda: on_loop(loop, handler_with_a_c_call))
    findings, _summary = detect_loop_stalls(trace)
    (finding,) = findings
    functions = finding.evidence["functions"]
    # Per line, the C call's single line could outnumber each of the loop's lines; per function
    # the loop, which took more than twice the time, names the stall.
    assert finding.evidence["function"] == "spread_over_lines", functions
    assert functions["spread_over_lines"] > functions["handler_with_a_c_call"], functions
    assert f"spread_over_lines (test_loop_watchdog.py:{finding.evidence['line']})" in finding.title


def test_a_tokenizer_on_the_loop_is_a_tokenization_stall(tmp_path: Path, loop: asyncio.AbstractEventLoop) -> None:
    def tokenize_prompt() -> None:  # a user's own tokenizer helper, by its name
        blocking_report_writer(0.1)

    trace = _session_trace(tmp_path, loop, lambda: on_loop(loop, tokenize_prompt))
    findings, _summary = detect_loop_stalls(trace)
    assert [f.kind for f in findings] == ["tokenization_stall"]
    assert findings[0].evidence["function"] in ("blocking_report_writer", "tokenize_prompt")
    assert "Tokenize off the event loop" in findings[0].fix


def test_a_sleep_on_the_loop_gets_the_async_fix(tmp_path: Path, loop: asyncio.AbstractEventLoop) -> None:
    def work() -> None:
        asyncio.run_coroutine_threadsafe(_block_async(0.1), loop).result(10)

    trace = _session_trace(tmp_path, loop, work)
    findings, _summary = detect_loop_stalls(trace)
    (finding,) = findings
    assert finding.evidence["function"] == "_block_async"
    assert finding.evidence["innermost"]["function"] in ("_block_async", "sleep")


def test_an_http_client_built_per_call_on_the_loop_gets_the_build_it_once_fix(
        tmp_path: Path, loop: asyncio.AbstractEventLoop) -> None:
    """``httpx.AsyncClient()`` in a handler builds an SSL context each time (it reads the CA
    store): on the loop that is the stall, and the fix is one client for the app's life, not
    moving the handler to a thread."""
    import httpx

    def handler_opening_clients() -> None:
        for _ in range(8):
            httpx.AsyncClient()

    trace = _session_trace(tmp_path, loop, lambda: on_loop(loop, handler_opening_clients))
    findings, _summary = detect_loop_stalls(trace)
    (finding,) = [f for f in findings if f.evidence["function"] != UNSAMPLED]
    assert any(f["file"].endswith("ssl.py") for f in finding.evidence["frames"]), finding.evidence["frames"]
    assert "built an SSL context on the event loop" in finding.fix and "once" in finding.fix


def test_a_future_waited_for_on_the_loop_gets_the_await_it_fix(tmp_path: Path, loop: asyncio.AbstractEventLoop) -> None:
    """A handler that submits the model call to a pool and blocks on ``future.result()``: the loop
    waits for another thread, and the fix is to await the hand-off, not to move the handler."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)

    def handler_waiting_for_the_pool() -> None:
        pool.submit(time.sleep, 0.1).result()

    try:
        trace = _session_trace(tmp_path, loop, lambda: on_loop(loop, handler_waiting_for_the_pool))
    finally:
        pool.shutdown()
    findings, _summary = detect_loop_stalls(trace)
    (finding,) = [f for f in findings if f.evidence["function"] != UNSAMPLED]
    assert finding.evidence["function"] == "handler_waiting_for_the_pool"
    assert "waits on the event loop for another thread (result (_base.py:" in finding.fix
    assert "asyncio.wrap_future(future)" in finding.fix and "AsyncTextIteratorStreamer" not in finding.fix


@pytest.mark.parametrize("op_during_the_stall", [True, False])
def test_a_stall_with_no_sample_is_named_by_a_range_inside_it_never_by_the_loops_own_frames(
        tmp_path: Path, op_during_the_stall: bool) -> None:
    """A stall the watchdog could not sample (a C call held the GIL) is named from the trace: by
    what the loop thread ran then. With with_stack, the loop thread's outer frames (its thread's
    entry, asyncio.run) cover every stall: they are where the loop runs, never what blocked it (a
    real session named a stall 'threading.py(1002): _bootstrap')."""
    from _kineto_builder import KinetoTrace

    base_ns, loop_tid = 1_700_000_000_000_000_000, 5
    trace = KinetoTrace()
    trace.frame("threading.py(1002): _bootstrap", 0.0, 100_000.0, tid=loop_tid)
    trace.frame("asyncio/runners.py(118): run", 1.0, 99_998.0, tid=loop_tid)
    if op_during_the_stall:
        trace.host("aten::matmul", 10_500.0, 19_000.0, tid=loop_tid)
    stall = {"start_wall_ns": base_ns + 10_000_000, "end_wall_ns": base_ns + 30_000_000, "duration_ms": 20.0,
             "samples": 0, "idle_samples": 0, "stacks": [], "in_flight": 1, "request_ids": ["r1"]}
    trace.metadata = {"baseTimeNanoseconds": base_ns, "servprof": orjson.dumps(
        {"loop_stalls": [stall], "watchdog": {"attached": True, "watched_s": 0.1, "loop_tid": loop_tid},
         "event_loop_tid": loop_tid}).decode()}
    findings, _summary = detect_loop_stalls(load_trace(trace.write(tmp_path / "t.json")))
    (finding,) = findings
    assert finding.evidence["function"] == ("aten::matmul" if op_during_the_stall else UNSAMPLED)
    assert "_bootstrap" not in finding.title and "runners.py" not in finding.title
