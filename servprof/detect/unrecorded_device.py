"""Traces whose ops ran on a device that the trace did not record.

torch.profiler records the device only when asked (``activities=[ProfilerActivity.CPU,
ProfilerActivity.CUDA]``; the legacy ``torch.autograd.profiler.profile()`` without ``use_cuda``,
or ``activities=[ProfilerActivity.CPU]``, record the host alone), and torch_npu's profiler writes
Ascend NPU tasks in its own form, which servprof does not read. Such a trace has no device events,
yet its ops did not run on this CPU: their host times are the time to dispatch them, not the
work. Judged as a CPU trace, a GEMM's dispatch would be read as the GEMM and measured against a
CPU's bandwidth. This says when the trace itself shows it: ops that exist only on a device (cuDNN
and MIOpen ops, the CUDA attention kernels' ops, NCCL's, Ascend's CANN calls), never from where
servprof runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import numpy as np

from servprof.detect.devices import device_name, trace_device_properties
from servprof.detect.name_guard import Guarded
from servprof.detect.name_scan import host_ids_matching
from servprof.trace.model import Trace

# Host events that only a device backend runs (aten's CPU attention ops end in "_for_cpu").
# (Ops and collectives, never kernels' names: a trace may hold those outside a kernel timeline.)
CUDA_ONLY = Guarded(re.compile(
    r"^aten::\w*cudnn|^aten::_scaled_dot_product_(flash_attention|efficient_attention|cudnn_attention)(_backward)?$"
    r"|^aten::_(flash|efficient)_attention_(forward|backward)$|^nccl:"), "cudnn", "aten::_scaled_dot_product_",
    "_attention_", "nccl:")
ROCM_ONLY = Guarded(re.compile(r"^aten::\w*miopen"), "miopen")
# torch_npu's traces: CANN's API calls ("AscendCL@aclnnMm") and the host-to-device links.
ASCEND = Guarded(re.compile(r"^AscendCL@|^HostToDevice$"), "AscendCL@", "HostToDevice")
FAMILIES = (("a CUDA GPU", CUDA_ONLY), ("a ROCm GPU", ROCM_ONLY), ("an Ascend NPU", ASCEND))
MAX_NAMED = 3


@dataclass(frozen=True)
class UnrecordedDevice:
    device: str  # the trace's deviceProperties name, else the family its ops say
    ascend: bool  # torch_npu's trace: its device tasks are there, in a form servprof does not read
    evidence: str  # the ops that say so, with their counts
    launches: bool  # the host's launch calls were recorded (their kernels were not)

    def message(self) -> str:
        if self.ascend:
            recorded = (f"This is torch_npu's trace of {self.device} ({self.evidence}): its device tasks are written "
                        "in Ascend's own form (the 'Ascend Hardware' process), which servprof does not read")
            how = "Read the device side with Ascend's tools (MindStudio Insight, msprof-analyze)"
        else:
            recorded = (f"The ops ran on {self.device} ({self.evidence}), but the trace recorded "
                        + ("their launches and no kernel or copy on the device (a run of CUPTI's range profiler "
                           "or counters, not its activity timeline)" if self.launches else
                           "no device activity (kernels, copies, their launches): the profiler ran without the "
                           "device's activity"))
            how = ("Record with activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] (torch.profiler.profile's "
                   "default where a GPU is present), or use_device='cuda' with the legacy autograd profiler")
        return (f"{recorded}. The host times of its ops are the time to dispatch them, not the work, so device "
                f"idle, launch gaps and op bandwidth cannot be judged from it; gaps on the host's threads are "
                f"judged as they are. {how}.")

    def missing_entry(self) -> dict[str, str]:
        return {"what": "device activity", "message": self.message()}


# Per trace, its answer: the bandwidth and host-read detectors both ask (weakly keyed: it goes with its trace).
_FOUND: WeakKeyDictionary[Trace, UnrecordedDevice | None] = WeakKeyDictionary()


def unrecorded_device(trace: Trace) -> UnrecordedDevice | None:
    """The device a trace's ops ran on, when the trace holds no device events but its ops show
    they ran on one; None for every other trace (the shared scan of the distinct host names,
    name_scan.py, not a pass over the rows)."""
    if trace.has_device_events():
        return None
    if trace not in _FOUND:
        _FOUND[trace] = _find(trace)
    return _FOUND[trace]


def _find(trace: Trace) -> UnrecordedDevice | None:
    for family, guarded in FAMILIES:
        ids = host_ids_matching(trace, guarded)
        if ids.size == 0:
            continue
        counts = np.bincount(trace.name_id[trace.has_id(trace.name_id, ids)], minlength=len(trace.names))[ids]
        order = np.argsort(-counts, kind="stable")[:MAX_NAMED]
        evidence = ", ".join(f"{trace.names[int(ids[i])]} x{int(counts[i])}" for i in order)
        listed = [n for n in (device_name(p) for p in trace_device_properties(trace.metadata)) if n]
        ascend = guarded is ASCEND
        return UnrecordedDevice(listed[0] if listed and not ascend else family, ascend, evidence,
                                bool(trace.launch_mask().any()))
    return None
