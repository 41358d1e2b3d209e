"""What each part of the trace loader buys: the inflater, the decoder, the streaming loader.

    .venv/bin/python bench/bench_loader.py [TRACE.json.gz ...] [--repeats 5]

For each trace (default: the public traces in tests/fixtures/public and the demo fixtures),
the best of --repeats, runs taken in turn so that a busy moment on a shared machine falls on
all of them:

- inflate alone, in the loader's 1 MiB chunks: the standard library's zlib (gzip.GzipFile),
  python-isal's igzip (what servprof uses) and zlib-ng (when installed);
- decode the inflated text alone: orjson.loads (a dict per event) against msgspec decoding
  the events into Structs with only the fields servprof reads, args kept as raw text;
- load_trace end to end: the orjson loader servprof had (servprof.trace.reference) and the
  streaming msgspec loader, each with the stdlib inflater and with isal.

Ratios are within this run only.
"""

from __future__ import annotations

import argparse
import gzip
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import orjson

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
CHUNK = 1024**2


def best_in_turn(repeats: int, runs: dict[str, Callable[[], Any]]) -> dict[str, float]:
    best = {name: math.inf for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def inflate_with(reader: Any, path: Path) -> Callable[[], int]:
    def once() -> int:
        total = 0
        with open(path, "rb") as raw, reader(fileobj=raw, mode="rb") as gz:
            while chunk := gz.read(CHUNK):
                total += len(chunk)
        return total

    return once


def inflaters() -> dict[str, Any]:
    found: dict[str, Any] = {"zlib (stdlib)": gzip.GzipFile}
    try:
        from isal import igzip

        found["isal igzip"] = igzip.GzipFile
    except ImportError:
        pass
    try:
        from zlib_ng import gzip_ng

        found["zlib-ng"] = gzip_ng.GzipFile
    except ImportError:
        pass
    return found


def events_text(data: bytes) -> bytes:
    """The traceEvents array's text (or the whole text in the JSON Array Format)."""
    if data.lstrip()[:1] == b"[":
        return data
    return bytes(msgspec.json.decode(data, type=dict[str, msgspec.Raw])["traceEvents"])


def load_with(loader: Callable[[Path], Any], reader: Any, path: Path) -> Callable[[], Any]:
    from servprof.trace import source

    def once() -> Any:
        kept = source.GzipReader
        source.GzipReader = reader
        try:
            return loader(path)
        finally:
            source.GzipReader = kept

    return once


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    traces = args.traces or sorted((FIXTURES / "public").glob("*.json.gz")) + sorted(FIXTURES.glob("*.json.gz"))
    from servprof.trace import load_trace
    from servprof.trace.columns import EVENTS
    from servprof.trace.loader import paused_gc
    from servprof.trace.reference import load_trace_orjson

    readers = inflaters()
    stdlib, isal = readers["zlib (stdlib)"], readers.get("isal igzip", gzip.GzipFile)
    print("times in ms, best of", args.repeats)
    print(f"{'trace':34} {'MB':>6} | inflate: " + " ".join(f"{name:>13}" for name in readers)
          + f" | decode: {'orjson':>7} {'msgspec':>7} | load: {'orjson+zlib':>11} {'orjson+isal':>11} "
            f"{'stream+zlib':>11} {'stream+isal':>11}")
    totals: dict[str, float] = {}
    with paused_gc():
        for path in traces:
            data = gzip.decompress(path.read_bytes())
            text = events_text(data)
            inflate = best_in_turn(args.repeats, {name: inflate_with(r, path) for name, r in readers.items()})
            decode = best_in_turn(args.repeats, {"orjson": lambda data=data: orjson.loads(data),
                                                 "msgspec": lambda text=text: EVENTS.decode(text)})
            load = best_in_turn(args.repeats, {
                "orjson+zlib": load_with(load_trace_orjson, stdlib, path),
                "orjson+isal": load_with(load_trace_orjson, isal, path),
                "stream+zlib": load_with(load_trace, stdlib, path),
                "stream+isal": load_with(load_trace, isal, path),
            })
            for key, value in {**inflate, **decode, **load}.items():
                totals[key] = totals.get(key, 0.0) + value
            print(f"{path.name[:34]:34} {len(data) / 1e6:6.1f} | inflate: "
                  + " ".join(f"{inflate[name] * 1e3:13.1f}" for name in readers)
                  + f" | decode: {decode['orjson'] * 1e3:7.1f} {decode['msgspec'] * 1e3:7.1f} | load: "
                  + " ".join(f"{load[k] * 1e3:11.1f}" for k in ("orjson+zlib", "orjson+isal", "stream+zlib",
                                                                 "stream+isal")), flush=True)
    print("\nsummed over the traces:")
    for name in readers:
        if name != "zlib (stdlib)":
            print(f"  inflate: {name} is {totals['zlib (stdlib)'] / totals[name]:.2f}x the stdlib's speed")
    print(f"  decode: msgspec Structs (args raw) are {totals['orjson'] / totals['msgspec']:.2f}x orjson.loads")
    print(f"  load: isal under the orjson loader: {totals['orjson+zlib'] / totals['orjson+isal']:.2f}x; "
          f"under the streaming loader: {totals['stream+zlib'] / totals['stream+isal']:.2f}x")
    print(f"  load: streaming msgspec loader vs orjson loader (both isal): "
          f"{totals['orjson+isal'] / totals['stream+isal']:.2f}x; all together vs the loader before "
          f"(orjson + zlib): {totals['orjson+zlib'] / totals['stream+isal']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
