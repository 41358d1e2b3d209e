"""`servprof calibrate`: measure this device's achievable memory bandwidth and matmul FLOP/s.

Bandwidth: the best of several large tensor copies (bytes read + bytes written
per copy). FLOP/s: the best of several square matmuls (2·n³ FLOPs each), in
bfloat16 on CUDA and float32 on CPU. The result is saved as JSON under the cache
directory (SERVPROF_CACHE_DIR, default ~/.cache/servprof), one entry per device name, and
used by later analyses: by default on CPU traces and on traces of a GPU of the same name
that servprof's device table does not know, and with `--device calibrated`.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from servprof.detect.devices import calibration_path, calibrations


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="torch device to measure (default: cuda if available, else cpu)")
    parser.add_argument("--copy-mib", type=int, default=0,
                        help="size of the tensor copied (MiB; default 2048 on GPU, as free memory allows, 256 on CPU)")
    parser.add_argument("--matmul-n", type=int, default=0, help="matmul size n (default 8192 on GPU, 1024 on CPU)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions; the best is kept (default 5)")
    parser.add_argument("--no-save", action="store_true", help="print the result without saving it")


def _timed_best(fn: Any, repeats: int, sync: Any) -> float:
    fn()
    sync()  # warm-up: allocation and first-call costs are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def _copy_bandwidth_gbs(torch: Any, device: Any, copy_mib: int, repeats: int, sync: Any) -> float:
    source = torch.empty(copy_mib * 1024 * 1024 // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    seconds = _timed_best(lambda: target.copy_(source), repeats, sync)
    return 2 * source.numel() * 4 / seconds / 1e9  # each copy reads and writes every byte once


CPU_COPY_MIB = 256
# A GPU copies 256 MiB in ~0.2 ms, where the host's timing and sync add ~10-20 µs: measured on an
# H100 80GB HBM3, 256 MiB gave 2754 GB/s and 2048 MiB 2981 GB/s (89% of the datasheet's 3350).
GPU_COPY_MIB = 2048


def _default_copy_mib(torch: Any, device: Any) -> int:
    """GPU_COPY_MIB, halved until two copies of it fit in a third of the free memory."""
    size = GPU_COPY_MIB
    try:
        free, _total = torch.cuda.mem_get_info(device)
    except (RuntimeError, AttributeError):
        return CPU_COPY_MIB
    while size > CPU_COPY_MIB and 2 * size * 1024**2 > free / 3:
        size //= 2
    return size


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.lower().startswith("model name") and ":" in line:
                    return f"CPU {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"CPU {platform.processor() or platform.machine()}"


def cpu_cache_bytes() -> int | None:
    """The largest CPU cache (the last level) in bytes, from sysfs on Linux; None where unknown."""
    sizes = []
    for size_file in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = size_file.read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else None


def save(result: dict[str, Any]) -> None:
    """Add ``result`` to the saved calibrations (replacing an older one of the same device)."""
    devices = {r["name"]: r for r in calibrations()}
    devices[result["name"]] = result
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + f".{os.getpid()}.tmp")
    temporary.write_bytes(orjson.dumps({"devices": devices}, option=orjson.OPT_INDENT_2))
    os.replace(temporary, path)  # a reader never sees half a file


def measure(device_name: str | None, copy_mib: int, matmul_n: int, repeats: int) -> dict[str, Any]:
    import torch

    device = torch.device(device_name or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    if on_gpu and not torch.cuda.is_available():
        raise ValueError(f"{device}: this torch has no usable CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{device}: only cpu and cuda devices can be calibrated")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    if not copy_mib:
        copy_mib = _default_copy_mib(torch, device) if on_gpu else CPU_COPY_MIB
    bandwidth_gbs = _copy_bandwidth_gbs(torch, device, copy_mib, repeats, sync)
    n = matmul_n or (8192 if on_gpu else 1024)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    matmul_s = _timed_best(lambda: a @ b, repeats, sync)
    tflops = 2 * n**3 / matmul_s / 1e12
    name = torch.cuda.get_device_name(device) if on_gpu else cpu_name()
    return {
        "name": name, "torch_device": str(device), "memory_bandwidth_gbs": round(bandwidth_gbs, 3),
        "peak_tflops": round(tflops, 4), "matmul_dtype": str(dtype).removeprefix("torch."), "matmul_n": n,
        "copy_mib": copy_mib, "repeats": repeats, "threads": torch.get_num_threads(), "measured_at": time.time(),
        "cache_bytes": None if on_gpu else cpu_cache_bytes(),
    }


def run(args: argparse.Namespace) -> int:
    if args.copy_mib < 0 or args.repeats <= 0 or args.matmul_n < 0:
        print("servprof calibrate: --repeats must be positive, --copy-mib and --matmul-n not negative", file=sys.stderr)
        return 2
    try:
        result = measure(args.device, args.copy_mib, args.matmul_n, args.repeats)
    except (RuntimeError, ValueError) as exc:  # unknown device string, out of memory
        print(f"servprof calibrate: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"{result['name']}: {result['memory_bandwidth_gbs']:.1f} GB/s copy bandwidth, "
          f"{result['peak_tflops']:.3f} TFLOP/s {result['matmul_dtype']} matmul (n={result['matmul_n']})")
    if not args.no_save:
        path = calibration_path()
        try:
            save(result)
        except OSError as exc:
            print(f"servprof calibrate: cannot save to {path}: {exc.strerror}", file=sys.stderr)
            return 2
        print(f"saved to {path}; later analyses use it by default for traces of this device "
              "(CPU traces, or a GPU servprof's table does not know), and with --device calibrated")
    return 0
