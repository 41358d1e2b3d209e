"""HTA-style idle-time split per device stream: host_wait, kernel_wait, other.

For each device event (kernel, memcpy, memset) the gap is its start minus the
previous event's end on the same stream. The gap is host_wait when the host
launch of this event began after the previous event ended (the device was
starved by the host), kernel_wait when it is shorter than
``consecutive_kernel_delay_us`` (back-to-back launch overhead), otherwise other.
Like HTA 0.5, float-ns timestamps are rounded to whole µs (start up, end down)
first, and negative gaps (overlaps) are summed too, so the figures agree with
HTA's on the same trace. Also like HTA, when the trace has two or more
``ProfilerStep#N`` ranges, device work launched at or after the start of the last
(usually cut-off) step is left out.

One deliberate difference: a device event whose launch is not in the trace is never
host_wait here (nothing shows the host was late). HTA 0.5 joins such an event to the
trace's first event (its "no correlation" index is 0, a real row) and reads that event's
start as the launch: on the public HF prefill trace that makes 7 gaps of 2-3 µs host_wait.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from servprof.trace.model import Trace, distinct

HTA_CONSECUTIVE_KERNEL_DELAY_US = 30.0


class StreamIdle(NamedTuple):
    rank: int
    stream: int
    host_wait_us: float
    host_wait_gaps: int
    kernel_wait_us: float
    kernel_wait_gaps: int
    other_us: float
    other_gaps: int

    def to_dict(self) -> dict[str, float | int]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self._asdict().items()}


def idle_split(
    trace: Trace,
    consecutive_kernel_delay_us: float = HTA_CONSECUTIVE_KERNEL_DELAY_US,
    round_like_hta: bool = True,
) -> list[StreamIdle]:
    rows = np.flatnonzero(trace.device_mask())
    if rows.size == 0:
        return []
    launch = trace.launch_row_for(rows)
    if round_like_hta:
        rows, launch = _drop_last_profiler_step(trace, rows, launch)
    start = trace.ts[rows]
    end = start + trace.dur[rows]
    launch_ts = np.where(launch >= 0, trace.ts[np.maximum(launch, 0)], np.nan)
    if round_like_hta:
        start, end, launch_ts = np.ceil(start), np.floor(end), np.ceil(launch_ts)
    out: list[StreamIdle] = []
    ranks, streams = trace.rank[rows], trace.stream[rows]
    for rank, stream in sorted(set(zip(ranks.tolist(), streams.tolist(), strict=True))):
        sel = np.flatnonzero((ranks == rank) & (streams == stream))
        sel = sel[np.argsort(start[sel], kind="stable")]
        if sel.size < 2:
            continue
        prev_end = end[sel][:-1]
        gap = start[sel][1:] - prev_end
        with np.errstate(invalid="ignore"):
            host = launch_ts[sel][1:] > prev_end  # NaN (no launch in trace) compares False
        kernel = ~host & (gap < consecutive_kernel_delay_us)
        other = ~host & ~kernel
        out.append(
            StreamIdle(
                rank=int(rank),
                stream=int(stream),
                host_wait_us=float(gap[host].sum()),
                host_wait_gaps=int(host.sum()),
                kernel_wait_us=float(gap[kernel].sum()),
                kernel_wait_gaps=int(kernel.sum()),
                other_us=float(gap[other].sum()),
                other_gaps=int(other.sum()),
            )
        )
    return out


def _drop_last_profiler_step(trace: Trace, rows: np.ndarray, launch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    steps = np.flatnonzero(trace.mask_name(lambda s: s.startswith("ProfilerStep")) & (trace.stream < 0))
    step_names = trace.name_id[steps]
    if step_names.size == 0 or (step_names == step_names[0]).all():  # fewer than two ProfilerStep names
        return rows, launch
    keep = np.ones(rows.shape, dtype=bool)
    for rank in distinct(trace.rank[rows]):
        rank_steps = steps[trace.rank[steps] == rank]
        if rank_steps.size < 2:
            continue
        last_start = trace.ts[rank_steps].max()
        in_rank = trace.rank[rows] == rank
        launched_before = (launch >= 0) & (trace.ts[np.maximum(launch, 0)] < last_start)
        keep &= ~in_rank | launched_before
    return rows[keep], launch[keep]
