"""The decode steps' op time the bandwidth model could not count: outermost ops on the steps'
threads whose bytes their record_shapes args do not give (byte_models.py), less the modelled ops
inside them.

A dynamically quantised linear (``quantized::linear_dynamic``) holds its int8 weight in a packed
object the profiler records no shape for, and a custom kernel op (vLLM's, a fused one) is not in the
model: the bytes they move are in no figure. Where they hold much of the op time, what the modelled
ops add up to per step is a lower bound on a step's bytes, not its working set (it cannot be said to
fit in a cache), and the report says which ops were left out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from servprof.detect.steps import Step, step_index
from servprof.detect.threads import thread_groups
from servprof.trace.model import Trace, distinct, distinct_first_inverse

# From this share of the decode steps' op time, the bytes counted are not a step's whole traffic.
UNMODELLED_SHARE = 0.25
MAX_NAMED = 5
# Ops that move no data (views, allocations, dtype queries): nothing of a step's bytes is left out
# with them; their time is per-op overhead. (An op among them that copies, as reshape or contiguous
# of a strided tensor, does it in a modelled op inside: copy_, clone; so does to() when it converts,
# and to() to the dtype and device a tensor has returns it: a decode loop's many .to(dtype) calls,
# whose overhead on a busy CPU once held 13% of a demo's op time and tipped the share past the bar.)
NO_BYTES = frozenset({
    "aten::to", "aten::_to_copy", "aten::type_as",
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::slice",
    "aten::select", "aten::narrow", "aten::transpose", "aten::t", "aten::permute", "aten::expand", "aten::expand_as",
    "aten::unsqueeze", "aten::squeeze", "aten::flatten", "aten::unflatten", "aten::view_as", "aten::split",
    "aten::split_with_sizes", "aten::chunk", "aten::unbind", "aten::detach", "aten::alias", "aten::contiguous",
    "aten::lift_fresh", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::resize_",
    "aten::resolve_conj", "aten::resolve_neg", "aten::result_type", "aten::clone", "aten::numpy_T",
    "aten::_has_compatible_shallow_copy_type", "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense",
    "aten::set_", "aten::_nested_tensor_from_mask_left_aligned", "aten::broadcast_tensors",
})


def unmodelled_ops(trace: Trace, steps: list[Step], taken: np.ndarray, taken_time_us: np.ndarray,
                   op_time_us: Any) -> dict[str, Any]:
    """``taken``: the modelled ops counted (each once; none overlap on a thread), with their time
    (``taken_time_us``); ``op_time_us(rows)``: an op's time as the detector reads it (its device work
    on a GPU trace, its span on a CPU one). Returns the summary entry: the op time outside the
    model, its share of all the steps' op time, and the ops that hold the most of it."""
    if not steps:
        return {"op_time_ms": 0.0, "share_of_op_time": 0.0, "top_ops": []}
    # (Ops: "cpu_op"; "Operator" in 2021 Kineto's traces.)
    rows = np.flatnonzero(trace.mask_category("cpu_op", "Operator") & trace.complete() & (trace.stream < 0))
    on_threads = np.zeros(rows.shape, dtype=bool)
    for rank, tid in {(s.rank, s.tid) for s in steps}:
        on_threads |= (trace.tid[rows] == tid) & (trace.rank[rows] == rank)
    rows = rows[on_threads]
    rows = rows[step_index(steps, trace.rank[rows], trace.ts[rows]) >= 0]
    # Ops only ("aten::mm", "quantized::linear_dynamic", "vllm::unified_attention"), not ranges
    # recorded in the same category ("servprof:decode_step|...", a record_function's name).
    rows = rows[trace.has_id(trace.name_id[rows], trace.ids_matching(lambda name: "::" in name,
                                                                     distinct(trace.name_id[rows])))]
    outer = _outermost(trace, rows)
    outer_time = np.nan_to_num(op_time_us(outer))
    # Each counted op's time comes off the outermost op holding it (itself, when it is outermost).
    holder = _holders(trace, outer, taken)
    left = outer_time.copy()
    inside = holder >= 0
    np.add.at(left, holder[inside], -np.nan_to_num(taken_time_us[inside]))
    left = np.maximum(left, 0.0)
    left[trace.has_id(trace.name_id[outer], trace.ids_matching(NO_BYTES.__contains__, distinct(trace.name_id[outer])))] = 0.0
    total = float(outer_time.sum())
    unmodelled = float(left.sum())
    names, _first, which = distinct_first_inverse(trace.name_id[outer])
    by_name = np.bincount(which, weights=left, minlength=names.size)
    calls = np.bincount(which, weights=(left > 0).astype(np.float64), minlength=names.size)
    order = np.argsort(-by_name, kind="stable")[:MAX_NAMED]
    return {
        "op_time_ms": round(unmodelled / 1000, 3),
        "share_of_op_time": round(unmodelled / total, 4) if total > 0 else 0.0,
        "top_ops": [{"name": trace.names[int(names[i])], "ms": round(float(by_name[i]) / 1000, 3),
                     "calls": int(calls[i])} for i in order.tolist() if by_name[i] > 0],
    }


def incomplete(entry: dict[str, Any]) -> bool:
    """Too much of the steps' op time is outside the model for its bytes to be a step's traffic."""
    return entry["share_of_op_time"] >= UNMODELLED_SHARE


def describe(entry: dict[str, Any]) -> str:
    """"quantized::linear_dynamic (20.1 ms, 448 calls), aten::cat (3.2 ms, 64 calls)"."""
    return ", ".join(f"{o['name'][:80]} ({o['ms']:.1f} ms, {o['calls']} calls)" for o in entry["top_ops"][:3])


def missing_entry(entry: dict[str, Any]) -> dict[str, str]:
    return {"what": "op bytes", "message": (
        f"{100 * entry['share_of_op_time']:.0f}% of the decode steps' op time is in ops whose bytes servprof cannot "
        f"model from their recorded args ({describe(entry)}): the profiler records no shape for a quantised layer's "
        "packed weight nor an element type for a list of tensors (torch.cat's, when no op after it reads its "
        "result), and custom kernel ops are not in "
        "servprof's op models; the bandwidth figures count the other ops only, so whether those ops are bound by "
        "memory bandwidth is not judged (record_shapes=True gives the shapes of the others).")}


def _outermost(trace: Trace, rows: np.ndarray) -> np.ndarray:
    """The rows not inside another of them on their thread, ordered by thread, then start."""
    if not rows.size:
        return rows
    kept = []
    threads, thread_of = thread_groups(trace.rank[rows], trace.pid[rows], trace.tid[rows])
    for number in range(len(threads)):
        mine = rows[thread_of == number]
        mine = mine[np.lexsort((-trace.dur[mine], trace.ts[mine]))]
        end = trace.ts[mine] + trace.dur[mine]
        reach = np.maximum.accumulate(end)  # the furthest end of the ops begun so far on the thread
        keep = np.ones(mine.size, dtype=bool)
        keep[1:] = trace.ts[mine[1:]] >= reach[:-1]
        kept.append(mine[keep])
    return np.concatenate(kept)


def _holders(trace: Trace, outer: np.ndarray, taken: np.ndarray) -> np.ndarray:
    """Per taken op, the index in ``outer`` (ordered by thread, then start) of the outermost op that
    holds it (-1: none)."""
    out = np.full(taken.shape, -1, dtype=np.int64)
    if not outer.size or not taken.size:
        return out
    both = np.concatenate((outer, taken))
    _threads, thread_of = thread_groups(trace.rank[both], trace.pid[both], trace.tid[both])
    outer_thread, taken_thread = thread_of[:outer.size], thread_of[outer.size:]
    for number in set(outer_thread.tolist()) & set(taken_thread.tolist()):
        mine = np.flatnonzero(outer_thread == number)
        at = np.flatnonzero(taken_thread == number)
        i = np.searchsorted(trace.ts[outer[mine]], trace.ts[taken[at]], side="right") - 1
        j = mine[np.maximum(i, 0)]
        ok = (i >= 0) & (trace.ts[taken[at]] + trace.dur[taken[at]] <= trace.ts[outer[j]] + trace.dur[outer[j]])
        out[at[ok]] = j[ok]
    return out
