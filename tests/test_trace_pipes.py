"""Traces read from a stream, once, as it comes: a pipe (``servprof analyze - < t.json.gz``,
``servprof analyze <(zcat ...)``), a FIFO. Before: a pipe's size is 0, so every one was refused as
an "empty file". And a stream that never ends and is not JSON (/dev/zero) is refused at its first
chunk, not read to the size limit."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
import pytest
from _analyze_helpers import PUBLIC_TRACES

from servprof.trace import TraceError, load_trace

TRACE = PUBLIC_TRACES / "vllm_decode_bs32_fullgraph_mi300x.json.gz"


@contextmanager
def fifo_fed(tmp_path: Path, data: bytes, keep_open: threading.Event | None = None) -> Iterator[Path]:
    """A FIFO a thread writes ``data`` into (then holds open until ``keep_open`` is set, if given)."""
    path = tmp_path / "trace.fifo"
    os.mkfifo(path)

    def write() -> None:
        with open(path, "wb") as sink:  # (blocks until the reader opens it)
            try:
                sink.write(data)
                sink.flush()
                if keep_open is not None:
                    keep_open.wait(120)
            except BrokenPipeError:  # the reader refused it and closed its end
                pass

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        yield path
    finally:
        if keep_open is not None:
            keep_open.set()
        writer.join(timeout=30)


@pytest.mark.parametrize("packed", [True, False], ids=["gzip", "plain"])
def test_a_fifo_loads_as_the_file_does(tmp_path: Path, packed: bool) -> None:
    data = TRACE.read_bytes() if packed else gzip.decompress(TRACE.read_bytes())
    with fifo_fed(tmp_path, data) as path:
        streamed = load_trace(path)
    whole = load_trace(TRACE)
    assert len(streamed) == len(whole) > 0
    assert (streamed.ts == whole.ts).all() and (streamed.dur == whole.dur).all()
    assert [streamed.names[i] for i in streamed.name_id[:50]] == [whole.names[i] for i in whole.name_id[:50]]


def test_analyze_reads_standard_input_as_the_file(tmp_path: Path) -> None:
    def report(args: list[str], stdin: bytes | None = None) -> dict:
        done = subprocess.run([sys.executable, "-m", "servprof.cli", "analyze", *args, "--json", "-"], input=stdin,
                              capture_output=True, timeout=120, check=True)
        document = orjson.loads(done.stdout)
        document["summary"].pop("source")
        return document

    assert report(["-"], TRACE.read_bytes()) == report([str(TRACE)])


def test_an_endless_stream_that_is_not_json_is_refused_at_once(tmp_path: Path) -> None:
    """(The writer holds its end open: a reader that waited for the end would never return.)"""
    done = threading.Event()
    outcome: list[BaseException] = []

    def load(path: Path) -> None:
        try:
            load_trace(path)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)
        done.set()

    with fifo_fed(tmp_path, b"\0" * (4 * 1024**2), keep_open=threading.Event()) as path:
        threading.Thread(target=load, args=(path,), daemon=True).start()
        assert done.wait(120), "the reader waited for the end of an endless stream"
    (error,) = outcome
    assert isinstance(error, TraceError) and "not valid JSON for a trace" in str(error)


def test_a_gzip_bomb_through_a_pipe_is_refused(tmp_path: Path) -> None:
    bomb = gzip.compress(b'{"traceEvents": [' + b" " * (40 * 1024**2), compresslevel=9)
    with fifo_fed(tmp_path, bomb) as path, pytest.raises(TraceError, match="gzip bomb"):
        load_trace(path)


def test_an_empty_pipe_says_nothing_was_written(tmp_path: Path) -> None:
    with fifo_fed(tmp_path, b"") as path, pytest.raises(TraceError, match="nothing was written to it"):
        load_trace(path)
