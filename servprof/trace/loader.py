"""Read Kineto chrome traces (.json, .json.gz, or a directory of them) into a columnar Trace.

Each file streams through in chunks (source.py): inflated by isal, its events array cut into
batches of a few MB (split.py) and decoded by msgspec into Structs holding only the fields
servprof reads, with ``args`` left as JSON text (columns.py, args.py). Neither the whole text
of a big trace nor a Python object per event is ever held, so memory stays near the columns'
size (about 0.9x the inflated trace) and a trace's time is linear in its events. A small trace
(up to HELD_TEXT_BYTES, told from the files' sizes before reading; else as its text is read)
keeps its batches' text instead of finding each event's args in it:
the one pass over the text then reads the args the columns need too, and the args' text is
found only if a row's args are read (never, for an idle split). A caller that reads args all
through the trace (servprof's analysis) asks for the big trace's way (``read_args``): one pass.
Every way a file can be unusable ends in a one-line TraceError.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from servprof.trace.args import RawArgs
from servprof.trace.columns import EVENTS, TYPED_EVENTS, FileColumns
from servprof.trace.errors import TraceError
from servprof.trace.model import Trace
from servprof.trace.source import (
    DEFAULT_MAX_TRACE_BYTES,
    SIDECAR_SUFFIXES,
    SOURCE_FILE_KEY,
    max_trace_bytes,
    read_chunks,
    read_whole,
    text_size,
    trace_files,
)
from servprof.trace.split import BATCH_BYTES, DICTS, TYPED, EventBatches, NotStreamable
from servprof.trace.values import Interner, file_rank, normalise_metadata

__all__ = ["DEFAULT_MAX_TRACE_BYTES", "SIDECAR_SUFFIXES", "SOURCE_FILE_KEY", "TraceError", "load_trace",
           "max_trace_bytes", "paused_gc", "trace_files"]

ProgressCallback = Callable[[str], None]  # called with the stage just finished: "read", "parse", "columns"
# Batch text a load keeps (all files together); past it, every batch's args are found as it is
# read and only their text kept (about a third of a trace), so that a big trace's peak stays
# near its columns' size. A load that finds it passed midway finds the args of every batch it
# held then: a second pass over that text (a 35 MB trace took 180 ms instead of 145), so the
# files' sizes decide first where they can (source.text_size).
HELD_TEXT_BYTES = 64 * 1024**2


def load_trace(
    path: str | os.PathLike[str],
    progress: ProgressCallback | None = None,
    max_bytes: int | None = None,
    files: Sequence[Path] | None = None,
    read_args: bool = False,
) -> Trace:
    """Load a trace file or a directory of per-rank trace files (``files``: those of the
    directory's files that are one run's ranks, when not all are). ``read_args``: the caller
    will read the args of rows all through the trace (servprof's detectors do: op shapes, step
    args), so each event's args text is found as its batch is decoded, in that one pass; by
    default a small trace keeps its batches' text and finds them only when a row is first
    read, a second pass over each batch read (a load for an idle split reads none).

    Raises TraceError (one line) for anything that is not a usable chrome trace. Pauses
    Python's cyclic garbage collector while it runs: call it in an analysis process or
    a CLI, never on a serving process's threads (the serving process never parses traces).
    """
    files = trace_files(path) if files is None else list(files)
    limit = max_trace_bytes() if max_bytes is None else max_bytes
    with paused_gc():
        return _load(path, files, limit, progress, read_args)


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector. Loading and detecting allocate many objects, none of
    them cyclic garbage; with the collector on, its passes over them cost as much as the work."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _load(path: str | os.PathLike[str], files: list[Path], limit: int, progress: ProgressCallback | None,
          read_args: bool) -> Trace:
    interner = Interner()
    parts: list[dict[str, np.ndarray]] = []
    args = RawArgs()
    metadata: dict[int, dict[str, Any]] = {}
    thread_names: dict[tuple[int, int, int], str] = {}
    held = _HeldText(args, keep=not read_args and _small(files))
    for index, file in enumerate(files):
        columns, document = _read_file(file, limit, progress, held)
        rank = file_rank(document, index, list(metadata))
        document[SOURCE_FILE_KEY] = file.name  # for messages about the file (two files claiming a rank)
        metadata[rank] = document
        finished, names = columns.finish(rank, interner)
        thread_names.update(names)
        args.extend(columns.args)
        parts.append(finished)
        del columns
        if progress:
            progress("columns")
    if not any(len(p["ts"]) for p in parts):
        raise TraceError(f"{path}: the trace holds no timed events")
    merged: dict[str, np.ndarray] = {}
    for key in list(parts[0]):  # one column at a time: never two copies of every column
        merged[key] = parts[0][key] if len(parts) == 1 else np.concatenate([p.pop(key) for p in parts])
    return Trace(
        source=str(path),
        names=interner.strings,
        metadata=metadata,
        thread_names=thread_names,
        raw_args=args,
        _name_lookup=interner.lookup,
        **merged,
    )


def _small(files: list[Path]) -> bool:
    """Whether the files' text, told before reading them, fits HELD_TEXT_BYTES (not when untold)."""
    sizes = [text_size(file) for file in files]
    return None not in sizes and sum(sizes) <= HELD_TEXT_BYTES  # type: ignore[arg-type]


class _HeldText:
    """The batch text a load holds, and the rule that bounds it."""

    LET_GO = -(2**62)  # bytes held once no batch text is kept: every batch is decoded as a big trace's

    def __init__(self, trace_args: RawArgs, keep: bool = True) -> None:
        self.trace_args = trace_args
        self.bytes = 0 if keep else self.LET_GO

    def add(self, size: int, columns: FileColumns, batches: EventBatches) -> None:
        self.bytes += size
        if self.bytes > HELD_TEXT_BYTES:  # a big trace: let go of the text, decode as big traces do
            batches.typed = None
            self.bytes = self.LET_GO
            for args in (self.trace_args, columns.args):
                args.let_go_of_batches()

    def typed(self) -> Any:
        return TYPED_EVENTS if self.bytes >= 0 else None


def _read_file(file: Path, limit: int, progress: ProgressCallback | None,
               held: _HeldText) -> tuple[FileColumns, dict[str, Any]]:
    """One file's events as columns (its strings not yet in the trace's ids) and its top-level keys."""
    columns = FileColumns(file)
    with closing(read_chunks(file, limit)) as chunks:
        batches = EventBatches(file, chunks, EVENTS, BATCH_BYTES, typed=held.typed())
        try:
            for number, (events, kind, text) in enumerate(batches):
                if number == 0 and progress:
                    progress("read")
                columns.add(events, kind, text)
                if kind == TYPED:
                    held.add(len(text), columns, batches)
                del events, text
        except NotStreamable:
            columns = None  # type: ignore[assignment]
        else:
            if progress:
                progress("parse")
            return columns, normalise_metadata(batches.metadata)
    # A file the streaming reader cannot cut: parsed whole, as the loader always did.
    from servprof.trace.reference import parse_document

    columns = FileColumns(file)
    data = read_whole(file, limit)
    if progress:
        progress("read")
    document, events = parse_document(file, data)
    del data
    if progress:
        progress("parse")
    columns.add(events, DICTS)
    return columns, document
