"""Mutated traces for fuzzing the loader and `servprof analyze` (tests/test_fuzz_trace.py and
bench/fuzz_analyze.py): hypothesis strategies that start from real traces (the public ones
under tests/fixtures/public and the demo fixtures) and break them at the byte level (truncation, bit
flips, splices, gzip damage) or the structure level (dropped or retyped fields, odd numbers,
garbage events, missing traceEvents)."""

from __future__ import annotations

import copy
import gzip
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import orjson
from hypothesis import strategies as st

FIXTURES = Path(__file__).parent / "fixtures"
PUBLIC_TRACES = FIXTURES / "public"
SEED_EVENTS = 300  # timed events kept per seed, so one loader+detector pass stays in milliseconds
SEED_DEVICE_EVENTS = 50
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def seed_sources() -> list[Path]:
    """Real traces to mutate: the demo fixtures and the vendored public GPU traces."""
    return sorted(FIXTURES.glob("*.json.gz")) + sorted(PUBLIC_TRACES.glob("*.json.gz"))


@lru_cache(maxsize=1)
def seed_documents() -> tuple[dict[str, Any], ...]:
    """One small document per real trace: its top-level keys, metadata events and a window of
    timed events from the middle (where the model steps are)."""
    documents = []
    for path in seed_sources():
        document = orjson.loads(gzip.decompress(path.read_bytes()))
        events = document.pop("traceEvents")
        meta = [e for e in events if e.get("ph") == "M"][:50]
        timed = [e for e in events if e.get("ph") != "M"]
        start = max(0, len(timed) // 2 - SEED_EVENTS // 2)
        window = timed[start:start + SEED_EVENTS]
        # GPU traces keep device work in the window, so what reads the device's properties runs.
        device = [e for e in timed if e.get("cat") in DEVICE_CATEGORIES]
        if device and not any(e.get("cat") in DEVICE_CATEGORIES for e in window):
            window = window[: SEED_EVENTS - SEED_DEVICE_EVENTS] + device[len(device) // 2:][:SEED_DEVICE_EVENTS]
        document["traceEvents"] = meta + window
        documents.append(document)
    return tuple(documents)


# --- garbage values -------------------------------------------------------------------------

# orjson writes integers within [-2**63, 2**64); bigger ones reach the loader as text (byte_mutation "nan").
ODD_NUMBERS = [float("nan"), float("inf"), float("-inf"), -1.0, -1e300, 1e300, 0, -(2**63), 2**63, 2**64 - 1,
               1e-320, 5e-324]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(ODD_NUMBERS),
    st.text(max_size=20), st.sampled_from(["servprof:tokenize|", "servprof:decode_step|a,b", "servprof:",
                                           "ProfilerStep#1", "X", "M", "s", "f", "\x00", "é", "\ud7ff"]),
)
garbage = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
EVENT_FIELDS = ["ts", "dur", "ph", "name", "cat", "pid", "tid", "args", "id"]
ARG_FIELDS = ["stream", "correlation", "External id", "name", "device", "Input Dims", "Input type",
              "Concrete Inputs", "Input Strides"]
# Every metadata field some part of servprof reads, by where it lives in the document.
DEVICE_FIELDS = ["name", "totalGlobalMem", "computeMajor", "computeMinor", "numSms", "memoryClockRate",
                 "memoryBusWidth"]
SERVPROF_FIELDS = ["session_id", "request_ids", "wall_start_ns", "perf_start_ns", "stop_reason", "reason",
                   "event_loop_tid", "stop_wall_ns", "cut_wall_ns"]


def _to_json(document: Any) -> bytes:
    # orjson writes NaN/inf as null; those reach the loader through byte mutations instead.
    return orjson.dumps(document, option=orjson.OPT_NON_STR_KEYS)


@st.composite
def structure_mutation(draw: st.DrawFn) -> bytes:
    """A seed document with a few events (or the top level) broken, serialised as JSON."""
    document = copy.deepcopy(draw(st.sampled_from(seed_documents())))
    events: list[Any] = document["traceEvents"]
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["drop_field", "retype_field", "odd_time", "args", "event", "dup",
                                     "top", "servprof_meta", "phase_name", "meta_field", "meta_field",
                                     "meta_field"]))
        if not events and kind not in ("top", "servprof_meta", "meta_field"):
            kind = "top"
        index = draw(st.integers(0, max(0, len(events) - 1)))
        event = events[index] if events else None
        if kind == "drop_field" and isinstance(event, dict):
            event.pop(draw(st.sampled_from(EVENT_FIELDS)), None)
        elif kind == "retype_field" and isinstance(event, dict):
            event[draw(st.sampled_from(EVENT_FIELDS))] = draw(garbage)
        elif kind == "odd_time" and isinstance(event, dict):
            event[draw(st.sampled_from(["ts", "dur"]))] = draw(st.sampled_from(ODD_NUMBERS))
        elif kind == "args" and isinstance(event, dict):
            if draw(st.booleans()):
                event["args"] = draw(garbage)
            else:
                args = event.setdefault("args", {})
                if isinstance(args, dict):
                    args[draw(st.sampled_from(ARG_FIELDS))] = draw(garbage)
        elif kind == "event":
            events[index] = draw(garbage)
        elif kind == "dup" and events:
            events.extend(events[index:index + draw(st.integers(1, 50))])
        elif kind == "phase_name" and isinstance(event, dict):
            ids = draw(st.lists(st.text(max_size=10), max_size=4))
            event["name"] = f"servprof:{draw(st.text(max_size=12))}|{','.join(ids)}"
        elif kind == "top":
            choice = draw(st.sampled_from(["drop_events", "retype_events", "array_form", "garbage_doc",
                                           "empty_events", "extra_key"]))
            if choice == "drop_events":
                document.pop("traceEvents", None)
            elif choice == "retype_events":
                document["traceEvents"] = draw(garbage.filter(lambda v: not isinstance(v, list)))
            elif choice == "array_form":
                return _to_json(events)
            elif choice == "garbage_doc":
                return _to_json(draw(garbage))
            elif choice == "empty_events":
                events.clear()
            else:
                document[draw(st.text(max_size=10))] = draw(garbage)
        elif kind == "meta_field":
            _mutate_metadata_field(draw, document)
        elif kind == "servprof_meta":
            meta = draw(garbage)
            document[draw(st.sampled_from(["servprof", "distributedInfo", "deviceProperties"]))] = (
                _to_json(meta).decode() if draw(st.booleans()) else meta)
    return _to_json(document)


def _mutate_metadata_field(draw: st.DrawFn, document: dict[str, Any]) -> None:
    """One field of the metadata servprof reads retyped or dropped: a deviceProperties entry's field,
    distributedInfo.rank, baseTimeNanoseconds, or a field of servprof's own session block."""
    where = draw(st.sampled_from(["deviceProperties", "distributedInfo", "baseTimeNanoseconds", "servprof"]))
    if where == "baseTimeNanoseconds":
        if draw(st.integers(0, 4)) == 0:
            document.pop(where, None)
        else:
            document[where] = draw(garbage | st.sampled_from(ODD_NUMBERS))
        return
    if where == "deviceProperties":
        entries = document.get(where)
        if not isinstance(entries, list) or not entries or not isinstance(entries[0], dict):
            entries = document[where] = [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "computeMajor": 9,
                                           "computeMinor": 0, "numSms": 132, "totalGlobalMem": 85018279936}]
        target, fields = entries[draw(st.integers(0, len(entries) - 1))], DEVICE_FIELDS
    elif where == "distributedInfo":
        target = document.get(where)
        if not isinstance(target, dict):
            target = document[where] = {"backend": "nccl", "rank": 0, "world_size": 1}
        fields = ["rank", "world_size", "backend"]
    else:
        target = document.get(where)
        if not isinstance(target, dict):
            target = document[where] = {"session_id": "s", "request_ids": ["r1"], "event_loop_tid": 1}
        fields = SERVPROF_FIELDS
    if not isinstance(target, dict):
        return
    # A few fields at once: readers check one field, then use another (a name, then a size).
    for key in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        if draw(st.integers(0, 4)) == 0:
            target.pop(key, None)
        else:
            target[key] = draw(garbage | st.sampled_from(ODD_NUMBERS))


@st.composite
def metadata_mutation(draw: st.DrawFn) -> bytes:
    """A seed document, whole, with one to four metadata fields servprof reads retyped or dropped."""
    document = copy.deepcopy(draw(st.sampled_from(seed_documents())))
    for _ in range(draw(st.integers(1, 4))):
        _mutate_metadata_field(draw, document)
    return _to_json(document)


@st.composite
def byte_mutation(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` truncated, bit-flipped, spliced, or with ranges inserted, deleted or repeated."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["truncate", "flip", "splice", "insert", "delete", "repeat", "nan"]))
        position = draw(st.integers(0, max(0, len(out) - 1)))
        if kind == "truncate":
            del out[position:]
        elif kind == "flip" and out:
            for _ in range(draw(st.integers(1, 8))):
                at = draw(st.integers(0, len(out) - 1))
                out[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "splice":
            other = _to_json(draw(st.sampled_from(seed_documents())))
            out = out[:position] + other[draw(st.integers(0, len(other) - 1)):]
        elif kind == "insert":
            out[position:position] = draw(st.binary(min_size=1, max_size=64)
                                          | st.sampled_from([b"NaN", b"-Infinity", b"[" * 2000, b"{\"a\":" * 50,
                                                             b"1e999999", b"\"\\ud800\"", b"\x00", b"\xff\xfe"]))
        elif kind == "delete":
            del out[position:position + draw(st.integers(1, 256))]
        elif kind == "repeat":
            out[position:position] = out[position:position + draw(st.integers(1, 512))] * draw(st.integers(1, 20))
        elif kind == "nan":  # a number becomes a literal orjson refuses
            at = out.find(b'"ts": ', position) if b'"ts": ' in out else out.find(b'"ts":', position)
            if at >= 0:
                out[at + 5:at + 5] = draw(st.sampled_from([b"NaN", b"Infinity", b"-1e400", b"99999999999999999999999"]))
    return bytes(out)


@st.composite
def gzip_mutation(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` gzipped, then the gzip stream damaged (or left whole)."""
    packed = bytearray(gzip.compress(data, compresslevel=1, mtime=0))
    kind = draw(st.sampled_from(["whole", "truncate", "flip", "crc", "trailing", "two_members", "header"]))
    if kind == "truncate":
        del packed[draw(st.integers(0, len(packed) - 1)):]
    elif kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(packed) - 1))
            packed[at] ^= 1 << draw(st.integers(0, 7))
    elif kind == "crc":
        packed[-8] ^= 0xFF
    elif kind == "trailing":
        packed += draw(st.binary(min_size=1, max_size=32))
    elif kind == "two_members":
        packed += gzip.compress(draw(st.binary(max_size=64)) if draw(st.booleans()) else data[:1000])
    elif kind == "header":
        packed[3] = draw(st.integers(0, 255))  # FLG: claim an extra field, a name, a comment...
    return bytes(packed)


@st.composite
def trace_inputs(draw: st.DrawFn) -> tuple[str, bytes]:
    """(file suffix, file bytes): a real trace broken at the structure level, the byte level, or both,
    stored plain or gzipped (sometimes under the other suffix: the loader sniffs the gzip magic)."""
    form = draw(st.sampled_from(["structure", "structure", "metadata", "seed"]))
    if form == "metadata":  # left whole otherwise: the metadata readers must see it parse
        data = draw(metadata_mutation())
    else:
        data = draw(structure_mutation()) if form == "structure" else _to_json(draw(st.sampled_from(seed_documents())))
    if form != "metadata" and draw(st.integers(0, 3)) > 0:
        data = draw(byte_mutation(data))
    if draw(st.booleans()):
        data = draw(gzip_mutation(data))
        suffix = draw(st.sampled_from([".json.gz", ".json.gz", ".json"]))
    else:
        suffix = draw(st.sampled_from([".json", ".json", ".json.gz"]))
    return suffix, data


# --- special inputs ---------------------------------------------------------------------------

def deeply_nested(depth: int) -> bytes:
    """A trace whose first event's args nest ``depth`` arrays deep."""
    return b'{"traceEvents": [{"ph": "X", "ts": 1, "dur": 1, "name": "a", "args": {"x": ' + b"[" * depth \
        + b"]" * depth + b"}}]}"


def write_gzip_bomb(path: Path, uncompressed_bytes: int) -> None:
    """A .json.gz whose start is a trace's opening and whose body is ``uncompressed_bytes`` of
    spaces (valid JSON whitespace), about 1000:1. The spaces are one gzip member of 64 MiB
    compressed once and repeated (gzip readers join members), so writing it takes no time."""
    member = gzip.compress(b" " * (64 * 1024**2), compresslevel=9, mtime=0)
    with open(path, "wb") as out:
        out.write(gzip.compress(b'{"traceEvents": [{"ph": "X", "ts": 1, "dur": 1, "name": "a"}', mtime=0))
        for _ in range(-(-uncompressed_bytes // (64 * 1024**2))):
            out.write(member)
        out.write(gzip.compress(b"]}", mtime=0))


def write_sparse(path: Path, size: int, head: bytes = b'{"traceEvents": [') -> None:
    """A file of ``size`` bytes that takes no disk: a JSON opening, then a hole (NUL bytes)."""
    with open(path, "wb") as out:
        out.write(head)
        out.truncate(size)


@dataclass
class AnalyzeRun:
    returncode: int | None  # None: killed at the time limit
    stderr: str
    seconds: float
    peak_rss_mb: float  # the child's own high-water mark (VmHWM); 0 when it was killed


# Runs `servprof analyze` and, at exit, writes its own VmHWM to argv[1]. (wait4's ru_maxrss cannot be
# used: on Linux a child starts from its parent's high-water mark, which a fuzzing parent has raised.)
_ANALYZE_WITH_PEAK = """
import atexit, sys
def _peak(path=sys.argv[1]):
    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]
    open(path, 'w').write(hwm)
atexit.register(_peak)
from servprof.cli import main
sys.exit(main(['analyze', *sys.argv[2:]]))
"""


def run_analyze(path: Path, timeout_s: float, env: dict[str, str] | None = None,
                extra: list[str] | None = None) -> AnalyzeRun:
    """`servprof analyze PATH` as its own process, with its peak RSS."""
    peak_file = path.with_name(path.name + ".peak")
    command = [sys.executable, "-c", _ANALYZE_WITH_PEAK, str(peak_file), str(path), *(extra or [])]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env={**os.environ, **(env or {})}, timeout=timeout_s)
        returncode: int | None = done.returncode
        stderr = done.stderr
    except subprocess.TimeoutExpired as exc:
        returncode, stderr = None, exc.stderr or b""
    seconds = time.perf_counter() - started
    peak_kib = int(peak_file.read_text()) if peak_file.exists() else 0
    peak_file.unlink(missing_ok=True)
    return AnalyzeRun(returncode, stderr.decode("utf-8", "replace"), seconds, peak_kib / 1024)


def analyze_in_process(path: Path, report_dir: Path) -> tuple[int, str]:
    """`servprof analyze PATH --json --html` in this process: (exit status, stderr). Any exception
    other than a clean exit escapes, which is what a fuzz run looks for."""
    import contextlib
    import io

    from servprof.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["analyze", str(path), "--json", str(report_dir / "report.json"),
                       "--html", str(report_dir / "report.html")])
    return status, err.getvalue()


def clean_failure_line(stderr: str) -> bool:
    """Exactly one line, the command's own, no traceback."""
    lines = stderr.strip().splitlines()
    return len(lines) == 1 and lines[0].startswith("servprof analyze: ") and "Traceback" not in stderr
