"""A decode loop that reads a device tensor on the host every step.

``.item()`` records ``aten::item`` / ``aten::_local_scalar_dense``; ``.tolist()`` and
``.numpy()`` record a top-level ``aten::resolve_neg`` (after ``aten::resolve_conj``);
with ``with_stack`` the Python call itself shows; on a GPU the copy is a device-to-host
memcpy. On a GPU such a read right after a step waits for the whole step (a device sync
per step: the device idles while the host reads and launches the next step); on a CPU
trace it costs next to nothing, but it is the same loop, and it is named with what it
costs where it was measured.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from servprof.detect.cause_texts import CAUSES, cause_fix
from servprof.detect.finding import Finding, severity_for_share
from servprof.detect.host_stacks import _device_to_host_launches
from servprof.detect.name_guard import Guarded
from servprof.detect.nesting import start_order
from servprof.detect.step_forms import Step, outermost
from servprof.detect.unrecorded_device import unrecorded_device
from servprof.trace.model import Trace, distinct, distinct_first_inverse, median

READ_OPS = Guarded(re.compile(r"^aten::(item|_local_scalar_dense)$|<method '(tolist|item|cpu|numpy)' of"
                              r"|<built-in method (tolist|item|cpu|numpy) of"), "aten::", "method ")
TOLIST_SIGNATURE = "aten::resolve_neg"  # what .tolist() / .numpy() leave when not nested in another op
MIN_STEPS = 3
# Ops whose weights make a model's forward: a read with one of them after it in its step is a read
# inside the forward (data-dependent control flow), not the sampled token read after the step.
FORWARD_OPS = ("aten::linear", "aten::mm", "aten::addmm", "aten::matmul", "aten::bmm")
IN_FORWARD_SHARE = 0.5  # of a step's reads, for the fix to be the forward's
MIN_SHARE_OF_STEPS = 0.8  # "every step": at least this share of the decode steps read something


def _label(name: str) -> str:
    if name.startswith("aten::item") or name.startswith("aten::_local_scalar_dense") or "item" in name:
        return ".item()"
    if name == TOLIST_SIGNATURE or "tolist" in name or "numpy" in name:
        return ".tolist() / .numpy()"
    if "cpu" in name:
        return ".cpu()"
    return "device-to-host copy"


def _labels(trace: Trace, rows: np.ndarray) -> list[tuple[str, int]]:
    """(label, calls) per name read, in order of each name's first read."""
    names, first, inverse = distinct_first_inverse(trace.name_id[rows])
    calls = np.bincount(inverse, minlength=names.size)
    return [(_label(trace.names[int(names[i])]), int(calls[i])) for i in np.argsort(first)]


def read_rows(trace: Trace) -> np.ndarray:
    """Outermost host reads of device values, in time order."""
    base = trace.complete() & (trace.stream < 0)
    named = np.flatnonzero(base & trace.mask_name(lambda s: READ_OPS.search(s) is not None, trace.host_names()))
    d2h = _device_to_host_launches(trace)
    tolist = _top_level(trace, np.flatnonzero(base & (trace.name_id == trace.string_id(TOLIST_SIGNATURE))))
    rows = distinct(np.concatenate([named, d2h, tolist]).astype(np.int64))
    rows = rows[np.argsort(trace.ts[rows], kind="stable")]
    return outermost(trace, rows)


def reads_in_forward(summary: dict[str, Any]) -> bool:
    """Whether detect_host_reads' summary holds mostly reads inside the forward (the fix is the forward's)."""
    return summary["in_forward_per_step"] >= IN_FORWARD_SHARE * summary["reads_per_step"]


def _forward_rows(trace: Trace) -> np.ndarray:
    """Host rows of the ops a forward's layers run (FORWARD_OPS)."""
    named = np.zeros(trace.name_id.shape, dtype=bool)
    for name in FORWARD_OPS:
        named |= trace.name_id == trace.string_id(name)  # (-1, no such op: no row)
    return np.flatnonzero(named & trace.complete() & (trace.stream < 0))


def _top_level(trace: Trace, rows: np.ndarray) -> np.ndarray:
    """The rows that no other op (an ATen op, not an annotation) on their thread contains."""
    if rows.size == 0:
        return rows
    ops = np.flatnonzero(trace.complete() & trace.mask_category("cpu_op") & (trace.stream < 0)
                         & ~trace.mask_name(lambda s: s.startswith("servprof:")))
    keep = []
    for key in {(int(r), int(t)) for r, t in zip(trace.rank[rows].tolist(), trace.tid[rows].tolist(), strict=True)}:
        wanted = rows[(trace.rank[rows] == key[0]) & (trace.tid[rows] == key[1])]
        mine = distinct(np.concatenate([ops[(trace.rank[ops] == key[0]) & (trace.tid[ops] == key[1])], wanted]))
        mine = mine[start_order(trace.ts[mine], trace.dur[mine])]
        prior_end = np.concatenate([[-np.inf], np.maximum.accumulate(trace.ts[mine] + trace.dur[mine])[:-1]])
        by_row = np.argsort(mine)
        position = by_row[np.searchsorted(mine[by_row], wanted)]
        keep.append(wanted[prior_end[position] < trace.ts[wanted] + trace.dur[wanted]])
    return np.concatenate(keep).astype(np.int64)


def detect_host_reads(trace: Trace, steps: list[Step], span_us: float) -> tuple[Finding | None, dict[str, Any]]:
    """(a finding for CPU traces, summary). On device traces the same reads show up as sync gaps
    with their measured device idle (decode_gap, cause synchronize); the summary gives the count
    per step for both."""
    decode = [s for s in steps if s.kind == "decode"] or [s for s in steps if s.kind in ("step", "mixed")]
    if len(decode) < MIN_STEPS:
        return None, {}
    rows = read_rows(trace)
    counts = np.zeros(len(decode), dtype=np.int64)
    in_forward = np.zeros(len(decode), dtype=np.int64)
    spent = np.zeros(len(decode))
    labels: dict[str, int] = {}
    forward = _forward_rows(trace)
    for tid in {s.tid for s in decode}:
        mine = sorted((i for i, s in enumerate(decode) if s.tid == tid), key=lambda i: decode[i].start_us)
        starts = np.array([decode[i].start_us for i in mine])
        # A step's reads: inside it or after it, before the next step of its thread begins.
        ends = np.append(starts[1:], decode[mine[-1]].end_us + median([decode[i].dur_us for i in mine]))
        sel = rows[(trace.tid[rows] == tid) & (trace.rank[rows] == decode[mine[0]].rank)]
        pos = np.searchsorted(starts, trace.ts[sel], side="right") - 1
        ok = (pos >= 0) & (trace.ts[sel] < ends[np.maximum(pos, 0)])
        step_of = np.array(mine, dtype=np.int64)[pos[ok]]
        np.add.at(counts, step_of, 1)
        # (Forward ops of the step's thread before and after the read, inside the step: a read at
        # the top of a loop's iteration, the last token's, has none before it.)
        gemm_ts = np.sort(trace.ts[forward[(trace.tid[forward] == tid)
                                           & (trace.rank[forward] == decode[mine[0]].rank)]])
        after = np.searchsorted(gemm_ts, trace.ts[sel[ok]], side="right")
        next_gemm, last_gemm = np.append(gemm_ts, np.inf)[after], np.append(-np.inf, gemm_ts)[after]
        step_end = np.array([decode[i].end_us for i in mine])[pos[ok]]
        inside = (next_gemm < step_end) & (last_gemm >= starts[pos[ok]])
        np.add.at(in_forward, step_of, inside.astype(np.int64))
        np.add.at(spent, step_of, trace.dur[sel[ok]])  # (in time order, as the reads happened)
        for label, calls in _labels(trace, sel[ok]):
            labels[label] = labels.get(label, 0) + calls
    reading = int((counts > 0).sum())
    summary = {"steps": len(decode), "steps_with_reads": reading, "reads": int(counts.sum()),
               "reads_per_step": round(float(counts.mean()), 3), "calls": labels,
               "host_ms_per_step": round(float(spent.mean()) / 1000, 4),
               "in_forward_per_step": round(float(in_forward.mean()), 3)}
    if reading < MIN_SHARE_OF_STEPS * len(decode) or trace.has_device_events():
        return None, summary
    cost_ms = float(spent.sum()) / 1000
    share = cost_ms * 1000 / span_us if span_us > 0 else 0.0
    calls = ", ".join(f"{name} x{n}" for name, n in sorted(labels.items(), key=lambda kv: -kv[1]))
    unrecorded = unrecorded_device(trace)
    inside = reads_in_forward(summary)
    if inside:
        title = (f"the model's forward reads device values on the host every step ({calls}: {counts.mean():.1f} "
                 f"per step, {in_forward.mean():.1f} of them with the step's layers still to run, "
                 f"{spent.mean():.1f} µs per step here, {share:.2%} of step time"
                 + (" on this CPU trace" if unrecorded is None else f"; the trace recorded no {unrecorded.device} activity")
                 + "): on a GPU each is a device sync mid-step, the kernels after it not yet launched")
    elif unrecorded is None:
        title = (f"the decode loop reads a tensor to the host every step ({calls}: {counts.mean():.1f} per step, "
                 f"{spent.mean():.1f} µs per step here, {share:.2%} of step time on this CPU trace); on a GPU "
                 f"each read of the step just launched is a device sync per step: the GPU idles while the host "
                 f"reads and launches the next step")
    else:  # (the ops ran on a device the trace did not record: each read waited for it)
        title = (f"the decode loop reads a tensor from {unrecorded.device} every step ({calls}: "
                 f"{counts.mean():.1f} per step, {spent.mean():.1f} µs per step of host time, {share:.2%} of step "
                 f"time): each read is a device sync, the device idle while the host reads and launches the next "
                 f"step (the trace recorded no device activity, so that idle is not measured)")
    return Finding(
        kind="decode_gap", severity=severity_for_share(share, cost_ms),  # type: ignore[arg-type]
        cost_ms=cost_ms, start_us=decode[0].start_us, end_us=decode[-1].end_us, title=title,
        request_ids=sorted({r for s in decode for r in s.request_ids})[:100],
        evidence={"cause": "host_read_per_step", "where": "in_forward" if inside else "per_step",
                  "what": CAUSES["host_read_in_forward" if inside else "host_read_per_step"][0],
                  **summary, "share_of_step_time": round(share, 5),
                  "on_gpu": "a device synchronisation per step (the read waits for every kernel queued before it)"},
        fix=cause_fix("host_read_in_forward" if inside else "host_read_per_step"),
    ), summary
