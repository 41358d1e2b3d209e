"""Decode ops bound by memory bandwidth, and how much bandwidth they leave unused.

Per op inside decode steps, from record_shapes (Input Dims / Input type): FLOPs
and bytes moved (GEMM: 2MNK FLOPs, (MK+KN+MN)·element size bytes; attention:
2·B·H·Sq·Sk·(d_qk+d_v) FLOPs, Q+K+V+out bytes; element-wise: inputs + output
bytes, one FLOP per output element). Time is the op's device kernels when the
trace has them (joined on External id), else the op's own host duration. The
op's arithmetic intensity is compared with the device's ridge point; a
memory-bound op's achieved GB/s against peak says what it leaves on the table.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import orjson

from servprof.detect.devices import DeviceSpec, resolve_device
from servprof.detect.finding import Finding
from servprof.detect.steps import Step, step_index
from servprof.trace.model import Trace

ELEMENT_BYTES = {
    "double": 8, "float": 4, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "long": 8, "int64_t": 8,
    "int": 4, "short int": 2, "bool": 1, "signed char": 1, "unsigned char": 1, "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1, "c10::Float8_e4m3fnuz": 1, "c10::Float8_e5m2fnuz": 1, "c10::complex<float>": 8,
}
GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
ATTENTION = {"aten::scaled_dot_product_attention"}
ELEMENTWISE = {"aten::add", "aten::mul", "aten::sub", "aten::div", "aten::silu", "aten::neg", "aten::rsqrt",
               "aten::pow", "aten::mean", "aten::exp", "aten::softmax", "aten::_softmax", "aten::where",
               "aten::copy_", "aten::add_", "aten::mul_", "aten::gelu", "aten::cat", "aten::index"}
MIN_SHARE_OF_STEP = 0.05
LOW_BANDWIDTH_SHARE = 0.5  # memory-bound ops reaching under half of peak bandwidth leave it on the table


def _numel(dims: Any) -> int:
    return math.prod(int(d) for d in dims) if isinstance(dims, list) and dims and all(isinstance(d, int) for d in dims) else 0


def op_cost(name: str, dims: list[Any], types: list[Any]) -> tuple[float, float] | None:
    """(FLOPs, bytes) of one op from its record_shapes args; None when it cannot be modelled."""
    tensors = [(d, ELEMENT_BYTES.get(t, 0)) for d, t in zip(dims, types, strict=False)
               if isinstance(d, list) and d and t in ELEMENT_BYTES]
    if not tensors:
        return None
    elem = tensors[-1][1] if name == "aten::addmm" else tensors[0][1]
    if name in GEMMS:
        mats = [d for d, _ in tensors if len(d) in (2, 3)]
        if name in ("aten::addmm", "aten::baddbmm"):
            mats = mats[1:] if len(mats) >= 3 else mats
        if len(mats) < 2:
            return None
        a, b = mats[0], mats[1]
        batch = a[0] if len(a) == 3 else 1
        m, k, n = a[-2], a[-1], b[-1]
        flops = 2.0 * batch * m * n * k
        nbytes = float(batch * (m * k + k * n + m * n) * elem)
        return flops, nbytes
    if name in ATTENTION:
        if len(tensors) < 3 or len(tensors[0][0]) != 4:
            return None
        (q, e), (k, _), (v, _) = tensors[0], tensors[1], tensors[2]
        b, h, sq, dqk = q
        sk, dv = k[-2], v[-1]
        flops = 2.0 * b * h * sq * sk * (dqk + dv)
        out = b * h * sq * dv
        nbytes = float((_numel(q) + _numel(k) + _numel(v) + out) * e)
        return flops, nbytes
    if name in ELEMENTWISE:
        sizes = [_numel(d) * e for d, e in tensors]
        out_elems = max(_numel(d) for d, _ in tensors)
        return float(out_elems), float(sum(sizes) + out_elems * tensors[0][1])
    return None


def _device_properties(trace: Trace) -> list[dict[str, Any]]:
    listed = [meta.get("deviceProperties") for meta in trace.metadata.values()]
    return [p for props in listed if isinstance(props, list) for p in props if isinstance(p, dict)]


def detect_bandwidth_bound(trace: Trace, steps: list[Step], device: str | None
                           ) -> tuple[list[Finding], dict[str, Any], list[dict[str, Any]]]:
    spec = resolve_device(device, _device_properties(trace), trace.has_device_events())
    modelled = GEMMS | ATTENTION | ELEMENTWISE
    rows = np.flatnonzero(trace.mask_name(lambda s: s in modelled) & trace.complete() & (trace.stream < 0))
    decode_steps = [s for s in steps if s.kind == "decode"]
    scope = "decode steps" if decode_steps else "whole trace (no decode steps found)"
    if decode_steps:
        rows = rows[step_index(decode_steps, trace.rank[rows], trace.ts[rows]) >= 0]
    kernel_time = _kernel_time_by_external_id(trace)
    points: list[dict[str, Any]] = []
    costs: dict[bytes, tuple[float, float] | None] = {}  # decode repeats the same shapes every step
    for row in rows:
        args = trace.args(row)
        name, dims, types = trace.name(row), args.get("Input Dims") or [], args.get("Input type") or []
        shape_key = orjson.dumps([name, dims, types])
        if shape_key not in costs:
            costs[shape_key] = op_cost(name, dims, types)
        cost = costs[shape_key]
        if cost is None or cost[1] <= 0:
            continue
        key = (int(trace.rank[row]), int(trace.external_id[row]))
        time_us = kernel_time.get(key) if kernel_time else float(trace.dur[row])
        if time_us is None or not time_us >= 1e-3:  # no kernel, or under 1 ns (or NaN): no rate to compute
            continue
        points.append(_point(trace.name(row), args.get("Input Dims"), cost, time_us, spec))
    summary, grouped = _summarise(points, spec, scope, trace)
    step_time = sum(s.dur_us for s in decode_steps or steps) or sum(p["time_us"] for p in points)
    findings = _findings(grouped, spec, scope, decode_steps, step_time)
    return findings, summary, points


def _kernel_time_by_external_id(trace: Trace) -> dict[tuple[int, int], float]:
    dev = np.flatnonzero(trace.device_mask() & (trace.external_id >= 0))
    out: dict[tuple[int, int], float] = {}
    for r, e, d in zip(trace.rank[dev].tolist(), trace.external_id[dev].tolist(), trace.dur[dev].tolist(), strict=True):
        out[(r, e)] = out.get((r, e), 0.0) + d
    return out


def _point(name: str, dims: Any, cost: tuple[float, float], time_us: float, spec: DeviceSpec) -> dict[str, Any]:
    flops, nbytes = cost
    achieved_gbs = nbytes / (time_us * 1e-6) / 1e9
    intensity = flops / nbytes
    roofline_us = max(flops / (spec.peak_tflops * 1e12), nbytes / (spec.memory_bandwidth_gbs * 1e9)) * 1e6
    return {
        "op": name, "shapes": dims, "flops": flops, "bytes": nbytes, "time_us": time_us,
        "intensity": intensity, "achieved_gbs": achieved_gbs,
        "achieved_tflops": flops / (time_us * 1e-6) / 1e12,
        "bandwidth_share": achieved_gbs / spec.memory_bandwidth_gbs,
        "bound": "memory" if intensity < spec.ridge_flops_per_byte else "compute",
        "roofline_us": roofline_us,
    }


def _summarise(points: list[dict[str, Any]], spec: DeviceSpec, scope: str, trace: Trace
               ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for p in points:
        g = groups.setdefault((p["op"], str(p["shapes"])), {"op": p["op"], "shapes": p["shapes"], "calls": 0,
                                                             "time_us": 0.0, "bytes": 0.0, "flops": 0.0,
                                                             "roofline_us": 0.0})
        g["calls"] += 1
        for k in ("time_us", "bytes", "flops", "roofline_us"):
            g[k] += p[k]
    grouped = []
    for g in groups.values():
        g["achieved_gbs"] = g["bytes"] / (g["time_us"] * 1e-6) / 1e9
        g["bandwidth_share"] = g["achieved_gbs"] / spec.memory_bandwidth_gbs
        g["intensity"] = g["flops"] / g["bytes"]
        g["bound"] = "memory" if g["intensity"] < spec.ridge_flops_per_byte else "compute"
        g["left_on_table_us"] = max(0.0, g["time_us"] - g["roofline_us"])
        grouped.append(g)
    grouped.sort(key=lambda g: -g["time_us"])
    total = sum(p["time_us"] for p in points)
    memory_time = sum(p["time_us"] for p in points if p["bound"] == "memory")
    summary = {
        "device": spec.to_dict(), "scope": scope, "ops_modelled": len(points),
        "op_time_ms": round(total / 1000, 3),
        "memory_bound_share": round(memory_time / total, 4) if total else None,
        "achieved_gbs": round(sum(p["bytes"] for p in points) / (total * 1e-6) / 1e9, 3) if total else None,
    }
    replay = _graph_replay_kernels(trace)
    if replay["kernels"]:
        summary["graph_replay"] = {**replay, "note": (
            "kernels replayed from a CUDA/HIP graph carry no shapes (one launch, many kernels), so their "
            "bytes and FLOPs cannot be modelled from this trace; their time is listed instead")}
    elif not points and trace.has_device_events():
        summary["note"] = "no decode op carries record_shapes, so bytes and FLOPs cannot be modelled"
    return summary, grouped


def _graph_replay_kernels(trace: Trace) -> dict[str, Any]:
    dev = np.flatnonzero(trace.device_mask())
    launch = trace.launch_row_for(dev)
    graph_ids = trace.ids_matching(lambda s: "GraphLaunch" in s)
    replayed = dev[(launch >= 0) & np.isin(trace.name_id[np.maximum(launch, 0)], graph_ids)]
    per_name: dict[str, float] = {}
    for row in replayed:
        per_name[trace.name(row)] = per_name.get(trace.name(row), 0.0) + float(trace.dur[row])
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:8]
    return {"kernels": int(replayed.size), "kernel_ms": round(float(trace.dur[replayed].sum()) / 1000, 3),
            "launches": int(np.unique(launch[np.isin(dev, replayed)]).size),
            "top_kernels": [{"name": n[:160], "us": round(us, 1)} for n, us in top]}


def _findings(grouped: list[dict[str, Any]], spec: DeviceSpec, scope: str, steps: list[Step],
              step_time_us: float) -> list[Finding]:
    memory = [g for g in grouped if g["bound"] == "memory"]
    # Memory-bound ops that are a sliver of the step are not where its time goes.
    if not memory or sum(g["time_us"] for g in memory) < MIN_SHARE_OF_STEP * step_time_us:
        return []
    slow = [g for g in memory if g["bandwidth_share"] < LOW_BANDWIDTH_SHARE]
    mem_time = sum(g["time_us"] for g in memory)
    mem_bytes = sum(g["bytes"] for g in memory)
    achieved = mem_bytes / (mem_time * 1e-6) / 1e9
    left = sum(g["left_on_table_us"] for g in slow)
    share = achieved / spec.memory_bandwidth_gbs
    left_share = left / step_time_us if step_time_us else 0.0
    severity = "critical" if left_share >= 0.2 else "warning" if left_share >= 0.05 else "info"
    what = "decode op" if steps else "op"
    title = (f"{len(memory)} memory-bound {what} shape(s) in {scope} reach {achieved:.1f} GB/s, "
             f"{100 * share:.1f}% of {spec.name}'s {spec.memory_bandwidth_gbs:.0f} GB/s")
    if slow:
        title += f"; {len(slow)} leave {left / 1000:.2f} ms on the table"
    start = min((s.start_us for s in steps), default=0.0)
    end = max((s.end_us for s in steps), default=0.0)
    top = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in g.items()} for g in slow[:10] or memory[:10]]
    return [Finding(
        kind="bandwidth_bound_decode", severity=severity, cost_ms=left / 1000.0, start_us=start, end_us=end,
        title=title, request_ids=sorted({r for s in steps for r in s.request_ids})[:100],
        evidence={"device": spec.to_dict(), "scope": scope, "left_on_table_share_of_steps": round(left_share, 4), "memory_bound_time_ms": round(mem_time / 1000, 3),
                  "achieved_gbs": round(achieved, 3), "bandwidth_share": round(share, 4),
                  "ops_below_half_peak": len(slow), "top_ops": top},
    )]
