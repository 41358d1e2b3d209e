"""Decode ops bound by memory bandwidth, and how much bandwidth they leave unused.

Per op inside decode steps (the whole trace when none is found), FLOPs and the minimum
bytes it must move come from its record_shapes args (byte_models.py). Ops that wrap
others are modelled once, at the outermost level that can be (aten::linear, not the
addmm inside it). Time is the device kernels the op launched (on its own thread, inside
its span) when the trace has device events, else the op's host duration. The op's
arithmetic intensity against the device's ridge point says whether memory bounds it;
a memory-bound op's GB/s against the peak says what it leaves on the table.

A GB/s above the device's peak is physically impossible: such ops are never findings;
the summary lists them with the reason (the peak is not this device's, or the model or
the op's time is wrong). Severity is the share of step time (or of the trace's span,
without steps) left on the table, and at most `info` when the peak was assumed rather
than identified or measured. A light trace (tier.py) has no ops, so nothing is judged: it
says a deep window with shapes is needed (kernels alone carry no bytes).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec
import numpy as np
import orjson

from servprof.detect.bandwidth_fix import fix_text
from servprof.detect.bandwidth_points import PointTally, group_key, op_floor_us
from servprof.detect.byte_models import LISTS, MODELLED, op_cost, op_family
from servprof.detect.devices import (
    BASIS_ASSUMED,
    BASIS_UNKNOWN,
    MIB,
    MIN_GPU_RIDGE,
    DeviceSpec,
    device_warnings,
    resolve_device,
    trace_device_properties,
    with_mismatch,
)
from servprof.detect.finding import WHOLE_TRACE, Finding, severity_for_share
from servprof.detect.list_ops import ListTypes, list_cost, list_output_dims, mark_growing
from servprof.detect.name_scan import ids_holding
from servprof.detect.op_time import device_time
from servprof.detect.steps import Step, step_index, time_judged_us
from servprof.detect.tier import BANDWIDTH_NOTE, is_light
from servprof.detect.unmodelled_ops import describe, incomplete, missing_entry, unmodelled_ops
from servprof.detect.unrecorded_device import unrecorded_device
from servprof.trace.model import Trace, distinct

MIN_SHARE_OF_STEP = 0.05  # memory-bound ops under this share of the time judged are not where it goes
LOW_BANDWIDTH_SHARE = 0.5  # memory-bound ops reaching under half of peak bandwidth leave it on the table
MAX_TOP_OPS = 10


def detect_bandwidth_bound(trace: Trace, steps: list[Step], device: str | None
                           ) -> tuple[list[Finding], dict[str, Any], list[dict[str, Any]]]:
    unrecorded = unrecorded_device(trace)
    if unrecorded is not None:  # (host times are dispatch, not the ops' work: nothing to judge)
        summary, _ = _summarise(PointTally(), DeviceSpec(unrecorded.device, None, None, unrecorded.message(),
                                                         basis=BASIS_UNKNOWN), WHOLE_TRACE, trace, [])
        summary.update(note=f"no op is judged: {unrecorded.message()}", missing=[unrecorded.missing_entry()])
        return [], summary, []
    properties = trace_device_properties(trace.metadata)
    on_device = trace.has_device_events()
    spec = resolve_device(device, properties, on_device)
    warnings, contradicted = device_warnings(device, spec, properties, on_device)
    if contradicted:
        spec = with_mismatch(spec)
    # (Only host events' names are tried: the rows kept are host events, and kernel names are many.)
    rows = np.flatnonzero(trace.mask_name(MODELLED.__contains__, trace.host_names()) & trace.complete()
                          & (trace.stream < 0))
    taken, costs = _outermost_modelled(trace, rows)
    decode_steps = [s for s in steps if s.kind == "decode"]
    scope = "decode steps" if decode_steps else WHOLE_TRACE
    step_of = np.zeros(taken.shape, dtype=np.int64)
    if decode_steps and taken.size:
        step_of = step_index(decode_steps, trace.rank[taken], trace.ts[taken])
        inside = step_of >= 0
        taken, step_of = taken[inside], step_of[inside]
        costs = [c for c, keep in zip(costs, inside.tolist(), strict=True) if keep]
    times = device_time(trace, taken) if on_device else trace.dur[taken].astype(np.float64)
    points = PointTally()
    step_bytes: dict[int, float] = {}
    # What a point owes to its op and shapes alone, worked out once per OpCost (decode repeats the
    # same few shapes thousands of times); the costs list keeps each OpCost alive, so ids are unique.
    shared: dict[int, _Shared] = {}
    for row, cost, time_us, step in zip(taken.tolist(), costs, times.tolist(), step_of.tolist(), strict=True):
        if time_us >= 1e-3:  # no kernel (NaN), or under 1 ns: no rate to compute
            same = shared.get(id(cost))
            if same is None:
                same = shared[id(cost)] = _shared(trace.name(row), cost, spec)
            points.add(_point(same, cost, time_us, spec), same.group_key)
            step_bytes[step] = step_bytes.get(step, 0.0) + cost.bytes
    time_judged = time_judged_us(trace, decode_steps, on_device)  # no decode steps: the whole trace's span
    summary, grouped = _summarise(points, spec, scope, trace, warnings)
    mark_growing(grouped, [cost.shapes for cost in costs if cost.family == "join"])
    summary["time_judged_ms"] = round(time_judged / 1000, 3)
    # Every byte the ops of one step move, re-reads included: more than the data it touches.
    working_set = max(step_bytes.values(), default=0.0)
    summary["bytes_per_step_max"] = working_set
    left_out = unmodelled_ops(trace, decode_steps, taken, times,
                              lambda rows: device_time(trace, rows) if on_device else trace.dur[rows].astype(np.float64))
    summary["unmodelled"] = left_out
    if incomplete(left_out) and taken.size:  # (none modelled: the summary already says what is missing)
        summary.setdefault("missing", []).append(missing_entry(left_out))
    findings = _findings(grouped, spec, scope, decode_steps, time_judged, working_set, left_out)
    return findings, summary, points.kept


class OpCost(NamedTuple):
    """What one modelled op moves and computes, and the shapes it was modelled from (shared by the
    ops of one shape: decode repeats the same shapes every step)."""

    flops: float
    bytes: float
    shapes: Any
    types: Any
    family: str  # byte_models.op_family: the remedy's kind


class _ShapeArgs(msgspec.Struct, gc=False):
    """The args an op's cost is modelled from, as their JSON text (which keys the shapes' cache)."""

    dims: msgspec.Raw = msgspec.field(default=msgspec.Raw(b"null"), name="Input Dims")
    types: msgspec.Raw = msgspec.field(default=msgspec.Raw(b"null"), name="Input type")
    concrete: msgspec.Raw = msgspec.field(default=msgspec.Raw(b"null"), name="Concrete Inputs")
    strides: msgspec.Raw = msgspec.field(default=msgspec.Raw(b"null"), name="Input Strides")


_SHAPE_ARGS = msgspec.json.Decoder(list[_ShapeArgs])
ShapeValues = tuple[Any, Any, Any, Any]  # Input Dims, Input type, Concrete Inputs, Input Strides


def _outermost_modelled(trace: Trace, rows: np.ndarray) -> tuple[np.ndarray, list[OpCost]]:
    """The modelled ops to count, each once: per thread, an op inside one already counted is part of
    it (addmm's bias copy_, to -> _to_copy -> copy_); an op that cannot be modelled leaves its
    children to be counted instead."""
    order = np.lexsort((-trace.dur[rows], trace.ts[rows], trace.tid[rows], trace.pid[rows], trace.rank[rows]))
    rows = rows[order]
    cache: dict[Any, OpCost | None] = {}
    taken: list[int] = []
    costs: list[OpCost] = []
    ends = (trace.ts[rows] + trace.dur[rows]).tolist()
    keys = zip(trace.rank[rows].tolist(), trace.pid[rows].tolist(), trace.tid[rows].tolist(), strict=True)
    names = trace.name_id[rows].tolist()
    covered: dict[tuple[int, int, int], float] = {}
    list_ids = {trace.string_id(name) for name in LISTS} - {-1}
    list_results: dict[Any, tuple[ShapeValues, list[int]] | None] = {}
    list_types = ListTypes(trace, rows[trace.has_id(trace.name_id[rows], list(list_ids))] if list_ids
                           else np.zeros(0, dtype=np.int64))
    # The four shape args of every op, as text: decode repeats a few shapes thousands of times, so
    # each distinct text is decoded once (an op's whole args, decoded, took most of this pass).
    fields_of = trace.arg_fields_each(rows, _SHAPE_ARGS)
    for row, name_id, start, end, thread, fields in zip(rows.tolist(), names, trace.ts[rows].tolist(), ends, keys,
                                                        fields_of, strict=True):
        if start < covered.get(thread, -np.inf):
            continue
        if fields is not None:
            shape_key: Any = (name_id, b"\0".join((fields.dims, fields.types, fields.concrete, fields.strides)))
            if shape_key not in cache:
                cache[shape_key] = _op_cost(trace.names[name_id], _shape_values(fields))
        else:  # args held as values, or not objects: read in full
            args = trace.args_once(row)  # (read once per op: kept, every op's args would stay in memory)
            values = (args.get("Input Dims"), args.get("Input type"), args.get("Concrete Inputs"),
                      args.get("Input Strides"))
            shape_key = orjson.dumps([trace.names[name_id], *values], default=str)
            if shape_key not in cache:
                cache[shape_key] = _op_cost(trace.names[name_id], values)
        cost = cache[shape_key]
        if cost is None and name_id in list_ids:  # cat / stack: their parts' type from the op reading them
            result = list_results.get(shape_key, False)
            if result is False:
                result = list_results[shape_key] = _list_result(trace.names[name_id], fields, shape_key)
            cost = _list_op_cost(result, row, list_types) if result is not None else None
        if cost is not None:
            taken.append(row)
            costs.append(cost)
            covered[thread] = end
    return np.array(taken, dtype=np.int64), costs


def _shape_values(fields: _ShapeArgs) -> ShapeValues:
    """The four args decoded; all None when one is not JSON orjson reads (as a row whose args do
    not decode has none)."""
    try:
        return tuple(orjson.loads(memoryview(text))  # type: ignore[return-value]  # (orjson reads no Raw)
                     for text in (fields.dims, fields.types, fields.concrete, fields.strides))
    except orjson.JSONDecodeError:
        return (None, None, None, None)


def _op_cost(name: str, values: ShapeValues) -> OpCost | None:
    modelled = op_cost(name, *values)
    return None if modelled is None else OpCost(*modelled, values[0], values[1], op_family(name, values[0], values[2]))


def _list_result(name: str, fields: _ShapeArgs | None, shape_key: Any) -> tuple[ShapeValues, list[int]] | None:
    """A cat / stack's args and result dims, when its parts are a recorded list of tensors."""
    values = _shape_values(fields) if fields is not None else tuple(orjson.loads(shape_key)[1:])
    dims, types, concrete, _ = values
    if not isinstance(types, list) or not types or types[0] != "TensorList":
        return None
    result = list_output_dims(name, dims, concrete)
    return None if result is None else (values, result)  # type: ignore[return-value]


def _list_op_cost(list_result: tuple[ShapeValues, list[int]], row: int, list_types: ListTypes) -> OpCost | None:
    """A cat / stack of a recorded list of tensors, at the element type of the op that reads its
    result (list_ops.py); None when no op after it says."""
    (dims, types, _, _), result = list_result
    type_name = list_types.element_type(row, result)
    modelled = list_cost(result, type_name) if type_name is not None else None
    if modelled is None:
        return None
    # The type shown says where it came from: the profiler recorded none.
    return OpCost(*modelled, dims, [f"TensorList[{type_name}]", *types[1:]], "join")  # (mark_growing: growth)


class _Shared(NamedTuple):
    """A point's fields that depend on its op and shapes only."""

    op: str
    intensity: float
    bound: str
    roofline_us: float | None
    group_key: str


def _shared(op: str, cost: OpCost, spec: DeviceSpec) -> _Shared:
    intensity = cost.flops / cost.bytes
    return _Shared(op, intensity, _bound(intensity, spec), _roofline_us(cost.flops, cost.bytes, spec),
                   group_key(op, cost.shapes, cost.types))


def _point(same: _Shared, cost: OpCost, time_us: float, spec: DeviceSpec) -> dict[str, Any]:
    flops, nbytes = cost.flops, cost.bytes
    achieved_gbs = nbytes / (time_us * 1e-6) / 1e9
    share = achieved_gbs / spec.memory_bandwidth_gbs if spec.memory_bandwidth_gbs else None
    above = share is not None and share > 1.0
    return {
        "op": same.op, "family": cost.family, "shapes": cost.shapes, "types": cost.types,
        "flops": flops, "bytes": nbytes, "time_us": time_us, "intensity": same.intensity,
        "achieved_gbs": achieved_gbs, "achieved_tflops": flops / (time_us * 1e-6) / 1e12, "bandwidth_share": share,
        "bound": same.bound, "roofline_us": same.roofline_us, "above_peak": above,
        "cache_may_serve": above and _cache_may_serve(nbytes, time_us, spec),
    }


def _cache_may_serve(nbytes: float, time_us: float, spec: DeviceSpec) -> bool:
    """Whether the device's last-level cache can account for an op measured faster than the DRAM
    peak: what DRAM at peak could not have moved in its time fits in the cache (its data was there
    before it ran: the tensor the op before it wrote, a weight read twice)."""
    peak = spec.memory_bandwidth_gbs
    return bool(spec.cache_bytes and peak) and nbytes - peak * 1e9 * time_us * 1e-6 <= spec.cache_bytes  # type: ignore[operator]


def _bound(intensity: float, spec: DeviceSpec) -> str:
    ridge = spec.ridge_flops_per_byte
    if ridge is None:  # FLOP/s unknown: below every known GPU's ridge is memory-bound on any GPU
        return "memory" if spec.kind == "gpu" and intensity < MIN_GPU_RIDGE else "unknown"
    return "memory" if intensity < ridge else "compute"


def _roofline_us(flops: float, nbytes: float, spec: DeviceSpec) -> float | None:
    if not spec.memory_bandwidth_gbs:
        return None
    compute_s = flops / (spec.peak_tflops * 1e12) if spec.peak_tflops else 0.0
    return max(compute_s, nbytes / (spec.memory_bandwidth_gbs * 1e9)) * 1e6


def _above_peak_summary(points: PointTally, spec: DeviceSpec) -> dict[str, Any] | None:
    if not points.above_count:
        return None
    cached = points.above_cache_count
    if not spec.identified:
        error, why = "device", (f"the peak used ({spec.memory_bandwidth_gbs:g} GB/s, {spec.basis}) is not this "
                                f"device's: {spec.source}")
    elif spec.kind == "cpu":
        error, why = "model", ("the ops' data is small enough to stay in the CPU's caches, which are faster than "
                               "the DRAM bandwidth `servprof calibrate` measured; the roofline does not model caches")
    elif cached == points.above_count:
        error, why = "cache", (f"each moved no more than DRAM at peak could in its time plus what fits in the "
                               f"device's {spec.cache_bytes / MIB:g} MiB last-level cache (L2): their data may have "  # type: ignore[operator]
                               "been there already (a tensor the op before wrote, one read twice); the roofline "
                               "models DRAM only")
    else:
        beyond = (f" (more than DRAM at peak and the device's {spec.cache_bytes / MIB:g} MiB cache together could "
                  "have moved)" if spec.cache_bytes else " (or their data was already in the device's cache)")
        error, why = "model", f"servprof's byte model, or the time it gave these ops, is wrong for them{beyond}; " \
                              "please report the op and shapes"
    return {"ops": points.above_count, "cache_may_serve": cached, "error": error, "why": why,
            "examples": [{"op": p["op"], "shapes": p["shapes"], "types": p["types"], "bytes": p["bytes"],
                          "time_us": round(p["time_us"], 3), "achieved_gbs": round(p["achieved_gbs"], 1)}
                         for p in points.worst_above()],
            "note": "left out of every finding: no op moves bytes faster than the device's peak"}


def _summarise(points: PointTally, spec: DeviceSpec, scope: str, trace: Trace, warnings: list[str]
               ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    groups = points.groups  # the judged points (those not above peak) by op, shapes and types
    grouped = []
    for g in groups.values():
        g["achieved_gbs"] = g["bytes"] / (g["time_us"] * 1e-6) / 1e9
        g["bandwidth_share"] = g["achieved_gbs"] / spec.memory_bandwidth_gbs if spec.memory_bandwidth_gbs else None
        g["intensity"] = g["flops"] / g["bytes"]
        g["bound"] = _bound(g["intensity"], spec)
        g["left_on_table_us"] = max(0.0, g["time_us"] - g["roofline_us"]) if spec.memory_bandwidth_gbs else 0.0
        grouped.append(g)
    floor_us = op_floor_us(points.judged_times)
    for g in grouped:
        g["overhead_bound"] = g["roofline_us"] / g["calls"] < floor_us
    grouped.sort(key=lambda g: -g["time_us"])
    total = points.time_us
    summary: dict[str, Any] = {
        "device": spec.to_dict(), "scope": scope, "ops_modelled": points.count,
        "op_time_ms": round(total / 1000, 3),
        "memory_bound_share": round(points.memory_time_us / total, 4) if total else None,
        "achieved_gbs": round(points.bytes / (total * 1e-6) / 1e9, 3) if total else None,
        "op_floor_us": round(floor_us, 3),
    }
    if warnings:
        summary["warnings"] = warnings
    above = _above_peak_summary(points, spec)
    if above:
        summary["above_peak"] = above
    # Said out loud where someone can act on it: a peak the trace contradicts, a model error on a
    # GPU that its cache cannot account for. An assumed peak is already said (summary["missing"]); caches are
    # no one's error.
    if above and spec.basis != BASIS_ASSUMED and spec.kind != "cpu" and above["error"] != "cache":
        unexplained = above["ops"] - above["cache_may_serve"] if above["error"] == "model" else above["ops"]
        summary.setdefault("warnings", []).append(
            f"{unexplained} op call(s) measured faster than {spec.name}'s {spec.memory_bandwidth_gbs:g} GB/s peak "
            f"were left out of the findings: a {above['error']} error ({above['why']})")
    if not spec.memory_bandwidth_gbs:
        summary["note"] = f"peak bandwidth unknown, so no op is judged: {spec.source}"
    replay = _graph_replay_kernels(trace)
    if replay["kernels"]:
        summary["graph_replay"] = {**replay, "note": (
            "kernels replayed from a CUDA/HIP graph carry no shapes (one launch, many kernels), so their "
            "bytes and FLOPs cannot be modelled from this trace; their time is listed instead")}
    elif not points.count and "note" not in summary:
        summary["note"] = ("no op in scope carries record_shapes args servprof can model, so bytes and FLOPs "
                           "cannot be computed (profile with record_shapes=True, SERVPROF_RECORD_SHAPES=1)")
    light = is_light(trace)
    if light and not points.count:
        summary["note"] = BANDWIDTH_NOTE
    # (A light trace's own entry, tier.light_missing, says what it lacks, bandwidth included.)
    summary["missing"] = [] if light else _missing(points, spec, bool(replay["kernels"]))
    return summary, grouped


def _missing(points: PointTally, spec: DeviceSpec, replayed: bool) -> list[dict[str, str]]:
    """What this trace could not show about bandwidth, and how to get it (summary["missing"])."""
    if not points.count and not replayed:
        return [{"what": "op shapes", "message": (
            "No op in scope carries record_shapes args, so the bytes each op moves and its bandwidth cannot be "
            "computed: profile with record_shapes=True (servprof sessions: SERVPROF_RECORD_SHAPES=1).")}]
    if not spec.memory_bandwidth_gbs:
        return [{"what": "device peak", "message": f"No op was judged against a peak: {spec.source}."}]
    if spec.basis == BASIS_ASSUMED and points.count:
        return [{"what": "device peak", "message": (
            f"Ops were judged against an assumed peak ({spec.name}, {spec.memory_bandwidth_gbs:g} GB/s), so "
            "bandwidth findings are at most info: run `servprof calibrate` on the machine that ran the trace "
            "(or pass --device) for a measured one.")}]
    return []


def _graph_replay_kernels(trace: Trace) -> dict[str, Any]:
    dev = np.flatnonzero(trace.device_mask())
    launch = trace.launch_row_for(dev)
    graph_ids = ids_holding(trace, ("GraphLaunch",), lambda s: True)
    if not graph_ids.size:  # no graph launch: nothing replayed (what the steps below give, without them)
        return {"kernels": 0, "kernel_ms": 0.0, "launches": 0, "top_kernels": []}
    is_replayed = (launch >= 0) & trace.has_id(trace.name_id[np.maximum(launch, 0)], graph_ids)
    replayed = dev[is_replayed]
    # Time per kernel name, summed in order; the most first, ties in order of appearance.
    names, first, which = np.unique(trace.name_id[replayed], return_index=True, return_inverse=True)
    totals = np.bincount(which, weights=trace.dur[replayed], minlength=names.size)
    top = [(trace.names[int(names[i])], float(totals[i])) for i in np.lexsort((first, -totals))[:8]]
    return {"kernels": int(replayed.size), "kernel_ms": round(float(trace.dur[replayed].sum()) / 1000, 3),
            "launches": int(distinct(launch[is_replayed]).size),
            "top_kernels": [{"name": n[:160], "us": round(us, 1)} for n, us in top]}


def _fits_in_cache(spec: DeviceSpec, working_set: float, left_out: dict[str, Any]) -> bool:
    """All the bytes one step's ops move fit in the device's last-level cache (where it is measured),
    and those counted are most of them (ops left out of the model hold under UNMODELLED_SHARE)."""
    return bool(spec.cache_bytes and 0 < working_set <= spec.cache_bytes) and not incomplete(left_out)


def _cap_reason(spec: DeviceSpec, working_set: float, left_out: dict[str, Any]) -> str | None:
    """Why this finding cannot be more than info, if it cannot."""
    if not spec.identified:
        return (f"the peak was not identified or measured ({spec.basis}: {spec.source}); run `servprof calibrate` "
                "on this machine, or pass --device")
    if _fits_in_cache(spec, working_set, left_out):
        return (f"all the bytes one step's ops move ({working_set / 1e6:.1f} MB, re-reads included) fit in this "
                f"device's {spec.cache_bytes / 1e6:.0f} MB last-level cache, so memory bandwidth does not bound "
                "this decode: its ops' time is per-op overhead and compute, not DRAM traffic")
    return None


def _findings(grouped: list[dict[str, Any]], spec: DeviceSpec, scope: str, steps: list[Step],
              time_judged_us: float, working_set: float, left_out: dict[str, Any]) -> list[Finding]:
    memory = [g for g in grouped if g["bound"] == "memory"]
    if not spec.memory_bandwidth_gbs or not memory or time_judged_us <= 0:
        return []
    mem_time = sum(g["time_us"] for g in memory)
    if mem_time < MIN_SHARE_OF_STEP * time_judged_us:
        return []
    below = sorted((g for g in memory if g["bandwidth_share"] < LOW_BANDWIDTH_SHARE),
                   key=lambda g: -g["left_on_table_us"])
    # An op whose bytes take less time at peak than the shortest ops of this trace take at all is
    # bounded by per-op overhead, not bandwidth: its time "left" is not a bandwidth finding's.
    slow = [g for g in below if not g["overhead_bound"]]
    overhead = [g for g in below if g["overhead_bound"]]
    achieved = sum(g["bytes"] for g in memory) / (mem_time * 1e-6) / 1e9
    left = sum(g["left_on_table_us"] for g in slow)
    overhead_left = sum(g["left_on_table_us"] for g in overhead)
    share = achieved / spec.memory_bandwidth_gbs
    left_share = left / time_judged_us
    severity = severity_for_share(left_share, (left if slow else overhead_left) / 1000.0)
    capped = _cap_reason(spec, working_set, left_out)
    if not slow and overhead and not capped:
        capped = ("the ops below peak move too little per call to be bandwidth-bound (their bytes take less time "
                  "at peak than the shortest ops of this trace take at all): per-op overhead, not memory, bounds them")
    if capped:
        severity = "info"
    what = "decode op" if steps else "op"
    where = scope if steps else "the whole trace (no decode steps found)"
    peak = f"{spec.name}'s {spec.memory_bandwidth_gbs:g} GB/s"
    if spec.basis == BASIS_ASSUMED:
        peak += " (assumed)"
    title = (f"{len(memory)} memory-bound {what} shape(s) in {where} reach {achieved:.1f} GB/s, "
             f"{100 * share:.1f}% of {peak}")
    judged = "step time" if steps else "the trace span"
    if slow:
        title += (f"; {len(slow)} leave {left / 1000:.2f} ms on the table ({100 * left_share:.1f}% of "
                  f"{judged})")
    elif overhead:
        title += (f"; {len(overhead)} move too little per call to be bandwidth-bound: per-op overhead holds "
                  f"{overhead_left / 1000:.2f} ms ({100 * overhead_left / time_judged_us:.1f}% of {judged})")
    start = min((s.start_us for s in steps), default=0.0)
    end = max((s.end_us for s in steps), default=0.0)
    shown = slow or overhead or memory
    top = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in g.items()} for g in shown[:MAX_TOP_OPS]]
    evidence = {"device": spec.to_dict(), "scope": scope, "left_on_table_share": round(left_share, 4),
                "time_judged_ms": round(time_judged_us / 1000, 3), "memory_bound_time_ms": round(mem_time / 1000, 3),
                "achieved_gbs": round(achieved, 3), "bandwidth_share": round(share, 4),
                "ops_below_half_peak": len(slow), "overhead_bound_ops": len(overhead),
                "overhead_bound_left_ms": round(overhead_left / 1000, 3), "top_ops": top}
    if capped:
        evidence["severity_capped"] = f"at most info: {capped}"
    if incomplete(left_out):
        evidence["unmodelled"] = left_out
    return [Finding(
        kind="bandwidth_bound_decode", severity=severity, cost_ms=(left if slow else overhead_left) / 1000.0,
        start_us=start, end_us=end, title=title, request_ids=sorted({r for s in steps for r in s.request_ids}),
        evidence=evidence,
        fix=fix_text(shown, spec, share, capped, in_cache=_fits_in_cache(spec, working_set, left_out),
                     decode=scope != WHOLE_TRACE)
        + (f" These figures leave out {100 * left_out['share_of_op_time']:.0f}% of the steps' op time, in ops whose bytes "
           f"are not modelled ({describe(left_out)}): judge those from their kernels' own profile (Nsight Compute on "
           "a GPU)." if incomplete(left_out) else ""),
    )]

