"""Real traces for the memory and recompilation detectors, recorded in this process with the
real torch.profiler, servprof's phase markers and servprof's own probes (servprof.probes):

- ``record_memory_trace``: a small model served step by step on the profiling thread with
  ``profile_memory=True`` (the setting where torch 2.13 writes ``[memory]`` allocator events),
  each admitted request optionally keeping ``leak_bytes`` that are never freed.
- ``record_compile_trace``: a ``torch.compile``d function (the eager backend: Dynamo's own
  compile, seconds faster than Inductor) called in marked decode steps under
  ``profile_all_threads`` as servprof runs it, with the compile records servprof's probe reads
  from torch at the session's start and end in the trace's ``servprof`` metadata.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from servprof.auto.session import trace_metadata_json
from servprof.phases import phase
from servprof.probes import SessionProbes


def record_memory_trace(path: Path, leak_bytes: int, requests: int = 6, decode_steps: int = 4) -> tuple[Path, list]:
    """Serve `requests` requests, one after another; returns (trace path, the kept tensors)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
    kept: list[torch.Tensor] = []  # the leak: what every admitted request leaves behind
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with torch.inference_mode():
        model(torch.randn(4, 256))  # first-call allocations outside the trace
        prof.start()
        for index in range(requests):
            rid = f"req-{index}"
            with phase("prefill", request_id=rid):
                model(torch.randn(32, 256))
                if leak_bytes:
                    kept.append(torch.ones(leak_bytes, dtype=torch.uint8))
            for _ in range(decode_steps):
                with phase("decode_step", request_ids=[rid]):
                    model(torch.randn(1, 256))
        prof.stop()
    prof.export_chrome_trace(str(path))
    return path, kept


def record_compile_trace(path: Path, warm: list[int], served: list[int], graph_break: bool = False,
                         probes: bool = True, backend: str = "eager", eager_sleep_s: float = 0.0
                         ) -> tuple[Path, list[Any]]:
    """Compile for the `warm` batch sizes, then serve one decode step per size in `served` under
    the profiler (``eager_sleep_s``: a sleep after the graph break, run eagerly). Returns (trace
    path, torch's compile records made while profiling)."""
    import torch._dynamo
    from torch._dynamo.utils import get_compilation_metrics

    torch._dynamo.reset()  # a fresh cache: earlier tests compiled this same code
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 32)

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = layer(x).relu()
        if graph_break:
            torch._dynamo.graph_break()
            if eager_sleep_s:
                time.sleep(eager_sleep_s)
        return y * 2

    compiled = torch.compile(forward, dynamic=False, backend=backend)
    with torch.inference_mode():
        for size in warm:
            compiled(torch.randn(size, 32))
        before = len(get_compilation_metrics())
        session_probes = SessionProbes(memory=False) if probes else None
        prof = profile(activities=[ProfilerActivity.CPU],
                       experimental_config=_ExperimentalConfig(profile_all_threads=True))
        wall_start = time.time_ns()
        prof.start()
        for step, size in enumerate(served):
            ids = [f"req-{step}-{i}" for i in range(size)]
            with phase("decode_step", request_ids=ids):
                compiled(torch.randn(size, 32))
        metadata: dict[str, Any] = {"session_id": "compile-test", "stop_wall_ns": time.time_ns()}
        if session_probes is not None:
            metadata.update(session_probes.finish(wall_start, serving_since_ns=wall_start))
        prof.add_metadata_json("servprof", trace_metadata_json(metadata))  # as servprof's capture writes it
        prof.stop()
    prof.export_chrome_trace(str(path))
    return path, list(get_compilation_metrics())[before:]
