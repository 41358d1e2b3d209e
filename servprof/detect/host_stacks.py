"""What each host thread was doing at every instant, by self time.

A thread's recorded events (Python frames, ops, runtime calls, annotations) nest. At
any instant the thread is in its innermost event: that event's *self* time is what the
instant is spent on. One sweep per thread turns the nested events into disjoint
segments, each labelled with a class (a device sync, tokenization, Python, an op, a
kernel launch, waiting, ...) and the name of the innermost frame that says something
(generic wrappers such as ``_call_impl``, ``decorate_context`` or ``__call__`` give their
time to the frame that called them). Questions about a window are then binary searches:
never more time than the window, and nothing counted twice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from servprof.detect.step_forms import is_step_annotation
from servprof.trace.model import RUNTIME_CATEGORIES, Trace
from servprof.trace.phases import PHASE_PREFIX

HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function", *RUNTIME_CATEGORIES)
CLASSES = ("untraced", "python", "op", "launch", "runtime", "sync", "tokenize", "detokenize", "wait",
           "collective", "compile")
(UNTRACED, PYTHON, OP, LAUNCH, RUNTIME, SYNC, TOKENIZE, DETOKENIZE, WAIT, COLLECTIVE, COMPILE) = range(len(CLASSES))
BUSY_CLASSES = (PYTHON, OP, LAUNCH, RUNTIME, SYNC, TOKENIZE, DETOKENIZE, COLLECTIVE, COMPILE)

# Host calls that block until the device is done: explicit syncs, blocking copies, reads of a
# device value on the host (.item(), .tolist(), .cpu(), nonzero's output size).
SYNC_NAMES = re.compile(
    r"(cuda|hip)(Stream|Device|Event|Ctx)Synchronize|^cu(Stream|Ctx|Event)Synchronize|^(cuda|hip)Memcpy$"
    r"|^hipMemcpyWithStream$|^(cuda|hip|cu)Memcpy(DtoH|D2H)|^aten::_local_scalar_dense$|^aten::item$"
    r"|^aten::nonzero$|torch/cuda/__init__\.py\(\d+\): synchronize|<method '(tolist|item|cpu|numpy)' of"
    r"|<built-in method (tolist|item|cpu|numpy) of"
)
# Tokenizer work recognisable in traces that carry no servprof phase markers.
TOKENIZER_NAMES = re.compile(r"((?<!de)tokeniz|encode_batch|apply_chat_template|PreTrainedTokenizer|\.encode\b)",
                             re.IGNORECASE)
DETOKENIZER_NAMES = re.compile(r"detokeniz|batch_decode\b|decode_stream|convert_ids_to_tokens", re.IGNORECASE)
# A thread asleep or blocked on another thread/process: it holds no GIL and does no work.
WAIT_NAMES = re.compile(
    r"threading\.py\(\d+\): (wait|join|_wait_for_tstate_lock)$|<method 'acquire' of '_thread\.|<built-in method acquire"
    r"|time\.sleep|<built-in function sleep>|selectors\.py\(\d+\): select$|<method '(poll|select|control)' of"
    r"|<built-in method (select|poll|epoll)|queue\.py\(\d+\): get$|multiprocessing/connection\.py\(\d+\): "
    r"(recv|recv_bytes|poll|wait|_poll)$|tqdm/_monitor\.py|recv_multipart$|shm_broadcast\.py\(\d+\): acquire_read$"
)
# Collectives the host blocks in (a NCCL call only enqueues a kernel: its wait shows on the device).
COLLECTIVE_NAMES = re.compile(r"^gloo:|barrier|_distributed_c10d\.Work' objects>|^c10d::wait|ProcessGroup\w*\.wait")
# torch.compile / CUDA-graph machinery on the host: guards, dispatch into compiled code.
COMPILE_NAMES = re.compile(r"torch/_dynamo/|torch/_inductor/|torch/fx/|torch/_functorch/|torch/_guards|"
                           r"^TorchDynamo Cache Lookup|cudagraph_trees|vllm/compilation/|torch/_subclasses/")
# Inside a compiled forward or a graph replay.
COMPILED_REGION = re.compile(r"^Torch-Compiled Region|CompiledFxGraph|torch/_inductor/|cuda_graph\.py\(\d+\): __call__"
                             r"|cudagraph_trees|torch/cuda/graphs\.py\(\d+\): replay|<built-in method replay of"
                             r"|^(cuda|hip|cu)GraphLaunch")
GRAPH_LAUNCH = re.compile(r"^(cuda|hip|cu)GraphLaunch")
LAUNCH_NAMES = re.compile(r"Launch|Memcpy\w*Async|Memset")
GENERIC_FRAMES = re.compile(
    r"torch/nn/modules/module\.py\(\d+\): _(wrapped_)?call_impl$|torch/utils/_contextlib\.py\(\d+\): decorate_context$"
    r"|\): __call__$|\): (wrapper|inner|wrapped|decorated|_fn)$|torch/_ops\.py|torch/utils/_device\.py"
    r"|<built-in function _disabled_torch_function_impl>|torch/overrides\.py|<built-in method __(enter|exit)__"
)


def _class_of_name(name: str) -> int:
    """The class a name gives to everything inside it, or -1 when it only names itself."""
    if name.startswith(PHASE_PREFIX):
        phase = name[len(PHASE_PREFIX):].split("|", 1)[0].removeprefix("auto.")
        return {"tokenize": TOKENIZE, "detokenize": DETOKENIZE}.get(phase, -1)
    if SYNC_NAMES.search(name):
        return SYNC
    if DETOKENIZER_NAMES.search(name):
        return DETOKENIZE
    if TOKENIZER_NAMES.search(name):
        return TOKENIZE
    if WAIT_NAMES.search(name):
        return WAIT
    if COLLECTIVE_NAMES.search(name):
        return COLLECTIVE
    return -1


class NameClasses:
    """Per interned string: its class and flags (one pass over the distinct names of a trace)."""

    def __init__(self, trace: Trace):
        names = trace.names
        self.specific = np.array([_class_of_name(n) for n in names], dtype=np.int8)
        self.generic = np.array([bool(GENERIC_FRAMES.search(n)) for n in names])
        self.compile = np.array([bool(COMPILE_NAMES.search(n)) for n in names])
        self.compiled_region = np.array([bool(COMPILED_REGION.search(n)) for n in names])
        self.launch = np.array([bool(LAUNCH_NAMES.search(n)) for n in names])
        self.annotation = np.array([n.startswith(PHASE_PREFIX) or is_step_annotation(n) for n in names])


@dataclass
class ThreadStack:
    """Disjoint self-time segments of one thread, each with a class and a name id."""

    tid: int
    start: np.ndarray
    end: np.ndarray
    cls: np.ndarray
    name: np.ndarray
    compiled: np.ndarray

    def __post_init__(self) -> None:
        self._by_class = []
        for c in range(len(CLASSES)):
            sel = self.cls == c
            s, e = self.start[sel], self.end[sel]
            self._by_class.append((s, e, np.concatenate([[0.0], np.cumsum(e - s)])))

    def _covered_before(self, c: int, t: np.ndarray) -> np.ndarray:
        s, e, cum = self._by_class[c]
        if s.size == 0:
            return np.zeros(t.shape)
        i = np.searchsorted(s, t, side="right") - 1
        ok = i >= 0
        j = np.maximum(i, 0)
        partial = np.clip(t - s[j], 0.0, e[j] - s[j])
        return np.where(ok, cum[j] + partial, 0.0)

    def class_times(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """[len(a), len(CLASSES)]: self time of each class inside each window [a, b];
        "untraced" is the rest of the window (nothing recorded on the thread)."""
        out = np.zeros((a.size, len(CLASSES)))
        for c in range(1, len(CLASSES)):
            out[:, c] = self._covered_before(c, b) - self._covered_before(c, a)
        out[:, UNTRACED] = np.maximum((b - a) - out[:, 1:].sum(axis=1), 0.0)
        return out

    def class_at(self, t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(self.start, t, side="right") - 1
        j = np.maximum(i, 0)
        inside = (i >= 0) & (t < self.end[j]) if self.start.size else np.zeros(t.shape, dtype=bool)
        return np.where(inside, self.cls[j] if self.start.size else 0, UNTRACED)

    def compiled_at(self, t: np.ndarray) -> np.ndarray:
        if self.start.size == 0:
            return np.zeros(t.shape, dtype=bool)
        i = np.searchsorted(self.start, t, side="right") - 1
        j = np.maximum(i, 0)
        return (i >= 0) & (t <= self.end[j]) & self.compiled[j]

    def top(self, a: float, b: float, names: list[str], limit: int = 5) -> list[dict[str, object]]:
        """The frames with the most self time inside [a, b], with their class."""
        lo = int(np.searchsorted(self.end, a, side="right"))
        hi = int(np.searchsorted(self.start, b, side="left"))
        if hi <= lo:
            return []
        clip = np.minimum(self.end[lo:hi], b) - np.maximum(self.start[lo:hi], a)
        totals: dict[tuple[int, int], float] = {}
        for name, cls, us in zip(self.name[lo:hi].tolist(), self.cls[lo:hi].tolist(), clip.tolist(), strict=True):
            if us > 0:
                totals[(name, cls)] = totals.get((name, cls), 0.0) + us
        ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:limit]
        return [{"name": names[n], "class": CLASSES[c], "self_us": round(us, 1)} for (n, c), us in ranked]


class HostStacks:
    """The host threads of one rank, swept lazily (only the threads a question is about)."""

    def __init__(self, trace: Trace, rank: int, classes: NameClasses | None = None):
        self.trace = trace
        self.classes = classes or NameClasses(trace)
        mask = (trace.complete() & (trace.rank == rank) & (trace.stream < 0) & (trace.dur > 0)
                & trace.mask_category(*HOST_CATEGORIES))
        rows = np.flatnonzero(mask)
        self.rows_by_tid: dict[int, np.ndarray] = {}
        tids = trace.tid[rows]
        for tid in np.unique(tids).tolist():
            self.rows_by_tid[int(tid)] = rows[tids == tid]
        self._d2h = _device_to_host_launches(trace)
        self._stacks: dict[int, ThreadStack] = {}

    @property
    def tids(self) -> list[int]:
        return list(self.rows_by_tid)

    def thread(self, tid: int) -> ThreadStack:
        if tid not in self._stacks:
            self._stacks[tid] = self._sweep(tid, self.rows_by_tid.get(tid, np.zeros(0, dtype=np.int64)))
        return self._stacks[tid]

    def _sweep(self, tid: int, rows: np.ndarray) -> ThreadStack:
        trace, nc = self.trace, self.classes
        start = trace.ts[rows]
        order = np.lexsort((-trace.dur[rows], start))
        rows = rows[order]
        starts = trace.ts[rows].tolist()
        ends = (trace.ts[rows] + trace.dur[rows]).tolist()
        name_ids = trace.name_id[rows]
        specific = nc.specific[name_ids].astype(np.int64)
        specific[np.isin(rows, self._d2h)] = SYNC  # a copy to the host blocks until the device is done
        base = _base_classes(trace, rows, nc)
        generic = nc.generic[name_ids].tolist()
        region = nc.compiled_region[name_ids].tolist()
        is_compile = nc.compile
        names = name_ids.tolist()
        specific_l, base_l = specific.tolist(), base.tolist()
        n = len(rows)
        ctx_spec, ctx_name, ctx_region, cls = [0] * n, [0] * n, [False] * n, [0] * n
        seg_s: list[float] = []
        seg_e: list[float] = []
        seg_k: list[int] = []
        stack: list[int] = []
        cursor = 0.0
        for k in range(n + 1):  # the last turn only closes what is still open
            s = starts[k] if k < n else np.inf
            while stack and ends[stack[-1]] <= s:
                top = stack.pop()
                if ends[top] > cursor:
                    seg_s.append(cursor)
                    seg_e.append(ends[top])
                    seg_k.append(top)
                    cursor = ends[top]
            if k == n:
                break
            if stack:
                parent = stack[-1]
                if s > cursor:
                    seg_s.append(cursor)
                    seg_e.append(s)
                    seg_k.append(parent)
                # A child that outlives its parent (µs rounding, or ranges that do not nest): the
                # ones below it last as long, so that at every instant the innermost event open is on top.
                depth = len(stack) - 1
                while depth >= 0 and ends[stack[depth]] < ends[k]:
                    ends[stack[depth]] = ends[k]
                    depth -= 1
                ctx_spec[k] = specific_l[k] if specific_l[k] >= 0 else ctx_spec[parent]
                ctx_name[k] = ctx_name[parent] if generic[k] else names[k]
                ctx_region[k] = region[k] or ctx_region[parent]
            else:
                ctx_spec[k], ctx_name[k], ctx_region[k] = specific_l[k], names[k], region[k]
            if ctx_spec[k] >= 0:
                cls[k] = ctx_spec[k]
            elif base_l[k] in (PYTHON, OP) and (is_compile[names[k]] or is_compile[ctx_name[k]]):
                cls[k] = COMPILE
            else:
                cls[k] = base_l[k]
            cursor = s
            stack.append(k)
        k_arr = np.array(seg_k, dtype=np.int64)
        return ThreadStack(tid, np.array(seg_s, dtype=float), np.array(seg_e, dtype=float),
                           np.array(cls, dtype=np.int8)[k_arr], np.array(ctx_name, dtype=np.int64)[k_arr],
                           np.array(ctx_region, dtype=bool)[k_arr])


def _base_classes(trace: Trace, rows: np.ndarray, nc: NameClasses) -> np.ndarray:
    """Class of an event by its own kind: a Python frame, an op, a launch or other runtime call;
    annotations (step ranges, servprof phases) record no work of their own: untraced."""
    out = np.full(rows.shape, OP, dtype=np.int64)
    out[trace.mask_category("python_function")[rows]] = PYTHON
    runtime = trace.mask_category(*RUNTIME_CATEGORIES)[rows]
    launch = nc.launch[trace.name_id[rows]]
    out[runtime & launch] = LAUNCH
    out[runtime & ~launch] = RUNTIME
    out[trace.mask_category("user_annotation")[rows] | nc.annotation[trace.name_id[rows]]] = UNTRACED
    return out


def _device_to_host_launches(trace: Trace) -> np.ndarray:
    """Rows of runtime calls whose copy went device -> host into pageable memory: the host waits
    for the device (a copy into pinned memory with non_blocking=True does not)."""
    copies = np.flatnonzero(trace.device_mask() & trace.mask_category("gpu_memcpy", "Memcpy")
                            & trace.mask_name(lambda s: bool(re.search(r"DtoH|D2H|DeviceToHost", s))
                                              and "Pinned" not in s))
    launches = trace.launch_row_for(copies)
    return launches[launches >= 0]
