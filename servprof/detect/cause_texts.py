"""What each cause of a gap is, in a few words, and what to do about it: the words every
decode_gap finding (causes.py, gaps.py, host_reads.py) is written from."""

from __future__ import annotations

from typing import Any

from servprof.detect.tier import DEEP_WINDOW_HOW, LIGHT_TRACE, NEEDS_DEEP, NEEDS_DEEP_CAUSE

# cause id -> (what it is, in a few words; what to do about it)
CAUSES: dict[str, tuple[str, str]] = {
    "synchronize": (
        "a blocking copy or device sync (the host waited for the device)",
        "Stop reading device values on the host inside the step: keep sampled tokens on the device and read them "
        "one step behind (copy with non_blocking=True into pinned memory, wait on an event after launching the "
        "next step), and remove .item() / .tolist() / .cpu() / torch.cuda.synchronize() from the decode loop.",
    ),
    "host_read_per_step": (
        "a read of a device tensor on the host every step",
        "Keep sampled tokens on the device and read them one step behind, after launching the next step "
        "(non_blocking copy into pinned memory + an event), instead of .item() / .tolist() / .cpu() right after "
        "each step: on a GPU each such read is a device sync per step.",
    ),
    "host_read_in_forward": (
        "reads of device values on the host inside the model's forward, every step",
        "Keep the forward free of reads of device values: each is a device sync on a GPU, mid-step, with "
        "the kernels after it not yet launched. They come from data-dependent control flow: an MoE layer "
        "looping over the experts its tokens were routed to (`nonzero()`, `.item()` per expert: use a grouped "
        "or fused MoE, transformers' `experts_implementation=\"grouped_mm\"` or vLLM's / SGLang's fused_moe), "
        "boolean-mask indexing or `torch.where(mask)` with one argument (use masks or `torch.where(mask, a, b)` "
        "with fixed shapes), `if tensor:` / `int(tensor)` in the model's code.",
    ),
    "tokenization": (
        "tokenization",
        "Move tokenization off the thread and process that drive the model: a thread or process pool "
        "(`await loop.run_in_executor(pool, tokenizer.encode, text)`), or in vLLM its tokenizer workers "
        "(`--renderer-num-workers`, more `--api-server-count`); use a fast (Rust) tokenizer.",
    ),
    "detokenization": (
        "detokenization",
        "Detokenize outside the engine thread (a separate thread or process) or in larger batches of tokens.",
    ),
    "data_loading": (
        "the thread waited for its next batch of input (a DataLoader's __next__)",
        "Have the batch ready before the step asks for it: DataLoader(num_workers>0, pin_memory=True, "
        "persistent_workers=True, prefetch_factor=...), heavy preprocessing (decoding, resizing, augmenting) in the "
        "workers or on the device; in a server, prepare the next inputs while the current step runs.",
    ),
    "compiling": (
        "torch.compile compiling (or recording a CUDA graph) while the device waited",
        "Compile before serving, not while: run every shape the server will see (each batch and length bucket) "
        "once at start-up, before taking traffic; the recompilation finding says what made it compile and how to "
        "keep it from compiling again.",
    ),
    "compiled_dispatch": (
        "Python in a compiled forward before its device work (torch.compile's guards, dispatch and generated "
        "wrapper code)",
        "Capture the whole decode step in a CUDA graph (torch.compile mode='reduce-overhead', vLLM full CUDA "
        "graphs), keep guards from failing (stable input types and shapes, dynamic dims marked), and move "
        "per-step Python out of the compiled call.",
    ),
    "host_python": (
        "Python on the launching thread while the device waited",
        "The GPU waits for Python: capture decode with CUDA graphs or torch.compile, raise the batch so each "
        "launch does more work, and move per-step Python (input preparation, bookkeeping) off the critical path "
        "(asynchronous scheduling).",
    ),
    "host_ops": (
        "a slow host op while the device waited",
        "Move that op out of the step or make it asynchronous (precompute it, cache it, or run it on the device).",
    ),
    "slow_launch": (
        "a launch that itself took long (the launch call, or the wait for its work to start)",
        "A launch this slow is the driver loading the kernel's code on its first use (CUDA's lazy module loading, "
        "a ROCm code object, a cuDNN/MIOpen kernel built on first call): run every shape once at start-up, before "
        "taking traffic (vLLM and SGLang do this when they capture graphs; in your own server, send a request per "
        "batch size and length bucket), or load modules eagerly (CUDA_MODULE_LOADING=EAGER). If it recurs every "
        "step, the launch waits on the driver: look for other processes on the GPU and for a starved host CPU.",
    ),
    "runtime_calls": (
        "CUDA/HIP runtime calls (not kernel launches) on the launching thread while the device waited",
        "These calls set the device up rather than run the model: cudaMalloc / cudaFree are PyTorch's caching "
        "allocator growing or giving memory back (torch.cuda.empty_cache(), or memory pressure making it free "
        "and retry: keep its cache, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, leave more headroom); "
        "the first event, stream, cuBLAS/cuDNN handle or module a process creates pays the driver's set-up. Run "
        "every shape once at start-up, before taking traffic; if they recur every step, find the code that "
        "allocates or creates them per step.",
    ),
    "launch_bound": (
        "many short gaps between kernels: the GPU ran each kernel faster than the host launched the next "
        "(launch-bound)",
        "Capture decode with CUDA graphs (vLLM: keep CUDA graphs on; Hugging Face: a static cache with "
        "torch.compile(mode='reduce-overhead')), fuse small kernels, or raise the batch so each kernel does "
        "more work.",
    ),
    "stream_wait": (
        "the stream waited on an event before running work already queued (a dependency on another stream or "
        "process)",
        "Find what that event waits for (work on another stream, another process, a copy) and overlap or reorder "
        "it; drop the dependency if it is not needed.",
    ),
    "kernel_wait": (
        "idle between kernels that were already queued (inter-kernel latency, a wait on another stream, or "
        "another process's work on the same GPU)",
        "If several processes share this GPU (server workers each holding the model, another job), they take "
        "turns on it: serve from one process that batches, or give each its own GPU (or run NVIDIA MPS). "
        "Otherwise fuse the small kernels (torch.compile) or replay them from a CUDA graph, and check "
        "cross-stream waits.",
    ),
    "event_loop_work": (
        "the event loop's own work between the model's steps, which run on the loop (see the loop_stall finding)",
        "Run the model off the event loop (the loop_stall finding says how): the loop's other work, this and other "
        "requests' coroutines and HTTP writes, then runs beside the model's steps instead of between them.",
    ),
    "concurrent_steps": (
        "other requests' model steps ran on other threads meanwhile (concurrent model calls compete for the CPUs "
        "and the GIL)",
        "Run one model call over a batch instead of one call per request on parallel threads: a batcher (one model "
        "thread fed by a queue that pads waiting requests into each forward) or an engine with continuous "
        "batching (vLLM, SGLang, TGI); at the least cap concurrent model calls at what the machine runs at once "
        "(a semaphore, or a thread pool that size). Forwards in parallel on one device mostly wait for each other.",
    ),
    "gil_contention": (
        "another thread held the GIL",
        "Move that thread's work out of the process that drives the GPU (a separate process), or make it release "
        "the GIL; keep the engine thread's process for launching device work.",
    ),
    "collective_straggler": (
        "a collective that ran far longer than its median on this rank: it waited for a slower rank",
        "Look at the straggler rank's trace (the one that arrived last): balance work across ranks and remove "
        "host stalls there (GC, data loading, a sync); this rank's time in the collective is waiting, not work.",
    ),
    "collective_wait": (
        "the host waited in a collective call",
        "Look at the other ranks' traces for the one that arrived late, and overlap the collective with work.",
    ),
    "python_gc": (
        "Python's garbage collector (a collection of the older generations walks the whole long-lived heap, the "
        "GIL held)",
        "Keep the collector off the serving heap: call gc.freeze() once the model and the server are loaded (what "
        "they allocated is then never walked again; vLLM and SGLang do so), raise the thresholds "
        "(gc.set_threshold(50_000, 50, 100)) or collect between requests, and allocate fewer container objects per "
        "step (per-token dicts and lists, objects with reference cycles).",
    ),
    "waiting": (
        "the launching thread was blocked or asleep (a queue, a lock, another process, a sleep)",
        "The frames name the call it waited in. A sleep or a polling interval in the loop delays every step it "
        "falls between: remove it, or wake on an event. A queue or a lock: look at what feeds this thread (the "
        "scheduler or API-server process): with asynchronous scheduling the next step is prepared while the "
        "current one runs.",
    ),
    "untraced_host_time": (
        "host time the profiler recorded nothing for",
        "Record with with_stack=True to see the Python frames; look for sleeps, waits on other processes, or "
        "too few CPU cores for the server's threads (the thread was off the CPU).",
    ),
    NEEDS_DEEP_CAUSE: (
        f"{NEEDS_DEEP} ({LIGHT_TRACE})",
        f"To see which ops or Python ran in these gaps: {DEEP_WINDOW_HOW}.",
    ),
}


# A training step's fix where the serving one would not fit (sampled tokens, a decode loop).
TRAINING_FIXES: dict[str, str] = {
    "synchronize": (
        "Stop reading device values on the host inside the training step: log the loss every N steps or sum it "
        "on the device (no .item() / .cpu() / printing a tensor each step), avoid ops whose output size depends on "
        "the data (nonzero, masked_select, boolean indexing) and torch.cuda.synchronize(); copies to the device "
        "from pinned memory with non_blocking=True. With torch.backends.cudnn.benchmark, the first steps' syncs "
        "are its autotuning."
    ),
    "launch_bound": (
        "The GPU runs each kernel faster than the host launches the next: compile the step (torch.compile; "
        "mode='reduce-overhead' replays it from CUDA graphs), use fused or foreach optimizers "
        "(torch.optim.AdamW(fused=True)), and raise the batch size so each kernel does more work."
    ),
    "host_python": (
        "The GPU waits for Python in the training loop: compile the step (torch.compile), move per-step Python "
        "(logging, metrics, reshaping the batch) out of the step or onto the device, and prepare the next batch "
        "while this one runs (DataLoader workers, pin_memory, non_blocking copies)."
    ),
}


# A host-only trace's words where the device's would not fit (no device waited: the step's thread
# itself was in the way of the next step).
HOST_CAUSES: dict[str, tuple[str, str]] = {
    "host_python": (
        "Python on the step's thread between its ops",
        "Per-step Python is on the decode loop's critical path: speed up the frames named (do per-token work on "
        "tensors: a logits processor that loops over the vocabulary in Python becomes one masked op, its mask "
        "computed once; cache what does not change between steps; move bookkeeping out of the loop), or take the "
        "loop's framework Python away with torch.compile.",
    ),
    "host_ops": (
        "a slow op on the step's thread outside the model's forward",
        "Move that op out of the decode loop or make it cheaper: precompute or cache it, or do it once per batch "
        "instead of once per step.",
    ),
}


def cause_label(cause: str, on_device: bool = True) -> str:
    """What a cause is, in a few words; ``on_device``: the trace has the device's timeline."""
    if not on_device and cause in HOST_CAUSES:
        return HOST_CAUSES[cause][0]
    return CAUSES.get(cause, CAUSES["untraced_host_time"])[0]


# Host time with nothing recorded, where the trace already holds Python frames (with_stack was on)
# or came from servprof's own session (its setting turns the frames on).
UNTRACED_WITH_FRAMES = (
    "The thread recorded nothing there, not even a Python frame: it was off the CPU or blocked outside Python "
    "(a sleep or a lock taken in C code, a wait on another process or on I/O, too few CPU cores for the server's "
    "threads). Check the server's thread count against its cores, and what that thread waits on."
)
UNTRACED_IN_SESSION = (
    "Set SERVPROF_WITH_STACK=1 so that deep windows record the Python frames as well as the ops; look for sleeps, "
    "waits on other processes, or too few CPU cores for the server's threads (the thread was off the CPU)."
)
# Why a thread has no Python frames where others have them, and what to do (two detectors say it).
THREAD_STARTED_LATE = (
    "it follows the threads alive when the profiler started, and {which} began later, as a thread pool's new workers "
    "do (anyio's pool, which runs FastAPI's `def` endpoints, retires workers idle for 10 s; `asyncio.to_thread`'s "
    "executor starts its threads on first use) and threads started per request do. A window taken while the server is "
    "busy finds a pool's workers alive and records their frames; a thread started per request is never recorded: run "
    "that work on threads that outlive requests (a fixed pool, or an engine thread started with the server)."
)
UNTRACED_THREAD_UNFRAMED = (
    "torch's Python tracer recorded other threads' Python but none of this thread's, so its time between steps may "
    "be its own Python: " + THREAD_STARTED_LATE.format(which="this one")
)


def untraced_fix(evidence: dict[str, Any], in_session: bool) -> str:
    """The fix for host time nothing was recorded for, as the trace can take it further: the gap's
    evidence says whether its thread's Python frames were recorded (``python_frames``, absent when
    the trace has none); ``in_session``: a servprof session's trace."""
    frames = evidence.get("python_frames")
    if frames == "other_threads_only":
        return UNTRACED_THREAD_UNFRAMED
    if frames == "recorded":
        return UNTRACED_WITH_FRAMES
    return UNTRACED_IN_SESSION if in_session else CAUSES["untraced_host_time"][1]


def cause_fix(cause: str, training: bool = False, on_device: bool = True) -> str:
    """What to do about a cause; ``training``: for training steps (no decode loop, no sampled tokens);
    ``on_device``: the trace has the device's timeline."""
    if training and cause in TRAINING_FIXES:
        return TRAINING_FIXES[cause]
    if not on_device and cause in HOST_CAUSES:
        return HOST_CAUSES[cause][1]
    return CAUSES.get(cause, CAUSES["untraced_host_time"])[1]


# A collection on the model's own thread this share of a gap's, or more, is named beside the other's.
SHARED_COLLECTION_SHARE = 0.1


def collected_text(evidence: dict[str, Any], thread: str, other: str) -> str:
    """Where a gap's collections ran: on the thread driving the model, on the one it waited for,
    or both back to back (each thread can trigger one; the GIL runs them in turn). Sets the
    evidence's ``collected_us``."""
    own = float(evidence["self_us"].get("gc", 0.0))
    elsewhere = float(evidence["ran_instead"]["self_us"].get("gc", 0.0)) if "ran_instead" in evidence else 0.0
    evidence["collected_us"] = round(own + elsewhere, 1)
    if elsewhere and own >= SHARED_COLLECTION_SHARE * (own + elsewhere):
        return (f"{(own + elsewhere) / 1000:.2f} ms collecting, {own / 1000:.2f} ms on thread {thread} (the one "
                f"driving the model) and {elsewhere / 1000:.2f} ms on thread {other}, which it waited for")
    if elsewhere:
        return (f"{elsewhere / 1000:.2f} ms collecting on thread {other} while thread {thread} (the one "
                "driving the model) waited")
    return f"{own / 1000:.2f} ms collecting on thread {thread}"
