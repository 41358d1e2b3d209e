"""The cause of each gap, on small synthetic Kineto traces with known answers: read from the
thread that launched the device work, by self time (nested frames once, generic wrappers left
out, never more than the gap), sleeping threads never named, gaps counted once, short gaps
summed per step, and each cause with a fix. Only the timings are invented (tests/_kineto_builder.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from _kineto_builder import KinetoTrace, covered_in, eager_step, union

from servprof.detect.analysis import analyse
from servprof.trace import load_trace

ENGINE, OTHER, MONITOR = 1, 2, 3
DECODE = "servprof:decode_step|r1,r2"


def _gaps(analysis, cause=None):
    return [f for f in analysis.findings if f.kind == "decode_gap" and (cause is None or f.evidence["cause"] == cause)]


def _sleeping_monitor(trace: KinetoTrace, until: float) -> None:
    """A tqdm monitor thread asleep for the whole trace (as in real HF traces)."""
    trace.frame("threading.py(1032): _bootstrap", 0.0, until, tid=MONITOR)
    trace.frame("tqdm/_monitor.py(60): run", 1.0, until - 2, tid=MONITOR)
    trace.frame("threading.py(359): wait", 2.0, until - 4, tid=MONITOR)


def test_python_gap_named_by_self_time_never_more_than_the_gap(tmp_path: Path):
    trace = KinetoTrace()
    t = 0.0
    for _ in range(6):
        trace.host(DECODE, t, 60)
        end = eager_step(trace, t, kernels=10)
        # Between steps the engine prepares the next batch in Python: nested frames under a
        # generic wrapper that spans more than the gap.
        trace.frame("torch/nn/modules/module.py(1779): _call_impl", end - 100, 700)
        trace.frame("myapp/engine.py(10): prepare_batch", end + 20, 450)
        trace.host("aten::index", end + 200, 100)
        t = end + 500
    _sleeping_monitor(trace, t + 100)
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    (gap,) = _gaps(analysis)
    assert gap.evidence["cause"] == "host_python" and gap.evidence["where"] == "between_steps"
    worst = gap.evidence["worst_gaps"][0]
    assert worst["thread"] == ENGINE
    frames = {f["name"]: f["self_us"] for f in worst["top_frames"]}
    # prepare_batch's own time excludes the op inside it; the wrapper's time goes to nobody by name.
    assert frames["myapp/engine.py(10): prepare_batch"] == pytest.approx(350.0)
    assert frames["aten::index"] == pytest.approx(100.0)
    assert not any("_call_impl" in name for name in frames) or frames.get(
        "torch/nn/modules/module.py(1779): _call_impl", 0) < 100
    assert sum(worst["self_us"].values()) <= worst["idle_us"] + 1e-6
    assert all(g["thread"] != MONITOR for g in gap.evidence["worst_gaps"])
    assert gap.fix and "CUDA graphs" in gap.fix


def _engine_then_other_thread(other_work: Callable[[KinetoTrace, int, float], None]) -> tuple[KinetoTrace, float]:
    """Five engine steps, after each of which the engine thread records nothing for 800 µs while
    ``other_work(trace, k, end)`` puts what another thread ran then; returns the trace and its end."""
    trace = KinetoTrace()
    t = 0.0
    for k in range(5):
        trace.host(DECODE, t, 60)
        end = eager_step(trace, t, kernels=10)
        trace.frame("myapp/engine.py(20): step", t, end - t)  # (with_stack follows the engine thread)
        other_work(trace, k, end)
        t = end + 800
    return trace, t


def test_a_thread_whose_python_was_not_followed_is_never_read_as_waiting_for_the_gil(tmp_path: Path):
    """torch's Python tracer follows the threads alive when the profiler started: a pool worker
    started later records ops but no frame. Its unrecorded time may be its own Python, so another
    thread's work meanwhile is not 'held the GIL', and the fix says why nothing was recorded."""
    from servprof.detect.cause_texts import UNTRACED_THREAD_UNFRAMED

    trace = KinetoTrace()
    t = 0.0
    for _ in range(5):
        trace.host(DECODE, t, 60)
        end = eager_step(trace, t, kernels=10)
        trace.frame("myapp/normalise.py(5): slow_normalise", end + 10, 780, tid=OTHER)
        t = end + 800
    (gap,) = _gaps(analyse(load_trace(trace.write(tmp_path / "t.json"))))
    assert gap.evidence["cause"] == "untraced_host_time"
    assert gap.fix == UNTRACED_THREAD_UNFRAMED


def _servprof_capture_thread(trace: KinetoTrace, k: int, end: float) -> None:
    if k == 0:
        trace.frame("/srv/app/.venv/lib/servprof/capture.py(245): _run", 0.0, 20_000, tid=OTHER)
    trace.frame("/srv/app/.venv/lib/servprof/capture.py(249): _tick", end + 10, 780, tid=OTHER)


def _uvloop_thread(trace: KinetoTrace, _k: int, end: float) -> None:
    trace.frame("asyncio/runners.py(118): run", end - 5, 810, tid=OTHER)
    trace.frame("myapp/routes.py(30): health", end + 100, 20, tid=OTHER)


@pytest.mark.parametrize(("other_work", "never_named"), [(_servprof_capture_thread, "servprof"),
                                                          (_uvloop_thread, "runners.py")])
def test_no_thread_held_the_gil_when_the_other_thread_was_servprof_or_an_idle_event_loop(
        tmp_path: Path, other_work: Callable[[KinetoTrace, int, float], None], never_named: str):
    """servprof's capture thread (its profiler calls, its polls) is servprof's overhead, not the
    app's work. uvloop waits for events in C under ``asyncio.run``: the loop thread's innermost
    recorded frame is runners.py's ``run`` all that time, the GIL released; only a callback it ran
    is its work."""
    trace, _t = _engine_then_other_thread(other_work)
    (gap,) = _gaps(analyse(load_trace(trace.write(tmp_path / "t.json"))))
    assert gap.evidence["cause"] == "untraced_host_time"
    assert never_named not in gap.title


def test_a_thread_that_holds_the_gil_is_named_and_a_sleeping_one_never(tmp_path: Path):
    # Another thread runs the app's Python meanwhile.
    trace, t = _engine_then_other_thread(
        lambda trace, _k, end: trace.frame("myapp/normalise.py(5): slow_normalise", end + 10, 780, tid=OTHER))
    _sleeping_monitor(trace, t + 100)
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    (gap,) = _gaps(analysis)
    assert gap.evidence["cause"] == "gil_contention"
    worst = gap.evidence["worst_gaps"][0]
    assert worst["ran_instead"]["thread"] == OTHER
    assert worst["ran_instead"]["top_frames"][0]["name"] == "myapp/normalise.py(5): slow_normalise"
    assert f"thread {OTHER} ran myapp/normalise.py(5): slow_normalise" in gap.title


@pytest.mark.parametrize("calls_recorded", [False, True])
def test_a_thread_inside_a_call_since_before_the_tracer_started_is_not_read_as_holding_the_gil(
        tmp_path: Path, calls_recorded: bool):
    """A thread already inside a C call when torch's Python tracer started (an HTTP client's socket
    read, found so in a real server's deep window) shows only the Python frame that made the call,
    for the whole trace: the tracer never saw the call begin. That is no evidence of Python holding
    the GIL. A thread whose frame, open since then, records calls is running Python: named."""
    trace, t = _engine_then_other_thread(lambda trace, k, end: None)
    trace.frame("threading.py(1012): run", 0.0, t, tid=OTHER)
    name = "httpcore/_backends/sync.py(128): read" if not calls_recorded else "myapp/normalise.py(5): slow_normalise"
    trace.frame(name, 0.5, t - 1, tid=OTHER)
    if calls_recorded:
        for start in range(10, int(t) - 20, 40):
            trace.frame("<built-in method sub of re.Pattern object at 0x7f00>", float(start), 30.0, tid=OTHER)
    (gap,) = _gaps(analyse(load_trace(trace.write(tmp_path / "t.json"))))
    if calls_recorded:
        assert gap.evidence["cause"] == "gil_contention" and "re.Pattern" in gap.title
    else:
        assert gap.evidence["cause"] == "untraced_host_time"
        assert "sync.py" not in gap.title and "ran_instead" not in gap.evidence["worst_gaps"][0]


@pytest.mark.parametrize("call", ["<built-in method recv of socket object at 0x7f7a307fbf40>",
                                  "<method 'read' of '_ssl._SSLSocket' objects>"])
def test_a_thread_waiting_in_a_socket_read_never_held_the_gil(tmp_path: Path, call: str):
    """A client thread waiting for its answer (an HTTP call to another service, a database read)
    sits in a socket read, the GIL released: never the thread that kept the engine from running."""
    def client_read(trace: KinetoTrace, _k: int, end: float) -> None:
        trace.frame("httpcore/_backends/sync.py(128): read", end + 5, 790, tid=OTHER)
        trace.frame(call, end + 6, 788, tid=OTHER)

    trace, _t = _engine_then_other_thread(client_read)
    (gap,) = _gaps(analyse(load_trace(trace.write(tmp_path / "t.json"))))
    assert gap.evidence["cause"] == "untraced_host_time" and "sync.py" not in gap.title
    instead = gap.evidence["worst_gaps"][0].get("ran_instead")  # (shown as what it was: waiting)
    assert instead is None or instead["top_frames"][0]["class"] == "wait"


def test_only_a_sleeping_thread_meanwhile_is_not_a_cause(tmp_path: Path):
    trace = KinetoTrace()
    t = 0.0
    for _ in range(5):
        trace.host(DECODE, t, 60)
        t = eager_step(trace, t, kernels=10) + 800
    _sleeping_monitor(trace, t + 100)
    (gap,) = _gaps(analyse(load_trace(trace.write(tmp_path / "t.json"))))
    assert gap.evidence["cause"] == "untraced_host_time"
    assert "ran_instead" not in gap.evidence["worst_gaps"][0]


@pytest.mark.parametrize("recorded", ["python frames", "a servprof session", "neither"])
def test_time_nothing_recorded_for_is_followed_up_as_the_trace_allows(tmp_path: Path, recorded: str):
    """With Python frames in the trace, more frames would show nothing more (the thread was off the
    CPU or blocked in C); in a servprof session, frames come from servprof's setting; else from
    torch.profiler's."""
    from servprof.detect.cause_texts import UNTRACED_IN_SESSION, UNTRACED_WITH_FRAMES

    trace = KinetoTrace()
    t = 0.0
    for _ in range(5):
        trace.host(DECODE, t, 60)
        t = eager_step(trace, t, kernels=10) + 800
    if recorded == "python frames":
        _sleeping_monitor(trace, t + 100)
        trace.frame("myapp/engine.py(20): step", 0.0, 50.0)  # the engine thread is followed too
    elif recorded == "a servprof session":
        trace.metadata["servprof"] = {"session_id": "s1", "tier": "deep"}
    (gap,) = _gaps(analyse(load_trace(trace.write(tmp_path / "t.json"))))
    assert gap.evidence["cause"] == "untraced_host_time"
    expected = {"python frames": UNTRACED_WITH_FRAMES, "a servprof session": UNTRACED_IN_SESSION}
    if recorded in expected:
        assert gap.fix == expected[recorded]
    else:
        assert gap.fix.startswith("Record with with_stack=True")


def test_blocking_device_to_host_read_every_step(tmp_path: Path):
    """Each step ends with .item(): aten::item > _local_scalar_dense > a DtoH copy into pageable memory
    and cudaStreamSynchronize. The device drains while the host waits, then idles while the host
    runs 200 µs of Python before launching the next step: a sync per step."""
    trace = KinetoTrace()
    t = 0.0
    syncs = []
    for _ in range(6):
        end = eager_step(trace, t, kernels=10)
        trace.host(DECODE, t, end + 10 - t)  # the read is the step's last act
        h = t + 60
        trace.host("aten::item", h, end + 10 - h)
        trace.host("aten::_local_scalar_dense", h + 1, end + 8 - h)
        trace.launch(h + 2, end, 4.0, name="Memcpy DtoH (Device -> Pageable)", runtime="cudaMemcpyAsync",
                     cat="gpu_memcpy")
        trace.host("cudaStreamSynchronize", h + 6, end + 4 - h, cat="cuda_runtime")
        syncs.append((end + 4, end + 6))
        t = end + 10 + 200
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    (gap,) = _gaps(analysis)
    assert gap.evidence["cause"] == "synchronize" and gap.evidence["where"] == "between_steps"
    assert gap.evidence["gaps"] == 5
    # The device idles from the copy's end to the next step's first kernel (launch + 20 µs).
    assert gap.evidence["median_gap_ms"] == pytest.approx((6 + 200 + 20) / 1000, abs=1e-6)
    assert gap.evidence["host_reads_per_step"] == 1.0 and gap.evidence["host_read_calls"] == {".item()": 6}
    worst = gap.evidence["worst_gaps"][0]
    assert {"aten::item", "cudaStreamSynchronize"} & {f["name"] for f in worst["top_frames"]}
    assert ".item()" in gap.fix and "one step behind" in gap.fix


def test_python_before_the_first_graph_launch_of_a_compiled_forward(tmp_path: Path):
    trace = KinetoTrace()
    t = 0.0
    for _ in range(5):
        trace.host(DECODE, t, 700)
        # torch.compile's guards and dispatch: Python frames, no runtime call, no kernel ...
        trace.frame("torch/_dynamo/eval_frame.py(1039): _fn", t, 650)
        trace.host("TorchDynamo Cache Lookup", t + 5, 300)
        trace.frame("torch/_dynamo/guards.py(2100): check", t + 310, 290)
        # ... then one graph replay runs the whole step.
        corr = trace.launch(t + 610, t + 640, 50, runtime="cudaGraphLaunch")
        for i in range(1, 8):
            trace.device(t + 640 + i * 50, 50, f"graph_kernel_{i}", corr)
        t += 1100
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    (gap,) = _gaps(analysis)
    assert gap.evidence["cause"] == "compiled_dispatch"
    worst = gap.evidence["worst_gaps"][0]
    names = {f["name"] for f in worst["top_frames"]}
    assert "TorchDynamo Cache Lookup" in names and "torch/_dynamo/guards.py(2100): check" in names
    assert "CUDA graph" in gap.fix


@pytest.mark.parametrize("runtime", ["cudaLaunchKernel", "cudaGraphLaunch"])
def test_a_launch_call_that_takes_milliseconds_is_a_slow_launch_not_launch_bound(tmp_path: Path, runtime: str):
    """The first launch of a kernel loads its code (CUDA lazy loading, a ROCm code object): the
    call itself takes milliseconds while the device idles. That is one slow launch, named with the
    time the call took, not "many short gaps". A graph launch's cost grows with the graph: a long
    one is not called a slow kernel launch."""
    trace = KinetoTrace()
    t = 0.0
    for k in range(4):
        trace.host(DECODE, t, 2600)
        end = eager_step(trace, t, kernels=10)
        if k == 1:  # the device's queue runs dry; the next launch call takes 2 ms itself
            trace.host("aten::add_", end + 5, 2030)
            trace.launch(end + 15, end + 2025, 40.0, runtime=runtime, launch_dur=2000.0)
        t += 2700
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    slow = _gaps(analysis, "slow_launch")
    if runtime == "cudaGraphLaunch":
        assert slow == []
        return
    (gap,) = slow
    worst = gap.evidence["worst_gaps"][0]
    assert worst["count"] == 1 and worst["idle_us"] == pytest.approx(2025 - 0.0, abs=30)
    assert worst["self_us"]["launch"] >= 2000
    assert f"on thread {ENGINE}: cudaLaunchKernel (2.00 ms)" in gap.title
    assert "first use" in gap.fix and "start-up" in gap.fix
    assert not _gaps(analysis, "launch_bound") or all(
        g["count"] > 1 for f in _gaps(analysis, "launch_bound") for g in f.evidence["worst_gaps"])


@pytest.mark.parametrize("call", ["cudaFree", "cudaEventCreateWithFlags"])
def test_a_gap_spent_in_runtime_calls_names_them_never_python_nobody_recorded(tmp_path: Path, call: str):
    """The caching allocator giving memory back (cudaFree syncs the device) or the first event a
    process creates: the thread spent the gap in a runtime call that launches nothing. No Python
    was recorded (no with_stack): the gap is not "Python on the launching thread"."""
    trace = KinetoTrace()
    t = 0.0
    for k in range(4):
        trace.host(DECODE, t, 4600)
        end = eager_step(trace, t, kernels=10)
        if k == 1:
            trace.host("aten::empty", end + 5, 3010)
            trace.host(call, end + 10, 3000, cat="cuda_runtime")
            trace.launch(end + 3020, end + 3030, 40.0)
        t += 4700
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    (gap,) = _gaps(analysis, "runtime_calls")
    worst = gap.evidence["worst_gaps"][0]
    assert worst["count"] == 1 and worst["self_us"]["runtime"] >= 3000 * 0.99
    assert f"on thread {ENGINE}: {call} (3.00 ms)" in gap.title
    assert "cudaFree" in gap.fix and "start-up" in gap.fix
    assert not _gaps(analysis, "host_python")


def test_a_gap_while_torch_compile_compiles_is_compiling_not_dispatch(tmp_path: Path):
    """A recompile in the middle of serving: the launching thread is inside Dynamo's
    ``entire_frame_compile`` range (its Python and ops inherit the range: compiling) until the
    compiled graph's first launch. Before, the gap read as "Python before the first graph launch
    (guards and dispatch)"."""
    trace = KinetoTrace()
    t = 0.0
    for k in range(4):
        trace.host(DECODE, t, 5000)
        trace.frame("torch/_dynamo/eval_frame.py(1039): _fn", t, 4900)
        if k == 2:
            trace.annotation("entire_frame_compile", t + 10, 4000)
            trace.frame("torch/_inductor/codegen/wrapper.py(10): generate", t + 20, 2500)
            trace.frame("myapp/model.py(5): forward", t + 2600, 1300)  # traced again by Dynamo
        corr = trace.launch(t + 4100, t + 4120, 50, runtime="cudaGraphLaunch")
        for i in range(1, 8):
            trace.device(t + 4120 + i * 50, 50, f"graph_kernel_{i}", corr)
        trace.host("TorchDynamo Cache Lookup", t + 4020, 60)
        t += 5200
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    (gap,) = _gaps(analysis, "compiling")
    worst = gap.evidence["worst_gaps"][0]
    assert worst["self_us"]["compiling"] == pytest.approx(4000, abs=1)  # the whole range, inside the gap
    assert "torch.compile compiling" in gap.title and "myapp/model.py(5): forward" in gap.title
    assert "start-up" in gap.fix
    assert all(f["class"] == "compiling" for f in worst["top_frames"][:2])


def test_a_step_waiting_for_a_dataloader_worker_is_data_loading_not_waiting(tmp_path: Path):
    """With num_workers > 0 the step's thread waits in a queue inside the DataLoader's
    ``__next__`` (with_stack: a ``queue.py: get`` frame, a wait). The range torch.profiler puts
    around ``__next__`` says what the wait was for: the input batch, not the scheduler."""
    trace = KinetoTrace()
    t = 0.0
    for _ in range(5):
        trace.annotation("ProfilerStep#1", t, 1500)
        trace.annotation("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", t + 5, 900)
        trace.frame("torch/utils/data/dataloader.py(1329): _next_data", t + 10, 880)
        trace.frame("queue.py(180): get", t + 20, 860)
        end = eager_step(trace, t + 910, kernels=10)
        t = end + 20
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    (gap,) = _gaps(analysis, "data_loading")
    assert not _gaps(analysis, "waiting")
    worst = gap.evidence["worst_gaps"][0]
    assert worst["data_loading"]["range"] == "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__"
    assert worst["data_loading"]["us"] == pytest.approx(900, abs=1) and worst["self_us"]["wait"] >= 800
    assert f"on thread {ENGINE}: enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__ for 0.90 of" in gap.title
    assert "num_workers" in gap.fix


@pytest.mark.parametrize("blocked_us", [350.0, 100.0])
def test_a_sync_running_as_the_device_went_idle_explains_the_gap_as_far_as_it_blocked(tmp_path: Path,
                                                                                     blocked_us: float):
    """A blocking copy ends a few µs into the gap, then the host runs three ops of 100 µs before it
    launches again. Without the copy's wait the host would have run them that much sooner, no more:
    a copy that blocked for longer than half the gap (the step's device work) is its cause, named
    though the ops hold more self time in it; one that blocked briefly leaves the gap to the ops
    (the host is slower than the device, sync or not)."""
    trace = KinetoTrace()
    t = 0.0
    for _ in range(5):
        trace.host(DECODE, t, 1200)
        end = eager_step(trace, t, kernels=10)
        trace.host("cudaMemcpy", end - blocked_us, blocked_us + 5, cat="cuda_runtime")  # returns 5 µs after the device idles
        for i in range(3):
            trace.host(f"aten::op_{i}", end + 10 + i * 100, 100)
        t = end + 400
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    if blocked_us < 0.5 * 400:
        assert not _gaps(analysis, "synchronize")
        (gap,) = _gaps(analysis, "host_ops")
        assert "aten::op_" in gap.title
        return
    (gap,) = _gaps(analysis, "synchronize")
    assert gap.title.endswith(f"on thread {ENGINE}: cudaMemcpy")
    worst = gap.evidence["worst_gaps"][0]
    assert "cudaMemcpy" not in {f["name"] for f in worst["top_frames"][:3]}  # three ops hold more
    assert worst["cause_frames"] == [{"name": "cudaMemcpy", "class": "sync", "self_us": 5.0}]


def test_a_thousand_tiny_gaps_are_one_launch_bound_cause_summed_per_step(tmp_path: Path):
    """Eager decode: 1,000 kernels of 5 µs per step, each launched as the previous one ends, so the
    device idles ~10 µs before each: no gap is worth listing, together they are half the step."""
    trace = KinetoTrace()
    t = 0.0
    for _ in range(3):
        trace.host(DECODE, t, 15020)
        for i in range(1000):
            trace.launch(t + i * 15, t + i * 15 + 10, 5.0, launch_dur=4.0)
        t += 15100
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    (gap,) = _gaps(analysis)
    assert gap.evidence["cause"] == "launch_bound" and gap.evidence["where"] == "inside_step"
    assert gap.evidence["gaps"] == 3 * 999
    holes = union(trace.kernels)
    inside = sum(b[0] - a[1] for a, b in zip(holes, holes[1:], strict=False) if b[0] - a[1] < 50)
    assert gap.cost_ms == pytest.approx(inside / 1000)
    assert len(gap.evidence["worst_gaps"]) == 3  # one summed entry per step, not 2,997
    assert gap.severity == "critical"  # two thirds of every step


def test_straggler_collective(tmp_path: Path):
    trace = KinetoTrace()
    t = 0.0
    for k in range(8):
        trace.host(DECODE, t, 60)
        end = eager_step(trace, t, kernels=5)
        wait = 2000.0 if k == 5 else 100.0
        trace.launch(t + 30, end, wait, name="ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*)")
        t = end + wait + 10
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    (gap,) = _gaps(analysis, "collective_straggler")
    assert gap.cost_ms == pytest.approx(1.9)
    assert gap.evidence["worst_gaps"][0]["median_us"] == pytest.approx(100.0)
    assert "straggler rank" in gap.fix
    (missing,) = [m for m in analysis.summary["missing"] if m["what"] == "other ranks"]
    assert "holds 1 rank(s) and names no world size" in missing["message"]
    # It is waiting, but the device shows it busy: it is never counted as idle too.
    assert gap.evidence["gaps"] == 1 and not _gaps(analysis, "kernel_wait")


ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*)"


def _ranks_folder(tmp_path: Path, late_rank: int, late_by: float, clock_offset: dict[int, float],
                  first_step: dict[int, int] | None = None) -> Path:
    """Three rank files of eight steps, each ending in one all-reduce: ``late_rank`` reaches the
    sixth one ``late_by`` µs after the others, who wait for it; every call ends at the same instant
    on all ranks (plus a rank's ``clock_offset``: its host's clock disagreeing with the others').
    ``first_step``: a rank whose profiler started that many steps late (its file has fewer calls)."""
    folder = tmp_path / "ranks"
    folder.mkdir()
    for rank in range(3):
        trace = KinetoTrace(metadata={"distributedInfo": {"rank": rank, "world_size": 3, "backend": "nccl"}})
        shift = clock_offset.get(rank, 0.0)
        for k in range((first_step or {}).get(rank, 0), 8):
            t = k * 5000.0 + shift
            trace.host(DECODE, t, 60)
            ready = eager_step(trace, t, kernels=5)
            late = late_by if k == 5 else 0.0
            arrive = ready + (late if rank == late_rank else 0.0)
            trace.launch(t + 30, arrive, ready + late + 100 - arrive, name=ALL_REDUCE)
        trace.write(folder / f"rank-{rank}.json")
    return folder


def test_a_folder_of_ranks_names_the_rank_a_collective_waited_for(tmp_path: Path):
    """With every rank's trace, the wait is pinned on the rank that reached the collective last:
    the others' calls of it end together with theirs, and it started its call last."""
    analysis = analyse(load_trace(_ranks_folder(tmp_path, late_rank=2, late_by=4000.0, clock_offset={})))
    gaps = [g for g in analysis.gaps if g.cause == "collective_straggler"]
    assert sorted(g.rank for g in gaps) == [0, 1]  # (rank 2 waited for no one)
    for gap in gaps:
        arrived = gap.evidence["arrived_last"]
        assert {k: v for k, v in arrived.items() if k != "before_arrival"} == \
            {"ranks": [2], "after_us": 4000.0, "at_us": arrived["at_us"], "ranks_compared": 3}
        assert arrived["before_arrival"]["held_by"] == "launched"  # (its launch was at the step's start)
        assert arrived["at_us"] == gap.end_us - gap.evidence["duration_us"] + 4000.0  # (rank 2's start, on the shared clock)
        assert "rank 2 arrived last, 4.00 ms after this rank" in gap.explanation
    (finding,) = [f for f in analysis.findings if f.evidence.get("cause") == "collective_straggler"]
    assert finding.fix.startswith("Rank 2 arrived last at 2 of these 2 collectives")
    assert "other ranks" not in {m["what"] for m in analysis.summary["missing"]}


def test_ranks_whose_profilers_started_apart_are_matched_by_when_the_call_ended(tmp_path: Path):
    """Rank 2's profiler started two steps after the others' (each vLLM worker starts its own): its
    k-th all-reduce is not theirs, but the one ending with theirs is, and it is still named."""
    analysis = analyse(load_trace(_ranks_folder(tmp_path, late_rank=2, late_by=4000.0, clock_offset={},
                                                first_step={2: 2})))
    gaps = [g for g in analysis.gaps if g.cause == "collective_straggler"]
    assert sorted(g.rank for g in gaps) == [0, 1]
    assert all(g.evidence["arrived_last"]["ranks"] == [2] for g in gaps)


def test_a_rank_whose_clock_disagrees_is_not_named(tmp_path: Path):
    """Rank 2's host clock runs 3 ms ahead: its calls do not end with the others', so nothing says
    they are the same collective, and its start cannot be compared; no rank is named."""
    analysis = analyse(load_trace(_ranks_folder(tmp_path, late_rank=2, late_by=2000.0, clock_offset={2: 3000.0})))
    gaps = [g for g in analysis.gaps if g.cause == "collective_straggler"]
    assert sorted(g.rank for g in gaps) == [0, 1]
    assert all("arrived_last" not in g.evidence and "arrived last" not in g.explanation for g in gaps)


def test_overlapping_step_windows_count_each_idle_stretch_once(tmp_path: Path):
    """Step k's last kernel (on a second stream) runs past step k+1's first kernels: the device
    spans overlap. Every hole of the device timeline belongs to exactly one step or gap."""
    trace = KinetoTrace()
    t = 0.0
    for _ in range(5):
        trace.host(DECODE, t, 200)
        end = eager_step(trace, t, kernels=6)
        trace.launch(t + 40, end - 100, 700, name="side_stream_kernel", stream=8)
        t = end + 300  # the next step launches while the side kernel still runs
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    steps = sorted(analysis.steps, key=lambda s: s.device_start_us)
    assert any(a.device_end_us > b.device_start_us for a, b in zip(steps, steps[1:], strict=False))
    blocks = union(trace.kernels)
    span = (steps[0].device_start_us, max(s.device_end_us for s in steps))
    idle = (span[1] - span[0]) - covered_in(blocks, *span)
    rows = analysis.summary["utilisation"]["steps"]
    assert sum(r["idle_inside_ms"] + r["idle_between_ms"] for r in rows) == pytest.approx(idle / 1000)
    assert sum(r["cycle_ms"] for r in rows) == pytest.approx((span[1] - span[0]) / 1000)
    counted = sum(g.idle_us for g in analysis.gaps) + sum(
        g["idle_us"] for g in analysis.summary["decode_gap"].get("unreported_gaps", []))
    assert counted <= idle + 1e-6


def test_a_cause_that_costs_next_to_nothing_is_never_critical(tmp_path: Path):
    trace = KinetoTrace()
    t = 0.0
    for _ in range(3):  # 3 tiny steps, each with 70 µs of idle: 40% of the step, 0.14 ms in all
        trace.host(DECODE, t, 30)
        end = eager_step(trace, t, kernels=2, kernel_us=20)
        t = end + 50
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    for gap in _gaps(analysis):
        assert gap.severity != "critical" and (gap.cost_ms >= 0.1 or gap.severity == "info")


def test_nothing_after_servprofs_stop_is_blamed_on_the_app(tmp_path: Path):
    """Session metadata says stop() began at 3,000 µs: the step running then is cut there, the one
    after it dropped, and the 'gap' the stop caused (the engine thread held off the GIL) is gone."""
    base_ns = 1_700_000_000_000_000  # (trace µs = (unix ns - base) / 1000)
    trace = KinetoTrace()
    trace.metadata = {"baseTimeNanoseconds": base_ns,
                      "servprof": {"session_id": "s", "stop_wall_ns": base_ns + 2_900_000}}
    t = 0.0
    for k in range(5):
        length = 1400.0 if k == 3 else 500.0  # step 3 straddles the stop and seems stalled by it
        trace.host(DECODE, t, length)
        trace.host("aten::mm", t, 400)
        t += length + 100
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    assert [s.end_us for s in analysis.steps] == [500.0, 1100.0, 1700.0, 2900.0]
    overhead = analysis.summary["servprof_overhead"]
    assert overhead["steps_cut"] == 1 and overhead["steps_dropped"] == 1
    assert overhead["steps_cut_ms"] == pytest.approx(0.3)
    assert overhead["after_stop_ms"] == pytest.approx((t - 100 - 2900) / 1000)
    assert all(f.end_us <= 2900.0 for f in analysis.findings)
    assert not [f for f in analysis.findings if f.kind == "decode_gap" and f.severity != "info"]
    # Without the stop time the same trace blames the app for the stalled step.
    trace.metadata = {}
    blamed = analyse(load_trace(trace.write(tmp_path / "u.json")))
    assert [g for g in blamed.gaps if g.start_us < 2900.0 < g.end_us]


def test_nothing_after_servprofs_collection_cut_is_blamed_on_the_app(tmp_path: Path):
    """Collection switched off at 2,000 µs (a deep session's drain or the budget's cut), stop()
    at 2,900: a step open at the cut kept its range but none of its ops, so it is cut at the cut,
    not at the stop, and the report says collection was switched off there."""
    base_ns = 1_700_000_000_000_000
    trace = KinetoTrace()
    trace.metadata = {"baseTimeNanoseconds": base_ns,
                      "servprof": {"session_id": "s", "cut_wall_ns": base_ns + 2_000_000,
                                   "stop_wall_ns": base_ns + 2_900_000}}
    t = 0.0
    for _ in range(4):
        trace.host(DECODE, t, 500.0)
        trace.host("aten::mm", t, 400)  # each starts before the cut: recorded whole
        t += 600
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    assert [s.end_us for s in analysis.steps] == [500.0, 1100.0, 1700.0, 2000.0]
    overhead = analysis.summary["servprof_overhead"]
    assert overhead["stop_us"] == pytest.approx(2000.0)
    assert overhead["steps_cut"] == 1 and overhead["steps_cut_ms"] == pytest.approx(0.3)
    assert "switched collection off 2.0 ms into the trace" in overhead["message"]
    assert not [f for f in analysis.findings if f.end_us > 2000.0]
    # A cut time that is not before the stop is not a cut: the stop is the cutoff.
    trace.metadata["servprof"]["cut_wall_ns"] = base_ns + 3_000_000
    late = analyse(load_trace(trace.write(tmp_path / "u.json"))).summary["servprof_overhead"]
    assert late["stop_us"] == pytest.approx(2900.0) and "stop() began" in late["message"]


@pytest.mark.parametrize("runtime_tid", ["25738", "engine"])
def test_a_thread_given_as_text_is_one_thread_and_named_as_the_trace_names_it(tmp_path: Path, runtime_tid: str):
    """2021 Kineto traces (PyTorch's TensorBoard plugin samples) give the ops' tid as an int and
    the runtime calls' tid as text ("tid": "25738"): one thread. Read as two, every gap's launching
    thread "recorded nothing" ("thread -182": servprof's id for the text, found nowhere in the
    trace). A thread named with other text keeps the name, and the findings use it."""
    trace = KinetoTrace()
    ops_tid: int | str = 25738 if runtime_tid == "25738" else runtime_tid
    t = 0.0
    for _ in range(5):
        trace.host(DECODE, t, 60, tid=ops_tid)  # type: ignore[arg-type]
        end = eager_step(trace, t, kernels=10, tid=runtime_tid)  # type: ignore[arg-type]
        trace.host("aten::index_select", end + 20, 760, tid=ops_tid)  # type: ignore[arg-type]
        t = end + 800
    loaded = load_trace(trace.write(tmp_path / "t.json"))
    (gap,) = _gaps(analyse(loaded))
    assert gap.evidence["cause"] == "host_ops" and f"on thread {runtime_tid}: aten::index_select" in gap.title
    worst = gap.evidence["worst_gaps"][0]
    assert loaded.thread_label(worst["thread"]) == runtime_tid
    assert (worst["thread"] == 25738) == (runtime_tid == "25738")  # text of an int is that int, a name stays one


def _steps_with_a_long_first(trace: KinetoTrace, first_cause: str, marker: str = DECODE) -> None:
    """Six steps: every one ends with a 1 ms blocking read; the first also holds 30 ms of
    ``first_cause`` (a slow launch, or a host op) while the device idles."""
    t = 0.0
    for k in range(6):
        end = eager_step(trace, t, kernels=10)
        if k == 0 and first_cause == "slow_launch":
            trace.host("aten::add_", end + 5, 30_010)
            trace.launch(end + 10, end + 30_020, 40.0, launch_dur=30_000.0)
            end += 30_060
        elif k == 0:
            trace.host("aten::nonzero_static", end + 5, 30_000)
            trace.launch(end + 30_010, end + 30_020, 40.0)
            end += 30_060
        trace.host("cudaStreamSynchronize", end + 5, 1000, cat="cuda_runtime")
        trace.launch(end + 1010, end + 1020, 40.0)
        trace.host(marker, t, end + 1015 - t)
        t = end + 1100


@pytest.mark.parametrize("first_cause", ["slow_launch", "host_ops"])
def test_a_long_first_step_is_reported_apart_and_hides_nothing(tmp_path: Path, first_cause: str):
    """A first decode step 3x longer than the later ones: its gaps say so (a slow launch there is a
    one-time warm-up cost, never critical; a host op is not called warm-up), and the later steps'
    blocking reads are judged against the later steps' time, not hidden by the first one's."""
    trace = KinetoTrace()
    _steps_with_a_long_first(trace, first_cause)
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    steps = analysis.steps
    assert steps[0].time_us > 3 * steps[1].time_us
    (first,) = _gaps(analysis, first_cause)
    assert first.evidence["first_step_only"] and first.evidence["warm_up"] == (first_cause == "slow_launch")
    assert "inside the first of the decode steps (" in first.title
    assert ("a one-time warm-up cost" in first.title) == (first_cause == "slow_launch")
    if first_cause == "slow_launch":
        assert first.severity == "warning"
    (reads,) = [f for f in _gaps(analysis, "synchronize") if not f.evidence["first_step_only"]]
    later = steps[-1].device_end_us - steps[1].device_start_us
    assert reads.evidence["share_of_step_time"] == pytest.approx(reads.cost_ms * 1000 / later, abs=1e-3)
    assert reads.severity == "critical"


def test_a_first_prefill_is_longer_by_nature_not_reported_apart(tmp_path: Path):
    trace = KinetoTrace()
    _steps_with_a_long_first(trace, "host_ops", marker="servprof:prefill|r1")
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    assert not any(f.evidence.get("first_step_only") for f in _gaps(analysis))


def test_a_thread_the_profiler_could_not_name_is_said_to_be_one(tmp_path: Path):
    # A light session on a GPU server: the CUDA calls of a thread that recorded nothing else (an
    # unsampled request's) carry CUPTI's own id for it, above any OS thread id (seen on an H100).
    trace = KinetoTrace()
    trace.launch(0.0, 10.0, 5.0, tid=1849)
    trace.launch(20.0, 30.0, 5.0, tid=754947776)
    named = KinetoTrace(events=[*trace.events, {"ph": "M", "name": "thread_name", "pid": 100, "tid": 754947776,
                                                "args": {"name": "thread 754947776 (python3)"}}])
    loaded, loaded_named = load_trace(trace.write(tmp_path / "t.json")), load_trace(named.write(tmp_path / "n.json"))
    assert loaded.thread_label(1849) == "1849"
    assert loaded.thread_label(754947776).startswith("754947776 (an id the profiler gave a thread it could not name")
    assert loaded_named.thread_label(754947776) == "754947776"  # a thread the trace names is that thread


def test_queued_kernels_held_apart_name_a_shared_gpu_among_the_causes(tmp_path: Path):
    # Every kernel launched well before it runs (the host far ahead), yet 60 µs of idle between
    # them, no other stream of this process running: what six servers sharing one H100 showed.
    trace = KinetoTrace()
    t = 0.0
    for _step in range(6):
        trace.host(DECODE, t, 200.0)
        begin = t + 300.0
        for i in range(20):
            trace.launch(t + 5 * i, begin + i * 100.0, 40.0)  # 40 µs kernels, 60 µs apart
        t = begin + 20 * 100.0 + 100.0
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    waits = _gaps(analysis, "kernel_wait")
    assert waits and all("another process's work on the same GPU" in gap.title for gap in waits)
    assert all(gap.fix.startswith("If several processes share this GPU") for gap in waits)
    assert sum(gap.evidence["gaps"] for gap in waits) >= 6 * 19  # every hole between queued kernels


def test_a_gil_held_by_another_requests_model_step_is_concurrent_model_calls(tmp_path: Path):
    # As above, but what the other thread runs meanwhile is another request's model step (one
    # model call per request, each on its own thread, as the thread-pool servers on an H100): the
    # fix is to batch the calls, not to move that thread's work out of the process.
    def other_step(trace: KinetoTrace, k: int, end: float) -> None:
        trace.annotation(f"servprof:decode_step|r{10 + k}", end + 10, 780, tid=OTHER)
        trace.launch(end + 12, end + 20, 5.0, tid=OTHER)  # its step's device work, then its host ops
        trace.host("aten::index", end + 30, 750, tid=OTHER)

    trace, _ = _engine_then_other_thread(other_step)
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    (gap,) = _gaps(analysis)
    assert gap.evidence["cause"] == "concurrent_steps"
    assert "other requests' model steps ran on other threads meanwhile" in gap.title
    assert "batch" in gap.fix


def _layers(trace: KinetoTrace, host: float, device: float, count: int) -> tuple[float, float]:
    """``count`` layers: an aten::linear on the host launching each one's kernel; returns the
    (host, device) times after them."""
    for i in range(count):
        trace.host("aten::linear", host + 5 * i, 4.0)
        trace.launch(host + 5 * i + 1, device + 40 * i, 40.0)
    return host + 5 * count, device + 40 * count


def test_a_read_between_a_steps_layers_is_the_forwards_own_sync(tmp_path: Path):
    """Each step's forward reads a device value halfway through its layers (an eager MoE's expert
    loop, a boolean mask's nonzero): the device drains, the host reads, then launches the rest of
    the layers. The sync is the forward's, not the sampled token's read: the fix says so."""
    trace = KinetoTrace()
    t = 0.0
    for _ in range(6):
        host, device = _layers(trace, t, t + 20, 5)
        trace.host("aten::item", host, device + 10 - host)
        trace.host("aten::_local_scalar_dense", host + 1, device + 8 - host)
        trace.launch(host + 2, device, 4.0, name="Memcpy DtoH (Device -> Pageable)", runtime="cudaMemcpyAsync",
                     cat="gpu_memcpy")
        trace.host("cudaStreamSynchronize", host + 6, device + 4 - host, cat="cuda_runtime")
        resume = device + 10 + 100  # (100 µs of Python nothing recorded, then the later layers)
        host, device = _layers(trace, resume, resume + 20, 5)
        trace.host(DECODE, t, host + 5 - t)
        t = device + 10
    analysis = analyse(load_trace(trace.write(tmp_path / "t.json")))
    (gap,) = [f for f in _gaps(analysis, "synchronize") if f.evidence["where"] == "inside_step"]
    assert gap.evidence["host_reads_per_step"] == 1.0 and gap.evidence["host_reads_in_forward_per_step"] == 1.0
    assert "model's forward reads the device" in gap.title
    assert "fused_moe" in gap.fix and "one step behind" not in gap.fix
