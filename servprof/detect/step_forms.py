"""Every form in which a trace marks model steps, one reader per form.

Each reader returns ``Step`` objects for the whole trace; ``steps.find_steps`` picks,
per rank, the best form present. The forms:

- servprof's phase markers ``servprof:decode_step|ids`` / ``servprof:prefill|ids``
  (and the automatic ``servprof:auto.*`` ones, when the server marked nothing itself);
- SGLang's ``step[DECODE bs=N]`` / ``step[EXTEND bs=N]`` annotations (SGLang also writes a
  vLLM-style ``execute_*`` range around them: such a trace is labelled SGLang, and the step
  spans that outer range, input preparation included);
- vLLM's ``execute_<T>_context_<C>(...)_generation_<G>(...)`` /
  ``execute_context_<C>(...)_generation_<G>(...)`` annotations;
- vLLM V1's ``gpu_model_runner.py(N): execute_model`` Python frames (``with_stack``, no annotation);
- ``ProfilerStep#N`` (a training step when backward ops run inside it);
- the outermost model forward: ``nn.Module: LlamaForCausalLM_0`` frames (``with_stack`` /
  ``with_modules``), the module class that takes the most time at the top of its thread;
- with none of these, landmarks (step_landmarks.py: each DataLoader fetch, each forward's first
  ``aten::embedding``) and a compiled model's ``Torch-Compiled Region`` ranges (step_compiled.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from servprof.detect.name_guard import Guarded
from servprof.detect.name_scan import host_ids_matching
from servprof.trace.model import DEVICE_MIRROR_CATEGORY, Trace
from servprof.trace.phases import phase_events

# vLLM writes "execute_<T>_context_..." with attention sums, or "execute_context_..." with token counts.
VLLM_STEP = re.compile(r"^execute_(?:(\d+)_)?context_(\d+)\(([^)]*)\)_generation_(\d+)\(([^)]*)\)")
# ΣN_Q, ΣN_KV, ΣN_Q², ΣN_Q·N_KV inside the parentheses: "sq32sk55086sqsq32sqsk55086"
VLLM_SEQ_SUMS = re.compile(r"sq(\d+)sk(\d+)sqsq(\d+)sqsk(\d+)")
SGLANG_STEP = re.compile(r"^step\[(DECODE|EXTEND|MIXED|PREFILL|IDLE)(?:[^\]]*?\bbs=(\d+))?[^\]]*\]", re.IGNORECASE)
PROFILER_STEP = re.compile(r"^ProfilerStep\s*#\s*(\d+)")
# vLLM V1's worker step, as Python's profiler names the frame: "vllm/v1/worker/gpu_model_runner.py(2907): execute_model"
VLLM_EXECUTE_FRAME = re.compile(r"(?:^|/)(?:gpu|cpu|xpu|tpu|npu)?_?model_runner\.py\(\d+\): execute_model$")
MODULE_FRAME = "nn.Module: "
FORWARD_FRAME = re.compile(r"\.py\(\d+\): forward$")
# The step forms' patterns as host_rows asks them, with the literal every match holds
# (name_guard.py; tests/test_name_guard.py checks each against its regex).
VLLM_STEP_ROWS = Guarded(VLLM_STEP, "execute_")
SGLANG_STEP_ROWS = Guarded(SGLANG_STEP, "step[")
PROFILER_STEP_ROWS = Guarded(PROFILER_STEP, "ProfilerStep")
VLLM_EXECUTE_ROWS = Guarded(VLLM_EXECUTE_FRAME, "model_runner.py(")
FORWARD_ROWS = Guarded(FORWARD_FRAME, "): forward")
MODULE_ROWS = Guarded(re.compile("^" + re.escape(MODULE_FRAME)), MODULE_FRAME)
EMBEDDING_ROWS = Guarded(re.compile(r"^aten::embedding$"), "aten::embedding")
_SERVPROF_STEP_PHASES = ("servprof:decode_step|", "servprof:prefill|", "servprof:auto.decode_step|",
                         "servprof:auto.prefill|")

SOURCE_LABELS = {
    "servprof": "servprof phase markers",
    "servprof_auto": "servprof automatic phases",
    "sglang": "SGLang step annotations",
    "vllm": "vLLM step annotations",
    "vllm_frames": "vLLM execute_model frames",
    "annotation": "your record_function ranges",
    "profiler_step": "ProfilerStep#N",
    "forward": "outermost model forward",
    "data_loader": "each DataLoader fetch (no step marked)",
    "optimizer": "each optimizer step (no step or DataLoader fetch marked)",
    "embedding": "each forward's first aten::embedding (no step marked)",
    "compiled": "each call of the torch.compile'd model (no step marked)",
}


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
    start_us: float  # the host range that marks the step
    end_us: float
    kind: str  # "decode" | "prefill" | "mixed" | "train" | "step" (unknown mix)
    source: str  # a key of SOURCE_LABELS
    label: str
    request_ids: list[str] = field(default_factory=list)
    batch: int | None = None
    attention: dict[str, int] = field(default_factory=dict)  # vLLM sequence sums, when known
    # First start and last end of the device work launched from inside the host range (None on
    # CPU traces). Under asynchronous scheduling the host runs ahead: the device span is the step.
    device_start_us: float | None = None
    device_end_us: float | None = None
    cut_at_stop_us: float = 0.0  # host time past servprof's own stop() that was cut off this step
    # A decode step whose forward ran over the whole sequence (no KV cache), read from its shapes,
    # and the sequence length its input ids held (record_shapes).
    recomputes_prefix: bool = False
    tokens: int | None = None
    # The first step of a call that ran a request's steps (transformers' generate(), with_stack): the
    # time before it is the wait for the request and its set-up, not the decode loop's (step_kinds.py).
    opens_request: bool = False

    @property
    def dur_us(self) -> float:
        return self.end_us - self.start_us

    @property
    def on_device(self) -> bool:
        return self.device_start_us is not None and self.device_end_us is not None

    @property
    def time_us(self) -> float:
        """The step's length: its device span when it launched device work, else its host range."""
        if self.device_start_us is not None and self.device_end_us is not None:
            return self.device_end_us - self.device_start_us
        return self.dur_us


def servprof_steps(trace: Trace) -> list[Step]:
    """One step per batch: servers that mark decode_step once per request get their
    overlapping markers on one thread merged, with the union of the request ids."""
    steps: list[Step] = []
    last: dict[tuple[int, int, str], Step] = {}  # the latest step of each thread and kind
    for event in phase_events(trace):
        if event.phase not in ("decode_step", "prefill"):
            continue
        kind = "decode" if event.phase == "decode_step" else "prefill"
        rank = int(trace.rank[event.row])
        source = "servprof_auto" if event.auto else "servprof"
        same = last.get((rank, event.tid, kind))
        if same is not None and event.start_us < same.end_us:
            same.end_us = max(same.end_us, event.end_us)
            same.request_ids.extend(r for r in event.request_ids if r not in same.request_ids)
            same.batch = len(same.request_ids) or None
            continue
        steps.append(Step(event.row, rank, event.tid, event.start_us, event.end_us, kind, source, event.phase,
                          list(event.request_ids), len(event.request_ids) or None))
        last[(rank, event.tid, kind)] = steps[-1]
    return steps


def host_rows(trace: Trace, pattern: re.Pattern[str] | Guarded, category: str | None = None) -> np.ndarray:
    """Host duration events whose name matches, in time order."""
    ids = host_ids_matching(trace, pattern) if isinstance(pattern, Guarded) else \
        trace.ids_matching(lambda s: pattern.search(s) is not None, trace.host_names())
    if not len(ids):  # (most forms' names are in no trace at hand: no pass over its rows)
        return np.zeros(0, dtype=np.intp)
    mask = trace.has_id(trace.name_id, ids) & trace.complete() & (trace.stream < 0)
    if category is not None:
        mask &= trace.mask_category(category)
    rows = np.flatnonzero(mask)
    # The same annotation can be mirrored on the device timeline (gpu_user_annotation): keep the host one.
    rows = rows[~trace.mask_category(DEVICE_MIRROR_CATEGORY)[rows]]
    return rows[np.argsort(trace.ts[rows], kind="stable")]


def vllm_steps(trace: Trace) -> list[Step]:
    steps = []
    for row in host_rows(trace, VLLM_STEP_ROWS):
        name = trace.name(row)
        match = VLLM_STEP.match(name)
        assert match is not None
        context, generation = int(match.group(2)), int(match.group(4))
        kind = "decode" if context == 0 else ("prefill" if generation == 0 else "mixed")
        steps.append(step_from_row(trace, row, kind, "vllm", name, batch=context + generation,
                                   attention=_attention_sums(match)))
    return steps


def _attention_sums(match: re.Match[str]) -> dict[str, int]:
    sums = VLLM_SEQ_SUMS.search(match.group(5))
    return {"decode_sum_q": int(sums.group(1)), "decode_sum_kv": int(sums.group(2))} if sums else {}


def sglang_steps(trace: Trace) -> list[Step]:
    steps = []
    outer = host_rows(trace, VLLM_STEP_ROWS)  # SGLang's own execute_* range around each step, when present
    for row in host_rows(trace, SGLANG_STEP_ROWS):
        match = SGLANG_STEP.match(trace.name(row))
        assert match is not None
        mode = match.group(1).upper()
        kind = {"DECODE": "decode", "EXTEND": "prefill", "PREFILL": "prefill", "MIXED": "mixed"}.get(mode, "step")
        batch = int(match.group(2)) if match.group(2) else None
        step = step_from_row(trace, row, kind, "sglang", trace.name(row), batch=batch)
        around = _enclosing(trace, outer, row)
        if around is not None:
            # The whole scheduler step (batch preparation, input copies) is SGLang's step: its range.
            vllm_form = VLLM_STEP.match(trace.name(around))
            step.attention = _attention_sums(vllm_form) if vllm_form else {}
            step.start_us, step.end_us = float(trace.ts[around]), float(trace.end[around])
        steps.append(step)
    return steps


def _enclosing(trace: Trace, candidates: np.ndarray, row: int) -> int | None:
    """The last-starting of the (time-sorted) candidate ranges that contains ``row`` on its thread."""
    pos = int(np.searchsorted(trace.ts[candidates], trace.ts[row], side="right")) - 1
    row_end = trace.ts[row] + trace.dur[row]
    while pos >= 0:
        c = int(candidates[pos])
        if trace.ts[c] + trace.dur[c] >= row_end and trace.tid[c] == trace.tid[row] and trace.rank[c] == trace.rank[row]:
            return c
        if trace.ts[row] - trace.ts[c] > 60e6:  # a minute back: no step range is that long
            return None
        pos -= 1
    return None


def outermost(trace: Trace, rows: np.ndarray, ends: np.ndarray | None = None) -> np.ndarray:
    """The rows (time-sorted) not nested inside another of them on the same rank and thread: on
    each thread, the first row, then the first to start at or after the end of the last one kept
    (``ends``: each row's end, when not its own)."""
    if rows.size == 0:
        return np.zeros(0, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    ends = trace.ts[rows] + trace.dur[rows] if ends is None else ends
    by_thread = np.lexsort((trace.tid[rows], trace.rank[rows]))  # stable: time order within a thread
    thread = np.stack([trace.rank[rows[by_thread]].astype(np.int64), trace.tid[rows[by_thread]]])
    bounds = np.flatnonzero(np.any(thread[:, 1:] != thread[:, :-1], axis=0)) + 1
    keep: list[int] = []
    for mine in np.split(by_thread, bounds):
        start = trace.ts[rows[mine]]
        # The next row kept after row i (a Python step per row kept, not per row).
        following = np.maximum(np.searchsorted(start, ends[mine], side="left"), np.arange(1, mine.size + 1)).tolist()
        i = 0
        while i < mine.size:
            keep.append(int(mine[i]))
            i = following[i]
    return rows[np.sort(np.array(keep, dtype=np.int64))]


def vllm_frame_steps(trace: Trace) -> list[Step]:
    rows = outermost(trace, host_rows(trace, VLLM_EXECUTE_ROWS, "python_function"))
    return [step_from_row(trace, row, "step", "vllm_frames", trace.name(row)) for row in rows]


def profiler_steps(trace: Trace) -> list[Step]:
    return [step_from_row(trace, row, "step", "profiler_step", trace.name(row))
            for row in host_rows(trace, PROFILER_STEP_ROWS)]


def forward_steps(trace: Trace) -> list[Step]:
    """Per rank and thread: the calls of the module class that spends the most time as the
    outermost module (the model, not the sampler or logits processor beside it); on threads
    without module frames (with_stack but not with_modules), the outermost ``...: forward``
    Python frame that does."""
    modules = outermost(trace, host_rows(trace, MODULE_ROWS))
    with_modules = {(int(r), int(t)) for r, t in zip(trace.rank[modules].tolist(), trace.tid[modules].tolist(),
                                                      strict=True)}
    forwards = outermost(trace, host_rows(trace, FORWARD_ROWS, "python_function"))
    forwards = np.array([r for r in forwards.tolist() if (int(trace.rank[r]), int(trace.tid[r])) not in with_modules],
                        dtype=np.int64)
    rows = np.concatenate([modules, forwards]).astype(np.int64)
    if rows.size == 0:
        return []
    best: dict[tuple[int, int], tuple[float, str]] = {}
    totals: dict[tuple[int, int, str], float] = {}
    for row in rows.tolist():
        key = (int(trace.rank[row]), int(trace.tid[row]), _forward_key(trace.name(row)))
        totals[key] = totals.get(key, 0.0) + float(trace.dur[row])
    for (rank, tid, key), total in totals.items():
        if total > best.get((rank, tid), (-1.0, ""))[0]:
            best[(rank, tid)] = (total, key)
    chosen = [row for row in rows.tolist()
              if best[(int(trace.rank[row]), int(trace.tid[row]))][1] == _forward_key(trace.name(row))]
    chosen.sort(key=lambda row: float(trace.ts[row]))
    return [step_from_row(trace, row, "step", "forward", trace.name(row)) for row in chosen]


def _forward_key(frame: str) -> str:
    """"nn.Module: LlamaForCausalLM_0" -> "LlamaForCausalLM" (the suffix numbers instances); a
    Python frame is its own key (file, line and function)."""
    return re.sub(r"_\d+$", "", frame[len(MODULE_FRAME):]) if frame.startswith(MODULE_FRAME) else frame


def step_from_row(trace: Trace, row: int, kind: str, source: str, label: str, batch: int | None = None,
                  attention: dict[str, int] | None = None) -> Step:
    start = float(trace.ts[row])
    return Step(int(row), int(trace.rank[row]), int(trace.tid[row]), start, start + float(trace.dur[row]), kind,
                source, label, batch=batch, attention=attention or {})

