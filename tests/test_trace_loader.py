"""servprof.trace: loading real Kineto traces into columns, and refusing bad input clearly."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np
import orjson
import pytest
from _analyze_helpers import fixture, public_trace

from servprof.trace import TraceError, load_trace, request_phases


def test_float_ns_trace_loads_without_negative_durations():
    trace = load_trace(public_trace("resnet_ddp_training_v100.json.gz"))
    raw = orjson.loads(gzip.decompress(public_trace("resnet_ddp_training_v100.json.gz").read_bytes()))
    timed = [e for e in raw["traceEvents"] if e.get("ph") != "M" and "ts" in e]
    assert len(trace) == len(timed)
    assert (trace.dur >= 0).all()
    assert trace.ranks == [0]
    # Fractional µs survive (ns resolution is not rounded away at load).
    assert np.any(trace.ts != np.floor(trace.ts))
    device = np.flatnonzero(trace.device_mask())
    assert set(trace.stream[device].tolist()) == {7}
    kernels = sum(1 for e in timed if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    assert device.size == kernels


def test_graph_replay_maps_many_kernels_to_one_launch():
    trace = load_trace(public_trace("vllm_decode_bs32_fullgraph_mi300x.json.gz"))
    device = np.flatnonzero(trace.device_mask())
    launch = trace.launch_row_for(device)
    assert (launch >= 0).all()
    graph_launches = {int(r) for r in launch if trace.name(int(r)) == "hipGraphLaunch"}
    replayed = sum(1 for r in launch if trace.name(int(r)) == "hipGraphLaunch")
    assert len(graph_launches) == 1
    assert replayed > 400  # one launch, hundreds of kernels


def test_several_streams_and_flow_links():
    trace = load_trace(public_trace("sglang_qwen3_8b_decode_bs32_mi300x.json.gz"))
    device = np.flatnonzero(trace.device_mask())
    assert len(set(trace.stream[device].tolist())) == 2
    flows = trace.flow_id[(trace.ph == ord("s")) | (trace.ph == ord("f"))]
    assert flows.size > 0 and (flows >= 0).all()
    # Kineto's flow ids are the correlation ids of the launches they link.
    launches = set(trace.correlation[trace.launch_mask()].tolist())
    assert set(flows.tolist()) <= launches | set(trace.correlation[device].tolist())


def test_directory_of_ranks(tmp_path: Path):
    source = fixture("clean")
    document = orjson.loads(gzip.decompress(source.read_bytes()))
    for rank in (0, 1):
        document["distributedInfo"] = {"rank": rank, "world_size": 2}
        (tmp_path / f"rank-{rank}.json").write_bytes(orjson.dumps(document))
    (tmp_path / "notes.txt").write_text("not a trace")
    trace = load_trace(tmp_path)
    single = load_trace(source)
    assert trace.ranks == [0, 1]
    assert len(trace) == 2 * len(single)
    assert (trace.rank == 1).sum() == len(single)


def test_servprof_metadata_and_phases():
    trace = load_trace(fixture("clean"))
    meta = trace.servprof_metadata()
    assert meta["session_id"] == "fixture-clean"
    phases = request_phases(trace)
    assert sorted(phases) == meta["request_ids"]
    for rid, items in phases.items():
        names = [p["name"] for p in items]
        assert names[0] == "tokenize", rid
        assert "prefill" in names and "decode_step" in names
        queue = [p for p in items if p["name"] == "queue"]
        tokenize_end = max(p["end_us"] for p in items if p["name"] == "tokenize")
        prefill_start = min(p["start_us"] for p in items if p["name"] == "prefill")
        assert queue and queue[0]["start_us"] == tokenize_end and queue[0]["end_us"] == prefill_start
        assert all(p["end_us"] >= p["start_us"] for p in items)


def test_metadata_written_as_json_text_is_parsed(tmp_path: Path):
    path = tmp_path / "t.json"
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10.0, "dur": 2.0}]
    path.write_bytes(orjson.dumps({"traceEvents": events, "servprof": '{"session_id": "s1"}'}))
    assert load_trace(path).servprof_metadata() == {"session_id": "s1"}


def test_missing_optional_fields_and_odd_values(tmp_path: Path):
    events = [
        {"ph": "X", "name": "a", "ts": 1.0, "dur": -0.001},  # no cat/pid/tid/args, negative dur
        {"ph": "X", "cat": "kernel", "name": "k", "pid": "GPU 0", "tid": "stream 7", "ts": 2, "dur": 1,
         "args": {"stream": "7", "correlation": 5.0}},
        {"ph": "i", "name": "mark", "ts": 3},
        {"ph": "X", "name": "no ts"},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "engine"}},
    ]
    path = tmp_path / "odd.json"
    path.write_bytes(orjson.dumps({"traceEvents": events}))
    trace = load_trace(path)
    assert len(trace) == 3
    assert trace.dur.tolist() == [0.0, 1.0, 0.0]
    assert trace.stream.tolist() == [-1, 7, -1]
    assert trace.correlation.tolist() == [-1, 5, -1]
    assert trace.pid[1] < 0 and trace.pid[1] != trace.tid[1]
    assert trace.thread_names == {(0, 1, 2): "engine"}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty file"),
        (b"   \n", "empty trace"),
        (b"{not json", "not valid JSON"),
        (b'{"displayTimeUnit": "ms"}', "no 'traceEvents'"),
        (b'{"traceEvents": 5}', "not a list"),
        (b'{"traceEvents": [1, 2]}', "not an object"),
        (b'{"traceEvents": []}', "no timed events"),
    ],
)
def test_bad_input_is_one_line_trace_error(tmp_path: Path, content: bytes, message: str):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(TraceError) as error:
        load_trace(path)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_truncated_gzip(tmp_path: Path):
    path = tmp_path / "cut.json.gz"
    path.write_bytes(fixture("clean").read_bytes()[:2000])
    with pytest.raises(TraceError, match="truncated or corrupt gzip"):
        load_trace(path)


def test_too_large_is_refused_before_parsing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SERVPROF_MAX_TRACE_BYTES", "10000")
    with pytest.raises(TraceError, match="SERVPROF_MAX_TRACE_BYTES"):
        load_trace(fixture("clean"))
    plain = tmp_path / "plain.json"
    with gzip.open(fixture("clean")) as src, open(plain, "wb") as dst:
        shutil.copyfileobj(src, dst)
    with pytest.raises(TraceError, match="larger than"):
        load_trace(plain)


def test_missing_path_and_empty_directory(tmp_path: Path):
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "nope.json")
    with pytest.raises(TraceError, match="no .json or .json.gz"):
        load_trace(tmp_path)


def test_phase_names_round_trip():
    """What servprof.phases writes, the trace side reads back (one parser serves both)."""
    from servprof.phases import phase_event_name
    from servprof.trace.phases import parse_phase_event_name

    assert parse_phase_event_name(phase_event_name("decode_step", ["a", "b.c", "d:e-1"])) == \
        ("decode_step", ["a", "b.c", "d:e-1"])
    assert parse_phase_event_name(phase_event_name("tokenize", [])) == ("tokenize", [])
    assert parse_phase_event_name("servprof:queue") == ("queue", [])
    assert parse_phase_event_name("servprof:decode_step|,,a,") == ("decode_step", ["a"])
    assert parse_phase_event_name("aten::mm") is None


def test_a_null_name_has_one_id_and_text_whatever_else_its_batch_holds() -> None:
    """An unhashable name (a list) makes the interner fall back to text for that batch: only that
    name becomes its text, so a null or numeric name gets the same id and text in every batch (the
    streaming loader's 1 MiB batches against the whole-file reference; found by the fuzzer)."""
    from servprof.trace.values import Interner

    batched, whole = Interner(), Interner()
    first = batched.ids([None, 5, "x"]).tolist()
    second = batched.ids([None, ["a"], 5]).tolist()
    assert second[0] == first[0] and second[2] == first[1]
    assert whole.ids([None, 5, "x", None, ["a"], 5]).tolist() == first + second
    assert batched.strings == whole.strings == ["", "5", "x", "['a']"]


def test_a_pid_or_tid_reads_the_same_whatever_else_its_batch_holds():
    """The streaming loader reads a file in batches; a tid written as text ("25738", as 2021
    Kineto traces write their runtime calls') read as the number 25738 in a batch of texts and
    as a name in a batch that also held ints: one thread became two. Each value now reads alone
    as it does in any batch: a number when numpy takes it as an int64, else its text."""
    from servprof.trace.values import Interner, process_column

    values = [25738, "25738", "stream 7", None, 2**70, True, 1.5, " 3", "Spans", -4, "25738", [1]]

    def read(batch: list) -> list:
        names = Interner()
        column, rows, ids = process_column(batch, names)
        out: list = column.tolist()
        for row, i in zip(rows.tolist(), ids.tolist(), strict=True):
            out[row] = ("name", names.strings[i])
        return out

    whole = read(values)
    assert whole == [item for value in values for item in read([value])]
    assert whole[:4] == [25738, 25738, ("name", "stream 7"), ("name", "None")]
    assert whole[4] == ("name", str(2**70)) and whole[-2:] == [25738, ("name", "[1]")]
    assert read(["25738", "25738"]) == read([25738, "25738"])[1:] * 2


@pytest.mark.parametrize("reference", [False, True])
def test_a_built_in_method_is_one_name_whatever_object_it_was_called_on(tmp_path: Path, reference: bool):
    """torch's Python tracer writes a built-in method with its object's address: `pattern.sub` on
    three compiled patterns is three names, each frame list then splitting its time three ways. Both
    loaders make them one name (without the address); other names are untouched."""
    from servprof.trace.reference import load_trace_orjson

    def frame(name: str, ts: float) -> dict:
        return {"ph": "X", "cat": "python_function", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": 5.0}

    subs = [f"<built-in method sub of re.Pattern object at 0x7f{k:010x}>" for k in (1, 2, 3)]
    others = ["app.py(3): safety_filter", "<built-in method acquire of _thread.lock object at 0x>",
              "<method 'item' of 'torch._C.TensorBase' objects>"]
    events = [frame(name, 10.0 * i) for i, name in enumerate([*subs, *others, subs[0]])]
    path = tmp_path / "t.json"
    path.write_bytes(orjson.dumps({"traceEvents": events}))
    trace = (load_trace_orjson if reference else load_trace)(path)
    shown = [trace.names[i] for i in trace.name_id.tolist()]
    assert shown == ["<built-in method sub of re.Pattern object>"] * 3 + others + ["<built-in method sub of re.Pattern object>"]
    assert len(set(trace.name_id[:3].tolist() + [int(trace.name_id[-1])])) == 1
    assert trace.string_id("<built-in method sub of re.Pattern object>") == int(trace.name_id[0])
