"""The memory detector on real traces: the profiler's own allocator events (recorded here with
profile_memory=True on the model's thread), servprof's probe output, and what each can and
cannot show. Live sessions on the demo server are in test_memory_compile_live.py."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from _analyze_helpers import public_trace
from _memory_compile_helpers import record_memory_trace

from servprof.detect.analysis import analyse
from servprof.detect.memory import between_sessions, trend
from servprof.probes import SessionProbes
from servprof.probes.memory import MemoryHistory
from servprof.trace import load_trace

LEAK = 3 * 1024 * 1024


def _growth(analysis: Any) -> list[Any]:
    return [f for f in analysis.findings if f.kind == "memory_growth"]


def test_torch_213_writes_no_memory_events_under_profile_all_threads(tmp_path: Path):
    """Why servprof samples memory itself: the mode it needs to see engine threads records no
    allocator events (measured; if a torch release fixes this, the [memory] path takes over)."""
    import torch
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    def run(**kwargs: Any) -> int:
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, **kwargs)
        prof.start()
        kept = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(3)]
        prof.stop()
        out = tmp_path / "t.json"
        prof.export_chrome_trace(str(out))
        del kept
        return sum(1 for e in json.loads(out.read_text())["traceEvents"] if e.get("name") == "[memory]")

    assert run() >= 3
    if torch.__version__.startswith("2.13"):
        assert run(experimental_config=_ExperimentalConfig(profile_all_threads=True)) == 0


def test_a_per_request_leak_in_allocator_events_is_found_with_its_size_and_where(tmp_path: Path):
    path, kept = record_memory_trace(tmp_path / "leak.json", LEAK, requests=6)
    findings = _growth(analyse(load_trace(path)))
    assert len(findings) == 1
    evidence = findings[0].evidence
    assert evidence["where"] == "in_trace" and evidence["source"] == "profiler_events"
    assert evidence["requests_admitted"] == 6
    # Measured directly: what the requests kept.
    kept_per_request = sum(t.numel() for t in kept) / len(kept)
    assert evidence["per_request_bytes"] == pytest.approx(kept_per_request, rel=0.2)
    # Kept inside prefill, by the op that allocated it; decode steps give back what they take.
    assert evidence["by_phase"]["prefill"]["kept_bytes"] == pytest.approx(len(kept) * LEAK, rel=0.05)
    assert abs(evidence["by_phase"]["decode"]["kept_bytes"]) < 0.05 * LEAK
    assert evidence["top_ops"][0]["op"] in ("aten::ones", "aten::empty")
    assert findings[0].fix and findings[0].request_ids


def test_the_same_serving_without_a_leak_shows_no_growth(tmp_path: Path):
    path, _ = record_memory_trace(tmp_path / "clean.json", 0, requests=6)
    analysis = analyse(load_trace(path))
    assert not _growth(analysis)
    cpu = analysis.summary["memory"]["devices"]["cpu"]
    assert cpu["source"] == "profiler_events" and cpu["peak_allocated_bytes"] > 0
    assert {"prefill", "decode"} <= set(cpu["by_phase"])


def _with_metadata(source: Path, target: Path, change: Any) -> Path:
    """A copy of a real trace whose servprof metadata `change(meta)` edited."""
    opener = gzip.open if source.suffix == ".gz" else open
    with opener(source, "rb") as f:
        document = orjson.loads(f.read())
    meta = document.get("servprof")
    meta = orjson.loads(meta) if isinstance(meta, str) else (meta or {})
    change(meta)
    document["servprof"] = meta
    target.write_bytes(orjson.dumps(document))
    return target


def _cuda_series(base_ns: int, allocated: list[int], reserved: list[int], total: int,
                 stats_end: dict[str, int] | None = None) -> dict[str, Any]:
    """A CUDA device's entry as servprof.probes.memory writes it: a stand-in, as no GPU is
    here to produce one (the format is the probe's, checked in test_probe_output_is_json)."""
    samples = [[base_ns + 1_000_000 * (i + 1), a, r] for i, (a, r) in enumerate(zip(allocated, reserved, strict=True))]
    return {"kind": "cuda_allocator", "total_bytes": total, "total_from": "cudaMemGetInfo", "samples": samples,
            "stats_start": {"num_alloc_retries": 0, "num_ooms": 0},
            "stats_end": {"num_alloc_retries": 0, "num_ooms": 0, **(stats_end or {})}}


def _base_ns(path: Path) -> int:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return int(orjson.loads(f.read())["baseTimeNanoseconds"])


GIB = 1024**3


def test_fragmentation_and_near_limit_from_cuda_allocator_samples(tmp_path: Path):
    source = Path(__file__).parent / "fixtures" / "demo_clean.json.gz"
    base = _base_ns(source)

    def add(meta: dict[str, Any]) -> None:
        # 60 GiB reserved for 30 GiB allocated on an 80 GiB device, and the allocator retried.
        meta["memory"] = {"devices": {"cuda:0": _cuda_series(base, [20 * GIB, 30 * GIB, 25 * GIB],
                                                              [40 * GIB, 60 * GIB, 60 * GIB], 80 * GIB,
                                                              {"num_alloc_retries": 3})}}

    analysis = analyse(load_trace(_with_metadata(source, tmp_path / "frag.json", add)))
    kinds = {f.kind: f for f in analysis.findings}
    frag = kinds["memory_fragmentation"]
    assert frag.evidence["cached_unused_bytes"] == 30 * GIB and frag.evidence["share"] == pytest.approx(0.5)
    near = kinds["memory_near_limit"]
    assert near.evidence["alloc_retries"] == 3 and near.severity == "warning"
    assert "expandable_segments" in frag.fix and near.fix
    assert "memory_growth" not in kinds  # it went up and came back down


def test_a_pool_held_near_the_limit_is_not_pressure_until_the_allocator_retries(tmp_path: Path):
    """An engine's KV cache sized to 90% of the device (vLLM's --gpu-memory-utilization): 73 GiB
    allocated all through, a little on top. Said at info, with no advice to shrink the pool; the
    same levels with allocator retries are a warning with the room-making fix."""
    source = Path(__file__).parent / "fixtures" / "demo_clean.json.gz"
    base = _base_ns(source)

    def pool(retries: int):  # noqa: ANN202
        def add(meta: dict[str, Any]) -> None:
            meta["memory"] = {"devices": {"cuda:0": _cuda_series(
                base, [73 * GIB, 73 * GIB + 512 * 1024**2, 73 * GIB], [74 * GIB, 74 * GIB, 74 * GIB], 80 * GIB,
                {"num_alloc_retries": retries})}}
        return add

    (held,) = [f for f in analyse(load_trace(_with_metadata(source, tmp_path / "p.json", pool(0)))).findings
               if f.kind == "memory_near_limit"]
    assert held.severity == "info" and held.evidence["preallocated_pool"] is True
    assert "allocated all through the trace" in held.title and "--gpu-memory-utilization" in held.fix
    assert held.fix.startswith("Nothing to lower")
    (pressed,) = [f for f in analyse(load_trace(_with_metadata(source, tmp_path / "q.json", pool(2)))).findings
                  if f.kind == "memory_near_limit"]
    assert pressed.severity == "warning" and pressed.evidence["preallocated_pool"] is False
    assert pressed.fix.startswith("Give the peak room")


def test_device_memory_growing_step_over_step_in_cuda_samples(tmp_path: Path):
    source = Path(__file__).parent / "fixtures" / "demo_clean.json.gz"
    trace = load_trace(source)
    steps = analyse(trace).steps
    base = _base_ns(source)
    # A reading every 1 ms across the trace, 64 MiB more after each prefill step.
    t0, t1 = min(s.start_us for s in steps), max(s.end_us for s in steps)
    times = np.arange(t0 - 1000, t1 + 1000, 1000.0)
    prefills = sorted(s.end_us for s in steps if s.kind == "prefill")
    allocated = [int(GIB + 64 * 1024**2 * np.searchsorted(prefills, t)) for t in times]

    def add(meta: dict[str, Any]) -> None:
        samples = [[int(base + t * 1000), a, a + GIB // 4] for t, a in zip(times, allocated, strict=True)]
        meta["memory"] = {"devices": {"cuda:0": {"kind": "cuda_allocator", "total_bytes": 80 * GIB,
                                                 "samples": samples}}}

    growth = _growth(analyse(load_trace(_with_metadata(source, tmp_path / "grow.json", add))))
    assert len(growth) == 1 and growth[0].evidence["where"] == "in_trace"
    assert growth[0].evidence["requests_admitted"] == len(prefills)
    assert growth[0].evidence["per_request_bytes"] == pytest.approx(64 * 1024**2, rel=0.2)


def test_growth_given_back_before_the_trace_ends_is_no_leak(tmp_path: Path):
    """Memory that rose step over step and was all given back after the last step (a benchmark that
    kept each forward's results until it finished, as in TraceLens' OWLv2 trace): no growth finding,
    and the summary says how much came back; kept to the end, the same rise is one."""
    source = Path(__file__).parent / "fixtures" / "demo_clean.json.gz"
    steps = analyse(load_trace(source)).steps
    base = _base_ns(source)
    t0, t1 = min(s.start_us for s in steps), max(s.end_us for s in steps)
    times = np.arange(t0 - 1000, t1 + 5000, 1000.0)
    prefills = sorted(s.end_us for s in steps if s.kind == "prefill")

    def series(given_back: bool):  # noqa: ANN202
        allocated = [int(GIB + 64 * 1024**2 * np.searchsorted(prefills, t)) for t in times]
        if given_back:
            allocated = [GIB if t > t1 + 2000 else a for t, a in zip(times, allocated, strict=True)]

        def add(meta: dict[str, Any]) -> None:
            samples = [[int(base + t * 1000), a, a + GIB // 4] for t, a in zip(times, allocated, strict=True)]
            meta["memory"] = {"devices": {"cuda:0": {"kind": "cuda_allocator", "total_bytes": 80 * GIB,
                                                     "samples": samples}}}
        return add

    kept = analyse(load_trace(_with_metadata(source, tmp_path / "kept.json", series(False))))
    assert len(_growth(kept)) == 1
    released = analyse(load_trace(_with_metadata(source, tmp_path / "back.json", series(True))))
    assert _growth(released) == []
    device = released.summary["memory"]["devices"]["cuda:0"]
    assert device["released_after_steps_bytes"] == 64 * 1024**2 * len(prefills)


def test_between_sessions_growth_follows_requests_not_a_warm_up():
    points = [[i * 10**9, 10 * i, 1] for i in range(8)]
    leak = [500_000_000 + 8 * 1024**2 * 10 * i for i in range(8)]
    shape = between_sessions(points, leak)
    assert shape["model_requests"] == 70 and shape["growth_bytes"] == 70 * 8 * 1024**2
    assert shape["late_growth_bytes"] >= 0.25 * shape["growth_bytes"]
    warm_up = [500_000_000 + min(i, 2) * 40 * 1024**2 for i in range(8)]  # grows with the first requests, then flat
    assert between_sessions(points, warm_up)["late_growth_bytes"] == 0
    # A reading across a session (the count changed) is left out: the profiler's buffers grow there.
    across = [[0, 0, 1], [10**9, 5, 2], [2 * 10**9, 10, 2]]
    assert between_sessions(across, [0, 900 * 1024**2, 900 * 1024**2])["growth_bytes"] == 0
    assert trend(np.array([0.0, 1.0, 2.0, 3.0]))["rises"] == 3


def test_probe_output_is_json_and_the_history_marks_quiet_stretches():
    history = MemoryHistory(interval_s=0.0)
    history.tick(requests=0, sessions=0)
    history.tick(requests=3, sessions=0)
    exported = history.export()
    assert [p[1:] for p in exported["points"]] == [[0, 0], [3, 0]]
    assert all(len(v) == 2 for v in exported["levels"]["process"])
    probes = SessionProbes(memory=True)
    probes.sample()
    out = probes.finish(session_wall_start_ns=0)
    orjson.dumps(out)
    process = out["memory"]["devices"]["process"]
    assert process["kind"] == "process_rss" and len(process["samples"]) >= 2
    assert "history" in out["memory"]


@pytest.mark.parametrize("garbage", [
    {"memory": "x"}, {"memory": {"devices": {"cuda:0": {"samples": [["a", None, {}], [1]]}}}},
    {"memory": {"devices": [], "history": {"points": [[1, 2]], "levels": {"process": [1]}}}},
    {"memory": {"history": {"points": [[1, 2, 3], [2, 3, 3]], "levels": {"process": [[1, None], ["x"]]}}}},
    {"compile": {"compiles": [{"start_time_us": "x"}, 3], "frames": [], "before_session": "no"}},
    {"compile": {"before_session": [{"duration_us": 5, "compile_id": 7, "recompile_reason": ["x"]}]}},
])
def test_metadata_of_the_wrong_shape_is_ignored_not_fatal(tmp_path: Path, garbage: dict[str, Any]):
    source = Path(__file__).parent / "fixtures" / "demo_clean.json.gz"
    analysis = analyse(load_trace(_with_metadata(source, tmp_path / "bad.json", lambda m: m.update(garbage))))
    assert not [f for f in analysis.findings if f.kind.startswith("memory_")]


def test_public_gpu_traces_without_memory_data_say_what_is_missing():
    analysis = analyse(load_trace(public_trace("vllm_decode_bs32_fullgraph_mi300x.json.gz")))
    assert any(m["what"] == "memory" for m in analysis.summary["missing"])
    assert not [f for f in analysis.findings if f.kind.startswith("memory_")]
