"""Fuzzing the trace loader and `servprof analyze` with inputs mutated from real traces (events,
args, bytes, and every metadata field servprof reads: deviceProperties, distributedInfo,
baseTimeNanoseconds, servprof's own session block).

CI runs a few hundred generated inputs (bench/fuzz_analyze.py runs >= 10,000 and reports
counts, the slowest input and peak memory). Whatever the input: `load_trace` succeeds or
raises TraceError; `servprof analyze` exits 0, or 2 with exactly one line on stderr.
"""

from __future__ import annotations

import contextlib
import gzip
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from _fuzz_helpers import (
    analyze_in_process,
    clean_failure_line,
    deeply_nested,
    metadata_mutation,
    run_analyze,
    seed_documents,
    seed_sources,
    trace_inputs,
    write_gzip_bomb,
    write_sparse,
)
from hypothesis import HealthCheck, given, settings

from servprof.detect.analysis import analyse
from servprof.trace import TraceError, load_trace

CI_EXAMPLES = 1000
PER_INPUT_LIMIT_S = 5.0
# Derandomized: CI fuzzes the same 1000 inputs each run, so a new failure points at the change
# that caused it; bench/fuzz_analyze.py explores new inputs.
_FUZZ = settings(max_examples=CI_EXAMPLES, deadline=None, database=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.function_scoped_fixture])


def test_seeds_are_real_traces_that_load() -> None:
    assert len(seed_documents()) == len(seed_sources()) >= 5
    for document in seed_documents():
        assert len(document["traceEvents"]) > 50  # (HTA's cuda_event_sync trace holds 92 events in all)


@_FUZZ
@given(case=trace_inputs())
def test_mutated_traces_load_or_fail_cleanly(tmp_path_factory: pytest.TempPathFactory,
                                            case: tuple[str, bytes]) -> None:
    suffix, data = case
    work = tmp_path_factory.mktemp("fuzz")
    path = work / f"input{suffix}"
    path.write_bytes(data)
    started = time.perf_counter()
    try:
        trace = load_trace(path)
    except TraceError as exc:
        assert "\n" not in str(exc) and str(exc)
    else:
        assert len(trace) > 0
    # The whole command: exit 0, or 2 with one line; any other exception fails this test.
    status, stderr = analyze_in_process(path, work)
    assert status == 0 or (status == 2 and clean_failure_line(stderr)), (status, stderr)
    if status == 0:
        assert orjson.loads((work / "report.json").read_bytes())["summary"]["events"] >= 0
    # Not a wall-clock threshold on speed: a guard against a hang (inputs here are a few hundred events).
    assert time.perf_counter() - started < PER_INPUT_LIMIT_S


@settings(max_examples=300, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(data=metadata_mutation())
def test_mutated_metadata_analyses_cleanly(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    """Every metadata field servprof reads (deviceProperties, distributedInfo, baseTimeNanoseconds,
    servprof's own block), retyped or dropped, on whole real traces: the analysis still runs."""
    from servprof.analysis import analyse as child_analyse

    work = tmp_path_factory.mktemp("meta")
    path = work / "input.json"
    path.write_bytes(data)
    status, stderr = analyze_in_process(path, work)
    assert status == 0 or (status == 2 and clean_failure_line(stderr)), (status, stderr)
    if status == 0:  # and the serving side's analysis child, with session records
        result = child_analyse(path, {"session_id": "s", "requests": [{"request_id": "r1", "arrival_ns": 1}]})
        assert "failed" not in str(result["summary"].get("detectors")), result["summary"]


@pytest.mark.parametrize("depth", [1000, 1025, 5000, 100_000])
def test_deeply_nested_json_is_a_clean_error(tmp_path: Path, depth: int) -> None:
    path = tmp_path / "deep.json"
    path.write_bytes(deeply_nested(depth))
    gz = tmp_path / "deep.json.gz"
    gz.write_bytes(gzip.compress(deeply_nested(depth)))
    # msgspec nests as deep as the interpreter's recursion limit lets it, orjson up to 1024 levels: at
    # Python's default limit what neither reads is refused with a clear error ...
    with recursion_limit(1000):
        if depth <= 1000:
            load_trace(path)
        else:
            for source in (path, gz):
                with pytest.raises(TraceError, match="not valid JSON"):
                    load_trace(source)
    # ... and where the process raised it (torch.compile's inductor sets at least 2000), what msgspec
    # reads loads, its over-deep args reading as none; deeper still, the same clear error.
    with recursion_limit(3000):
        for source in (path, gz):
            if depth <= 1025:
                trace = load_trace(source)
                if depth > 1000:
                    assert trace.args(0) == {}  # (orjson cannot read them: no args, never a traceback)
                analyse(trace)
            else:
                with pytest.raises(TraceError, match="not valid JSON"):
                    load_trace(source)


@contextlib.contextmanager
def recursion_limit(limit: int) -> Iterator[None]:
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        yield
    finally:
        sys.setrecursionlimit(before)


def test_gzip_bomb_is_refused_without_inflating_it(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.json.gz"
    write_gzip_bomb(bomb, 3 * 1024**3)  # 3 GiB of JSON (over the default 2 GiB limit) in about 3 MiB
    assert bomb.stat().st_size < 8 * 1024**2
    with pytest.raises(TraceError, match="gzip bomb"):
        load_trace(bomb)
    run = run_analyze(bomb, timeout_s=60)
    assert run.returncode == 2 and clean_failure_line(run.stderr), run
    assert "gzip bomb" in run.stderr
    # Refused after inflating a few MiB: nowhere near the 2 GiB limit (baseline process: ~270 MiB).
    assert run.peak_rss_mb < 1024, run


def test_gzip_over_the_limit_at_a_trace_like_ratio_is_refused_at_the_limit(tmp_path: Path) -> None:
    """A trace that inflates like a real one is read up to SERVPROF_MAX_TRACE_BYTES, not past it."""
    real = gzip.decompress(seed_sources()[0].read_bytes())
    path = tmp_path / "big.json.gz"
    path.write_bytes(gzip.compress(real * 6, compresslevel=1))
    assert len(real) * 6 > 8 * 1024**2 and path.stat().st_size * 20 > len(real) * 6
    with pytest.raises(TraceError, match="SERVPROF_MAX_TRACE_BYTES"):
        load_trace(path, max_bytes=8 * 1024**2)


def test_gzip_of_whitespace_only_is_an_empty_trace(tmp_path: Path) -> None:
    for content in (b"", b" \n\t "):
        path = tmp_path / "blank.json.gz"
        path.write_bytes(gzip.compress(content))
        with pytest.raises(TraceError, match="empty trace"):
            load_trace(path)


def test_multi_gb_sparse_json_is_refused_without_reading(tmp_path: Path) -> None:
    huge = tmp_path / "huge.json"
    write_sparse(huge, 3 * 1024**3)  # above the default 2 GiB limit
    assert huge.stat().st_blocks * 512 < 1024**2  # sparse: no real disk used
    run = run_analyze(huge, timeout_s=60)
    assert run.returncode == 2 and clean_failure_line(run.stderr), run
    assert "larger than" in run.stderr
    assert run.peak_rss_mb < 1024, run


def test_sparse_json_under_the_limit_is_a_clean_parse_error(tmp_path: Path) -> None:
    nul = tmp_path / "nul.json"
    write_sparse(nul, 200 * 1024**2)
    with pytest.raises(TraceError, match="not valid JSON"):
        load_trace(nul)


def test_analyze_process_on_mutated_inputs_prints_one_line(tmp_path: Path) -> None:
    """A handful of broken inputs through the real command line (a process each, ~2 s apiece)."""
    seed = orjson.dumps(seed_documents()[0])
    cases = {
        "cut.json": seed[: len(seed) // 2],
        "cut.json.gz": gzip.compress(seed)[:-9],
        "no_events.json": orjson.dumps({"servprof": {"x": 1}}),
        "events_not_list.json": orjson.dumps({"traceEvents": {"a": 1}}),
        "nan_ts.json": seed.replace(b'"ts":', b'"ts":NaN,"x":', 1),
        "deep.json": deeply_nested(100_000),
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        run = run_analyze(tmp_path / name, timeout_s=60)
        assert run.returncode == 2 and clean_failure_line(run.stderr), (name, run)


# Inputs the fuzzer found that used to end in a traceback (each fixed in servprof/).

def test_thread_name_metadata_with_list_args_loads(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_bytes(orjson.dumps({"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": [None]},
        {"ph": "X", "name": "a", "pid": 1, "tid": 2, "ts": 1.0, "dur": 1.0}]}))
    assert load_trace(path).thread_names == {}


def test_op_shorter_than_the_trace_resolution_is_skipped_by_the_bandwidth_detector(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    op = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 2, "ts": 1.0,
          "args": {"Input Dims": [[64, 64], [64, 64]], "Input type": ["float", "float"]}}
    path.write_bytes(orjson.dumps({"traceEvents": [{**op, "dur": 5e-324}, {**op, "ts": 10.0, "dur": 4.0}]}))
    status, stderr = analyze_in_process(path, tmp_path)
    assert status == 0, stderr
    bandwidth = orjson.loads((tmp_path / "report.json").read_bytes())["summary"]["bandwidth"]
    assert bandwidth["ops_modelled"] == 1 and bandwidth["op_time_ms"] == 0.004  # the 4 us op only


@pytest.mark.parametrize("properties", [True, 3, "gpu", {"name": "H100"}, [1, None, {"name": 7}]])
def test_device_properties_that_are_not_a_list_of_objects(tmp_path: Path, properties: object) -> None:
    path = tmp_path / "t.json"
    path.write_bytes(orjson.dumps({"deviceProperties": properties, "traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 2, "ts": 1.0, "dur": 4.0,
         "args": {"Input Dims": [[64, 64], [64, 64]], "Input type": ["float", "float"]}}]}))
    status, stderr = analyze_in_process(path, tmp_path)
    assert status == 0, stderr


def test_modelled_op_without_a_kernel_in_a_trace_with_kernels(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    op = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 2, "ts": 1.0, "dur": 4.0,
          "args": {"Input Dims": [[64, 64], [64, 64]], "Input type": ["float", "float"], "External id": 5}}
    kernel = {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 2.0, "dur": 1.0,
              "args": {"stream": 7, "correlation": 1, "External id": 6}}
    path.write_bytes(orjson.dumps({"traceEvents": [op, kernel]}))
    status, stderr = analyze_in_process(path, tmp_path)
    assert status == 0, stderr


@pytest.mark.parametrize("field", [
    {"name": "", "computeMajor": 9, "computeMinor": 0, "numSms": 132, "totalGlobalMem": "80GB"},  # issue 18 item 12
    {"name": ["H100"], "computeMajor": "9", "numSms": 1.5, "memoryClockRate": "2619000", "memoryBusWidth": {}},
    {"name": "NVIDIA Unknown", "memoryClockRate": float("inf"), "memoryBusWidth": True},
])
def test_device_property_fields_of_the_wrong_type(tmp_path: Path, field: dict) -> None:
    kernel = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 2.0, "dur": 1.0,
              "args": {"stream": 7, "correlation": 1}}
    op = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 2, "ts": 1.0, "dur": 4.0,
          "args": {"Input Dims": [[64, 64], [64, 64]], "Input type": ["float", "float"]}}
    path = tmp_path / "t.json"
    path.write_bytes(orjson.dumps({"deviceProperties": [field], "traceEvents": [op, kernel]}))
    status, stderr = analyze_in_process(path, tmp_path)
    assert status == 0, stderr


@pytest.mark.parametrize("meta", [
    {"baseTimeNanoseconds": "1700000000000000000", "distributedInfo": {"rank": [0]}},
    {"baseTimeNanoseconds": float("inf"), "distributedInfo": {"rank": "zero"}},
    {"servprof": {"session_id": 5, "request_ids": {"a": 1}, "event_loop_tid": "main", "stop_wall_ns": "late"}},
    {"servprof": {"request_ids": ["r1", 3, None], "event_loop_tid": 2.5, "wall_start_ns": [1]}},
])
def test_metadata_fields_of_the_wrong_type(tmp_path: Path, meta: dict) -> None:
    """Every metadata field servprof reads, retyped: `servprof analyze` and the analysis child both run."""
    from servprof.analysis import analyse as child_analyse

    document = orjson.loads(gzip.decompress(seed_sources()[0].read_bytes()))
    document.update(meta)
    path = tmp_path / "t.json"
    path.write_bytes(orjson.dumps(document))
    status, stderr = analyze_in_process(path, tmp_path)
    assert status == 0, stderr
    result = child_analyse(path, {"session_id": "s", "requests": [{"request_id": "r1", "arrival_ns": "soon"}]})
    assert result["error"] is None and "failed" not in str(result["summary"].get("detectors"))


@pytest.mark.parametrize("ranks", [[-(2**63)], [2**31], [2**31 - 1, 2**31 - 1], ["7", 7.0]])
def test_ranks_out_of_range_or_repeated_load(tmp_path: Path, ranks: list) -> None:
    """Found by the metadata fuzzer: a distributedInfo.rank beyond int32 overflowed the rank column."""
    run = tmp_path / "run"
    run.mkdir()
    document = orjson.loads(gzip.decompress(seed_sources()[0].read_bytes()))
    for index, rank in enumerate(ranks):
        (run / f"r{index}.json").write_bytes(orjson.dumps({**document, "distributedInfo": {"rank": rank}}))
    trace = load_trace(run)
    assert len(trace.ranks) == len(ranks) and all(0 <= r < 2**31 for r in trace.ranks)
    status, stderr = analyze_in_process(run, tmp_path)
    assert status == 0, stderr
