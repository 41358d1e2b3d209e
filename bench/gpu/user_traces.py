"""Traces recorded the way users record them, on a GPU: ``torch.profiler`` around transformers'
``model.generate()`` (no servprof inside), exported with ``export_chrome_trace``, for
``servprof analyze`` to read as it would read a user's file.

    SERVPROF_TEST_DEVICE=cuda SERVPROF_TEST_MODEL=gpu python bench/gpu/user_traces.py --out DIR

Variants: ``plain`` (CPU + CUDA activity, batch 1), ``shapes`` (record_shapes + with_stack, batch 4),
``schedule`` (a wait/warmup/active schedule over several generate calls, batch 8), ``short`` (as plain,
6 new tokens: small enough for a test fixture), ``sync_loop`` (a
hand-written greedy loop that reads each token with ``.item()``), ``static`` (a static KV cache and
``torch.compile(mode="reduce-overhead")``: decode steps as CUDA graph launches).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from servers.hf_streaming import DEVICE, model, tokenizer  # noqa: E402

tokenizer.padding_side = "left"  # as generate() asks of a batch for a decoder-only model

PROMPT = "The harbour master counted the boats twice before the storm and once after it. "
ACTIVITIES = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE.type == "cuda" else [])


def inputs(batch: int) -> dict:
    prompts = [PROMPT * (1 + i % 3) for i in range(batch)]
    return tokenizer(prompts, return_tensors="pt", padding=True).to(DEVICE)


def generate(batch: int, new_tokens: int, **kwargs) -> None:
    with torch.inference_mode():
        model.generate(**inputs(batch), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=tokenizer.pad_token_id, **kwargs)


def sync_loop(new_tokens: int) -> None:
    ids = inputs(1)["input_ids"]
    past = None
    with torch.inference_mode():
        for _ in range(new_tokens):
            out = model(input_ids=ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax().item())  # the host reads every token
            ids = torch.cat([ids, torch.tensor([[token]], device=DEVICE)], dim=1)


def record(variant: str, out: Path) -> None:
    path = out / f"user_{variant}.json"
    generate(1, 4)  # warm-up outside the trace, as users do (or not: the others below do not)
    start = time.perf_counter()
    if variant == "schedule":
        def export(prof: profile) -> None:
            prof.export_chrome_trace(str(path))

        with profile(activities=ACTIVITIES, schedule=schedule(wait=1, warmup=1, active=2),
                     on_trace_ready=export) as prof:
            for _ in range(4):
                generate(8, 16)
                prof.step()
    else:
        options = dict(record_shapes=True, with_stack=True) if variant == "shapes" else {}
        if variant == "static":
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
            for _ in range(3):  # compile and capture the graphs for this length before the trace
                generate(1, 32, cache_implementation="static")
        with profile(activities=ACTIVITIES, **options) as prof:
            if variant == "sync_loop":
                sync_loop(32)
            elif variant == "static":
                generate(1, 32, cache_implementation="static")
            else:
                generate(4, 16) if variant == "shapes" else generate(1, 6 if variant == "short" else 32)
        prof.export_chrome_trace(str(path))
    print(f"{variant}: {path} {path.stat().st_size / 1e6:.1f} MB in {time.perf_counter() - start:.1f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("variants", nargs="*", default=["plain", "shapes", "schedule", "sync_loop", "static"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for variant in args.variants:  # static last: it compiles the model in place
        record(variant, args.out)


if __name__ == "__main__":
    main()
