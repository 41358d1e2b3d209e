"""The streaming msgspec loader gives the same findings, to the byte, as the orjson loader it
replaced (kept as servprof.trace.reference), on every fixture and public trace: through the
whole `servprof analyze --json` report and the analysis child's result, whatever detectors
exist. Also with batches cut every few KB, so that every file is split hundreds of times, and
with args found as each batch is decoded (servprof's analysis) or on first read (the default)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import orjson
import pytest
from _analyze_helpers import FIXTURES, PUBLIC_TRACES

import servprof.trace
import servprof.trace.loader as loader
from servprof import analysis
from servprof.report import analyze_cli
from servprof.trace.reference import load_trace_orjson

TRACES = sorted(FIXTURES.glob("*.json.gz")) + sorted(PUBLIC_TRACES.glob("*.json.gz"))
COLUMNS = ("name_id", "cat_id", "ph", "pid", "tid", "ts", "dur", "stream", "correlation", "external_id",
           "flow_id", "rank")


@pytest.fixture(autouse=True)
def _no_saved_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVPROF_CACHE_DIR", str(tmp_path / "cache"))  # same device for both runs


def _analyze_json(path: Path, out: Path) -> bytes:
    parser = argparse.ArgumentParser()
    analyze_cli.add_arguments(parser)
    assert analyze_cli.run(parser.parse_args([str(path), "--json", str(out)])) == 0
    return out.read_bytes()


def _child_result(path: Path) -> bytes:
    trace = servprof.trace.load_trace(path)
    requests = [{"request_id": rid} for rid in trace.servprof_metadata().get("request_ids", [])]
    result = analysis.analyse(path, {"session_id": "s", "requests": requests})
    return orjson.dumps(result, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)


def _both(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, bytes]:
    """(report, child result) from the streaming loader, then from the orjson one."""
    ours = _analyze_json(path, tmp_path / "ours.json") + _child_result(path)
    monkeypatch.setattr(analyze_cli, "load_trace", lambda p, progress=None, files=None, **_: load_trace_orjson(p))
    monkeypatch.setattr(servprof.trace, "load_trace", lambda p, **_: load_trace_orjson(p))
    reference = _analyze_json(path, tmp_path / "reference.json") + _child_result(path)
    return ours, reference


def _args_read(read_args: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every load (the report's, the child's) find args as asked: with the events, or on
    first read (servprof's analysis asks for the first; a library caller gets the second)."""
    load = loader.load_trace
    monkeypatch.setattr(analyze_cli, "load_trace", lambda *a, **k: load(*a, **{**k, "read_args": read_args}))
    monkeypatch.setattr(servprof.trace, "load_trace", lambda *a, **k: load(*a, **{**k, "read_args": read_args}))


@pytest.mark.parametrize("read_args", [True, False], ids=["args_with_events", "args_on_first_read"])
@pytest.mark.parametrize("batch_bytes", [loader.BATCH_BYTES, 4096], ids=["default_batches", "4KB_batches"])
@pytest.mark.parametrize("path", TRACES, ids=[p.name.split(".")[0] for p in TRACES])
def test_same_findings_to_the_byte(path: Path, batch_bytes: int, read_args: bool, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "BATCH_BYTES", batch_bytes)
    _args_read(read_args, monkeypatch)
    ours, reference = _both(path, tmp_path, monkeypatch)
    assert b'"findings"' in ours
    assert ours == reference


@pytest.mark.parametrize("read_args", [True, False], ids=["args_with_events", "args_on_first_read"])
@pytest.mark.parametrize("path", TRACES, ids=[p.name.split(".")[0] for p in TRACES])
def test_same_columns_strings_and_args(path: Path, read_args: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond today's detectors: every column, interned string, metadata key and args dict."""
    monkeypatch.setattr(loader, "BATCH_BYTES", 16 * 1024)
    ours, reference = servprof.trace.load_trace(path, read_args=read_args), load_trace_orjson(path)
    for column in COLUMNS:
        assert np.array_equal(getattr(ours, column), getattr(reference, column), equal_nan=True), column
        assert getattr(ours, column).dtype == getattr(reference, column).dtype, column
    assert ours.names == reference.names
    assert ours.metadata == reference.metadata
    assert list(ours.metadata[0]) == list(reference.metadata[0])  # key order too
    assert ours.thread_names == reference.thread_names
    assert all(ours.args(row) == reference.args(row) for row in range(len(reference)))
