"""What the rank that arrived last at a collective did before it (late_rank.py), read from its own
trace over the time the others waited: its device still busy, its host not yet launching the call
(and what that thread ran), or the call launched in time and started late on the device.

Synthetic rank folders first (the timings invented, the answers written from them), then PARAM's
DLRM traces: eight V100 ranks where rank 7's host arrived last at an all-to-all while its GPU sat
idle, checked against the raw JSON.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from _kineto_builder import KinetoTrace, eager_step

from servprof.detect.analysis import analyse
from servprof.trace import load_trace

DECODE = "servprof:decode_step|r1,r2"
ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
LATE_STEP, LATE_BY, LATE_RANK = 5, 4000.0, 2
PUBLIC = Path(__file__).parent / "fixtures" / "public"


def _folder(tmp_path: Path, held_by: str) -> Path:
    """Three ranks of eight steps, each ending in one all-reduce that ends at the same instant on
    all; at step LATE_STEP rank LATE_RANK starts it LATE_BY µs after the others, because (``held_by``)
    its host spent that time in a data-loading range before launching it ("host"; "skewed": the same,
    the launch stamped after its kernel began), its device ran a long kernel first ("device"), or its
    stream started the call late with nothing running ("launched")."""
    folder = tmp_path / held_by
    folder.mkdir()
    for rank in range(3):
        trace = KinetoTrace(metadata={"distributedInfo": {"rank": rank, "world_size": 3, "backend": "nccl"}})
        for k in range(8):
            t = k * 5000.0
            trace.host(DECODE, t, 60)
            ready = eager_step(trace, t, kernels=5)  # the step's kernels end here
            late = LATE_BY if k == LATE_STEP and rank == LATE_RANK else 0.0
            if late and held_by in ("host", "skewed"):
                trace.annotation("## load_batch ##", ready, late - 100)  # the host busy, then the launch
                trace.host("aten::copy_", ready + 100, 1000)
                # ("skewed": the host's clock 30 µs behind the device's, the launch stamped after its kernel began)
                trace.launch(ready + late + (30 if held_by == "skewed" else -50), ready + late, 100, name=ALL_REDUCE)
            elif late and held_by == "device":
                trace.launch(t + 40, ready, late, name="big_gemm_kernel")  # queued behind the step's kernels
                trace.launch(t + 45, ready + late, 100, name=ALL_REDUCE)
            else:
                trace.launch(t + 30, ready + late, ready + LATE_BY * (k == LATE_STEP) + 100 - ready - late,
                             name=ALL_REDUCE)
        trace.write(folder / f"rank-{rank}.json")
    return folder


def _waits(folder: Path):
    """The two ranks' waits (rank 2 waited for no one), what each says rank 2 did, and the finding."""
    analysis = analyse(load_trace(folder))
    gaps = [g for g in analysis.gaps if g.cause == "collective_straggler"]
    assert sorted(g.rank for g in gaps) == [0, 1]
    (finding,) = [f for f in analysis.findings if f.evidence.get("cause") == "collective_straggler"]
    return [(g, g.evidence["arrived_last"]["before_arrival"]) for g in gaps], finding


def test_a_late_host_is_named_with_what_it_ran_before_the_launch(tmp_path: Path):
    waits, finding = _waits(_folder(tmp_path, "host"))
    for gap, before in waits:
        assert before["rank"] == LATE_RANK and before["held_by"] == "host" and before["device_busy_ms"] == 0.0
        assert before["window_ms"] == LATE_BY / 1e3
        assert before["launched_after_ms"] == (LATE_BY - 50) / 1e3
        # the range's own time (less the copy inside it), then the copy
        assert [(f["name"], f["self_ms"]) for f in before["host_top"][:2]] == \
            [("## load_batch ##", (LATE_BY - 100 - 1000) / 1e3), ("aten::copy_", 1.0)]
        assert f"thread 1 launched the call {(LATE_BY - 50) / 1e3:.2f} ms into them" in gap.explanation
    assert "Rank 2 arrived last at 2 of these 2 collectives" in finding.fix
    assert "its host had not launched the call yet (most of its own time in ## load_batch ##" in finding.fix


def test_a_launch_stamped_after_its_kernel_began_is_cut_at_the_kernel(tmp_path: Path):
    waits, _finding = _waits(_folder(tmp_path, "skewed"))
    for _gap, before in waits:
        assert before["held_by"] == "host" and before["launched_after_ms"] == before["window_ms"] == LATE_BY / 1e3
        assert "## load_batch ##" in [f["name"] for f in before["host_top"]]


def test_a_late_device_is_named_with_the_kernels_it_still_ran(tmp_path: Path):
    waits, finding = _waits(_folder(tmp_path, "device"))
    for gap, before in waits:
        assert before["held_by"] == "device" and before["device_busy_ms"] == LATE_BY / 1e3
        assert before["device_top"] == [{"name": "big_gemm_kernel", "ms": LATE_BY / 1e3}]
        ms = f"{LATE_BY / 1e3:.2f}"
        assert f"its device ran kernels for {ms} of those {ms} ms (big_gemm_kernel {ms} ms)" in gap.explanation
    assert "rank 2 had more device work before the collective than the others" in finding.fix


def test_a_call_launched_in_time_and_started_late_is_the_devices(tmp_path: Path):
    waits, finding = _waits(_folder(tmp_path, "launched"))
    for gap, before in waits:
        assert before["held_by"] == "launched" and before["device_busy_ms"] == 0.0
        assert before["launched_before_ms"] > 0
        assert "its stream waited" in gap.explanation
    assert "its host had launched the call in time but its device started it late" in finding.fix


def test_dlrm_rank_seven_was_late_from_its_host():
    """Where rank 7's trace covers the time rank 0 waited in its all-to-all, its GPU ran (almost)
    nothing then and its host thread launched the call just before the GPU started it: the raw
    JSON's launch (by correlation) and kernels say the same."""
    folder = PUBLIC / "param_dlrm_8ranks_v100"
    analysis = analyse(load_trace(folder))
    read = [g for g in analysis.gaps if "before_arrival" in g.evidence.get("arrived_last", {})]
    assert read
    raw = {}
    for path in folder.glob("*.json.gz"):
        with gzip.open(path) as f:
            document = json.load(f)
        raw[document["distributedInfo"]["rank"]] = document["traceEvents"]
    for gap in read:
        before = gap.evidence["arrived_last"]["before_arrival"]
        late, at = before["rank"], gap.evidence["arrived_last"]["at_us"]
        start = gap.end_us - gap.evidence["duration_us"]
        events = raw[late]
        call = next(e for e in events if e.get("cat") == "kernel" and e["name"] == gap.evidence["collective"]
                    and e["ts"] == at)
        launch = next(e for e in events if e.get("cat") == "cuda_runtime"
                      and e.get("args", {}).get("correlation") == call["args"]["correlation"])
        busy = sum(min(e["ts"] + e["dur"], at) - max(e["ts"], start) for e in events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e["ts"] < at
                   and e["ts"] + e["dur"] > start and e is not call)
        assert before["device_busy_ms"] <= busy / 1e3 + 1e-3  # (a union: overlapping kernels count once)
        assert before["held_by"] == "host" and before["host_thread"] == launch["tid"]
        assert before["launched_after_ms"] == pytest.approx((launch["ts"] - start) / 1e3, abs=1e-3)
        assert before["host_top"] and all(f["self_ms"] <= before["launched_after_ms"] for f in before["host_top"])
