"""What each host event is: its class (a device sync, tokenization, Python, an op, a kernel launch,
waiting, ...) from its category and name, and the names that say so (host_stacks.py sweeps the
threads with them)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from servprof.detect.compile_ranges import COMPILING_NAMES
from servprof.detect.name_guard import Guarded
from servprof.detect.name_scan import NameText, host_name_text
from servprof.detect.step_forms import PROFILER_STEP_ROWS, SGLANG_STEP_ROWS, VLLM_STEP_ROWS
from servprof.trace.model import RUNTIME_CATEGORIES, Trace
from servprof.trace.phases import PHASE_PREFIX

HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function", *RUNTIME_CATEGORIES)
# compile: torch.compile's per-call machinery (guards, dispatch into compiled code); compiling:
# everything inside a range torch.compile records while it compiles or records a CUDA graph.
# gc: Python's garbage collector (servprof's ranges around its older collections: auto/gc_ranges.py).
CLASSES = ("untraced", "python", "op", "launch", "runtime", "sync", "tokenize", "detokenize", "wait",
           "collective", "compile", "compiling", "gc")
(UNTRACED, PYTHON, OP, LAUNCH, RUNTIME, SYNC, TOKENIZE, DETOKENIZE, WAIT, COLLECTIVE, COMPILE,
 COMPILING, GC) = range(len(CLASSES))
BUSY_CLASSES = (PYTHON, OP, LAUNCH, RUNTIME, SYNC, TOKENIZE, DETOKENIZE, COLLECTIVE, COMPILE, COMPILING, GC)

# Host calls that block until the device is done: explicit syncs, blocking copies, reads of a
# device value on the host (.item(), .tolist(), .cpu(), nonzero's output size).
# (Guarded: the literal substrings every match holds; a name holding none skips the regex.)
SYNC_NAMES = Guarded(re.compile(
    r"(cuda|hip)(Stream|Device|Event|Ctx)Synchronize|^cu(Stream|Ctx|Event)Synchronize|^(cuda|hip)Memcpy$"
    r"|^hipMemcpyWithStream$|^(cuda|hip|cu)Memcpy(DtoH|D2H)|^aten::_local_scalar_dense$|^aten::item$"
    # Intel GPUs (XPU): SYCL's unified runtime and Level Zero waits.
    r"|^urQueueFinish$|^urEventWait$|^ze(Event|Fence|CommandList)HostSynchronize$|^zeCommandQueueSynchronize$"
    r"|^aten::nonzero$|torch/(cuda|xpu)/__init__\.py\(\d+\): synchronize|<method '(tolist|item|cpu|numpy)' of"
    r"|<built-in method (tolist|item|cpu|numpy) of"
), "ynchronize", "Memcpy", "aten::_local_scalar_dense", "aten::item", "urQueueFinish", "urEventWait", "aten::nonzero",
   "method 'tolist'", "method 'item'", "method 'cpu'", "method 'numpy'", "method tolist", "method item", "method cpu",
   "method numpy")
# Tokenizer work recognisable in traces that carry no servprof phase markers.
# (Not the accessors of the tokenizer's output, a BatchEncoding, which live in the same files:
# `inputs["input_ids"]` or `.to(device)` in a generate loop is no tokenization.)
TOKENIZER_NAMES = Guarded(re.compile(
    r"((?<!de)tokeniz(?!ation_utils\w*\.py\(\d+\): (?:__(?:getitem|getattr|contains|len|iter)__|to|keys|values|items)$)"
    r"|encode_batch|apply_chat_template|PreTrainedTokenizer|\.encode\b)", re.IGNORECASE),
    "tokeniz", "encode_batch", "apply_chat_template", ".encode")
DETOKENIZER_NAMES = Guarded(re.compile(r"detokeniz|batch_decode\b|decode_stream|convert_ids_to_tokens", re.IGNORECASE),
                            "detokeniz", "decode", "convert_ids_to_tokens")
# A thread asleep or blocked on another thread/process: it holds no GIL and does no work.
WAIT_NAMES = Guarded(re.compile(
    r"threading\.py\(\d+\): (wait|join|_wait_for_tstate_lock)$|<method 'acquire' of '_thread\.|<built-in method acquire"
    r"|time\.sleep|<built-in function sleep>|selectors\.py\(\d+\): select$|<method '(poll|select|control)' of"
    r"|<built-in method (select|poll|epoll)|queue\.py\(\d+\): get$|multiprocessing/connection\.py\(\d+\): "
    r"(recv|recv_bytes|poll|wait|_poll)$|tqdm/_monitor\.py|recv_multipart$|shm_broadcast\.py\(\d+\): acquire_read$"
    # Blocking socket calls (an HTTP or database client waiting for its answer): the GIL released.
    r"|<built-in method (recv|recv_into|recvfrom|recvfrom_into|recvmsg|accept|_accept|connect|sendall) of socket"
    r"|<method '(read|write|do_handshake)' of '_ssl\._SSLSocket' objects>|<built-in function getaddrinfo>"
    # A C queue's get (concurrent.futures' idle workers, asyncio.to_thread's executor) and a child's wait.
    r"|<built-in method get of _queue\.SimpleQueue|<method 'get' of '_queue\.SimpleQueue'|<built-in function (waitpid|select)>"
), "threading.py(", "acquire", "sleep", "selectors.py(", "<method 'poll'", "<method 'select'", "<method 'control'",
   "<built-in method select", "<built-in method poll", "<built-in method epoll", "queue.py(", "connection.py(",
   "tqdm/_monitor.py", "recv_multipart", " of socket", "_ssl._SSLSocket", "getaddrinfo", "_queue.SimpleQueue",
   "waitpid", "<built-in function select>")
# An event loop's own frames whose self time is its C core waiting for events (uvloop's loop, the
# standard loop's when its selector call is not recorded), the GIL released: a loop thread idle,
# not Python holding the GIL. Only their own time: the callbacks they run keep their classes.
LOOP_IDLE_FRAMES = Guarded(re.compile(
    r"asyncio/runners\.py\(\d+\): run$|asyncio/base_events\.py\(\d+\): (run_forever|run_until_complete)$"
    r"|uvloop/__init__\.py\(\d+\): run$|(<method|<built-in method) '?run_(forever|until_complete)'? of '?uvloop"
), "asyncio/", "uvloop")
# The entry frames of servprof's own threads (capture, loop watchdog, memory snapshots): what they
# run is servprof's overhead, never the app's work another thread waited for.
SERVPROF_THREAD_FRAMES = Guarded(re.compile(r"servprof/(capture|watchdog|probes/snapshot)\.py\(\d+\): (_run|_watch)$"),
                                 "servprof/")
# Collectives the host blocks in (a NCCL call only enqueues a kernel: its wait shows on the device).
COLLECTIVE_NAMES = Guarded(re.compile(r"^gloo:|barrier|_distributed_c10d\.Work' objects>|^c10d::wait|ProcessGroup\w*\.wait"),
                           "gloo:", "barrier", "c10d", "ProcessGroup")
# torch.compile / CUDA-graph machinery on the host: guards, dispatch into compiled code.
COMPILE_NAMES = Guarded(re.compile(r"torch/_dynamo/|torch/_inductor/|torch/fx/|torch/_functorch/|torch/_guards|"
                                   r"^TorchDynamo Cache Lookup|cudagraph_trees|vllm/compilation/|torch/_subclasses/"),
                        "torch/_", "torch/fx/", "TorchDynamo", "cudagraph_trees", "vllm/compilation/")
# Inside a compiled forward or a graph replay.
COMPILED_REGION = Guarded(re.compile(r"^Torch-Compiled Region|CompiledFxGraph|torch/_inductor/|cuda_graph\.py\(\d+\): __call__"
                                     r"|cudagraph_trees|torch/cuda/graphs\.py\(\d+\): replay|<built-in method replay of"
                                     r"|^(cuda|hip|cu)GraphLaunch"),
                          "Torch-Compiled Region", "CompiledFxGraph", "torch/_inductor/", "cuda_graph.py(",
                          "cudagraph_trees", "replay", "GraphLaunch")
GRAPH_LAUNCH = Guarded(re.compile(r"^(cuda|hip|cu)GraphLaunch"), "GraphLaunch")
# (An Intel GPU's runtime enqueues all device work: urEnqueueKernelLaunch, urEnqueueUSMMemcpy, and
# Level Zero's zeCommandListAppend* under it.)
LAUNCH_NAMES = Guarded(re.compile(r"Launch|Memcpy\w*Async|Memset|^urEnqueue|^zeCommandListAppend"), "Launch", "Memcpy",
                       "Memset", "urEnqueue", "zeCommandListAppend")
DEVICE_TO_HOST = re.compile(r"DtoH|D2H|DeviceToHost")
# (A ``__call__`` is a wrapper in the frameworks' and the standard library's files: a module's, a
# processor list's, an enum's; in the server's own code, or a library servprof does not know, it is a
# callable class doing the work itself, as a user's logits processor or stopping criterion does.)
GENERIC_FRAMES = Guarded(re.compile(
    r"torch/nn/modules/module\.py\(\d+\): _(wrapped_)?call_impl$|torch/utils/_contextlib\.py\(\d+\): decorate_context$"
    r"|(^|/)(torch|transformers|accelerate|peft|diffusers|vllm|sglang)/[^(]*\(\d+\): __call__$"
    r"|^(enum|functools|contextlib|typing|abc)\.py\(\d+\): __call__$"
    r"|\): (wrapper|inner|wrapped|decorated|_fn)$|torch/_ops\.py|torch/utils/_device\.py"
    r"|<built-in function _disabled_torch_function_impl>|torch/overrides\.py|<built-in method __(enter|exit)__"
), "torch/nn/modules/module.py(", "torch/utils/_contextlib.py(", "): __call__", "): wrapper", "): inner", "): wrapped",
   "): decorated", "): _fn", "torch/_ops.py", "torch/utils/_device.py", "_disabled_torch_function_impl",
   "torch/overrides.py", "<built-in method __")


# The classes a name gives to everything inside it, the first that matches winning.
SPECIFIC = ((SYNC_NAMES, SYNC), (DETOKENIZER_NAMES, DETOKENIZE), (TOKENIZER_NAMES, TOKENIZE), (WAIT_NAMES, WAIT),
            (COLLECTIVE_NAMES, COLLECTIVE), (COMPILING_NAMES, COMPILING))
PHASE_CLASSES = {"tokenize": TOKENIZE, "detokenize": DETOKENIZE, "gc": GC}


def _class_of_name(name: str) -> int:
    """The class a name gives to everything inside it, or -1 when it only names itself."""
    if name.startswith(PHASE_PREFIX):
        return PHASE_CLASSES.get(name[len(PHASE_PREFIX):].split("|", 1)[0].removeprefix("auto."), -1)
    return next((cls for guarded, cls in SPECIFIC if guarded.search(name)), -1)


def _classes_of_names(text: NameText, phase: np.ndarray) -> np.ndarray:
    """_class_of_name of every name, each guard asked of all the names at once (name_scan.py);
    ``phase``: the names starting with PHASE_PREFIX."""
    out = np.full(len(text.names), -1, dtype=np.int8)
    for guarded, cls in reversed(SPECIFIC):  # the first that matches is written last
        out[text.search(guarded)] = cls
    for i in np.flatnonzero(phase).tolist():
        out[i] = _class_of_name(text.names[i])
    return out


class NameClasses:
    """Per interned string: its class and flags (one pass over the distinct names of a trace's
    host events; the kernels' names, often the longest, never say what a host thread did)."""

    def __init__(self, trace: Trace):
        host, text = host_name_text(trace)
        size = len(trace.names)
        phase = text.starting_with(PHASE_PREFIX)
        self.specific = _per_name(size, host, _classes_of_names(text, phase), -1, np.int8)
        self.generic = _per_name(size, host, text.search(GENERIC_FRAMES), False, bool)
        self.compile = _per_name(size, host, text.search(COMPILE_NAMES), False, bool)
        self.compiled_region = _per_name(size, host, text.search(COMPILED_REGION), False, bool)
        self.launch = _per_name(size, host, text.search(LAUNCH_NAMES), False, bool)
        self.loop_idle = _per_name(size, host, text.search(LOOP_IDLE_FRAMES), False, bool)
        # is_step_annotation of every name: the step forms' patterns are anchored (search is match),
        # and every servprof step phase starts with PHASE_PREFIX.
        annotation = phase  # (or-ed into in place: phase is not read again)
        for step_form in (VLLM_STEP_ROWS, SGLANG_STEP_ROWS, PROFILER_STEP_ROWS):
            annotation |= text.search(step_form)
        self.annotation = _per_name(size, host, annotation, False, bool)


def _per_name(size: int, ids: np.ndarray, values: list[Any] | np.ndarray, default: Any, dtype: Any) -> np.ndarray:
    out = np.full(size, default, dtype=dtype)
    out[ids] = values
    return out


def in_categories(trace: Trace, rows: np.ndarray, *categories: str) -> np.ndarray:
    """Which of ``rows`` are of one of ``categories`` (a lookup per row: never a pass over the whole trace)."""
    return trace.has_id(trace.cat_id[rows], [trace.string_id(c) for c in categories])


def base_classes(trace: Trace, rows: np.ndarray, name_ids: np.ndarray, nc: NameClasses,
                 python: np.ndarray) -> np.ndarray:
    """Class of an event by its own kind: a Python frame (``python``: which rows are), an op, a
    launch or other runtime call; annotations (step ranges, servprof phases) record no work of
    their own: untraced."""
    out = np.full(rows.shape, OP, dtype=np.int8)
    out[python] = PYTHON
    out[python & nc.loop_idle[name_ids]] = WAIT  # an event loop's C core between its callbacks
    runtime = in_categories(trace, rows, *RUNTIME_CATEGORIES)
    launch = nc.launch[name_ids]
    out[runtime & launch] = LAUNCH
    out[runtime & ~launch] = RUNTIME
    out[in_categories(trace, rows, "user_annotation") | nc.annotation[name_ids]] = UNTRACED
    return out
