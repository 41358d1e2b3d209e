"""Ops that pay a set-up on the host for every new input shape.

Some ops build something the first time they see a shape and cache it per shape: cuDNN's
attention an execution plan, oneDNN a primitive, an autotuner its choice. A server whose shapes
change every step (a growing key length, each new prompt length) pays that set-up over and over,
while the device waits. The trace shows it without knowing the library: with ``record_shapes``,
an op whose calls with a shape new to the trace are slow on the host, and whose calls with a shape
seen before are fast. Found in the demo engine on an H100 (tests/fixtures/cuda_tiny_*): cuDNN
attention took 44-654 ms on its first call with each shape and 0.12-0.2 ms on every repeat.

An op's time is its own host time: runtime and driver calls inside it are taken out, so a copy
waiting for the device (a sync) or a launch loading its kernel's code on first use (lazy loading,
per kernel rather than per shape; decode_gap names those) is not taken for a set-up. Only the
innermost such op is named (the SDPA op around cuDNN's is slow for the same reason), and only when
at least ``MIN_SHAPES`` new shapes were slow, most new shapes were (``NEW_SLOW_SHARE``) and most
slow calls were new shapes (``SLOW_NEW_SHARE``), with a repeat to compare with: one slow first call
(a lazy initialisation), or a few slow calls that happen to be new shapes, is not this.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import orjson

from servprof.detect.finding import Finding, severity_for_share
from servprof.detect.steps import Step, step_index, time_judged_us
from servprof.detect.threads import thread_groups
from servprof.trace.model import RUNTIME_CATEGORIES, Trace

OP_CATEGORIES = ("cpu_op", "Operator")  # Kineto's category for ATen ops (and older traces')
SLOW_US = 1000.0  # a first call with a shape that took less than this on the host is not worth naming
SLOWER = 10.0  # new-shape calls at least this many times the repeats' median
MIN_SHAPES = 3
SLOW_NEW_SHARE = 0.8  # of the slow calls, at least this share had a shape new to the trace
NEW_SLOW_SHARE = 0.75  # ... and of the calls with a new shape, at least this share were slow
MAX_CALLS = 5_000  # calls of one op read (their shapes), the first in time order: enough to judge it
NESTED_SHARE = 0.5  # an op half of whose slow calls hold another candidate's slow call: the inner one is named
EXAMPLES = 3
SPECIFIC_FIXES = (
    ("cudnn_attention", "This is cuDNN's attention building an execution plan for each new shape (PyTorch's "
                        "SDPA picks its cuDNN backend on recent GPUs): pad the key/query lengths to a few "
                        "buckets, or run SDPA with another backend, e.g. `with torch.nn.attention.sdpa_kernel("
                        "[SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):`."),
    ("mkldnn", "oneDNN builds a primitive for each new shape: pad inputs to a few bucketed sizes."),
)
GENERAL_FIX = ("Keep the shapes this op sees few: pad the sequence lengths to buckets (multiples of 64 or 128, "
               "masking the padding), and run each bucket once at start-up, before taking traffic.")


class _Op(NamedTuple):
    name: str
    slow_new: np.ndarray  # rows: calls with a shape new to the trace, slow
    repeat_median_us: float
    repeats: int
    shapes: int  # distinct shapes of all its calls read
    slow_seen: int  # slow calls whose shape had been seen
    setup_us: float
    examples: list[dict[str, Any]]
    new_median_us: float  # own host time of the slow new-shape calls, median


def detect_shape_setup(trace: Trace, steps: list[Step]) -> tuple[list[Finding], dict[str, Any]]:
    ops, unshaped = _candidates(trace)
    ops = _innermost(trace, ops)
    judged_us = time_judged_us(trace, steps, on_device=False)
    findings = [_finding(trace, op, steps, judged_us) for op in ops]
    summary = {"ops": [{"op": op.name, "shapes": op.shapes, "slow_new_shapes": int(op.slow_new.size),
                        "setup_ms": round(op.setup_us / 1000, 3)} for op in ops],
               # ops with a slow call (SLOW_US) recorded without shapes: no set-up per shape can be told apart
               "unshaped_ops": unshaped}
    return findings, summary


def _candidates(trace: Trace) -> tuple[list[_Op], list[str]]:
    """The ops judged (a few slow calls, with shapes), and the names of ops with a slow call but no
    shapes recorded (no finding can be made of them; a gap's fix still can name what to check)."""
    # Ops only (record_shapes gives them their shapes): not Python frames nor annotations.
    is_op = trace.complete() & (trace.stream < 0) & trace.mask_category(*OP_CATEGORIES)
    slow = np.flatnonzero(trace.dur >= SLOW_US)
    slow = slow[is_op[slow]]
    names, slow_calls = np.unique(trace.name_id[slow], return_counts=True)
    firsts_slow = slow[np.unique(trace.name_id[slow], return_index=True)[1]]  # one slow call of each name
    unshaped = [trace.name(int(row)) for row in firsts_slow.tolist()
                if next(iter(trace.args_each(np.array([row]))), {}).get("Input Dims") is None]
    names = names[slow_calls >= MIN_SHAPES]  # fewer slow calls than that cannot make a finding
    if not names.size:
        return [], unshaped
    rows = np.flatnonzero(trace.has_id(trace.name_id, names) & is_op)
    rows = rows[np.lexsort((trace.ts[rows], trace.name_id[rows]))]  # by name, then in time order
    firsts = np.flatnonzero(np.r_[True, trace.name_id[rows][1:] != trace.name_id[rows][:-1]])
    nested = _NestedRuntime(trace)
    out = []
    for calls in np.split(rows, firsts[1:]):
        calls = calls[:MAX_CALLS]
        name = trace.name(int(calls[0]))
        if name not in unshaped:
            op = _judge(trace, name, calls, nested.own_us(calls))
            if op is not None:
                out.append(op)
    return out, unshaped


class _NestedRuntime:
    """Per thread, the runtime and driver calls (leaves) to take out of an op's host time: read for
    the threads asked about only."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.rows = np.flatnonzero(trace.complete() & trace.mask_category(*RUNTIME_CATEGORIES))
        self.by_thread: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}

    def _of_thread(self, key: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
        found = self.by_thread.get(key)
        if found is None:
            trace, rows = self.trace, self.rows
            mine = rows[(trace.rank[rows] == key[0]) & (trace.pid[rows] == key[1]) & (trace.tid[rows] == key[2])]
            mine = mine[np.argsort(trace.ts[mine], kind="stable")]
            found = self.by_thread[key] = (trace.ts[mine], np.concatenate([[0.0], np.cumsum(trace.dur[mine])]))
        return found

    def own_us(self, calls: np.ndarray) -> np.ndarray:
        trace = self.trace
        own = trace.dur[calls].astype(np.float64)
        threads, thread_of = thread_groups(trace.rank[calls], trace.pid[calls], trace.tid[calls])
        for number, key in enumerate(threads.tolist()):
            starts, total = self._of_thread(tuple(key))
            at = np.flatnonzero(thread_of.ravel() == number)
            lo = np.searchsorted(starts, trace.ts[calls[at]], side="left")
            hi = np.searchsorted(starts, trace.ts[calls[at]] + trace.dur[calls[at]], side="right")
            own[at] -= total[hi] - total[lo]
        return np.maximum(own, 0.0)


def _judge(trace: Trace, name: str, calls: np.ndarray, dur: np.ndarray) -> _Op | None:
    keys, seen, new = [], set(), []
    for args in trace.args_each(calls):
        dims = args.get("Input Dims")
        if dims is None:  # no shapes recorded: nothing to tell shapes apart by
            return None
        key = orjson.dumps([dims, args.get("Input type")], default=str)
        keys.append(key)
        new.append(key not in seen)
        seen.add(key)
    is_new = np.array(new, dtype=bool)
    repeats = dur[~is_new]
    if repeats.size == 0:
        return None
    repeat_median = float(np.median(repeats))
    slow = dur >= max(SLOW_US, SLOWER * repeat_median)
    slow_new = slow & is_new
    if (int(slow_new.sum()) < MIN_SHAPES or slow_new.sum() < SLOW_NEW_SHARE * slow.sum()
            or slow_new.sum() < NEW_SLOW_SHARE * is_new.sum()):
        return None
    setup = float((dur[slow_new] - repeat_median).sum())
    picked = np.flatnonzero(slow_new)
    longest = picked[np.argsort(-dur[picked], kind="stable")][:EXAMPLES]
    examples = [{"shapes": orjson.loads(keys[i])[0], "host_ms": round(float(dur[i]) / 1000, 3)}
                for i in longest.tolist()]
    return _Op(name, calls[slow_new], repeat_median, int(repeats.size), len(seen), int((slow & ~is_new).sum()),
               setup, examples, float(np.median(dur[slow_new])))


def _innermost(trace: Trace, ops: list[_Op]) -> list[_Op]:
    """Drop an op whose slow calls mostly hold another candidate's slow call (on the same thread)."""
    kept = []
    for op in ops:
        inner = [other for other in ops if other is not op and _holds(trace, op.slow_new, other.slow_new)]
        if not inner:
            kept.append(op)
    return sorted(kept, key=lambda o: -o.setup_us)


def _holds(trace: Trace, outer: np.ndarray, inner: np.ndarray) -> bool:
    held = 0
    for row in outer.tolist():
        start, end = trace.ts[row], trace.ts[row] + trace.dur[row]
        same = ((trace.tid[inner] == trace.tid[row]) & (trace.pid[inner] == trace.pid[row])
                & (trace.rank[inner] == trace.rank[row]))
        within = same & (trace.ts[inner] >= start) & (trace.ts[inner] + trace.dur[inner] <= end)
        held += bool(within.any())
    return held >= NESTED_SHARE * outer.size


def _finding(trace: Trace, op: _Op, steps: list[Step], judged_us: float) -> Finding:
    starts = trace.ts[op.slow_new]
    ends = starts + trace.dur[op.slow_new]
    request_ids: list[str] = []
    rows = op.slow_new
    for index in np.unique(step_index(steps, trace.rank[rows], starts, trace.tid[rows])).tolist():
        if index >= 0:
            request_ids.extend(r for r in steps[index].request_ids if r not in request_ids)
    setup_ms = op.setup_us / 1000
    # (A set-up outside every step can outlast the steps' time: the share is at most all of it.)
    share = min(1.0, op.setup_us / judged_us) if judged_us > 0 else 0.0
    where = "step time" if steps else "the trace's span"
    new_ms = op.new_median_us / 1000
    title = (f"{op.name} paid a set-up on the host for each new input shape: {op.slow_new.size} new shape(s), "
             f"{setup_ms:,.2f} ms ({share:.0%} of {where}); a call with a shape seen before took "
             f"{op.repeat_median_us / 1000:.3f} ms, a new one {new_ms:.1f} ms (medians)")
    specific = next((text for key, text in SPECIFIC_FIXES if key in op.name), "")
    return Finding(
        kind="shape_setup", severity=severity_for_share(share, setup_ms), cost_ms=setup_ms,
        start_us=float(starts.min()), end_us=float(ends.max()), title=title, request_ids=request_ids,
        evidence={"op": op.name, "new_shape_calls": int(op.slow_new.size), "shapes_seen": op.shapes,
                  "repeat_calls": op.repeats, "repeat_median_ms": round(op.repeat_median_us / 1000, 4),
                  "new_median_ms": round(new_ms, 3), "slow_repeats": op.slow_seen,
                  "share_of_judged_time": round(share, 4), "examples": op.examples},
        fix=f"{specific} {GENERAL_FIX}".strip(),
    )


def explain_slow_host_ops(gap_findings: list[Finding], setups: list[Finding], unshaped: list[str]) -> None:
    """A decode_gap whose slow host op is one that pays a set-up per shape gets that fix: "move the op
    out of the step" is wrong for a plan built for each new shape, padding the shapes is right. An op
    known to build a plan per shape (cuDNN's attention) recorded without shapes gets it too, said as
    what to check: the trace cannot tell its new shapes from its repeats."""
    by_op = {f.evidence["op"]: f for f in setups}
    for finding in gap_findings:
        if finding.evidence.get("cause") != "host_ops":
            continue
        tops = [gap["top_frames"][0]["name"] for gap in finding.evidence.get("worst_gaps", []) if gap.get("top_frames")]
        named = next((name for name in tops if name in by_op), None)
        if named is not None:
            finding.evidence["shape_setup_op"] = named
            finding.fix = f"{named} pays a set-up on the host for each new input shape here (shape_setup): {by_op[named].fix}"
            continue
        known = next(((name, text) for name in tops if name in unshaped
                      for key, text in SPECIFIC_FIXES if key in name), None)
        if known is not None:
            name, text = known
            finding.evidence["shape_setup_op"] = name
            finding.fix = (f"{name} held the step on the host here, and is known to pay a set-up for each new "
                           f"input shape (a decode step's key length is new at every step). {text} This trace has no "
                           "shapes to confirm it: profile with record_shapes=True (servprof sessions: "
                           "SERVPROF_RECORD_SHAPES=1) and servprof times each new shape apart (shape_setup).")
