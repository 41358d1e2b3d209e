"""What made torch.compile compile while serving, in words a user acts on: the kind of cause
(from torch's recorded guard failure, or from what the trace's ranges show) and its fix."""

from __future__ import annotations

import re
from typing import Any

REASON_CHARS = 200  # of torch's words kept for a guard failure of no known kind
FAILED_ENTRY = re.compile(r"^\d+/\d+:\s*")  # "0/1: " before a reason: the cache entry whose guard failed
SIZE_GUARD = re.compile(r"tensor '([^']+)' size mismatch at index (\d+)\. expected (\d+), actual (\d+)")
VALUE_GUARD = re.compile(r"(L\[[^\]]+\](?:\[[^\]]+\])*)\s*==\s*([^\s,]+)")

FIXES = {
    "batch_size": ("Pad decode batches to a few bucket sizes (1, 2, 4, 8, ...) and run each once at start-up, "
                   "or mark the batch dimension dynamic before the first call: torch._dynamo.mark_dynamic(x, 0) "
                   "(or torch.compile(dynamic=True))."),
    "dimension": ("Mark the dimension dynamic before the first call: torch._dynamo.mark_dynamic({name}, {dim}), "
                  "or pad it to a few bucket sizes (dim 0 is usually the batch) and warm each up at start-up."),
    "value": ("A Python value is baked into the graph ({guard}): pass it as a tensor, or make it a constant; "
              "each new value compiles again."),
    "first_compile": ("This shape was compiled while serving: run every shape the server will see (each batch "
                      "and length bucket) once at start-up, before taking traffic."),
    "cudagraph_record": ("This shape's CUDA graph was recorded while serving (torch.compile "
                         "mode='reduce-overhead' records one per new shape, after running it eagerly first): run "
                         "every shape the server will see (each batch and length bucket) a few times at start-up, "
                         "before taking traffic."),
    "unknown": ("Find the failing guard with TORCH_LOGS=recompiles (or torch._dynamo.utils.guard_failures); "
                "then mark the changing dimension dynamic (torch._dynamo.mark_dynamic), pad it to buckets, or "
                "warm those shapes up at start-up."),
}


def classify(reason: str | None, compile_id: str | None, batch: int | None, graph_recording: bool = False
             ) -> dict[str, Any]:
    """What made Dynamo compile: the kind of cause and its particulars. ``graph_recording``: the
    trace's ranges show cudagraph trees recording a graph, and no compile."""
    if not reason and graph_recording:
        return {"cause": "cudagraph_record"}
    if not reason:
        recompile = compile_id is not None and not compile_id.endswith("/0")
        return {"cause": "unknown" if recompile else "first_compile"}
    size = SIZE_GUARD.search(reason)
    if size:
        name, dim, expected, actual = size.group(1), int(size.group(2)), int(size.group(3)), int(size.group(4))
        cause = "batch_size" if dim == 0 and actual == batch else "dimension"
        return {"cause": cause, "tensor": name, "dim": dim, "expected": expected, "actual": actual}
    value = VALUE_GUARD.search(reason)
    if value:
        return {"cause": "value", "guard": f"{value.group(1)} == {value.group(2)}"}
    # torch's own words, first line, without the "0/1: " of the entry that failed
    words = FAILED_ENTRY.sub("", reason.strip().splitlines()[0]).strip() if reason.strip() else ""
    return {"cause": "unknown", "torch_reason": words[:REASON_CHARS]} if words else {"cause": "unknown"}


def describe_cause(detail: dict[str, Any]) -> str:
    cause = detail["cause"]
    if cause == "batch_size":
        return f"a new batch size ({detail['actual']})"
    if cause == "dimension":
        return f"a new size of {detail['tensor']} dim {detail['dim']} ({detail['expected']} -> {detail['actual']})"
    if cause == "value":
        return f"a changed value ({detail['guard']})"
    if cause == "first_compile":
        return "a first compile while serving"
    if cause == "cudagraph_record":
        return "a new shape's CUDA graph recorded while serving (cudagraph trees)"
    if detail.get("torch_reason"):
        return f"a guard failure servprof cannot tell more of (torch: \"{detail['torch_reason']}\")"
    return "a guard failure torch did not name here"


def fix_for(detail: dict[str, Any]) -> str:
    cause = detail["cause"]
    if cause == "dimension":
        return FIXES["dimension"].format(name=detail["tensor"].split("[")[-1].strip("'\"]") or "x", dim=detail["dim"])
    if cause == "value":
        return FIXES["value"].format(guard=detail["guard"])
    return FIXES[cause]
