"""What record_shapes costs a `servprof demo` session: the profiler's stop() stall and the export.

    .venv/bin/python bench/bench_demo_shapes.py [--steps 64] [--requests 4] [--repeats 3]

The demo engine (tiny model, CPU) decodes in its own thread for about as many steps as the demo's
sessions capture (SERVPROF_MAX_SESSION_STEPS=64), under torch.profiler configured as servprof's
capture thread configures it (profile_all_threads), once without and once with record_shapes, in
alternation. A 1 ms ticker thread stands in for the serving event loop: its largest gap during
stop() is the stall stop() imposes on serving (stop holds the GIL). Prints medians per setting and
the ratio shapes / no shapes, measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch._C._profiler import _ExperimentalConfig

from servprof.demo.engine import Engine, EngineRequest, Output
from servprof.demo.model import LlamaLikeModel, model_config
from servprof.demo.sampling import SamplingParams
from servprof.demo.tokenizer import DemoTokenizer

PROMPT = "The profiler samples live requests while the server keeps serving them. " * 4


class Ticker(threading.Thread):
    """Wakes every 1 ms; records the largest gap between wake-ups since reset()."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.max_gap_s = 0.0
        self.running = True

    def reset(self) -> None:
        self.max_gap_s = 0.0

    def run(self) -> None:
        last = time.perf_counter()
        while self.running:
            time.sleep(0.001)
            now = time.perf_counter()
            self.max_gap_s = max(self.max_gap_s, now - last - 0.001)
            last = now


def one_session(engine: Engine, tokenizer: DemoTokenizer, ticker: Ticker, shapes: bool, steps: int,
                requests: int) -> dict[str, float]:
    done = threading.Semaphore(0)

    def deliver(output: Output) -> None:
        if output.finish_reason is not None:
            done.release()

    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=shapes,
                                      experimental_config=_ExperimentalConfig(profile_all_threads=True))
    profiler.start()
    for index in range(requests):
        engine.submit(EngineRequest(f"r{index}", tokenizer.encode(PROMPT), SamplingParams(max_tokens=steps, seed=index),
                                    deliver))
    for _ in range(requests):
        done.acquire()
    ticker.reset()
    started = time.perf_counter()
    profiler.stop()
    stop_s = time.perf_counter() - started
    stall_s = ticker.max_gap_s
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.json"
        started = time.perf_counter()
        profiler.export_chrome_trace(str(path))
        export_s = time.perf_counter() - started
        size = path.stat().st_size
    events = len(profiler.events())
    return {"stop_ms": stop_s * 1e3, "stall_ms": stall_s * 1e3, "export_ms": export_s * 1e3, "events": events,
            "mb": size / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    torch.manual_seed(0)
    tokenizer = DemoTokenizer()
    model = LlamaLikeModel(model_config("tiny", min_vocab=tokenizer.vocab_size), slots=8, context=512)
    engine = Engine(model, tokenizer)
    engine.start()
    ticker = Ticker()
    ticker.start()
    one_session(engine, tokenizer, ticker, False, 4, 1)  # warm-up: Kineto's first start, allocations
    results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(args.repeats):
        for shapes in (False, True):
            results[shapes].append(one_session(engine, tokenizer, ticker, shapes, args.steps, args.requests))
    ticker.running = False
    engine.stop()
    medians = {shapes: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for shapes, runs in results.items()}
    print(f"{args.requests} requests x {args.steps} decode steps, tiny model on CPU, {args.repeats} sessions each "
          "(medians)")
    print(f"{'':14}{'events':>8}{'stop ms':>10}{'stall ms':>10}{'export ms':>11}{'trace MB':>10}")
    for shapes in (False, True):
        m = medians[shapes]
        print(f"{'shapes' if shapes else 'no shapes':14}{m['events']:>8.0f}{m['stop_ms']:>10.1f}{m['stall_ms']:>10.1f}"
              f"{m['export_ms']:>11.1f}{m['mb']:>10.2f}")
    ratio = {k: medians[True][k] / medians[False][k] for k in ("stop_ms", "stall_ms", "export_ms", "mb")}
    print("ratio shapes / no shapes: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))


if __name__ == "__main__":
    main()
