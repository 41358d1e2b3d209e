"""Counters and a bounded step timeline the demo engine keeps about itself (for /demo/stats)."""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from servprof.demo.engine import EngineRequest


class EngineStats:
    def __init__(self, timeline_size: int = 4096, request_history: int = 1024):
        self.submitted = 0
        self.prefills = 0
        self.prefill_tokens = 0
        self.output_tokens = 0
        self.steps = 0
        self.blocking_syncs = 0  # host waits on the tokens just sampled, before the next step
        self.finished: Counter[str] = Counter()
        self.queue_ns_total = 0
        self.queue_ns_max = 0
        self.tokenize_count = 0
        self.tokenize_ns_total = 0
        self.tokenize_ns_max = 0
        self.tokenize_on_loop_ns = 0  # tokenization time spent on the event-loop thread
        self.loop_lag_ns_max = 0  # worst lateness of the event-loop probe
        self.loop_lag_ns_total = 0
        self.loop_probes = 0
        # Each step: (start_ns, end_ns, batch_size, host_gap_ns before it, synced after it).
        self.timeline: deque[tuple[int, int, int, int, bool]] = deque(maxlen=timeline_size)
        self.requests: deque[dict[str, Any]] = deque(maxlen=request_history)

    def record_step(self, start_ns: int, end_ns: int, batch_size: int, gap_ns: int, synced: bool) -> None:
        self.steps += 1
        self.timeline.append((start_ns, end_ns, batch_size, gap_ns, synced))

    def record_queue(self, waited_ns: int) -> None:
        self.queue_ns_total += waited_ns
        self.queue_ns_max = max(self.queue_ns_max, waited_ns)

    def record_tokenize(self, elapsed_ns: int, on_loop: bool) -> None:
        self.tokenize_count += 1
        self.tokenize_ns_total += elapsed_ns
        self.tokenize_ns_max = max(self.tokenize_ns_max, elapsed_ns)
        if on_loop:
            self.tokenize_on_loop_ns += elapsed_ns

    def record_loop_lag(self, lag_ns: int) -> None:
        self.loop_probes += 1
        self.loop_lag_ns_total += lag_ns
        self.loop_lag_ns_max = max(self.loop_lag_ns_max, lag_ns)

    def record_finish(self, request: EngineRequest, reason: str) -> None:
        self.finished[reason] += 1
        self.requests.append(
            {
                "request_id": request.request_id,
                "prompt_tokens": len(request.prompt_ids),
                "output_tokens": len(request.output_ids),
                "finish_reason": reason,
                "enqueued_ns": request.enqueued_ns,
                "admitted_ns": request.admitted_ns,
                "first_token_ns": request.first_token_ns,
                "finished_ns": time.perf_counter_ns(),
            }
        )

    def snapshot(self, steps: int | None = None, **live: Any) -> dict[str, Any]:
        timeline = list(self.timeline)
        if steps is not None:
            timeline = timeline[-steps:] if steps > 0 else []
        return {
            **live,
            "requests_submitted": self.submitted,
            "requests_finished": dict(self.finished),
            "prefills": self.prefills,
            "prefill_tokens": self.prefill_tokens,
            "output_tokens": self.output_tokens,
            "decode_steps": self.steps,
            "blocking_syncs": self.blocking_syncs,
            "queue_ns_total": self.queue_ns_total,
            "queue_ns_max": self.queue_ns_max,
            "tokenize": {
                "count": self.tokenize_count,
                "ns_total": self.tokenize_ns_total,
                "ns_max": self.tokenize_ns_max,
                "on_loop_ns": self.tokenize_on_loop_ns,
            },
            "loop_lag": {
                "probes": self.loop_probes,
                "ns_max": self.loop_lag_ns_max,
                "ns_total": self.loop_lag_ns_total,
            },
            "steps": [
                {"start_ns": s, "end_ns": e, "batch_size": b, "gap_ns": g, "synced": y}
                for s, e, b, g, y in timeline
            ],
            "recent_requests": list(self.requests)[-64:],
        }
