"""Where trace bytes come from: the files a path names, read (and inflated when gzipped) in
chunks, under a size limit and a gzip-bomb guard; every failure is a one-line TraceError.

Gzip is inflated by python-isal's igzip when it is installed (about 2.5x stdlib zlib on
Kineto traces, see bench/bench_loader.py), else by the standard library.
"""

from __future__ import annotations

import gzip
import os
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from servprof.trace.errors import TraceError

try:
    from isal import igzip as _igzip
    from isal.isal_zlib import error as _isal_error
except ImportError:  # pragma: no cover - isal is a dependency; the stdlib still reads every trace
    _igzip, _isal_error = None, zlib.error

# Uncompressed bytes accepted per file; a bigger trace is refused rather than
# exhausting memory. Override with SERVPROF_MAX_TRACE_BYTES.
DEFAULT_MAX_TRACE_BYTES = 2 * 1024**3
TRACE_SUFFIXES = (".json", ".json.gz")
# servprof's own files beside its session traces (capture.py): never traces themselves.
SIDECAR_SUFFIXES = (".session.json", ".analysis.json")
# Added to each file's metadata: the file's name, for messages about it (e.g. two files claiming a rank).
SOURCE_FILE_KEY = "servprof_source_file"
# Kineto traces inflate 12-16:1; far past that, a gzip stream is a run of repeated bytes (a
# "gzip bomb"), refused once this much is inflated instead of inflating up to the size limit.
MAX_GZIP_RATIO = 200
GZIP_RATIO_CHECK_BYTES = 16 * 1024**2
CHUNK_BYTES = 1024**2
# The class that reads gzip files (a GzipFile over a file object). bench/bench_loader.py swaps
# in the standard library's to measure what the faster inflater buys.
GzipReader: Any = _igzip.GzipFile if _igzip is not None else gzip.GzipFile
_GZIP_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile, _isal_error)


def max_trace_bytes() -> int:
    raw = os.environ.get("SERVPROF_MAX_TRACE_BYTES", "")
    try:
        return int(raw) if raw else DEFAULT_MAX_TRACE_BYTES
    except ValueError:
        raise TraceError(f"SERVPROF_MAX_TRACE_BYTES must be an integer, got {raw!r}") from None


def trace_files(path: str | os.PathLike[str]) -> list[Path]:
    """The trace files a path names: itself, or the .json/.json.gz files in a directory."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(TRACE_SUFFIXES)
                       and not f.name.endswith(SIDECAR_SUFFIXES))
        if not files:
            raise TraceError(f"{p}: directory holds no .json or .json.gz trace files{_nested_hint(p)}")
        return files
    if not p.exists():
        raise TraceError(f"{p}: no such file or directory")
    return [p]


# Other profilers' files people point a trace analyser at: (is it, what it is). Said only of a
# file whose text does not open as JSON does (a JSON file is read whatever its name).
FOREIGN_FORMATS: tuple[tuple[Any, str], ...] = (
    (lambda name, head: head.startswith(b"SQLite format 3\x00"), "an SQLite database (an Nsight Systems export?)"),
    (lambda name, head: name.endswith((".nsys-rep", ".qdrep")), "an Nsight Systems report"),
    (lambda name, head: ".xplane.pb" in name, "a TensorBoard / JAX XPlane protobuf"),
    (lambda name, head: name.endswith((".pftrace", ".perfetto-trace", ".pb")), "a protobuf trace (Perfetto?)"),
    (lambda name, head: name.endswith(".ncu-rep"), "an Nsight Compute report"),
    # torch.cuda.memory._dump_snapshot writes a pickle; so does torch.save.
    (lambda name, head: head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"),
     "a Python pickle (a CUDA memory snapshot from torch.cuda.memory._dump_snapshot? It opens at "
     "https://pytorch.org/memory_viz; servprof reads memory from a trace's allocator events, profile_memory=True)"),
)
RECORD_HOW = ("servprof reads the chrome-trace JSON torch.profiler writes: prof.export_chrome_trace('trace.json') "
              "or on_trace_ready=torch.profiler.tensorboard_trace_handler(dir)")


def _nested_hint(folder: Path) -> str:
    """A TensorBoard log dir holds a folder per run: name those that hold traces, to analyse one."""
    try:
        inner = sorted(d.name for d in folder.iterdir() if d.is_dir() and any(
            f.is_file() and f.name.endswith(TRACE_SUFFIXES) and not f.name.endswith(SIDECAR_SUFFIXES)
            for f in d.iterdir()))
    except OSError:
        return ""
    if not inner:
        return ""
    shown = ", ".join(inner[:5]) + (f" and {len(inner) - 5} more" if len(inner) > 5 else "")
    return f"; its folders {shown} do: analyse one of them (servprof analyze {folder / inner[0]})"


def read_chunks(path: Path, limit: int, chunk_bytes: int | None = None) -> Iterator[bytes]:
    """The file's JSON text, inflated when gzipped, in chunks of up to ``chunk_bytes``; refuses
    a file that holds more than ``limit`` bytes (a plain file before reading any of it), and
    another profiler's file with what it is."""
    first = True
    for chunk in _chunks(path, limit, chunk_bytes or CHUNK_BYTES):
        if first:
            _refuse_foreign(path, chunk)
            first = False
        yield chunk


UTF8_BOM = b"\xef\xbb\xbf"  # (a trace re-saved by a Windows editor: read past)
_LEADING = UTF8_BOM + b" \t\r\n"  # what may come before a trace's first '{' or '['


def _refuse_foreign(path: Path, head: bytes) -> None:
    lead = head.lstrip(_LEADING)
    if lead[:1] in (b"{", b"[", b""):  # (b"": a first chunk all blank; the parser reads on)
        return
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise TraceError(f"{path}: UTF-16 text (a trace re-saved by an editor or PowerShell?); torch writes its traces "
                         "in UTF-8, as JSON is: convert it back (iconv -f UTF-16 -t UTF-8 IN > OUT) and analyse that")
    if head.startswith(b"PK\x03\x04"):
        raise TraceError(f"{path}: a zip archive: extract the trace from it (unzip) and analyse the .json or "
                         ".json.gz inside")
    what = next((text for test, text in FOREIGN_FORMATS if test(path.name.lower(), head)), None)
    if what is not None:
        raise TraceError(f"{path}: {what}, not a torch.profiler trace: {RECORD_HOW}")
    # Refused at its first chunk, not after reading it all (a stream may never end: /dev/zero).
    raise TraceError(f"{path}: not valid JSON for a trace (a trace's text begins with '{{' or '[', this one with "
                     f"{lead[:16]!r})")


def _chunks(path: Path, limit: int, chunk_bytes: int) -> Iterator[bytes]:
    """A regular file, or a stream read once as it comes (a pipe: ``servprof analyze /dev/stdin``,
    ``<(zcat ...)``, a FIFO), whose size is known only at its end."""
    try:
        info = path.stat()
        regular = stat.S_ISREG(info.st_mode)
        if regular and info.st_size == 0:
            raise TraceError(f"{path}: empty file")
        with open(path, "rb") as raw:
            if raw.peek(2)[:2] == b"\x1f\x8b":  # (peeked, not read: a pipe cannot seek back)
                yield from _inflated(path, raw if regular else _Counted(raw), limit, chunk_bytes)
                return
            if regular and info.st_size > limit:
                raise TraceError(f"{path}: {info.st_size} bytes is larger than the {limit}-byte limit "
                                 "(SERVPROF_MAX_TRACE_BYTES)")
            total = 0
            while chunk := raw.read(chunk_bytes):
                total += len(chunk)
                if total > limit:  # (a stream's size is known only as it is read)
                    raise TraceError(f"{path}: more than {limit} bytes (limit SERVPROF_MAX_TRACE_BYTES)")
                yield chunk
            if total == 0:
                raise TraceError(f"{path}: empty (nothing was written to it)")
    except _GZIP_ERRORS as exc:
        raise TraceError(f"{path}: truncated or corrupt gzip ({exc})") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _inflated(path: Path, raw: Any, limit: int, chunk_bytes: int) -> Iterator[bytes]:
    """Inflate in chunks, so that neither a bomb nor a file over ``limit`` is ever inflated whole."""
    total = 0
    with GzipReader(fileobj=raw, mode="rb") as gz:
        while chunk := gz.read(min(chunk_bytes, limit + 1 - total)):
            total += len(chunk)
            if total > limit:
                raise TraceError(f"{path}: more than {limit} bytes uncompressed (limit SERVPROF_MAX_TRACE_BYTES)")
            if total >= GZIP_RATIO_CHECK_BYTES and total > MAX_GZIP_RATIO * max(1, raw.tell()):
                raise TraceError(f"{path}: inflates more than {MAX_GZIP_RATIO}:1 (traces inflate ~15:1); "
                                 "refused as a gzip bomb")
            yield chunk


class _Counted:
    """A stream handed to the inflater, counting what it read (a pipe has no tell() for the
    gzip-bomb check)."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._read = 0

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        self._read += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        count = self._raw.readinto(buffer)
        self._read += count or 0
        return count

    def tell(self) -> int:
        return self._read


def text_size(path: Path) -> int | None:
    """The bytes of JSON text a file will give, known before reading it: a plain file's size, or
    the size a gzip file's trailer records (modulo 4 GiB, and only its last member's; a trailer
    smaller than the file cannot be the whole text). None for a stream or what cannot be told."""
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            return None
        with open(path, "rb") as raw:
            if raw.read(2) != b"\x1f\x8b":
                return info.st_size
            if info.st_size < 18:  # (a header and a trailer at least)
                return None
            raw.seek(-4, os.SEEK_END)
            inflated = int.from_bytes(raw.read(4), "little")
    except OSError:
        return None
    return inflated if inflated >= info.st_size else None


def read_whole(path: Path, limit: int) -> bytearray:
    """The file's whole JSON text (inflated), refusing more than ``limit`` bytes or blank text."""
    data = bytearray()
    for chunk in read_chunks(path, limit):
        data += chunk
    if not data or data.isspace():  # (not strip(): that copies a whole trace that ends in a newline)
        raise TraceError(f"{path}: empty trace")
    return data
