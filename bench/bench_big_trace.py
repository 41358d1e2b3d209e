"""`servprof analyze` on traces of a few hundred MB to 1 GB (inflated): time per million events
and peak memory.

    .venv/bin/python bench/bench_big_trace.py [--sizes 128,512,1024] [--source TRACE] [--plain]
                                              [--reference-mb 128] [--keep DIR]

Each trace is built here, never committed: the events of a public trace (default: vLLM's
piecewise prefill+decode trace in tests/fixtures/public) repeated, each copy's timestamps moved
past the previous copy's end and its correlation, External id and flow ids moved past the
previous copy's, so that every copy is a further stretch of the same run. Written as .json.gz
(and, with --plain, as plain .json: read whole by the loader servprof had), then analysed by
`servprof analyze TRACE --json OUT` in a fresh process, whose own peak RSS (VmHWM) is read at
its exit. Prints wall seconds (process start to exit) and seconds per million events, the same
for load_trace alone, the peak and its ratio to the inflated size (goal: under 2 GB for 1 GB, and at most 1.5x). With --reference-mb, the same
for the orjson loader servprof had, on a trace of that size.
"""

from __future__ import annotations

import argparse
import gzip
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = ROOT / "tests" / "fixtures" / "public" / "vllm_prefill_decode_piecewise_mi300x.json.gz"

# Runs `servprof analyze` and, at exit, writes its own VmHWM (KiB; wait4's ru_maxrss would start
# from the parent's high-water mark) and the seconds load_trace took to argv[1].
# argv[2] == "reference": the orjson loader servprof had.
ANALYZE_WITH_PEAK = """
import atexit, sys, time
from servprof.report import analyze_cli
from servprof.trace.reference import load_trace_orjson
loading = [0.0]
def _peak(path=sys.argv[1]):
    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]
    open(path, 'w').write(f"{hwm} {loading[0]}")
atexit.register(_peak)
load = load_trace_orjson if sys.argv[2] == 'reference' else analyze_cli.load_trace
def timed_load(path, progress=None, files=None, **options):
    start = time.perf_counter()
    trace = load(path) if load is load_trace_orjson else load(path, progress=progress, files=files, **options)
    loading[0] = time.perf_counter() - start
    return trace
analyze_cli.load_trace = timed_load
from servprof.cli import main
sys.exit(main(['analyze', *sys.argv[3:]]))
"""


def build(source: Path, target: Path, inflated_bytes: int) -> int:
    """Write ``target`` (.json or .json.gz) of about ``inflated_bytes``; returns its event count."""
    document = orjson.loads(gzip.decompress(source.read_bytes()))
    events = document.pop("traceEvents")
    metadata = [e for e in events if e.get("ph") == "M"]
    timed = [e for e in events if e.get("ph") != "M"]
    ts = [e["ts"] for e in timed if isinstance(e.get("ts"), (int, float))]
    span = max(e.get("ts", 0) + e.get("dur", 0) for e in timed if isinstance(e.get("ts"), (int, float))) - min(ts)
    ids = [a for e in timed for a in (e.get("args", {}).get("correlation"), e.get("args", {}).get("External id"),
                                      e.get("id")) if isinstance(a, int)]
    id_span = max(ids, default=0) + 1
    opener: Any = gzip.open if target.name.endswith(".gz") else open
    try:
        from isal import igzip

        opener = (lambda p, m: igzip.open(p, m, compresslevel=1)) if target.name.endswith(".gz") else open
    except ImportError:
        pass
    count = len(metadata)
    with opener(target, "wb") as out:
        head = orjson.dumps(document)[:-1]
        out.write(head + (b"," if len(head) > 1 else b"") + b'"traceEvents":[')
        out.write(orjson.dumps(metadata)[1:-1])
        written, copy = len(head), 0
        while written < inflated_bytes:
            shifted = []
            for event in timed:
                event = dict(event)
                if isinstance(event.get("ts"), (int, float)):
                    event["ts"] = event["ts"] + copy * (span + 1000.0)
                if isinstance(event.get("id"), int):
                    event["id"] += copy * id_span
                args = event.get("args")
                if isinstance(args, dict) and ("correlation" in args or "External id" in args):
                    args = event["args"] = dict(args)
                    for key in ("correlation", "External id"):
                        if isinstance(args.get(key), int):
                            args[key] += copy * id_span
                shifted.append(event)
            block = (b"," if count else b"") + orjson.dumps(shifted)[1:-1]
            out.write(block)
            written += len(block)
            count += len(shifted)
            copy += 1
        out.write(b"]}")
    return count


def analyze(path: Path, loader: str, out_dir: Path) -> tuple[float, float, float, str]:
    """(wall seconds, load_trace seconds, peak RSS MiB, error) of `servprof analyze PATH --json OUT`
    in a fresh process."""
    peak_file = out_dir / "peak"
    peak_file.unlink(missing_ok=True)
    command = [sys.executable, "-c", ANALYZE_WITH_PEAK, str(peak_file), loader, str(path),
               "--json", str(out_dir / "report.json")]
    start = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seconds = time.perf_counter() - start
    peak_kib, loading = peak_file.read_text().split() if peak_file.exists() else ("nan", "nan")
    error = "" if done.returncode == 0 else done.stderr.decode(errors="replace").strip().splitlines()[-1][:120]
    return seconds, float(loading), float(peak_kib) / 1024, error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="128,512,1024", help="inflated sizes in MiB, comma-separated")
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    parser.add_argument("--plain", action="store_true", help="also analyse each size as plain .json")
    parser.add_argument("--reference-mb", type=int, default=0,
                        help="also run the orjson loader servprof had on a trace of this many MiB")
    parser.add_argument("--keep", type=Path, help="build the traces in this folder and keep them")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    work = args.keep or Path(tempfile.mkdtemp(prefix="servprof-big-"))
    work.mkdir(parents=True, exist_ok=True)
    runs: list[tuple[int, str, str]] = [(mb, suffix, "streaming") for mb in sizes
                                        for suffix in ((".json.gz", ".json") if args.plain else (".json.gz",))]
    if args.reference_mb:
        runs.append((args.reference_mb, ".json.gz", "reference"))
    print(f"source {args.source.name}; traces in {work}")
    print(f"{'trace':22} {'loader':10} {'MiB':>6} {'events':>10} {'seconds':>8} {'s/M events':>10} "
          f"{'load s':>7} {'load s/M':>8} {'peak MiB':>9} {'peak/size':>9}")
    try:
        for mb, suffix, loader in runs:
            path = work / f"big-{mb}mb{suffix}"
            if not path.exists():
                count = build(args.source, path, mb * 1024**2)
                (work / f"{path.name}.events").write_text(str(count))
            count = int((work / f"{path.name}.events").read_text())
            seconds, loading, peak, error = analyze(path, loader, work)
            print(f"{path.name:22} {loader:10} {mb:6d} {count:10d} {seconds:8.1f} {seconds / count * 1e6:10.2f} "
                  f"{loading:7.1f} {loading / count * 1e6:8.2f} {peak:9.0f} {peak / mb:8.2f}x {error}", flush=True)
    finally:
        if args.keep is None:
            for file in work.iterdir():
                file.unlink()
            work.rmdir()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("SERVPROF_CACHE_DIR", tempfile.gettempdir())
    sys.exit(main())
