"""Record small CPU traces of the demo engine with each fault knob on and off.

    .venv/bin/python bench/record_fixtures.py [--out tests/fixtures]

The demo engine (servprof.demo.engine) runs in-process, in its own thread, with
the real tiny model and tokenizer. Requests arrive on an asyncio loop in another
thread, as in the demo server: each is tokenized under servprof's `tokenize`
phase, either in a worker thread (default) or on the loop itself (knob
`tokenize_on_loop`), then submitted to the engine. torch.profiler runs with
profile_all_threads=True and record_shapes=True around the whole run, and the
trace is written gzipped with the knob settings in its metadata (key
`servprof_fixture`) so tests can compare what was injected with what was found.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import os
import tempfile
import threading
import time
from pathlib import Path

import orjson
import torch
from torch._C._profiler import _ExperimentalConfig

from servprof.demo.engine import Engine, EngineRequest, Output
from servprof.demo.model import LlamaLikeModel, model_config
from servprof.demo.sampling import SamplingParams
from servprof.demo.tokenizer import DemoTokenizer
from servprof.phases import phase

# name -> knobs; magnitudes chosen well above the clean run's own noise.
SCENARIOS: dict[str, dict[str, float | bool]] = {
    "clean": {},
    "step_delay_20ms": {"step_delay_ms": 20.0},
    "slow_tokenizer": {"slow_tokenizer_us_per_token": 150.0},
    "tokenize_on_loop_slow": {"slow_tokenizer_us_per_token": 150.0, "tokenize_on_loop": True},
    "sync_per_step": {"sync_per_step": True},
}
SLIMMED_ARGS = ("Input Strides", "Ev Idx", "Record function id", "Sequence number", "Fwd thread id")
PROMPT = (
    "The profiler samples live requests while the server keeps serving them, and names what made "
    "each one slow: tokenization, gaps between decode steps, or kernels bound by memory bandwidth. "
)


def record(name: str, knobs: dict[str, float | bool], out_dir: Path, requests: int = 3, max_tokens: int = 8,
           stagger_s: float = 0.01, device: str = "cpu", size: str = "tiny") -> Path:
    """Serve ``requests`` requests through the demo engine with ``knobs`` under the profiler;
    returns the path of the gzipped trace written to ``out_dir`` (demo_NAME on CPU, cuda_SIZE_NAME
    on a GPU, recorded with CUDA activity in bf16 as the demo server runs there)."""
    torch.manual_seed(0)
    tokenizer = DemoTokenizer(slow_us_per_token=float(knobs.get("slow_tokenizer_us_per_token", 0.0)))
    config = model_config(size, min_vocab=tokenizer.vocab_size)
    on_gpu = device.startswith("cuda")
    model = LlamaLikeModel(config, slots=8, context=512, device=device,
                           dtype=torch.bfloat16 if on_gpu else torch.float32)
    engine = Engine(model, tokenizer, step_delay_ms=float(knobs.get("step_delay_ms", 0.0)),
                    sync_per_step=bool(knobs.get("sync_per_step", False)))
    engine.start()
    prompt_tokens: dict[str, int] = {}
    loop_thread_ids: list[int] = []

    async def serve_one(index: int) -> None:
        loop = asyncio.get_running_loop()
        rid = f"req-{name}-{index}"
        text = PROMPT * (1 + index % 2)

        def tokenize() -> list[int]:
            with phase("tokenize", request_id=rid):
                return tokenizer.encode(text)

        ids = tokenize() if knobs.get("tokenize_on_loop") else await loop.run_in_executor(None, tokenize)
        prompt_tokens[rid] = len(ids)
        outputs: asyncio.Queue[Output] = asyncio.Queue()
        request = EngineRequest(rid, ids, SamplingParams(max_tokens=max_tokens, seed=index),
                                lambda o: loop.call_soon_threadsafe(outputs.put_nowait, o))
        engine.submit(request)
        while (await outputs.get()).finish_reason is None:
            pass

    async def serve_all() -> None:
        loop_thread_ids.append(threading.get_native_id())
        tasks = []
        for index in range(requests):
            tasks.append(asyncio.create_task(serve_one(index)))
            await asyncio.sleep(stagger_s)  # staggered arrivals: later requests arrive while others decode
        await asyncio.gather(*tasks)

    # Warm up outside the profiler (first-call allocations, tokenizer load).
    asyncio.run(_warm(engine, tokenizer))
    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else []),
        record_shapes=True,
        experimental_config=_ExperimentalConfig(profile_all_threads=True),
    )
    profiler.start()
    loop_thread = threading.Thread(target=lambda: asyncio.run(serve_all()), name="asyncio-loop")
    loop_thread.start()
    loop_thread.join()
    time.sleep(0.01)
    # What the middleware records about the server (servprof's session metadata), so the
    # tokenization detector can tell the event loop's thread apart from worker threads.
    profiler.add_metadata_json("servprof", orjson.dumps({
        "session_id": f"fixture-{name}", "request_ids": sorted(prompt_tokens), "event_loop_tid": loop_thread_ids[0],
    }).decode())
    profiler.add_metadata_json("servprof_fixture", orjson.dumps({
        "scenario": name, "knobs": knobs, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu", "model_size": size,
        "torch": torch.__version__,
    }).decode())
    profiler.stop()
    engine.stop()
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        profiler.export_chrome_trace(str(raw))
        target = out_dir / (f"cuda_{size}_{name}.json.gz" if on_gpu else f"demo_{name}.json.gz")
        document = orjson.loads(raw.read_bytes())
        for event in document["traceEvents"]:
            args = event.get("args")
            if isinstance(args, dict):  # fields no detector reads: dropped to keep fixtures small
                for key in SLIMMED_ARGS:
                    args.pop(key, None)
        with gzip.open(target, "wb", compresslevel=9) as dst:
            dst.write(orjson.dumps(document))
    return target


async def _warm(engine: Engine, tokenizer: DemoTokenizer) -> None:
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def deliver(output: Output) -> None:
        if output.finish_reason is not None:
            loop.call_soon_threadsafe(done.set)

    engine.submit(EngineRequest("warmup", tokenizer.encode("warm up"), SamplingParams(max_tokens=4), deliver))
    await done.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests" / "fixtures")
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), help="record only these scenarios")
    parser.add_argument("--device", default="cpu", help="cpu (the demo_* fixtures) or cuda (the cuda_* ones)")
    parser.add_argument("--size", default="tiny", help="demo model size (default tiny)")
    args = parser.parse_args()
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    for name in args.only or SCENARIOS:
        knobs = SCENARIOS[name]
        # slow_tokenizer: far apart, so nothing else holds the GIL while one tokenizes and its wall
        # time is the injected work; tokenize_on_loop_slow: close together, to show the harm.
        stagger = 0.12 if name == "slow_tokenizer" else 0.01
        path = record(name, knobs, args.out, stagger_s=stagger, device=args.device, size=args.size)
        print(f"{path}  {path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
