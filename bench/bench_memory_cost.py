"""What memory and compile observation costs: ratios against a baseline measured in the same run.

    PYTHONPATH=. .venv/bin/python bench/bench_memory_cost.py [--repeat 5] [--steps 200]

1. ``profile_memory=True`` on stop() and export, against the same session without it, in two
   profiler modes: servprof's (``profile_all_threads``, the model on another thread, as in a
   server) and the model's own thread (the mode in which torch 2.13 records ``[memory]``
   allocator events). Each repeat runs both settings back to back; medians are printed with
   the on/off ratio, and the number of events and of ``[memory]`` events.
2. servprof's own probes: one memory sample (process RSS, plus CUDA allocator levels where
   CUDA is in use), one between-sessions history reading, one read of torch.compile's records.
3. A CUDA memory snapshot (``torch.cuda.memory._snapshot()`` + pickle) with memory history
   recording bounded to 10k and 100k entries; skipped, and said so, without CUDA.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from servprof.demo.model import LlamaLikeModel, model_config


def _model() -> LlamaLikeModel:
    return LlamaLikeModel(model_config("tiny"), slots=8, context=256)


def _decode_steps(model: LlamaLikeModel, steps: int) -> None:
    tokens = torch.zeros(8, dtype=torch.long)
    slots = torch.arange(8)
    with torch.inference_mode():
        for step in range(steps):
            lengths = torch.full((8,), 8 + step % 64)
            model.decode(tokens, slots, lengths, 8 + step % 64 + 1)


def _session(model: LlamaLikeModel, steps: int, memory: bool, all_threads: bool, out: Path) -> dict[str, float]:
    config = _ExperimentalConfig(profile_all_threads=True) if all_threads else _ExperimentalConfig()
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=memory, experimental_config=config)
    prof.start()
    if all_threads:  # the model on its own thread, as a server's engine
        worker = threading.Thread(target=_decode_steps, args=(model, steps))
        worker.start()
        worker.join()
    else:
        _decode_steps(model, steps)
    started = time.perf_counter()
    prof.stop()
    stopped = time.perf_counter()
    prof.export_chrome_trace(str(out))
    exported = time.perf_counter()
    text = out.read_text()
    return {"stop_ms": (stopped - started) * 1e3, "export_ms": (exported - stopped) * 1e3,
            "events": text.count('"ph": "X"') + text.count('"ph": "i"'), "memory_events": text.count('"[memory]"')}


def profile_memory_cost(repeat: int, steps: int) -> None:
    model = _model()
    _decode_steps(model, 4)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trace.json"
        _session(model, 4, False, True, out)  # Kineto's first start, outside the measurement
        for all_threads, label in ((True, "profile_all_threads (servprof)"), (False, "model's own thread")):
            runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
            for _ in range(repeat):
                for memory in (False, True):
                    runs[memory].append(_session(model, steps, memory, all_threads, out))
            off, on = ({k: statistics.median(r[k] for r in runs[m]) for k in runs[m][0]} for m in (False, True))
            print(f"profile_memory, {label}, {steps} decode steps, median of {repeat}:")
            for key in ("stop_ms", "export_ms", "events", "memory_events"):
                ratio = on[key] / off[key] if off[key] else float("nan")
                print(f"  {key:<14} off {off[key]:>10.1f}   on {on[key]:>10.1f}   on/off {ratio:6.2f}")


def _time_us(call: Any, n: int) -> float:
    samples = []
    for _ in range(n):
        started = time.perf_counter_ns()
        call()
        samples.append((time.perf_counter_ns() - started) / 1e3)
    return statistics.median(samples)


def probe_cost() -> None:
    from servprof.probes.compile import compile_state
    from servprof.probes.memory import MemoryHistory, MemorySampler, rss_bytes

    sampler = MemorySampler()
    history = MemoryHistory(interval_s=0.0)
    print("servprof probes, median of 2000 calls:")
    print(f"  RSS read (/proc/self/statm)      {_time_us(rss_bytes, 2000):8.1f} us")
    print(f"  memory sample (all series)       {_time_us(lambda: sampler.sample(force=True), 2000):8.1f} us"
          f"   series: {', '.join(sampler.series)}")
    print(f"  history reading                  {_time_us(lambda: history.tick(0, 0, force=True), 2000):8.1f} us")
    import torch._dynamo  # noqa: F401 - what a compiling server has imported

    compiled = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    for size in (1, 2, 3):
        compiled(torch.ones(size))
    print(f"  torch.compile records read       {_time_us(compile_state, 200):8.1f} us")


def snapshot_cost() -> None:
    if not torch.cuda.is_available():
        print("CUDA memory snapshot: skipped (no CUDA device here; measure on a GPU machine)")
        return
    for entries in (10_000, 100_000):
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=entries)
        kept = []
        for i in range(entries):  # fill the history: allocations and frees of varied sizes
            kept.append(torch.empty(1024 * (1 + i % 64), device="cuda"))
            if len(kept) > 256:
                kept.pop(0)
        torch.cuda.synchronize()
        started = time.perf_counter()
        snapshot = torch.cuda.memory._snapshot()
        taken = time.perf_counter()
        with tempfile.NamedTemporaryFile(suffix=".pickle") as f:
            pickle.dump(snapshot, f, protocol=pickle.HIGHEST_PROTOCOL)
            size = os.path.getsize(f.name)
        written = time.perf_counter()
        print(f"CUDA memory snapshot, max_entries={entries}: _snapshot {1e3 * (taken - started):.1f} ms, "
              f"pickle {1e3 * (written - taken):.1f} ms, {size / 1e6:.1f} MB")
        del kept, snapshot
        torch.cuda.memory._record_memory_history(enabled=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    profile_memory_cost(args.repeat, args.steps)
    probe_cost()
    snapshot_cost()


if __name__ == "__main__":
    main()
