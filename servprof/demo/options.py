"""`servprof demo`'s command line: its flags, the demo-server flags of each injected fault, the
session settings the demo runs with, and the CPU peak its bandwidth findings are judged against."""

from __future__ import annotations

import argparse
from pathlib import Path

# Each injected fault as demo-server flags; the values are those the detectors' recorded
# fixtures were made with (tests/fixtures/README.md).
INJECT_FLAGS: dict[str, list[str]] = {
    "tokenization-stall": ["--tokenize-on-loop", "--slow-tokenizer-us-per-token", "150"],
    "decode-gap": ["--step-delay-ms", "20"],
    "sync": ["--sync-per-step"],
    # Dynamo's own recompiles (~1 s each here); --compile-backend inductor makes each ~10 s on CPU.
    "recompile": ["--compile", "--unpadded-batches", "--compile-backend", "eager"],
    "memory-leak": ["--leak-mb-per-request", "2"],
}
# The server's default session budget is sized for production (a few ms of capture, so
# serving barely notices); the demo wants a trace with enough decode steps for each detector
# to judge, and op shapes so that the bandwidth detector can model bytes. Shapes make the
# profiler's stop ~3.8x dearer per event (bench/bench_demo_shapes.py: 64 steps without shapes
# stalled the server ~320 ms, 16 steps with shapes ~270 ms), so the session stops at 16 decode
# steps: no longer a stall than the demo's sessions had without shapes. Its one session is deep
# (every op): a light session (the server default) records no op to model bytes from. An env var
# the user set wins (SERVPROF_TIER=light shows the default tier's session).
DEMO_SESSION_ENV = {"SERVPROF_MAX_SESSION_EVENTS": "50000", "SERVPROF_MAX_SESSION_STEPS": "16",
                    "SERVPROF_RECORD_SHAPES": "1", "SERVPROF_PROFILE_MEMORY": "1", "SERVPROF_TIER": "deep"}

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("servprof-out"), help="output directory (./servprof-out)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load (default 30)")
    parser.add_argument("--users", type=int, default=8, help="concurrent harness users (default 8)")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="open-loop Poisson arrivals per second; 0 = closed loop of --users (default)")
    parser.add_argument("--sample", type=int, default=4, help="requests to sample in the session (default 4)")
    parser.add_argument("--sample-at", type=float, default=None,
                        help="seconds into the load to order the sample (default: a third of --duration)")
    parser.add_argument("--max-output-tokens", type=int, default=64, help="cap on tokens per request (default 64)")
    parser.add_argument("--inject", action="append", choices=list(INJECT_FLAGS), default=[],
                        help="switch a demo fault knob on (repeatable): " + ", ".join(INJECT_FLAGS))
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the demo's decode step (implied by --inject recompile)")
    parser.add_argument("--compile-backend", choices=["inductor", "eager", "aot_eager"], default=None,
                        help="torch.compile backend (default inductor; eager compiles much faster on CPU)")
    parser.add_argument("--size", default="tiny", help="demo model size: tiny, small, 1b (default tiny)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--analysis-timeout", type=float, default=120.0,
                        help="seconds to wait for the session's analysis after the load (default 120)")


def cpu_peak_note() -> str:
    """This CPU's peak bandwidth for the bandwidth detector: measured once (a few seconds) and cached
    with `servprof calibrate`'s own code, so the demo's CPU decode is judged against a measured peak,
    not an assumed one."""
    from servprof.detect import calibrate
    from servprof.detect.devices import calibration_kind, calibration_path, calibrations

    name = calibrate.cpu_name()
    known = [r for r in calibrations() if r["name"] == name and calibration_kind(r) == "cpu"]
    if known:
        return (f"judging bandwidth against this CPU's measured {known[-1]['memory_bandwidth_gbs']:.1f} GB/s "
                f"({calibration_path()}; re-measure with `servprof calibrate`)")
    cache = calibrate.cpu_cache_bytes() or 0
    copy_mib = min(max(64, 4 * cache // 1024**2), 512)  # well past the last-level cache: DRAM, not cache
    try:
        result = calibrate.measure("cpu", copy_mib=copy_mib, matmul_n=1024, repeats=3)
        calibrate.save(result)
    except (OSError, RuntimeError, ValueError) as exc:
        return f"could not measure this CPU's bandwidth ({exc}): bandwidth is judged against an assumed peak"
    return (f"measured this CPU's memory bandwidth once: {result['memory_bandwidth_gbs']:.1f} GB/s "
            f"(cached in {calibration_path()})")
