"""What the host was doing during a time window: the evidence behind a gap's cause."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servprof.detect.steps import is_step_annotation
from servprof.trace.model import RUNTIME_CATEGORIES, Trace
from servprof.trace.phases import PHASE_PREFIX, parse_phase_event_name

HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function", *RUNTIME_CATEGORIES)
# Host calls that wait for the device: explicit synchronizes, blocking copies, .item().
SYNC_NAMES = re.compile(
    r"(Synchronize|aten::_local_scalar_dense|aten::item$|cudaMemcpy$|hipMemcpy$|hipMemcpyWithStream|"
    r"cudaStreamWaitEvent|aten::nonzero$|torch\.cuda\.synchronize)"
)
# Tokenizer work recognisable in traces that carry no servprof phase markers.
# Detokenization (turning output ids back into text) is not on the path to the first token.
TOKENIZER_NAMES = re.compile(r"((?<!de)tokeniz|encode_batch|apply_chat_template|PreTrainedTokenizer|\.encode\b)",
                             re.IGNORECASE)
TINY_KERNEL_US = 10.0


def union_length(starts: np.ndarray, ends: np.ndarray) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    if starts.size == 0:
        return 0.0
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], np.maximum.accumulate(ends[order])
    # A new block starts where an interval begins after everything before it ended.
    new_block = np.empty(s.size, dtype=bool)
    new_block[0] = True
    new_block[1:] = s[1:] > e[:-1]
    block_ids = np.cumsum(new_block) - 1
    block_start = s[new_block]
    block_end = np.zeros(block_start.size)
    np.maximum.at(block_end, block_ids, e)
    return float(np.sum(block_end - block_start))


@dataclass
class HostWindow:
    """Host activity clipped to one window, grouped into the causes servprof names."""

    start_us: float
    end_us: float
    tokenize_us: float = 0.0
    tokenize_request_ids: list[str] = field(default_factory=list)
    sync_us: float = 0.0
    sync_calls: list[str] = field(default_factory=list)
    op_us: float = 0.0  # union of every other profiled host op in the window
    top_ops: list[tuple[str, float]] = field(default_factory=list)
    tiny_kernels: int = 0
    tiny_kernel_span_us: float = 0.0  # first start to last end of the tiny kernels in the window

    @property
    def length_us(self) -> float:
        return self.end_us - self.start_us

    def cause(self) -> tuple[str, str]:
        """(cause id, one-line explanation) for the largest share of the window."""
        length = max(self.length_us, 1e-9)
        # Most specific first: a sync or tokenizer call sits inside the Python frames and
        # ops that also cover the window, so it names the cause better than they do.
        candidates = [
            ("tokenization", self.tokenize_us),
            ("synchronize", self.sync_us),
            # Launch-bound kernels keep the device mostly idle between them: what counts is how
            # much of the window their run spans, not their own (tiny) busy time.
            ("tiny_kernels", self.tiny_kernel_span_us if self.tiny_kernels >= 8 else 0.0),
            ("host_ops", self.op_us),
        ]
        cause = next((name for name, covered in candidates if covered >= 0.2 * length), "")
        if not cause:
            return "untraced_host_time", (
                "the host ran nothing the profiler recorded (a sleep, pure-Python work, waiting for the GIL, "
                "or the thread was off the CPU)"
            )
        if cause == "tokenization":
            who = ", ".join(self.tokenize_request_ids[:5]) or "unmarked tokenizer calls"
            return cause, f"tokenization ({who}) ran during the gap"
        if cause == "synchronize":
            return cause, f"the host waited on the device ({', '.join(self.sync_calls[:3])})"
        if cause == "tiny_kernels":
            return cause, f"a run of {self.tiny_kernels} tiny (<{TINY_KERNEL_US:.0f} µs) launch-bound kernels"
        names = ", ".join(name for name, _ in self.top_ops[:3])
        return cause, f"host ops: {names}"

    def to_evidence(self) -> dict[str, Any]:
        return {
            "tokenize_us": round(self.tokenize_us, 1),
            "tokenize_request_ids": self.tokenize_request_ids[:20],
            "sync_us": round(self.sync_us, 1),
            "sync_calls": self.sync_calls[:10],
            "host_ops_us": round(self.op_us, 1),
            "top_host_ops": [{"name": n, "us": round(us, 1)} for n, us in self.top_ops[:5]],
            "tiny_kernels": self.tiny_kernels,
        }


class HostActivity:
    """Host events of one rank, indexed once so that many windows can be asked about cheaply."""

    def __init__(self, trace: Trace, rank: int):
        self.trace = trace
        mask = trace.complete() & (trace.rank == rank) & (trace.stream < 0) & trace.mask_category(*HOST_CATEGORIES)
        rows = np.flatnonzero(mask)
        rows = rows[~np.isin(trace.name_id[rows], trace.ids_matching(is_step_annotation))]
        self.rows = rows[np.argsort(trace.ts[rows], kind="stable")]
        self.start = trace.ts[self.rows]
        self.end = self.start + trace.dur[self.rows]
        self.longest = float(trace.dur[self.rows].max()) if self.rows.size else 0.0
        self.names = trace.name_id[self.rows]
        self.tids = trace.tid[self.rows]
        self.is_tokenize = np.isin(self.names, trace.ids_matching(_is_tokenizer_name))
        self.is_sync = np.isin(self.names, trace.ids_matching(lambda s: SYNC_NAMES.search(s) is not None))
        self.is_phase = np.isin(self.names, trace.ids_matching(lambda s: s.startswith(PHASE_PREFIX)))
        dev = np.flatnonzero(trace.device_mask() & (trace.rank == rank))
        dev = dev[np.argsort(trace.ts[dev], kind="stable")]
        self.dev_start = trace.ts[dev]  # sorted, so windows are found by binary search
        self.dev_end = self.dev_start + trace.dur[dev]
        self.dev_longest = float(trace.dur[dev].max()) if dev.size else 0.0

    def device_overlapping(self, start_us: float, end_us: float) -> np.ndarray:
        """Indices (into dev_start/dev_end) of device events overlapping [start, end)."""
        lo = int(np.searchsorted(self.dev_start, start_us - self.dev_longest, side="left"))
        hi = int(np.searchsorted(self.dev_start, end_us, side="left"))
        idx = np.arange(lo, hi)
        return idx[self.dev_end[idx] > start_us]

    def window(self, start_us: float, end_us: float, tid: int | None = None, exclude_tid: int | None = None
               ) -> HostWindow:
        """Host activity clipped to [start, end): on every thread, only on ``tid``, or on
        every thread but ``exclude_tid``."""
        out = HostWindow(start_us, end_us)
        # Events are sorted by start; any overlapping one starts after start - longest.
        lo = int(np.searchsorted(self.start, start_us - self.longest, side="left"))
        hi = int(np.searchsorted(self.start, end_us, side="left"))
        idx = np.arange(lo, hi)
        idx = idx[self.end[idx] > start_us]
        if tid is not None:
            idx = idx[self.tids[idx] == tid]
        if exclude_tid is not None:
            idx = idx[self.tids[idx] != exclude_tid]
        if idx.size:
            s, e = np.maximum(self.start[idx], start_us), np.minimum(self.end[idx], end_us)
            tok, sync = self.is_tokenize[idx], self.is_sync[idx]
            other = ~tok & ~sync & ~self.is_phase[idx]
            out.tokenize_us = union_length(s[tok], e[tok])
            out.sync_us = union_length(s[sync], e[sync])
            out.op_us = union_length(s[other], e[other])
            out.tokenize_request_ids = sorted(
                {rid for i in idx[tok] for rid in _phase_ids(self.trace.names[int(self.names[i])])}
            )
            out.sync_calls = sorted({self.trace.names[int(n)] for n in self.names[idx[sync]]})
            per_name: dict[str, float] = {}
            for i, clip in zip(idx[other].tolist(), (e - s)[other].tolist(), strict=True):
                name = self.trace.names[int(self.names[i])]
                per_name[name] = per_name.get(name, 0.0) + clip
            out.top_ops = sorted(per_name.items(), key=lambda kv: -kv[1])[:5]
        near = self.device_overlapping(start_us, end_us)
        s_dev, e_dev = self.dev_start[near], self.dev_end[near]
        tiny = (s_dev >= start_us) & (e_dev <= end_us) & ((e_dev - s_dev) < TINY_KERNEL_US)
        out.tiny_kernels = int(tiny.sum())
        if out.tiny_kernels:
            out.tiny_kernel_span_us = float(e_dev[tiny].max() - s_dev[tiny].min())
        return out


def _is_tokenizer_name(name: str) -> bool:
    if name.startswith(PHASE_PREFIX):
        return name.startswith((PHASE_PREFIX + "tokenize|", PHASE_PREFIX + "auto.tokenize|"))
    return TOKENIZER_NAMES.search(name) is not None


def _phase_ids(name: str) -> list[str]:
    parsed = parse_phase_event_name(name)
    return parsed[1] if parsed else []
