"""One decode step of the demo's 1B Llama-shaped model (bf16), for checking servprof's byte
models against the hardware's own counters (issue 15).

    python bench/gpu/decode_step.py profile --batch 1 8 32 --out DIR   # torch.profiler traces
    ncu --profile-from-start off ... python bench/gpu/decode_step.py ncu --batch 1   # one step under ncu

Both modes build the same model and cache, fill the batch's cache rows to ``--context`` tokens
(what is in them does not change the traffic), run ``--warmup`` decode steps, then the measured
one: under torch.profiler (CPU + CUDA activity, record_shapes, as a deep servprof session
records) or between cudaProfilerStart/Stop so that ncu profiles exactly its kernels. The step
is the demo engine's own call (``LlamaLikeModel.decode``), inside a ``servprof:decode_step``
phase, so the trace's decode step is found as in a served trace.
"""

from __future__ import annotations

import argparse
import gzip
import tempfile
from pathlib import Path

import torch

from servprof.demo.model import LlamaLikeModel, model_config
from servprof.phases import phase

SLOTS = 32


def build(size: str, device: str, context: int) -> LlamaLikeModel:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return LlamaLikeModel(model_config(size), slots=SLOTS, context=context + 64, device=device, dtype=dtype)


def decode_once(model: LlamaLikeModel, batch: int, context: int) -> torch.Tensor:
    device = model.device
    tokens = torch.randint(0, model.config.vocab_size, (batch,), device=device)
    slots = torch.arange(batch, device=device)
    lengths = torch.full((batch,), context, device=device)
    with phase("decode_step"):
        return model.decode(tokens, slots, lengths, context + 1, rows=slice(0, batch))


def sync(model: LlamaLikeModel) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def profile(model: LlamaLikeModel, batch: int, context: int, warmup: int, out: Path) -> Path:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(warmup):
        decode_once(model, batch, context)
    sync(model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    with torch_profile(activities=activities, record_shapes=True) as prof:
        decode_once(model, batch, context)
        sync(model)
    path = out / f"decode_b{batch}.json.gz"
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        path.write_bytes(gzip.compress(raw.read_bytes(), 9))
    return path


def under_ncu(model: LlamaLikeModel, batch: int, context: int, warmup: int) -> None:
    for _ in range(warmup):
        decode_once(model, batch, context)
    sync(model)
    torch.cuda.cudart().cudaProfilerStart()
    decode_once(model, batch, context)
    sync(model)
    torch.cuda.cudart().cudaProfilerStop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["profile", "ncu"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--size", default="1b")
    parser.add_argument("--context", type=int, default=512, help="tokens already in each request's cache")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    if max(args.batch) > SLOTS:
        parser.error(f"--batch at most {SLOTS}")
    model = build(args.size, args.device, args.context)
    args.out.mkdir(parents=True, exist_ok=True)
    for batch in args.batch:
        if args.mode == "profile":
            print(profile(model, batch, args.context, args.warmup, args.out), flush=True)
        else:
            under_ncu(model, batch, args.context, args.warmup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
