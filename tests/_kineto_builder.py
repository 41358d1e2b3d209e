"""Small synthetic Kineto (chrome-trace) files with known answers, shaped like torch.profiler's
GPU export: host events (cpu_op, user_annotation, python_function, cuda_runtime) on OS threads,
device events (kernel, gpu_memcpy) on streams, joined by ``correlation``.

No GPU runs here: only the timings are invented; the loader and detectors that read these
files are the real ones. Each builder call returns what it placed, so a test can compute
the answer independently of servprof's code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

HOST_PID, DEVICE_PID, STREAM = 100, 0, 7


@dataclass
class KinetoTrace:
    events: list[dict[str, Any]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    correlation: int = 0
    kernels: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of every device event

    def host(self, name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op",
             args: dict[str, Any] | None = None) -> None:
        event = {"ph": "X", "cat": cat, "name": name, "pid": HOST_PID, "tid": tid, "ts": ts, "dur": dur}
        if args:
            event["args"] = args
        self.events.append(event)

    def frame(self, name: str, ts: float, dur: float, tid: int = 1) -> None:
        """A Python frame as with_stack records it."""
        self.host(name, ts, dur, tid, cat="python_function")

    def annotation(self, name: str, ts: float, dur: float, tid: int = 1) -> None:
        self.host(name, ts, dur, tid, cat="user_annotation")

    def launch(self, ts: float, start: float, dur: float, name: str = "gemv_kernel", tid: int = 1,
               runtime: str = "cudaLaunchKernel", launch_dur: float = 3.0, stream: int = STREAM,
               cat: str = "kernel") -> int:
        """A runtime call on the host that enqueues one device event; returns its correlation id."""
        self.correlation += 1
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": runtime, "pid": HOST_PID, "tid": tid,
                            "ts": ts, "dur": launch_dur, "args": {"correlation": self.correlation}})
        self.device(start, dur, name, self.correlation, stream, cat)
        return self.correlation

    def device(self, start: float, dur: float, name: str, correlation: int, stream: int = STREAM,
               cat: str = "kernel") -> None:
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": DEVICE_PID, "tid": stream, "ts": start,
                            "dur": dur, "args": {"stream": stream, "correlation": correlation, "device": 0}})
        self.kernels.append((start, start + dur))

    def write(self, path: Path, device_name: str = "NVIDIA H100 80GB HBM3") -> Path:
        document = {"traceEvents": self.events, "deviceProperties": [{"name": device_name}], **self.metadata}
        path.write_bytes(orjson.dumps(document))
        return path


def eager_step(trace: KinetoTrace, start: float, kernels: int, kernel_us: float = 40.0, launch_every: float = 5.0,
               latency: float = 20.0, annotation: str | None = None, tid: int = 1) -> float:
    """One step whose host range launches ``kernels`` kernels back to back (queued: the host runs
    ahead); returns the end of the last kernel."""
    host_len = kernels * launch_every + 10
    if annotation is not None:
        trace.annotation(annotation, start, host_len, tid)
    end = start
    for i in range(kernels):
        begin = start + latency + i * kernel_us
        trace.launch(start + i * launch_every, begin, kernel_us, tid=tid)
        end = begin + kernel_us
    return end


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Reference union of intervals, written plainly (for answers computed apart from servprof)."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def covered_in(blocks: list[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(e, b) - max(s, a)) for s, e in blocks)
