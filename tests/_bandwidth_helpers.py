"""Small synthetic Kineto traces for the bandwidth detector: host ops with record_shapes args, the
runtime launch each makes inside its span, and the kernel it runs, with times chosen per test so
that the bytes / time each test expects is known by hand."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import orjson

H100 = {"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85018279936, "computeMajor": 9,
        "computeMinor": 0, "numSms": 132}


class SynthTrace:
    def __init__(self, device_properties: list[dict[str, Any]] | None = None, **top: Any) -> None:
        self.events: list[dict[str, Any]] = []
        self.top: dict[str, Any] = {"schemaVersion": 1, "deviceProperties": device_properties or [],
                                    "baseTimeNanoseconds": 1_700_000_000_000_000_000, **top}
        self._ids = 0

    def op(self, name: str, ts: float, dur: float, dims: list[Any], types: list[Any],
           concrete: list[Any] | None = None, kernel_us: float | None = None, tid: int = 1) -> None:
        """A host op; with kernel_us, a launch at ts + 1 and a kernel of that length on stream 7."""
        self._ids += 1
        args: dict[str, Any] = {"Input Dims": dims, "Input type": types, "External id": self._ids}
        if concrete is not None:
            args["Concrete Inputs"] = concrete
        self.events.append({"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
                            "args": args})
        if kernel_us is not None:
            self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": tid,
                                "ts": ts + 1, "dur": 2, "args": {"correlation": self._ids, "External id": self._ids}})
            self.events.append({"ph": "X", "cat": "kernel", "name": f"kernel_{self._ids}", "pid": 0, "tid": 7,
                                "ts": ts + 5, "dur": kernel_us,
                                "args": {"stream": 7, "correlation": self._ids, "External id": self._ids}})

    def span(self, name: str, ts: float, dur: float, tid: int = 1, cat: str = "user_annotation") -> None:
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur})

    def write(self, path: Path) -> Path:
        path.write_bytes(gzip.compress(orjson.dumps({**self.top, "traceEvents": self.events})))
        return path
