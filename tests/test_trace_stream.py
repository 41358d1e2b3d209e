"""The streaming loader on the shapes of JSON a chrome trace can take: cuts that fall inside
strings or nested args, keys after the events array, the array format, files it must parse
whole, odd values and broken text, metadata of the wrong type, and memory that stays bounded."""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import orjson
import pytest
from _analyze_helpers import fixture, public_trace
from _fuzz_helpers import run_analyze, trace_inputs
from hypothesis import HealthCheck, given, settings

import servprof.trace.loader as loader
import servprof.trace.source as source
import servprof.trace.split as split
from servprof.analysis import analyse as analyse_session
from servprof.trace import TraceError, load_trace
from servprof.trace.args import BatchText, RawArgs
from servprof.trace.reference import load_trace_orjson
from servprof.trace.values import _phase_code, phase_codes

COLUMNS = ("name_id", "cat_id", "ph", "pid", "tid", "ts", "dur", "stream", "correlation", "external_id",
           "flow_id", "rank")


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut every ~1 KB and read 300 bytes at a time: every file becomes many batches."""
    monkeypatch.setattr(loader, "BATCH_BYTES", 1024)
    monkeypatch.setattr("servprof.trace.source.CHUNK_BYTES", 300)


def assert_same(path: Path, args: bool = True) -> None:
    """The streaming loader's trace is the orjson loader's, whether args are found on first read
    (a library load) or with the events (servprof's analysis, read_args)."""
    reference = load_trace_orjson(path)
    for read_args in (False, True):
        ours = load_trace(path, read_args=read_args)
        for column in COLUMNS:
            assert np.array_equal(getattr(ours, column), getattr(reference, column), equal_nan=True), column
        assert ours.names == reference.names
        assert ours.metadata == reference.metadata
        assert ours.thread_names == reference.thread_names
        if args:  # (args nested a thousand deep would exhaust Python's recursion in ==)
            assert [ours.args(r) for r in range(len(ours))] == [reference.args(r) for r in range(len(reference))]


def kernel(i: int, **extra: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": "kernel", "name": f"k{i % 7}", "pid": 0, "tid": 7, "ts": 100.0 + 10 * i, "dur": 5.0,
            "args": {"stream": 7, "correlation": i, **extra}}


def write(path: Path, document: Any, gz: bool = False) -> Path:
    data = json.dumps(document, indent=None if gz else 2).encode()  # (json: ints past 64 bits too)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def test_cuts_inside_strings_and_nested_args_move_back(tmp_path: Path, small_batches: None) -> None:
    """Names and args full of '}, {' and lists of objects: every false cut is found and undone."""
    events = [kernel(i, note='{"a": 1}, {"b": 2}' * (i % 3), shapes=[{"x": [1, 2]}, {"y": {}}, {}])
              for i in range(300)]
    events += [{"ph": "X", "cat": "cpu_op", "name": "op }, { x" * 40, "pid": 1, "tid": 1, "ts": 5.0, "dur": 1.0}]
    for gz in (False, True):
        assert_same(write(tmp_path / f"t.json{'.gz' if gz else ''}", {"traceEvents": events}, gz))
    compact = tmp_path / "compact.json"  # '},{' with no spaces
    compact.write_bytes(orjson.dumps({"traceEvents": events}))
    assert_same(compact)


def test_keys_after_the_events_and_the_array_format(tmp_path: Path, small_batches: None) -> None:
    events = [kernel(i) for i in range(200)]
    after = tmp_path / "after.json"
    after.write_bytes(b'{"schemaVersion": 1, "traceEvents": ' + orjson.dumps(events)
                      + b', "distributedInfo": {"rank": 3}, "baseTimeNanoseconds": 1700000000000000000,'
                        b' "servprof": "{\\"session_id\\": \\"s\\"}", "deviceProperties": [{"id": 0}, {"id": 1}]}')
    trace = load_trace(after)
    assert trace.ranks == [3] and trace.base_time_ns() == 1700000000000000000
    assert trace.servprof_metadata() == {"session_id": "s"}
    assert list(trace.metadata[3]) == ["schemaVersion", "distributedInfo", "baseTimeNanoseconds", "servprof",
                                       "deviceProperties", "servprof_source_file"]
    assert_same(after)
    array = tmp_path / "array.json"
    array.write_bytes(b"  \n" + orjson.dumps(events) + b"\n")
    assert len(load_trace(array)) == 200
    assert_same(array)


@pytest.mark.parametrize(("after", "whole_tail"), [
    (b"", False), (b', "traceName": "run {1}", "baseTimeNanoseconds": 17', False),
    (b', "deviceProperties": [{"id": 0}, {"id": 1}]', True), (b', "traceName": "a},{b"', True)],
    ids=["array_format", "keys_after", "objects_after", "cut_in_a_string_after"])
def test_text_is_cut_at_its_end_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, after: bytes,
                                    whole_tail: bool) -> None:
    """A file read to its end in one go is still cut after its last whole event (the tail, parsed
    twice, is then one event), unless what follows the array holds a cut of its own (objects in a
    list, or the text of one in a string): then the tail is the rest of the text, as before. The
    same trace either way."""
    events = orjson.dumps([kernel(i) for i in range(3000)])
    assert len(events) > split.TAIL_BYTES
    path = tmp_path / "t.json"
    path.write_bytes(events + b"\n" if not after else b'{"traceEvents": ' + events + after + b"}")
    tails: list[int] = []
    tail = split.EventBatches._tail
    monkeypatch.setattr(split.EventBatches, "_tail", lambda self: (tails.append(len(self._buf)), (yield from tail(self))))
    assert_same(path)
    assert len(tails) == 2 and tails[0] == tails[1]  # (one tail per load: assert_same loads it two ways)
    assert tails[0] > len(events) if whole_tail else tails[0] < 200 + len(after)


def test_files_it_cannot_cut_are_parsed_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              small_batches: None) -> None:
    late = write(tmp_path / "late.json", {"notes": "x" * 5000, "traceEvents": [kernel(i) for i in range(100)]})
    monkeypatch.setattr(split, "HEADER_SCAN_BYTES", 1000)  # traceEvents past it
    assert_same(late)
    monkeypatch.setattr(split, "MAX_FALSE_CUTS", 0)  # the first false cut gives up cutting
    nested = write(tmp_path / "nested.json", {"traceEvents": [kernel(i, s=[{}, {}]) for i in range(100)]})
    assert_same(nested)


def test_odd_values_take_the_tolerant_path(tmp_path: Path, small_batches: None) -> None:
    events = [kernel(i) for i in range(100)]
    events[10]["args"] = {"stream": "7", "correlation": 5.0, "External id": True}
    events[20]["args"] = [1, 2]
    events[30]["args"] = None
    events[40]["pid"] = "GPU 0"
    events[50]["ts"] = "12.5"
    events[60]["args"] = {"stream": 2**64 - 1}
    events[70]["name"] = ["a", "list"]
    events[80]["args"] = {"deep": [[[[[[[[[[1]]]]]]]]]]}
    assert_same(write(tmp_path / "odd.json", {"traceEvents": events}))


def test_args_columns_where_few_rows_name_them(tmp_path: Path) -> None:
    """Mostly Python frames (whose args name no stream, correlation or External id), so only the
    rows whose text names one are decoded: nested keys, keys inside strings, odd values, args that
    are not objects and an escaped key still give the orjson loader's columns."""
    frames = [{"ph": "X", "cat": "python_function", "name": f"f.py({i}): g", "pid": 1, "tid": 1, "ts": 10.0 * i,
               "dur": 5.0, "args": {"Python id": i, "Python parent id": i - 1}} for i in range(3000)]
    odd = [kernel(1), kernel(2, note='"stream": 9'), {**kernel(3), "args": {"nested": {"correlation": 4}}},
           {**kernel(4), "args": {"stream": "7", "correlation": 5.0}}, {**kernel(5), "args": [1, "stream"]},
           {**kernel(6), "name": '"External id"'}, {**kernel(7), "args": {"External id": True, "stream": 3}}]
    for i, event in enumerate(odd):
        frames[400 * i + 7] = event
    assert_same(write(tmp_path / "sparse.json", {"traceEvents": frames}))
    escaped = orjson.dumps({"traceEvents": frames}).replace(b'"stream":7', b'"\\u0073tream":7', 1)
    assert escaped.count(b"\\u0073") == 1
    (tmp_path / "escaped.json").write_bytes(escaped)
    assert_same(tmp_path / "escaped.json")
    assert (load_trace(tmp_path / "escaped.json").stream >= 0).sum() == (load_trace(tmp_path / "sparse.json").stream >= 0).sum()


def test_deep_nesting_loads_to_orjsons_limit(tmp_path: Path, small_batches: None) -> None:
    """Nesting past msgspec's depth (the interpreter's recursion limit) is left to orjson, which
    refuses it past 1024. At Python's default limit, as here: torch.compile's inductor raises it to
    2000 for the rest of the process, and msgspec then reads the deeper file too."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        _deep_nesting(tmp_path)
    finally:
        sys.setrecursionlimit(limit)


def _deep_nesting(tmp_path: Path) -> None:
    events = [kernel(i) for i in range(50)]
    text = orjson.dumps({"traceEvents": events}).replace(b'"correlation":20', b'"correlation":20,"x":'
                                                          + b"[" * 1000 + b"]" * 1000, 1)
    path = tmp_path / "deep.json"
    path.write_bytes(text)
    assert_same(path, args=False)
    path.write_bytes(text.replace(b"[" * 1000, b"[" * 1100).replace(b"]" * 1000, b"]" * 1100))
    with pytest.raises(TraceError, match="not valid JSON"):
        load_trace(path)


def test_broken_text_anywhere_is_one_line(tmp_path: Path, small_batches: None) -> None:
    """Cut short or damaged at many places: the loader fails where the orjson one did, with one
    line, or loads the same trace. (Not UTF-8 inside an event's args is the one difference: that
    event's args read as empty instead of the whole file failing.)"""
    data = orjson.dumps({"traceEvents": [kernel(i, note="é}, {") for i in range(200)], "traceName": "t"})
    rng = np.random.default_rng(0)
    for position in rng.integers(1, len(data) - 1, size=60).tolist():
        for variant in (data[:position], data[:position] + b"@" + data[position + 1:]):
            path = tmp_path / "broken.json"
            path.write_bytes(variant)
            try:
                reference = load_trace_orjson(path)
            except TraceError as refused:
                if "UTF-8" in str(refused):  # a bad byte in an args string: only that event's args lost
                    continue
                with pytest.raises(TraceError) as error:
                    load_trace(path)
                assert "\n" not in str(error.value)
            else:
                assert len(load_trace(path)) == len(reference)


@pytest.mark.parametrize("batches", ["small", "whole"])
def test_text_shapes_other_tools_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batches: str) -> None:
    """A UTF-8 byte order mark (a trace re-saved by a Windows editor) is read past; the array
    format's closing bracket, which the chrome-trace format lets a writer leave out, may be
    missing; a trace cut off while written says so; UTF-16 text says what it is."""
    if batches == "small":
        monkeypatch.setattr(loader, "BATCH_BYTES", 1024)
        monkeypatch.setattr("servprof.trace.source.CHUNK_BYTES", 300)
    events = [kernel(i) for i in range(200)]
    document = orjson.dumps({"traceEvents": events, "traceName": "t"})
    plain = tmp_path / "plain.json"
    plain.write_bytes(document)
    expected = load_trace(plain)
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + document)
    assert np.array_equal(load_trace(bom).ts, expected.ts) and load_trace(bom).metadata[0]["traceName"] == "t"
    for tail in (b"", b",", b", \n"):
        open_array = tmp_path / "open.json"
        open_array.write_bytes(orjson.dumps(events)[:-1] + tail)
        assert np.array_equal(load_trace(open_array).ts, expected.ts)
    cut = tmp_path / "cut.json"
    cut.write_bytes(document[: len(document) * 2 // 3])
    with pytest.raises(TraceError, match=f"cut off while it was written.*after {len(document) * 2 // 3} bytes|"
                                         f"after {len(document) * 2 // 3} bytes.*cut off"):
        load_trace(cut)
    utf16 = tmp_path / "utf16.json"
    utf16.write_bytes(document.decode().encode("utf-16"))
    with pytest.raises(TraceError, match="UTF-16 text.*iconv"):
        load_trace(utf16)


def test_megabytes_of_whitespace_between_events(tmp_path: Path) -> None:
    path = tmp_path / "spaced.json"
    events = b", ".join(orjson.dumps(kernel(i)) for i in range(3))
    path.write_bytes(b'{"traceEvents": [' + events + b"," + b" " * (40 * 1024**2) + events + b"]}")
    assert len(load_trace(path)) == 6


@pytest.mark.parametrize("info", [{"rank": "x"}, [], "rank", {"rank": 2**40}, {"rank": -1}, {"rank": True},
                                  {"rank": 1.5}, {"rank": None}, 7])
@pytest.mark.parametrize("base", ["1700000000000000000", [], {}, True, 2**70, -(2**70), None])
def test_metadata_of_the_wrong_type_is_absent(tmp_path: Path, info: Any, base: Any) -> None:
    path = write(tmp_path / "t.json", {"distributedInfo": info, "baseTimeNanoseconds": base,
                                       "traceEvents": [kernel(i) for i in range(5)]})
    trace = load_trace(path)
    assert trace.ranks == [0]
    assert trace.base_time_ns() is None
    result = analyse_session(path, {"session_id": "s", "requests": [{"request_id": "r"}]})
    assert result["clock"] == {} and result["error"] is None


def test_base_time_of_a_whole_float_is_kept(tmp_path: Path) -> None:
    path = write(tmp_path / "t.json", {"baseTimeNanoseconds": 1.7e18, "traceEvents": [kernel(0)]})
    assert load_trace(path).base_time_ns() == 1700000000000000000


def test_args_stay_text_until_read() -> None:
    trace = load_trace(public_trace("vllm_decode_bs32_fullgraph_mi300x.json.gz"))
    assert isinstance(trace.raw_args, RawArgs)
    kernels = np.flatnonzero(trace.device_mask())
    assert trace.args(int(kernels[0]))["stream"] == int(trace.stream[kernels[0]])
    assert trace.args(int(kernels[0])) is trace.args(int(kernels[0]))  # decoded once
    assert len(trace.raw_args._decoded) == 1  # nothing else was decoded


@pytest.mark.parametrize(("held", "size_told"), [(loader.HELD_TEXT_BYTES, True), (40_000, False), (40_000, True),
                                               (0, True)], ids=["held", "let_go_midway", "told_too_big", "never_held"])
@pytest.mark.parametrize("name", ["hf_qwen1.5_0.5b_prefill_h100.json.gz", "vllm_decode_bs32_fullgraph_mi300x.json.gz"])
def test_batch_text_held_or_let_go_gives_the_same_trace(name: str, held: int, size_told: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A small trace keeps its batches' text and finds args in it when first read; past the
    budget the batches held so far give their args' text up and later ones are decoded as a big
    trace's: midway (a size not told before reading, here claimed small), or from the start when
    the file's size tells it. Every column, thread name and args the same. (The HF trace's thread
    names are in its last batches, which find their args at once.)"""
    monkeypatch.setattr(loader, "BATCH_BYTES", 8 * 1024)
    monkeypatch.setattr("servprof.trace.source.CHUNK_BYTES", 4096)
    monkeypatch.setattr(loader, "HELD_TEXT_BYTES", held)
    if not size_told:
        monkeypatch.setattr(loader, "text_size", lambda path: 0)
    path = public_trace(name)
    segments = load_trace(path).raw_args._segments
    assert len(segments) > 4
    holding = [isinstance(s, BatchText) and s.text is not None for s in segments[:-8]]
    assert all(holding) if held > path.stat().st_size * 20 else not any(holding)
    if not size_told and held:  # the first batches were held, then let go of
        assert any(isinstance(s, BatchText) for s in segments)
    assert_same(path)


def test_the_text_size_is_told_before_reading(tmp_path: Path) -> None:
    """A plain file's size; a gzip file's from its trailer (what the loader's rule for holding
    batch text reads first); None where it cannot be told."""
    path = public_trace("vllm_decode_bs32_fullgraph_mi300x.json.gz")
    with gzip.open(path, "rb") as file:
        text = file.read()
    assert source.text_size(path) == len(text)
    plain = tmp_path / "t.json"
    plain.write_bytes(text)
    assert source.text_size(plain) == len(text)
    # A trailer smaller than the file (cut short, or a member's size past 4 GiB wrapped): not told.
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(path.read_bytes()[:-4] + (1).to_bytes(4, "little"))
    assert source.text_size(cut) is None
    assert source.text_size(tmp_path / "missing.json") is None
    assert source.text_size(Path("/dev/null")) is None  # not a regular file: a stream


def test_raw_args_segments() -> None:
    args = RawArgs()
    args.add_text(b'{"a":1},[2],{}', np.array([0, 8, 12]), np.array([7, 11, 14]))
    args.add_values([{"b": 2}])
    other = RawArgs()
    other.add_text(b"nul", np.array([0]), np.array([3]))  # not JSON: read as None, not a traceback
    args.extend(other)
    assert len(args) == 5
    assert list(args) == [{"a": 1}, [2], {}, {"b": 2}, None]
    assert args[-1] is None
    with pytest.raises(IndexError):
        args[5]


class _Picked(msgspec.Struct):
    a: msgspec.Raw = msgspec.Raw(b"null")


def test_raw_args_fields_of_many_rows() -> None:
    """read_fields: the named fields of each row as text, across segments and in the rows' order;
    None for rows held as values and for a segment whose text is not all objects (the caller
    reads those rows in full), never an exception."""
    args = RawArgs()
    args.add_text(b'{"a":[1, 2],"b":0},{},{"b":{"a":1}}', np.array([0, 19, 22]), np.array([18, 21, 35]))
    args.add_values([{"a": 5}])
    args.add_text(b'{"a":"x"},[2]', np.array([0, 10]), np.array([9, 13]))  # a list: that segment is refused
    args.add_text(b'{"a":"\xff"}', np.array([0]), np.array([9]))  # not UTF-8: the text is returned as it is
    decoder = msgspec.json.Decoder(list[_Picked])
    fields = args.read_fields(np.array([3, 2, 0, 1, 4, 5, 6, -1]), decoder)
    texts = [None if f is None else bytes(f.a) for f in fields]
    assert texts == [None, b"null", b"[1, 2]", b"null", None, None, b'"\xff"', b'"\xff"']
    assert bytes(args.read_fields(np.array([4]), decoder)[0].a) == b'"x"'  # its own rows are objects
    assert [args.read(r) for r in (0, 2)] == [{"a": [1, 2], "b": 0}, {"b": {"a": 1}}]  # the same rows in full


def test_directory_of_ranks_with_small_batches(tmp_path: Path, small_batches: None) -> None:
    document = orjson.loads(gzip.decompress(fixture("clean").read_bytes()))
    for rank in (1, 0):
        document["distributedInfo"] = {"rank": rank}
        (tmp_path / f"rank-{rank}.json").write_bytes(orjson.dumps(document))
    assert_same(tmp_path)


@pytest.mark.slow
def test_memory_stays_near_the_columns_size(tmp_path: Path) -> None:
    """A 200 MB trace (plain JSON, read whole before) analysed within 1.5x its size (the orjson
    loader peaked at 624 MB on such a file), process start-up included."""
    events = orjson.loads(gzip.decompress(public_trace("vllm_prefill_decode_piecewise_mi300x.json.gz")
                                          .read_bytes()))["traceEvents"]
    path = tmp_path / "big.json"
    with open(path, "wb") as out:
        out.write(b'{"traceEvents": [')
        shift = 0.0
        while out.tell() < 200 * 1024**2:
            for event in events:
                if isinstance(event.get("ts"), float):
                    event["ts"] += shift
            out.write(orjson.dumps(events)[1:-1] + b",")
            shift = 1e6
        out.write(orjson.dumps(events[-1]) + b"]}")
    size_mb = path.stat().st_size / 1024**2
    run = run_analyze(path, timeout_s=600, extra=["--json", os.devnull])
    assert run.returncode == 0, run.stderr
    assert run.peak_rss_mb < 1.5 * size_mb, (run.peak_rss_mb, size_mb)


@settings(max_examples=500, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(case=trace_inputs())
def test_mutated_traces_load_as_the_orjson_loader_does(tmp_path_factory: pytest.TempPathFactory,
                                                       monkeypatch: pytest.MonkeyPatch, case: tuple[str, bytes]) -> None:
    """The fuzzer's inputs (real traces broken at the structure and byte level), cut every KB:
    the same trace as the orjson loader, or a one-line TraceError where it refused the file."""
    monkeypatch.setattr(loader, "BATCH_BYTES", 1024)
    monkeypatch.setattr("servprof.trace.source.CHUNK_BYTES", 300)
    suffix, data = case
    path = tmp_path_factory.mktemp("fuzz") / f"input{suffix}"
    path.write_bytes(data)
    try:
        reference = load_trace_orjson(path)
    except TraceError as refused:
        try:
            load_trace(path)
        except TraceError as error:
            assert "\n" not in str(error)
        else:  # the one input the streaming loader takes and orjson did not
            assert "UTF-8" in str(refused) or "surrogate" in str(refused), refused
        return
    ours = load_trace(path)
    for column in COLUMNS:
        assert np.array_equal(getattr(ours, column), getattr(reference, column), equal_nan=True), column
    assert ours.names == reference.names
    assert ours.thread_names == reference.thread_names
    assert ours.metadata == reference.metadata


def test_id_masks_match_isin() -> None:
    """Trace.has_id (a lookup table) selects exactly the rows np.isin does."""
    trace = load_trace(public_trace("sglang_qwen3_8b_decode_bs32_mi300x.json.gz"))
    for ids in ([], [-1], [trace.string_id("kernel"), -1], list(range(0, len(trace.names), 3))):
        assert np.array_equal(trace.has_id(trace.name_id, ids), np.isin(trace.name_id, [i for i in ids if i >= 0]))
    kernels = trace.ids_matching(lambda s: s.startswith("void"))
    assert kernels.size and all(trace.names[i].startswith("void") for i in kernels)
    assert np.array_equal(trace.mask_name(lambda s: s.startswith("void")), np.isin(trace.name_id, kernels))


@pytest.mark.parametrize("phases", [["X", "B", "E"], ["X", ""], ["", "XX"], ["XX", ""], ["X", "\0"], ["é", "X"],
                                    [1, "X"], ["X"], [], ["X\0", "Y"], ["Xa", "\0"], [None, "X"], [["X"], "X"]])
def test_phase_codes_of_odd_phases(phases: list[Any]) -> None:
    """The one-pass path (every phase one ASCII character) and the per-phase one agree."""
    expected = np.array([_phase_code(p) for p in phases], dtype=np.uint8)
    codes = phase_codes(phases)
    assert codes.dtype == np.uint8 and codes.tolist() == expected.tolist()
