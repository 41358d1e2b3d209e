"""The name guards (detect/name_guard.py) answer exactly as their regular expressions: on every
name of every fixture trace, and on names built to hit each alternative."""

from __future__ import annotations

from pathlib import Path

import pytest

from servprof.detect import (
    compile_ranges,
    gaps,
    host_classes,
    host_reads,
    host_stacks,
    step_compiled,
    step_forms,
    step_landmarks,
)
from servprof.detect.name_guard import Guarded
from servprof.trace import load_trace

FIXTURES = Path(__file__).parent / "fixtures"
GUARDED = {f"{module.__name__}.{name}": value for module in (compile_ranges, gaps, host_classes, host_reads, host_stacks,
                                                                           step_compiled, step_forms, step_landmarks)
           for name, value in vars(module).items() if isinstance(value, Guarded)}
CRAFTED = [
    "cudaStreamSynchronize", "hipDeviceSynchronize", "cuCtxSynchronize", "cudaMemcpy", "hipMemcpyWithStream",
    "cuMemcpyDtoH_v2", "aten::_local_scalar_dense", "aten::item", "aten::nonzero",
    "torch/cuda/__init__.py(123): synchronize", "<method 'tolist' of 'torch._C.TensorBase' objects>",
    "<built-in method item of Tensor object>", "PreTrainedTokenizerFast.__call__", "tokenizers.encode_batch",
    "apply_chat_template", "x.encode", "TOKENIZE", "detokenize", "batch_decode", "decode_stream",
    "convert_ids_to_tokens", "gloo:all_reduce", "barrier", "<method 'wait' of 'torch._C._distributed_c10d.Work' objects>",
    "c10d::wait", "ProcessGroupNCCL.wait", "torch/_dynamo/eval_frame.py(1): _fn", "torch/fx/graph.py(3): f",
    "TorchDynamo Cache Lookup", "cudagraph_trees.py", "vllm/compilation/backends.py(1): f",
    "torch/_subclasses/fake_tensor.py(2): g", "Torch-Compiled Region: 0/0", "CompiledFxGraph", "torch/_inductor/x",
    "vllm/cuda_graph.py(12): __call__", "torch/cuda/graphs.py(9): replay", "<built-in method replay of CUDAGraph>",
    "cudaGraphLaunch", "hipGraphLaunch", "ncclDevKernel_AllReduce", "rcclKernel", "AllGather", "ReduceScatter",
    "all_reduce", "cross_device_reduce_1stage", "autograd::engine::evaluate_function: MmBackward0",
    "AddmmBackward0", "## backward ##", "Optimizer.step#SGD.step", "Ｔokenize", "TOKENİZE", "toKenize",
    "ſync", "", "plain name",
    "threading.py(300): wait", "<built-in method acquire of _thread.lock object>", "time.sleep",
    "<built-in method epoll of x>", "<method 'poll' of 'select.poll' objects>", "queue.py(1): get",
    "multiprocessing/connection.py(1): recv_bytes", "tqdm/_monitor.py(2): run", "socket.recv_multipart",
    "shm_broadcast.py(5): acquire_read", "selectors.py(4): select", "cudaLaunchKernel", "hipMemcpyAsync",
    "cudaMemsetAsync", "torch/nn/modules/module.py(1): _call_impl", "torch/utils/_contextlib.py(1): decorate_context",
    "x.py(1): __call__", "x.py(2): wrapper", "torch/_ops.py(3): __call__", "<built-in function _disabled_torch_function_impl>",
    "<built-in method __exit__ of x>", "torch/overrides.py(9): f", "two\nlines: aten::item", "cudaLaunch\nKernel",
    "execute_context_1(1)_generation_0(0)", "step[DECODE bs=32]", "STEP[extend]", "ProfilerStep#3",
    "vllm/v1/worker/gpu_model_runner.py(2907): execute_model", "model.py(12): forward", "nn.Module: Linear_0",
    "aten::embedding", "cudaStreamWaitEvent", "hipStreamWaitEvent",
    "entire_frame_compile", "entire_frame_compile\n", "x entire_frame_compile", "CUDAGraphNode.record (dynamo_timed)",
    "CUDAGraphNode.record (dynamo_timed)\n", "torch/_dynamo/convert_frame.py(1): __call__",
    "torch/_inductor/compile_fx.py(2): compile_fx_inner", "_compile.compile_inner",
    "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", "x enumerate(DataLoader)#",
    "asyncio/runners.py(118): run", "asyncio/base_events.py(600): run_forever", "uvloop/__init__.py(105): run",
    "<built-in method run_until_complete of uvloop.Loop object>", "asyncio/runners.py(118): runner",
    "/srv/.venv/lib/servprof/capture.py(245): _run", "servprof/watchdog.py(10): _watch", "servprof/capture.py(9): _tick",
]


def _names() -> list[str]:
    names = set(CRAFTED)
    for path in sorted((FIXTURES / "public").glob("*.json.gz")) + sorted(FIXTURES.glob("*.json.gz")):
        names.update(load_trace(path).names)
    return sorted(names)


@pytest.mark.parametrize("name", sorted(GUARDED))
def test_guard_answers_as_its_regex(name: str) -> None:
    guarded = GUARDED[name]
    for text in _names():
        assert (guarded.search(text) is None) == (guarded.pattern.search(text) is None), text
        assert (guarded.match(text) is None) == (guarded.pattern.match(text) is None), text


def test_crafted_names_hit_every_guard() -> None:
    """Each guard lets through at least one crafted name its regex matches (the list covers them)."""
    for name, guarded in GUARDED.items():
        assert any(guarded.search(text) for text in CRAFTED), name


def test_case_insensitive_literals_must_be_lower_case() -> None:
    import re

    with pytest.raises(ValueError):
        Guarded(re.compile("Abc", re.IGNORECASE), "Abc")
