"""Peak memory bandwidth and dense 16-bit matrix FLOP/s of the device a trace ran on.

Figures in the table are the vendors' published datasheet numbers (dense, no sparsity),
which real kernels rarely exceed ~80-90% of. A GPU the table does not know is still a
GPU: its peak is derived from its deviceProperties where they allow (memory clock x bus
width), taken from a `servprof calibrate` run on a device of the same name, or else left
unknown (and said so) -- never a CPU's. On CPU traces, `servprof calibrate` measures what
the machine reaches; without it the peak is an assumed order of magnitude, and findings
measured against it are at most `info`.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import orjson

# How servprof came by a peak: only the first three are measurements of the device in hand.
BASIS_DATASHEET = "datasheet"  # named by --device, or identified from the trace's deviceProperties
BASIS_CALIBRATED = "calibrated"  # measured by `servprof calibrate`
BASIS_DERIVED = "derived"  # memory clock x bus width from the trace's deviceProperties
BASIS_ASSUMED = "assumed"  # the generic CPU: nothing identified, nothing measured
BASIS_UNKNOWN = "unknown"  # a GPU servprof cannot put a peak on


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bandwidth_gbs: float | None  # GB/s (1e9 bytes/s); None: unknown
    peak_tflops: float | None  # dense 16-bit (BF16/FP16) matrix TFLOP/s, or FP32 for CPUs; None: unknown
    source: str
    kind: str = "gpu"  # "gpu" | "cpu"
    basis: str = BASIS_DATASHEET
    # Last-level cache: a GPU's L2 (AMD Instinct MI300's Infinity Cache) from its datasheet or
    # architecture whitepaper, a CPU's where `servprof calibrate` measured it; None: not known.
    cache_bytes: int | None = None

    @property
    def ridge_flops_per_byte(self) -> float | None:
        """Arithmetic intensity above which a kernel is compute-bound rather than memory-bound."""
        if not self.peak_tflops or not self.memory_bandwidth_gbs:
            return None
        return self.peak_tflops * 1e12 / (self.memory_bandwidth_gbs * 1e9)

    @property
    def identified(self) -> bool:
        """True when the peak belongs to the device in hand (named, identified or measured), not assumed."""
        return self.basis in (BASIS_DATASHEET, BASIS_CALIBRATED, BASIS_DERIVED) and bool(self.memory_bandwidth_gbs)

    def to_dict(self) -> dict[str, Any]:
        ridge = self.ridge_flops_per_byte
        return {**asdict(self), "ridge_flops_per_byte": round(ridge, 2) if ridge else None,
                "identified": self.identified}


MIB = 1024 * 1024
DEVICES: dict[str, DeviceSpec] = {
    "h100-sxm": DeviceSpec("NVIDIA H100 SXM5 80GB", 3350.0, 989.4, "NVIDIA H100 datasheet: HBM3 3.35 TB/s, BF16 1979 TFLOPS with sparsity", cache_bytes=50 * MIB),
    "h100-pcie": DeviceSpec("NVIDIA H100 PCIe 80GB", 2000.0, 756.0, "NVIDIA H100 datasheet: HBM2e 2 TB/s, BF16 1513 TFLOPS with sparsity", cache_bytes=50 * MIB),
    "h100-nvl": DeviceSpec("NVIDIA H100 NVL 94GB", 3900.0, 835.5, "NVIDIA H100 datasheet: HBM3 3.9 TB/s, BF16 1671 TFLOPS with sparsity", cache_bytes=50 * MIB),
    "h200": DeviceSpec("NVIDIA H200 SXM 141GB", 4800.0, 989.4, "NVIDIA H200 datasheet: HBM3e 4.8 TB/s, BF16 1979 TFLOPS with sparsity", cache_bytes=50 * MIB),
    "h20": DeviceSpec("NVIDIA H20 96GB", 4000.0, 148.0, "NVIDIA H20: HBM3 4.0 TB/s, BF16 148 TFLOPS dense"),
    "a100": DeviceSpec("NVIDIA A100 SXM4 80GB", 2039.0, 312.0, "NVIDIA A100 datasheet: HBM2e 2039 GB/s, BF16 312 TFLOPS dense", cache_bytes=40 * MIB),
    "a100-40gb": DeviceSpec("NVIDIA A100 40GB", 1555.0, 312.0, "NVIDIA A100 datasheet: HBM2 1555 GB/s, BF16 312 TFLOPS dense", cache_bytes=40 * MIB),
    "b200": DeviceSpec("NVIDIA B200", 8000.0, 2250.0, "NVIDIA HGX B200 datasheet: HBM3e 8 TB/s, BF16 4.5 PFLOPS with sparsity"),
    "gb200": DeviceSpec("NVIDIA GB200 (per GPU)", 8000.0, 2500.0, "NVIDIA GB200 NVL72 datasheet: HBM3e 8 TB/s and BF16 5 PFLOPS with sparsity per GPU"),
    "mi300x": DeviceSpec("AMD Instinct MI300X", 5300.0, 1307.4, "AMD MI300X datasheet: HBM3 5.3 TB/s, BF16 1307.4 TFLOPS dense", cache_bytes=256 * MIB),
    "mi325x": DeviceSpec("AMD Instinct MI325X", 6000.0, 1307.4, "AMD MI325X datasheet: HBM3e 6 TB/s, BF16 1307.4 TFLOPS dense", cache_bytes=256 * MIB),
    "mi250x": DeviceSpec("AMD Instinct MI250X", 3276.8, 383.0, "AMD MI250X datasheet: HBM2e 3.2768 TB/s, BF16 383 TFLOPS dense", cache_bytes=8 * MIB),
    "mi210": DeviceSpec("AMD Instinct MI210", 1638.4, 181.0, "AMD MI210 datasheet: HBM2e 1.6384 TB/s, BF16 181 TFLOPS dense", cache_bytes=8 * MIB),
    "l40s": DeviceSpec("NVIDIA L40S", 864.0, 362.05, "NVIDIA L40S datasheet: GDDR6 864 GB/s, BF16 733 TFLOPS with sparsity", cache_bytes=96 * MIB),
    "l4": DeviceSpec("NVIDIA L4", 300.0, 121.0, "NVIDIA L4 datasheet: GDDR6 300 GB/s, BF16 242 TFLOPS with sparsity", cache_bytes=48 * MIB),
    "a10": DeviceSpec("NVIDIA A10", 600.0, 125.0, "NVIDIA A10 datasheet: GDDR6 600 GB/s, BF16 250 TFLOPS with sparsity", cache_bytes=6 * MIB),
    "v100": DeviceSpec("NVIDIA V100 SXM2", 900.0, 125.0, "NVIDIA V100 datasheet: HBM2 900 GB/s, FP16 tensor 125 TFLOPS", cache_bytes=6 * MIB),
    # Intel GPUs (XPU): BF16 peaks are the XMX engines' 4096 ops per Xe core per clock at the top clock
    # (128 cores at 1.6 GHz; 56 at 1.55 GHz), as Intel's 838.9 TFLOPS for the Max 1550 is.
    "max1550": DeviceSpec("Intel Data Center GPU Max 1550", 3276.8, 838.9, "Intel Data Center GPU Max 1550 datasheet: "
                          "HBM2e 3.2768 TB/s, BF16 XMX 838.9 TFLOPS dense, 408 MB L2", cache_bytes=408 * MIB),
    # Level Zero's default (FLAT) hierarchy makes each of its two stacks a device: half of each figure.
    "max1550-stack": DeviceSpec("Intel Data Center GPU Max 1550 (one stack)", 1638.4, 419.4, "Intel Data Center GPU "
                                "Max 1550 datasheet, halved: one of its two stacks (64 Xe cores, 4 of 8 HBM2e stacks, "
                                "204 MB of L2), which Level Zero's FLAT hierarchy makes a device", cache_bytes=204 * MIB),
    "max1100": DeviceSpec("Intel Data Center GPU Max 1100", 1228.8, 355.5, "Intel Data Center GPU Max 1100 datasheet: "
                          "HBM2e 1.2288 TB/s, 56 Xe cores at 1.55 GHz (BF16 XMX 355.5 TFLOPS), 108 MB L2",
                          cache_bytes=108 * MIB),
    "cpu": DeviceSpec("generic CPU (assumed)", 40.0, 1.0,
                      "an assumed order of magnitude for one server socket's DRAM and FP32 SIMD, not this machine's: "
                      "run `servprof calibrate` on it", kind="cpu", basis=BASIS_ASSUMED),
}
# The lowest ridge point of the GPUs above: an op below it is memory-bound on any of them, so also
# on a GPU whose FLOP/s servprof does not know.
MIN_GPU_RIDGE = min(s.ridge_flops_per_byte or math.inf for s in DEVICES.values() if s.kind == "gpu")
# Substrings of torch/Kineto device names -> table key (first match wins; GH200 is not an H200).
_NAME_PATTERNS = [
    (re.compile(r"H100.*PCIe", re.I), "h100-pcie"), (re.compile(r"H100.*NVL", re.I), "h100-nvl"),
    (re.compile(r"H100", re.I), "h100-sxm"), (re.compile(r"(?<![A-Z])H200", re.I), "h200"),
    (re.compile(r"\bH20\b", re.I), "h20"), (re.compile(r"A100.*40\s*GB", re.I), "a100-40gb"),
    (re.compile(r"A100", re.I), "a100"), (re.compile(r"GB200", re.I), "gb200"),
    (re.compile(r"(?<![A-Z])B200", re.I), "b200"), (re.compile(r"MI300X|gfx942", re.I), "mi300x"),
    (re.compile(r"MI325X", re.I), "mi325x"), (re.compile(r"MI250X?\b", re.I), "mi250x"),
    (re.compile(r"MI210", re.I), "mi210"), (re.compile(r"L40S", re.I), "l40s"), (re.compile(r"\bL4\b", re.I), "l4"),
    (re.compile(r"\bA10G?\b", re.I), "a10"), (re.compile(r"V100", re.I), "v100"),
    (re.compile(r"GPU Max 1550", re.I), "max1550"), (re.compile(r"GPU Max 1100", re.I), "max1100"),
]
# (computeMajor, computeMinor, numSms) -> table key, for traces that leave the name empty (some ROCm ones).
_BY_SHAPE = {(9, 4, 304): "mi300x", (9, 0, 114): "h100-pcie", (8, 0, 108): "a100", (8, 9, 58): "l4",
             (7, 0, 80): "v100", (10, 0, 148): "b200"}


class UnknownDevice(ValueError):
    pass


# --- the trace's deviceProperties (every field type-checked: traces come from anywhere) -------------

def _int_field(prop: dict[str, Any], key: str) -> int | None:
    value = prop.get(key)
    return value if type(value) is int else None


def _number_field(prop: dict[str, Any], key: str) -> float | None:
    value = prop.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        return None
    return float(value)


def trace_device_properties(metadata: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The deviceProperties entries of every rank's file that are objects (anything else is ignored)."""
    entries: list[dict[str, Any]] = []
    for document in metadata.values():
        listed = document.get("deviceProperties") if isinstance(document, dict) else None
        if isinstance(listed, list):
            entries.extend(p for p in listed if isinstance(p, dict))
    return entries


def device_name(prop: dict[str, Any]) -> str | None:
    name = prop.get("name")
    return name.strip() if isinstance(name, str) and name.strip() else None


def match_device_name(name: str) -> str | None:
    for pattern, key in _NAME_PATTERNS:
        if pattern.search(name):
            return key
    return None


def match_device_properties(prop: dict[str, Any]) -> str | None:
    """Kineto's deviceProperties entry -> table key, by name or else by its shape
    (some ROCm traces leave the name empty)."""
    name = device_name(prop)
    if name:
        key = match_device_name(name)
        if key == "max1550":  # a whole card (1024 vector engines) or one of its stacks, by the engines it lists
            return {1024: "max1550", 512: "max1550-stack"}.get(_int_field(prop, "maxComputeUnits"))  # type: ignore[arg-type]
        return key
    shape = (_int_field(prop, "computeMajor"), _int_field(prop, "computeMinor"), _int_field(prop, "numSms"))
    if shape == (9, 0, 132):
        return "h200" if (_number_field(prop, "totalGlobalMem") or 0) > 100e9 else "h100-sxm"
    return _BY_SHAPE.get(shape)  # type: ignore[arg-type]


def derived_bandwidth_gbs(prop: dict[str, Any]) -> float | None:
    """Peak DRAM bandwidth from CUDA-style properties: 2 (double data rate) x memoryClockRate (kHz)
    x memoryBusWidth (bits) / 8. Kineto does not write them today; other exporters may."""
    clock_khz, bus_bits = _number_field(prop, "memoryClockRate"), _number_field(prop, "memoryBusWidth")
    if clock_khz is None or bus_bits is None:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9


# --- calibration -------------------------------------------------------------------------------------

def cache_dir() -> Path:
    override = os.environ.get("SERVPROF_CACHE_DIR")
    return Path(override) if override else Path.home() / ".cache" / "servprof"


def calibration_path() -> Path:
    return cache_dir() / "calibration.json"


def calibrations() -> list[dict[str, Any]]:
    """Every saved calibration, newest last. The file holds {"devices": {name: result}}; an older
    file holding one result is read too. Anything unreadable counts as none."""
    try:
        data = orjson.loads(calibration_path().read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return []
    listed = list(data["devices"].values()) if isinstance(data, dict) and isinstance(data.get("devices"), dict) \
        else [data]
    valid = [r for r in listed if isinstance(r, dict) and isinstance(r.get("name"), str)
             and _number_field(r, "memory_bandwidth_gbs") and _number_field(r, "peak_tflops")]
    return sorted(valid, key=lambda r: _number_field(r, "measured_at") or 0.0)


def calibration_kind(result: dict[str, Any]) -> str:
    device = result.get("torch_device")
    return "gpu" if isinstance(device, str) and not device.startswith("cpu") else "cpu"


def load_calibrated(kind: str | None = None, name: str | None = None) -> DeviceSpec | None:
    """The calibration measured on a device of this name, else the newest of this kind (cpu/gpu)."""
    found = calibrations()
    if name is not None:
        found = [r for r in found if r["name"] == name] or ([] if kind == "gpu" else found)
    if kind is not None:
        found = [r for r in found if calibration_kind(r) == kind]
    if not found:
        return None
    result = found[-1]
    cache = result.get("cache_bytes")
    return DeviceSpec(result["name"], float(result["memory_bandwidth_gbs"]), float(result["peak_tflops"]),
                      f"measured by servprof calibrate ({calibration_path()})", kind=calibration_kind(result),
                      basis=BASIS_CALIBRATED, cache_bytes=cache if type(cache) is int and cache > 0 else None)


# --- choosing the device -----------------------------------------------------------------------------

CALIBRATE_HINT = ("run `servprof calibrate` on a machine with this device and analyse with `--device calibrated`, "
                  "or name the closest known device with `--device` ({known})")


def _unknown_gpu(name: str, prop: dict[str, Any]) -> DeviceSpec:
    calibrated = load_calibrated("gpu", name)
    if calibrated is not None:
        return calibrated
    bandwidth = derived_bandwidth_gbs(prop)
    if bandwidth is not None:
        return DeviceSpec(name, round(bandwidth, 1), None,
                          "derived from the trace's deviceProperties: 2 x memoryClockRate x memoryBusWidth / 8 "
                          "(FLOP/s unknown)", basis=BASIS_DERIVED)
    return DeviceSpec(name, None, None, f"{name!r} is not in servprof's device table and its deviceProperties "
                      "give no memory clock or bus width: its peak bandwidth is unknown; "
                      + CALIBRATE_HINT.format(known=", ".join(k for k in DEVICES if k != "cpu")),
                      basis=BASIS_UNKNOWN)


def resolve_device(requested: str | None, trace_devices: list[dict[str, Any]], has_device_events: bool) -> DeviceSpec:
    """The spec to judge ops against: the named one, else the trace's GPU (known, derived, calibrated or
    of unknown peak), else this machine's CPU calibration, else the assumed generic CPU."""
    on_gpu = has_device_events  # a trace's deviceProperties list GPUs even when its ops ran on the host
    if requested:
        key = requested.lower()
        if key == "calibrated":
            names = [n for n in (device_name(p) for p in trace_devices) if n]
            spec = load_calibrated("gpu" if on_gpu else "cpu", names[0] if names and on_gpu else None)
            if spec is None:
                raise UnknownDevice(f"no {'GPU' if on_gpu else 'CPU'} calibration at {calibration_path()}; "
                                    "run `servprof calibrate` first")
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
        named = next(((device_name(p), p) for p in trace_devices if device_name(p)), None)
        if named is not None:
            return _unknown_gpu(named[0], named[1])
        return DeviceSpec("unnamed GPU", None, None, "the trace has device kernels but its deviceProperties name no "
                          "device: its peak bandwidth is unknown; " + CALIBRATE_HINT.format(
                              known=", ".join(k for k in DEVICES if k != "cpu")), basis=BASIS_UNKNOWN)
    return load_calibrated("cpu") or DEVICES["cpu"]


def device_warnings(requested: str | None, spec: DeviceSpec, trace_devices: list[dict[str, Any]],
                    has_device_events: bool) -> tuple[list[str], bool]:
    """(warnings, contradicted): where the device asked for disagrees with what the trace says it ran
    on. Contradicted: the trace names a device servprof knows and it is another one, or the device
    kinds differ; a device the table does not know may be stood in for by a named one (a warning)."""
    if not requested:
        return [], False
    names = list(dict.fromkeys(n for n in (device_name(p) for p in trace_devices) if n))
    if not has_device_events:
        if spec.kind == "gpu":
            return [f"--device {requested}: this trace has no device kernels (its ops ran on the host CPU), "
                    f"so their times are judged against {spec.name}'s peak, which they cannot reach"], True
        return [], False
    if spec.kind == "cpu":
        return [f"--device {requested}: this trace ran kernels on {names[0] if names else 'a GPU'}, "
                f"judged here against a CPU's peak ({spec.name})"], True
    if not names:
        return [], False
    if spec.basis == BASIS_CALIBRATED:
        same, known = spec.name in names, True
    else:
        trace_keys = {match_device_name(n) for n in names} - {None}
        spec_key = next((k for k, s in DEVICES.items() if s == spec), None)
        same, known = spec_key in trace_keys, bool(trace_keys)
    if same:
        return [], False
    if not known:
        return [f"--device {requested}: judged against {spec.name} ({spec.memory_bandwidth_gbs:g} GB/s) as asked; "
                f"the trace ran on {', '.join(names)}, which servprof's table does not know"], False
    return [f"--device {requested} ({spec.name}, {spec.memory_bandwidth_gbs:g} GB/s) disagrees with the trace's "
            f"deviceProperties ({', '.join(names)}): figures are judged against the device asked for, "
            "not the one the trace ran on"], True


def with_mismatch(spec: DeviceSpec) -> DeviceSpec:
    """The spec, marked as contradicted by the trace: findings against it are at most info."""
    return replace(spec, source=spec.source + " (contradicted by the trace's deviceProperties)",
                   basis=BASIS_ASSUMED)
