"""Decode steps that run their forward over the whole sequence: a loop without a KV cache.

A model that keeps its attention keys and values between steps (the KV cache: transformers'
``use_cache=True``, the default) runs each decode step over the one new token. A hand-written
loop that feeds the whole sequence back every step (``model(torch.cat([ids, token], 1))``), or
``generate(use_cache=False)``, recomputes every earlier token each step: the step's work grows
with the sequence, and decoding n tokens costs about n²/2 token-forwards instead of n. The trace
shows it with ``record_shapes``: each step's embedding lookup holds one token more than the step
before on its thread, whatever form marked the steps (step_kinds.mark_prefix_recompute labels
them decode, ``recomputes_prefix``; servprof's sessions need a deep window with shapes).

The cost is read from the trace, not assumed: the steps' time against their sequence length,
the median of the slopes between every two steps (a step that also stalled, or was preempted,
moves it little, where it would tip a least-squares line); that slope is what each earlier token adds to a step, and a step's
recomputation is the slope times its earlier tokens (at most the step's time). With a KV cache,
attention over the cached keys still grows with the sequence, so this is an upper estimate of
the time saved; a slope at or under zero (a GPU that is not yet busy at these lengths) costs
nothing now, and the finding says it will as sequences grow.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from servprof.detect.finding import Finding, severity_for_share
from servprof.detect.steps import Step

KIND = "decode_without_kv_cache"
MIN_STEPS = 3
FIX = (
    "Keep the KV cache between decode steps and feed each step only the new token: with transformers, leave "
    "use_cache=True (the default; drop use_cache=False from generate() or the model call), and in a hand-written "
    "loop call `out = model(next_ids, past_key_values=past, use_cache=True)` and keep `past = out.past_key_values`. "
    "Each decode step then costs about the same whatever the sequence length, instead of recomputing every earlier "
    "token."
)


def detect_no_kv_cache(steps: list[Step]) -> tuple[list[Finding], dict[str, Any]]:
    again = [s for s in steps if s.recomputes_prefix and s.tokens]
    summary: dict[str, Any] = {"steps": len(again)}
    if len(again) < MIN_STEPS:
        return [], summary
    tokens = np.array([s.tokens for s in again], dtype=float)
    time_us = np.array([s.time_us for s in again])
    slope = _median_slope(tokens, time_us)
    recompute_us = np.minimum(np.maximum(slope, 0.0) * (tokens - 1), time_us)
    decode_us = float(sum(s.time_us for s in steps if s.kind == "decode"))
    cost_ms = float(recompute_us.sum()) / 1e3
    share = cost_ms * 1e3 / decode_us if decode_us > 0 else 0.0
    summary.update({"tokens_min": int(tokens.min()), "tokens_max": int(tokens.max()),
                    "us_per_earlier_token": round(slope, 3), "recompute_ms": round(cost_ms, 3),
                    "share_of_decode_time": round(share, 4)})
    title = (f"{len(again)} decode steps ran their forward over the whole sequence ({int(tokens.min())} to "
             f"{int(tokens.max())} tokens), not over the new token: no KV cache")
    if slope > 0:
        title += (f"; each earlier token added {slope:.1f} µs to a step here, about {cost_ms:.1f} ms in all "
                  f"({share:.0%} of decode step time) recomputing them")
    else:
        title += ("; at these lengths the step time did not grow with the sequence here, it will as sequences "
                  "grow (each step's work is the whole sequence's)")
    threads = sorted({(s.rank, s.tid) for s in again})
    return [Finding(
        kind=KIND, severity=severity_for_share(share, cost_ms), cost_ms=cost_ms,
        start_us=min(s.start_us for s in again), end_us=max(s.end_us for s in again), title=title,
        request_ids=sorted({r for s in again for r in s.request_ids}),
        evidence={**summary, "threads": [{"rank": r, "thread": t} for r, t in threads],
                  "examples": [{"start_us": s.start_us, "tokens": s.tokens, "step_ms": round(s.time_us / 1e3, 4)}
                               for s in again[:: max(1, len(again) // 5)][:5]]},
        fix=FIX,
    )], summary


def _median_slope(tokens: np.ndarray, time_us: np.ndarray, most: int = 600) -> float:
    """The median slope over all pairs of steps of different lengths (Theil-Sen), from at most
    ``most`` steps spread over the run; 0 when all have one length."""
    if tokens.size > most:
        keep = np.linspace(0, tokens.size - 1, most).astype(int)
        tokens, time_us = tokens[keep], time_us[keep]
    i, j = np.triu_indices(tokens.size, k=1)
    apart = tokens[j] - tokens[i]
    valid = apart != 0
    return float(np.median((time_us[j] - time_us[i])[valid] / apart[valid])) if valid.any() else 0.0
