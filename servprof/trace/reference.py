"""The orjson loader servprof used before the streaming one: the whole file parsed into Python
objects, then one list comprehension per column.

Kept for two jobs: the files the streaming reader cannot cut (``parse_document``), and as the
reference the streaming loader must match, finding for finding (tests/test_loader_equivalence.py;
bench/bench_loader.py times both).
"""

from __future__ import annotations

import os
from itertools import compress
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from servprof.trace.errors import TraceError
from servprof.trace.model import Trace
from servprof.trace.source import (
    RECORD_HOW,
    SOURCE_FILE_KEY,
    UTF8_BOM,
    max_trace_bytes,
    read_whole,
    trace_files,
)
from servprof.trace.values import (
    NO_ARGS,
    Interner,
    arg_columns,
    file_rank,
    float_column,
    int_column,
    normalise_metadata,
    phase_codes,
    thread_names,
)


def parse_document(path: Path, data: bytes | bytearray) -> tuple[dict[str, Any], list[Any]]:
    """Top-level keys (without the events) and the event list."""
    if data[:len(UTF8_BOM)] == UTF8_BOM:
        data = memoryview(data)[len(UTF8_BOM):]
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        why = str(exc).splitlines()[0]
        if why.startswith("unexpected content after document") and _json_lines(data):
            why = "one JSON document per line, as `nsys export --type json` writes; not a chrome trace: " + RECORD_HOW
        raise TraceError(f"{path}: not valid JSON ({why})") from None
    if isinstance(document, list):  # the chrome-trace "JSON Array Format"
        return {}, document
    if not isinstance(document, dict) or "traceEvents" not in document:
        raise TraceError(f"{path}: {_what_json(document)}")
    events = document.pop("traceEvents")
    if not isinstance(events, list):
        raise TraceError(f"{path}: 'traceEvents' is not a list")
    return normalise_metadata(document), events


def _json_lines(data: bytes | bytearray | memoryview) -> bool:
    """Does the text's first line hold a whole JSON document (JSON Lines)?"""
    first = bytes(data[:1 << 20]).split(b"\n", 1)[0]
    try:
        orjson.loads(first)
    except orjson.JSONDecodeError:
        return False
    return True


def _what_json(document: Any) -> str:
    """Why a JSON document is no chrome trace, naming the files people mistake for one."""
    if not isinstance(document, dict):
        return f"a JSON {type(document).__name__}, not a chrome trace (an object with 'traceEvents', or a list of events)"
    own = _servprof_output(document)
    if own:
        return own
    schema = document.get("$schema")
    if isinstance(schema, str) and "speedscope" in schema:
        return f"a speedscope profile (py-spy record --format speedscope?), not a torch.profiler trace: {RECORD_HOW}"
    if {"segments", "device_traces"} <= document.keys():
        return ("a CUDA memory snapshot (torch.cuda.memory._snapshot()), not a trace: it opens at "
                "https://pytorch.org/memory_viz")
    if {"nodes", "schema"} <= document.keys():
        return ("a PyTorch execution trace (ExecutionTraceObserver, as Chakra and PARAM's et_replay read it): its "
                "nodes are the ops and tensors, without the time each took, so it cannot show where time went; "
                "analyse the Kineto trace recorded beside it (torch.profiler's chrome trace: "
                "prof.export_chrome_trace('trace.json'), or a tensorboard_trace_handler's *.pt.trace.json)")
    keys = ", ".join(repr(k) for k in list(document)[:6]) + (", ..." if len(document) > 6 else "")
    return f"no 'traceEvents' key (its keys: {keys or 'none'}); not a chrome trace: {RECORD_HOW}"


def _servprof_output(document: dict[str, Any]) -> str | None:
    """What a JSON file servprof itself writes is, and the trace to analyse instead (people point
    `servprof analyze` at the report or a session's files beside the trace)."""
    session = document.get("session")
    trace_file = document.get("trace_file") or (session.get("trace_file") if isinstance(session, dict) else None)
    summary = document.get("summary")
    if "findings" in document:
        if isinstance(trace_file, str):
            return f"servprof's analysis of a session, not a trace: analyse its trace, {trace_file}"
        if isinstance(summary, dict) and isinstance(summary.get("source"), str):
            return f"servprof's analysis report, not a trace: it was made from {summary['source']}"
        return "servprof's analysis, not a trace: analyse the .pt.trace.json.gz it was made from"
    if isinstance(document.get("session_id"), str) and isinstance(trace_file, str):
        return f"a servprof session's description, not a trace: its trace is {trace_file}"
    if {"completed", "failed", "slo"} <= document.keys():
        return "the locust harness's summary, not a trace: servprof analyze reads torch.profiler traces"
    return None


def load_trace_orjson(path: str | os.PathLike[str], max_bytes: int | None = None) -> Trace:
    """``servprof.trace.load_trace`` as it was: every event an orjson dict (memory ~5x the text)."""
    from servprof.trace.loader import paused_gc

    files = trace_files(path)
    limit = max_trace_bytes() if max_bytes is None else max_bytes
    with paused_gc():
        interner = Interner()
        parts: list[dict[str, Any]] = []
        metadata: dict[int, dict[str, Any]] = {}
        names: dict[tuple[int, int, int], str] = {}
        for index, file in enumerate(files):
            document, events = parse_document(file, read_whole(file, limit))
            rank = file_rank(document, index, list(metadata))
            document[SOURCE_FILE_KEY] = file.name
            metadata[rank] = document
            columns = _columns(events, rank, interner, file)
            names.update(thread_names(columns.pop("metadata_events"), rank))
            parts.append(columns)
        if not any(len(p["ts"]) for p in parts):
            raise TraceError(f"{path}: the trace holds no timed events")
        merged = {key: [a for p in parts for a in p[key]] if key == "raw_args" else np.concatenate([p[key] for p in parts])
                  for key in parts[0]}
        return Trace(source=str(path), names=interner.strings, metadata=metadata, thread_names=names,
                     _name_lookup=interner.lookup, **merged)


def _columns(events: list[Any], rank: int, interner: Interner, file: Path) -> dict[str, Any]:
    nan = float("nan")
    try:
        ts = float_column([e.get("ts", nan) for e in events], nan)
    except AttributeError:
        raise TraceError(f"{file}: an entry of 'traceEvents' is not an object") from None
    phases = [e.get("ph", "") for e in events]
    # Timed events only: metadata ("M") events and events without a usable ts are dropped,
    # from the finished columns (masking arrays is cheaper than rebuilding the event list).
    is_metadata = np.array([p == "M" for p in phases], dtype=bool)
    metadata_events = list(compress(events, is_metadata.tolist()))
    keep = np.isfinite(ts) & ~is_metadata
    dur = float_column([e.get("dur", 0.0) for e in events], 0.0)
    np.nan_to_num(dur, copy=False, nan=0.0)
    np.maximum(dur, 0.0, out=dur)
    args = [e.get("args") or NO_ARGS for e in events]
    ph = phase_codes(phases)
    flow = (ph == ord("s")) | (ph == ord("f")) | (ph == ord("t"))
    flow_ids = np.full(len(events), -1, dtype=np.int64)
    if flow.any():
        flow_rows = np.flatnonzero(flow).tolist()
        flow_ids[flow] = int_column([events[i].get("id", -1) for i in flow_rows])
    columns = {
        "name_id": interner.ids([e.get("name", "") for e in events]),
        "cat_id": interner.ids([e.get("cat", "") for e in events]),
        "ph": ph,
        "pid": interner.process_ids([e.get("pid", -1) for e in events]),
        "tid": interner.process_ids([e.get("tid", -1) for e in events]),
        "ts": ts,
        "dur": dur,
        **arg_columns(args),
        "flow_id": flow_ids,
    }
    everything = keep.all()
    n = len(events) if everything else int(keep.sum())
    return {
        **(columns if everything else {key: column[keep] for key, column in columns.items()}),
        "rank": np.full(n, rank, dtype=np.int32),
        "raw_args": args if everything else list(compress(args, keep.tolist())),
        "metadata_events": metadata_events,
    }
