"""Model steps (decode / prefill / mixed) found in a trace, whoever wrote it.

Sources, first that is present wins (per rank):
1. servprof's own phase markers: ``servprof:decode_step|ids`` and ``servprof:prefill|ids``;
2. vLLM's step annotation ``execute_<T>_context_<C>(...)_generation_<G>(...)``
   (C = requests in prefill, G = requests decoding; C == 0 is a pure decode step);
3. SGLang's ``step[DECODE bs=N]`` / ``step[EXTEND bs=N]`` annotations;
4. ``ProfilerStep#N``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from servprof.trace.model import Trace
from servprof.trace.phases import phase_events

# vLLM writes "execute_<T>_context_..." with attention sums, or "execute_context_..." with token counts.
VLLM_STEP = re.compile(r"^execute_(?:(\d+)_)?context_(\d+)\(([^)]*)\)_generation_(\d+)\(([^)]*)\)")
# ΣN_Q, ΣN_KV, ΣN_Q², ΣN_Q·N_KV inside the parentheses: "sq32sk55086sqsq32sqsk55086"
VLLM_SEQ_SUMS = re.compile(r"sq(\d+)sk(\d+)sqsq(\d+)sqsk(\d+)")
SGLANG_STEP = re.compile(r"^step\[(DECODE|EXTEND|MIXED|PREFILL|IDLE)[^\]]*?(?:bs=(\d+))?\]", re.IGNORECASE)
PROFILER_STEP = re.compile(r"^ProfilerStep\s*#\s*(\d+)")
_SERVPROF_STEP_PHASES = ("servprof:decode_step|", "servprof:prefill|", "servprof:auto.decode_step|",
                         "servprof:auto.prefill|")


def is_step_annotation(name: str) -> bool:
    """A range that marks a whole model step (any framework's form): the step itself, not
    host work inside it."""
    return bool(VLLM_STEP.match(name) or SGLANG_STEP.match(name) or PROFILER_STEP.match(name)
                or name.startswith(_SERVPROF_STEP_PHASES))


@dataclass
class Step:
    row: int
    rank: int
    tid: int
    start_us: float
    end_us: float
    kind: str  # "decode" | "prefill" | "mixed" | "step" (unknown mix)
    source: str  # "servprof" | "vllm" | "sglang" | "profiler_step"
    label: str
    request_ids: list[str] = field(default_factory=list)
    batch: int | None = None
    attention: dict[str, int] = field(default_factory=dict)  # vLLM sequence sums, when known

    @property
    def dur_us(self) -> float:
        return self.end_us - self.start_us


def _servprof_steps(trace: Trace) -> list[Step]:
    """One step per batch: servers that mark decode_step once per request get their
    overlapping markers on one thread merged, with the union of the request ids."""
    steps: list[Step] = []
    for event in phase_events(trace):
        if event.phase not in ("decode_step", "prefill"):
            continue
        kind = "decode" if event.phase == "decode_step" else "prefill"
        rank = int(trace.rank[event.row])
        same = next((s for s in reversed(steps) if s.rank == rank and s.tid == event.tid and s.kind == kind), None)
        if same is not None and event.start_us < same.end_us:
            same.end_us = max(same.end_us, event.end_us)
            same.request_ids.extend(r for r in event.request_ids if r not in same.request_ids)
            same.batch = len(same.request_ids) or None
            continue
        steps.append(
            Step(
                row=event.row,
                rank=rank,
                tid=event.tid,
                start_us=event.start_us,
                end_us=event.end_us,
                kind=kind,
                source="servprof",
                label=event.phase,
                request_ids=list(event.request_ids),
                batch=len(event.request_ids) or None,
            )
        )
    return steps


def _annotation_rows(trace: Trace, pattern: re.Pattern[str]) -> np.ndarray:
    rows = np.flatnonzero(trace.mask_name(lambda s: pattern.match(s) is not None) & trace.complete() & (trace.stream < 0))
    # The same annotation can be mirrored on the device timeline (gpu_user_annotation): keep the host one.
    host = ~trace.mask_category("gpu_user_annotation")[rows]
    return rows[host]


def _vllm_steps(trace: Trace) -> list[Step]:
    steps = []
    for row in _annotation_rows(trace, VLLM_STEP):
        name = trace.name(row)
        match = VLLM_STEP.match(name)
        assert match is not None
        context, generation = int(match.group(2)), int(match.group(4))
        attention: dict[str, int] = {}
        sums = VLLM_SEQ_SUMS.search(match.group(5))
        if sums:
            attention = {"decode_sum_q": int(sums.group(1)), "decode_sum_kv": int(sums.group(2))}
        kind = "decode" if context == 0 else ("prefill" if generation == 0 else "mixed")
        steps.append(_step_from_row(trace, row, kind, "vllm", name, batch=context + generation, attention=attention))
    return steps


def _sglang_steps(trace: Trace) -> list[Step]:
    steps = []
    for row in _annotation_rows(trace, SGLANG_STEP):
        match = SGLANG_STEP.match(trace.name(row))
        assert match is not None
        mode = match.group(1).upper()
        kind = {"DECODE": "decode", "EXTEND": "prefill", "PREFILL": "prefill", "MIXED": "mixed"}.get(mode, "step")
        batch = int(match.group(2)) if match.group(2) else None
        steps.append(_step_from_row(trace, row, kind, "sglang", trace.name(row), batch=batch))
    return steps


def _profiler_steps(trace: Trace) -> list[Step]:
    return [_step_from_row(trace, row, "step", "profiler_step", trace.name(row)) for row in _annotation_rows(trace, PROFILER_STEP)]


def _step_from_row(trace: Trace, row: int, kind: str, source: str, label: str, batch: int | None = None,
                   attention: dict[str, int] | None = None) -> Step:
    start = float(trace.ts[row])
    return Step(int(row), int(trace.rank[row]), int(trace.tid[row]), start, start + float(trace.dur[row]), kind,
                source, label, batch=batch, attention=attention or {})


def find_steps(trace: Trace) -> list[Step]:
    """All model steps, per rank from the best source present, in start order."""
    found: list[Step] = []
    candidates = (_servprof_steps(trace), _vllm_steps(trace), _sglang_steps(trace), _profiler_steps(trace))
    for rank in trace.ranks:
        for source_steps in candidates:
            mine = [s for s in source_steps if s.rank == rank]
            if mine:
                found.extend(mine)
                break
    found.sort(key=lambda s: (s.rank, s.start_us))
    return found


def step_index(steps: list[Step], ranks: np.ndarray, times: np.ndarray) -> np.ndarray:
    """For each (rank, time): the index in ``steps`` of the step that contains it, -1 if none.

    One binary search per rank instead of a scan per step; where steps of one rank
    overlap, the latest-starting one that contains the time is taken.
    """
    out = np.full(times.shape, -1, dtype=np.int64)
    for rank in {s.rank for s in steps}:
        indices = np.array([i for i, s in enumerate(steps) if s.rank == rank], dtype=np.int64)
        starts = np.array([steps[i].start_us for i in indices])
        order = np.argsort(starts, kind="stable")
        indices, starts = indices[order], starts[order]
        ends = np.array([steps[i].end_us for i in indices])
        mine = np.flatnonzero(ranks == rank)
        pos = np.searchsorted(starts, times[mine], side="right") - 1
        ok = pos >= 0
        pos_ok = np.maximum(pos, 0)
        ok &= times[mine] <= ends[pos_ok]
        out[mine[ok]] = indices[pos_ok[ok]]
    return out
