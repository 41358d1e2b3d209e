"""Intel GPU (XPU) traces: their device events name the queue they ran on "sycl queue".

Kineto's XPU plugin (libkineto/src/plugin/xpupti) writes a kernel, copy or fill with args
``{"correlation", "device", "sycl queue", "l0 queue", ...}`` and no ``stream``; the host's
runtime calls (``urEnqueueKernelLaunch``, cat ``xpu_runtime``) carry the same correlation, as
CUDA's do. The SYCL queue is what a CUDA stream is: an ordered queue of device work. A device
event with no ``stream`` takes its ``sycl queue`` as its stream, so every detector reads an
XPU trace as it reads a CUDA or ROCm one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

if TYPE_CHECKING:
    from servprof.trace.model import Trace

# The host categories only an XPU trace holds (ActivityType names in Kineto's ActivityType.h).
XPU_CATEGORIES = ("xpu_runtime", "xpu_driver", "xpu_sync", "xpu_scope_profiler")


class _QueueArg(msgspec.Struct, gc=False):
    queue: Any = msgspec.field(default=None, name="sycl queue")


_QUEUE_ARGS = msgspec.json.Decoder(list[_QueueArg])


def is_xpu_trace(trace: Trace) -> bool:
    """Whether the trace holds events only Kineto's XPU plugin writes (a lookup per category, no pass over the rows)."""
    return any(trace.string_id(category) >= 0 for category in XPU_CATEGORIES)


def sycl_queue_streams(trace: Trace, device_categories: tuple[str, ...]) -> np.ndarray:
    """The trace's stream column, where a device event has none, its ``sycl queue`` (-1 where it
    has neither, or a value that is no queue id)."""
    rows = np.flatnonzero(trace.mask_category(*device_categories) & (trace.stream < 0))
    if rows.size == 0:
        return trace.stream
    queues = np.full(rows.size, -1, dtype=np.int64)
    for i, (row, fields) in enumerate(zip(rows.tolist(), trace.arg_fields_each(rows, _QUEUE_ARGS), strict=True)):
        value = fields.queue if fields is not None else trace.args(row).get("sycl queue")
        if type(value) is int and 0 <= value < 2**62:
            queues[i] = value
    stream = trace.stream.copy()
    stream[rows] = queues
    return stream
