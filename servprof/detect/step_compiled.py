"""Model steps of a ``torch.compile``d model that marks none: its compiled regions.

Dynamo names every call of a compiled frame ``Torch-Compiled Region: F/R`` (frame F, its R-th
compile) while a profiler records, whatever the backend. A model compiled whole
(``torch.compile(model)``, or ``model.forward = torch.compile(model.forward)`` as transformers
documents for ``generate``) runs one such range per forward; its inlined modules and ops leave no
``nn.Module`` frame and no ``aten::embedding`` (the graph holds them), so no other form finds its
steps. A graph break makes the rest of the frame a frame of its own, called from inside the first:
its ranges nest, and only the outermost count. Per thread, the frame that takes the most time at
the top is the model's (a compiled sampler or helper beside it is not a step).

What a region cannot say: whether it was a prefill or a decode (``Step.kind`` stays "step" unless
backward ops ran in it, labelled later), nor which requests it served.
"""

from __future__ import annotations

import re

from servprof.detect.name_guard import Guarded
from servprof.detect.step_forms import Step, host_rows, outermost, step_from_row
from servprof.trace.model import Trace

REGION_LITERAL = "Torch-Compiled Region: "
REGION = re.compile(r"^Torch-Compiled Region: \[?(\d+)/(\d+)")  # (frame, its compile); recompilation.py reads it too
REGION_ROWS = Guarded(REGION, REGION_LITERAL)


def compiled_steps(trace: Trace) -> list[Step]:
    rows = outermost(trace, host_rows(trace, REGION_ROWS))
    if rows.size == 0:
        return []
    threads = list(zip(trace.rank[rows].tolist(), trace.tid[rows].tolist(), strict=True))
    frames = [_frame(trace.name(row)) for row in rows.tolist()]
    totals: dict[tuple[int, int, str], float] = {}
    for thread, frame, dur in zip(threads, frames, trace.dur[rows].tolist(), strict=True):
        totals[(*thread, frame)] = totals.get((*thread, frame), 0.0) + float(dur)
    model_frame: dict[tuple[int, int], tuple[float, str]] = {}
    for (rank, tid, frame), total in totals.items():
        if total > model_frame.get((rank, tid), (-1.0, ""))[0]:
            model_frame[(rank, tid)] = (total, frame)
    return [step_from_row(trace, row, "step", "compiled", trace.name(row))
            for row, thread, frame in zip(rows.tolist(), threads, frames, strict=True)
            if model_frame[thread][1] == frame]


def _frame(name: str) -> str:
    match = REGION.match(name)
    return match.group(1) if match else name
