"""Peak memory bandwidth and dense 16-bit matrix FLOP/s of the devices servprof knows.

Figures are the vendors' published datasheet numbers (dense, no sparsity), which
real kernels rarely exceed ~80-90% of; `servprof calibrate` measures what the
device in hand really reaches and is preferred where present.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bandwidth_gbs: float  # GB/s (1e9 bytes/s)
    peak_tflops: float  # dense 16-bit (BF16/FP16) matrix TFLOP/s, or FP32 for CPUs
    source: str

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity above which a kernel is compute-bound rather than memory-bound."""
        return self.peak_tflops * 1e12 / (self.memory_bandwidth_gbs * 1e9)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ridge_flops_per_byte": round(self.ridge_flops_per_byte, 2)}


DEVICES: dict[str, DeviceSpec] = {
    "h100-sxm": DeviceSpec("NVIDIA H100 SXM5 80GB", 3350.0, 989.4, "NVIDIA H100 datasheet: HBM3 3.35 TB/s, BF16 1979 TFLOPS with sparsity"),
    "h100-pcie": DeviceSpec("NVIDIA H100 PCIe 80GB", 2000.0, 756.0, "NVIDIA H100 datasheet: HBM2e 2 TB/s, BF16 1513 TFLOPS with sparsity"),
    "h200": DeviceSpec("NVIDIA H200 SXM 141GB", 4800.0, 989.4, "NVIDIA H200 datasheet: HBM3e 4.8 TB/s, BF16 1979 TFLOPS with sparsity"),
    "a100": DeviceSpec("NVIDIA A100 SXM4 80GB", 2039.0, 312.0, "NVIDIA A100 datasheet: HBM2e 2039 GB/s, BF16 312 TFLOPS dense"),
    "b200": DeviceSpec("NVIDIA B200", 8000.0, 2250.0, "NVIDIA HGX B200 datasheet: HBM3e 8 TB/s, BF16 4.5 PFLOPS with sparsity"),
    "mi300x": DeviceSpec("AMD Instinct MI300X", 5300.0, 1307.4, "AMD MI300X datasheet: HBM3 5.3 TB/s, BF16 1307.4 TFLOPS dense"),
    "l4": DeviceSpec("NVIDIA L4", 300.0, 121.0, "NVIDIA L4 datasheet: GDDR6 300 GB/s, BF16 242 TFLOPS with sparsity"),
    "v100": DeviceSpec("NVIDIA V100 SXM2", 900.0, 125.0, "NVIDIA V100 datasheet: HBM2 900 GB/s, FP16 tensor 125 TFLOPS"),
    "cpu": DeviceSpec("generic CPU", 40.0, 1.0, "order of magnitude for one server socket's DRAM and FP32 SIMD; run `servprof calibrate`"),
}
# Substrings of torch/Kineto device names -> table key (first match wins).
_NAME_PATTERNS = [
    (re.compile(r"H100.*PCIe", re.I), "h100-pcie"), (re.compile(r"H100", re.I), "h100-sxm"),
    (re.compile(r"H200", re.I), "h200"), (re.compile(r"A100", re.I), "a100"), (re.compile(r"B200", re.I), "b200"),
    (re.compile(r"MI300X|gfx942", re.I), "mi300x"), (re.compile(r"\bL4\b", re.I), "l4"), (re.compile(r"V100", re.I), "v100"),
]


class UnknownDevice(ValueError):
    pass


def cache_dir() -> Path:
    override = os.environ.get("SERVPROF_CACHE_DIR")
    return Path(override) if override else Path.home() / ".cache" / "servprof"


def calibration_path() -> Path:
    return cache_dir() / "calibration.json"


def load_calibrated() -> DeviceSpec | None:
    path = calibration_path()
    try:
        data = orjson.loads(path.read_bytes())
        return DeviceSpec(str(data["name"]), float(data["memory_bandwidth_gbs"]), float(data["peak_tflops"]),
                          f"measured by servprof calibrate ({path})")
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def match_device_name(name: str) -> str | None:
    for pattern, key in _NAME_PATTERNS:
        if pattern.search(name):
            return key
    return None


def match_device_properties(prop: dict[str, Any]) -> str | None:
    """Kineto's deviceProperties entry -> table key, by name or else by its shape
    (some ROCm traces leave the name empty)."""
    name = prop.get("name")
    if isinstance(name, str) and name:
        return match_device_name(name)
    major, minor, sms = prop.get("computeMajor"), prop.get("computeMinor"), prop.get("numSms")
    memory_gb = (prop.get("totalGlobalMem") or 0) / 1e9
    by_shape = {
        (9, 4, 304): "mi300x", (9, 0, 114): "h100-pcie", (8, 0, 108): "a100", (8, 9, 58): "l4",
        (7, 0, 80): "v100", (10, 0, 148): "b200",
    }
    if (major, minor, sms) == (9, 0, 132):
        return "h200" if memory_gb > 100 else "h100-sxm"
    return by_shape.get((major, minor, sms))


def resolve_device(requested: str | None, trace_devices: list[dict[str, Any]], has_device_events: bool) -> DeviceSpec:
    """The spec to judge kernels against: the named one, else the trace's GPU, else calibration/CPU."""
    if requested:
        key = requested.lower()
        if key == "calibrated":
            spec = load_calibrated()
            if spec is None:
                raise UnknownDevice(f"no calibration at {calibration_path()}; run `servprof calibrate` first")
            return spec
        if key in DEVICES:
            return DEVICES[key]
        matched = match_device_name(requested)
        if matched:
            return DEVICES[matched]
        raise UnknownDevice(f"unknown device {requested!r}; choose one of {', '.join(DEVICES)} or 'calibrated'")
    if has_device_events:
        for prop in trace_devices:
            matched = match_device_properties(prop)
            if matched:
                return DEVICES[matched]
    return load_calibrated() or DEVICES["cpu"]
