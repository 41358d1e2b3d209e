"""Record tests/fixtures/torch_compile_recompile.json.gz: a real Inductor recompile on CPU.

    PYTHONPATH=. .venv/bin/python bench/record_compile_fixture.py [--out tests/fixtures]

A small module compiled with torch.compile (Inductor, static shapes) is warmed up at batch
size 2 and then served in servprof decode-step phases at sizes 2, 3, 3 under the profiler
(profile_all_threads, as servprof runs it): size 3 recompiles inside its step. servprof's
own probe (servprof.probes.SessionProbes) adds torch's compile records to the trace's
``servprof`` metadata, as in a live session. Inductor on CPU needs a C++ compiler (gcc);
the recording takes ~10-30 s cold, which is why tests read this file instead.
"""

from __future__ import annotations

import argparse
import gzip
import tempfile
import time
from pathlib import Path

import orjson
import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from servprof.phases import phase
from servprof.probes import SessionProbes


def record(out_dir: Path) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)).eval()
    compiled = torch.compile(model, dynamic=False)  # Inductor
    with torch.inference_mode():
        compiled(torch.randn(2, 64))  # the warmed-up shape
        probes = SessionProbes(memory=False)
        prof = profile(activities=[ProfilerActivity.CPU], experimental_config=_ExperimentalConfig(profile_all_threads=True))
        wall_start = time.time_ns()
        prof.start()
        for step, size in enumerate((2, 3, 3)):
            with phase("decode_step", request_ids=[f"req-{step}-{i}" for i in range(size)]):
                compiled(torch.randn(size, 64))
        metadata = {"session_id": "fixture-compile", "stop_wall_ns": time.time_ns(),
                    **probes.finish(wall_start, serving_since_ns=wall_start)}
        prof.add_metadata_json("servprof", orjson.dumps(metadata).decode())
        prof.stop()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / "torch_compile_recompile.json.gz"
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        target.write_bytes(gzip.compress(raw.read_bytes(), 9))
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "tests" / "fixtures")
    path = record(parser.parse_args().out)
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
