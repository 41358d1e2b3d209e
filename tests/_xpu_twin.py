"""An Intel GPU (XPU) twin of a CUDA trace, written as Kineto's XPU plugin writes its events.

No Intel GPU runs here, and no public XPU trace with a licence to vendor was found. The twin keeps
every timing of a real CUDA trace and changes what Kineto's XPU plugin (libkineto/src/plugin/xpupti,
read at pytorch/kineto's main) writes differently:
- host runtime calls: cat ``xpu_runtime`` with SYCL's unified-runtime names (``urEnqueueKernelLaunch``,
  ``urEnqueueUSMMemcpy``, ``urQueueFinish``, ...), driver calls cat ``xpu_driver`` with Level Zero's;
- device events: no ``stream`` arg; the queue in ``sycl queue`` (and a ``l0 queue`` handle), the
  thread id the SYCL queue id, as the plugin's ``resource``;
- ``deviceProperties``: the fields ``getXpuDeviceProperties`` writes, for one stack of a Max 1550.
"""

from __future__ import annotations

from typing import Any

# One name for one name (a twin's per-name sums must match the CUDA trace's), each a real one.
RUNTIME_NAMES = {
    "cudaLaunchKernel": "urEnqueueKernelLaunch", "cudaLaunchKernelExC": "urEnqueueKernelLaunchWithArgsExp",
    "cudaMemcpyAsync": "urEnqueueUSMMemcpy", "cudaMemsetAsync": "urEnqueueUSMFill",
    "cudaStreamSynchronize": "urQueueFinish", "cudaDeviceSynchronize": "zeCommandListHostSynchronize",
    "cudaEventSynchronize": "urEventWait", "cudaEventRecordWithFlags": "urEnqueueEventsWaitWithBarrier",
    "cudaEventQuery": "urEventGetInfo", "cudaStreamIsCapturing": "urQueueGetInfo",
    "cudaGetErrorString": "urAdapterGetLastError", "cudaGetDeviceProperties_v2": "urDeviceGetInfo",
    "cudaDeviceGetAttribute": "urDeviceGetNativeHandle", "cudaPointerGetAttributes": "urUSMGetMemAllocInfo",
    "cudaRuntimeGetVersion": "urAdapterGetInfo", "cudaHostAlloc": "urUSMHostAlloc",
    "cudaPeekAtLastError": "urPlatformGetLastError",
    "cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags": "urKernelSuggestMaxCooperativeGroupCount",
}
DRIVER_NAMES = {"cuLaunchKernelEx": "zeCommandListAppendLaunchKernelWithArguments",
                "cuLaunchKernel": "zeCommandListAppendLaunchKernel"}
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
MAX_1550_STACK = {"id": 0, "name": "Intel(R) Data Center GPU Max 1550", "totalGlobalMem": 68719476736,
                  "maxComputeUnits": 512, "maxWorkGroupSize": 1024, "maxClockFrequency": 1600,
                  "maxMemAllocSize": 68719476736, "localMemSize": 131072, "vendor": "Intel(R) Corporation",
                  "driverVersion": "1.6.31294"}


def xpu_twin(document: dict[str, Any]) -> dict[str, Any]:
    """The same trace as the XPU plugin would write it (a new document; the input is left as it was)."""
    events = []
    for event in document["traceEvents"]:
        event = dict(event)
        cat, name = event.get("cat"), event.get("name")
        if cat == "cuda_runtime":
            event["cat"], event["name"] = "xpu_runtime", RUNTIME_NAMES.get(name, name)
        elif cat == "cuda_driver":
            event["cat"], event["name"] = "xpu_driver", DRIVER_NAMES.get(name, name)
        elif cat in DEVICE_CATEGORIES and isinstance(event.get("args"), dict) and "stream" in event["args"]:
            args = dict(event["args"])
            queue = args.pop("stream")
            args["sycl queue"], args["l0 queue"] = queue, f"0x{0x55d08b8fc000 + queue:016x}"
            event["args"], event["tid"] = args, queue
        events.append(event)
    twin = {key: value for key, value in document.items() if not key.startswith(("cuda_", "cupti_"))}
    return {**twin, "traceEvents": events, "deviceProperties": [MAX_1550_STACK]}
