"""Cheap probes of vLLM's API-server process while a session runs.

vLLM tokenizes on a one-thread pool (`renderer._executor`) and detokenizes on the
event loop of the API process. A worker-side trace sees neither, so during a
session servprof measures them here:

- per request, the wall time of `renderer._tokenize_prompt_async` (queue + work),
  tagged with the request id from servprof's contextvar;
- the tokenizer pool's queueing, by submitting a no-op to the same pool every few
  milliseconds and timing how long it waits for the one thread;
- event-loop lag, with a ticker that notes how late each sleep wakes.

Probes run only during a session and are removed after it: an unsampled server
pays nothing. Every hook is guarded: a vLLM version without the attribute just
reports the probe as unavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import numpy as np

from servprof.request_context import current_request_id

TICK_S = 0.001  # loop-lag ticker period
POOL_PROBE_S = 0.005  # how often a no-op is put on the tokenizer pool
LOOP_STALL_MS = 20.0  # a loop lag above this is reported as a stall
QUEUE_STALL_MS = 10.0  # a tokenizer-pool wait above this is reported
MAX_SAMPLES = 200_000  # bounds memory on long sessions


class ApiProbes:
    """One session's probes. `start()` and `stop()` on the event loop, then `summary()` off it."""

    def __init__(self, renderer: Any) -> None:
        self.renderer = renderer
        self.problems: list[str] = []
        self.tokenize_spans: list[tuple[str | None, int, int]] = []  # (request id, start ns, end ns), wall clock
        self.loop_lag: list[tuple[int, float]] = []  # (wall ns at wake, lag ms)
        self.pool_wait: list[tuple[int, float]] = []  # (wall ns when submitted, wait ms)
        self._original_tokenize: Any = None
        self._tasks: list[asyncio.Task] = []
        self._running = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._running = True
        self._wrap_tokenizer()
        self._tasks = [asyncio.create_task(self._tick_loop(), name="servprof-loop-lag")]
        if getattr(self.renderer, "_executor", None) is not None:
            self._tasks.append(asyncio.create_task(self._probe_pool(), name="servprof-pool-probe"))
        else:
            self.problems.append("vLLM renderer has no _executor: tokenizer-pool queueing not measured")

    async def stop(self) -> None:
        """Remove the probes (on the event loop); summary() is then computed off the loop."""
        self._running = False
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):  # a probe never fails the session
                await task
        self._unwrap_tokenizer()

    # ------------------------------------------------------------------ probes

    def _wrap_tokenizer(self) -> None:
        original = getattr(self.renderer, "_tokenize_prompt_async", None)
        if original is None:
            self.problems.append("vLLM renderer has no _tokenize_prompt_async: per-request tokenization not timed")
            return
        spans = self.tokenize_spans

        async def timed_tokenize(*args: Any, **kwargs: Any) -> Any:
            start = time.time_ns()
            try:
                return await original(*args, **kwargs)
            finally:
                if len(spans) < MAX_SAMPLES:
                    spans.append((current_request_id(), start, time.time_ns()))

        self._original_tokenize = original
        self.renderer._tokenize_prompt_async = timed_tokenize

    def _unwrap_tokenizer(self) -> None:
        if self._original_tokenize is not None:
            self.renderer._tokenize_prompt_async = self._original_tokenize
            self._original_tokenize = None

    async def _tick_loop(self) -> None:
        samples = self.loop_lag
        while self._running:
            before = time.perf_counter()
            await asyncio.sleep(TICK_S)
            lag_ms = (time.perf_counter() - before - TICK_S) * 1e3
            if len(samples) < MAX_SAMPLES:
                samples.append((time.time_ns(), max(lag_ms, 0.0)))

    async def _probe_pool(self) -> None:
        loop = asyncio.get_running_loop()
        executor = self.renderer._executor
        while self._running:
            submitted = time.perf_counter()
            submitted_wall = time.time_ns()
            ran_at = await loop.run_in_executor(executor, time.perf_counter)
            if len(self.pool_wait) < MAX_SAMPLES:
                self.pool_wait.append((submitted_wall, (ran_at - submitted) * 1e3))
            await asyncio.sleep(POOL_PROBE_S)

    # ------------------------------------------------------------------ results

    def summary(self, request_ids: set[str] | None = None) -> dict[str, Any]:
        """The measurements, per request for `request_ids` only (the session's sampled ones:
        every request carries an id, sampled or not). Call it off the serving loop."""
        lag = np.array([ms for _, ms in self.loop_lag]) if self.loop_lag else np.zeros(0)
        wait_at = np.array([at for at, _ in self.pool_wait], dtype=np.int64)  # submitted in order
        wait = np.array([ms for _, ms in self.pool_wait]) if self.pool_wait else np.zeros(0)
        per_request: dict[str, dict[str, float]] = {}
        for request_id, start, end in self.tokenize_spans:
            if request_id is None or (request_ids is not None and request_id not in request_ids):
                continue
            entry = per_request.setdefault(request_id, {"tokenize_ms": 0.0, "start_ns": start, "end_ns": end})
            entry["tokenize_ms"] += (end - start) / 1e6
            entry["end_ns"] = max(entry["end_ns"], end)
        for entry in per_request.values():
            # Queueing on the one-thread pool that overlapped this request's tokenization.
            lo = np.searchsorted(wait_at, entry["start_ns"], side="left")
            hi = np.searchsorted(wait_at, entry["end_ns"], side="right")
            entry["pool_wait_max_ms"] = float(wait[lo:hi].max()) if hi > lo else 0.0
        return {
            "problems": list(self.problems),
            "loop_lag_ms": _percentiles(lag),
            "loop_stalls": [{"at_ns": at, "lag_ms": round(ms, 3)} for at, ms in self.loop_lag if ms >= LOOP_STALL_MS],
            "tokenizer_pool_wait_ms": _percentiles(wait),
            "tokenize": per_request,
            "tokenize_calls": len(self.tokenize_spans),
            "tokenize_calls_without_request": sum(1 for rid, _, _ in self.tokenize_spans if rid is None),
        }


def _percentiles(values: np.ndarray) -> dict[str, float | int]:
    if values.size == 0:
        return {"count": 0}
    p50, p99 = np.percentile(values, [50, 99])
    return {"count": int(values.size), "p50": round(float(p50), 3), "p99": round(float(p99), 3),
            "max": round(float(values.max()), 3)}


def api_findings(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Tokenization stalls seen on the API side, in the Finding dict format of the detectors."""
    findings: list[dict[str, Any]] = []
    for request_id, entry in summary.get("tokenize", {}).items():
        queued = entry.get("pool_wait_max_ms", 0.0)
        cost = entry["tokenize_ms"]
        if cost < QUEUE_STALL_MS and queued < QUEUE_STALL_MS:
            continue
        findings.append({
            "kind": "tokenization_stall", "severity": "critical" if cost >= 100 else "warning",
            "cost_ms": round(cost, 3), "start_us": entry["start_ns"] / 1e3, "end_us": entry["end_ns"] / 1e3,
            "request_ids": [request_id],
            "title": f"tokenization took {cost:.1f} ms in vLLM's API process"
                     + (f" (waited up to {queued:.1f} ms for the one-thread tokenizer pool)" if queued >= 1 else ""),
            "evidence": {"source": "vllm_api_process", "tokenize_ms": round(cost, 3),
                         "pool_wait_max_ms": round(queued, 3),
                         "hint": "raise --renderer-num-workers or shorten prompts"},
        })
    stalls = summary.get("loop_stalls", [])
    if stalls:
        total = sum(s["lag_ms"] for s in stalls)
        findings.append({
            "kind": "tokenization_stall", "severity": "critical" if max(s["lag_ms"] for s in stalls) >= 100 else "warning",
            "cost_ms": round(total, 3), "start_us": stalls[0]["at_ns"] / 1e3, "end_us": stalls[-1]["at_ns"] / 1e3,
            "request_ids": [],
            "title": f"vLLM's API event loop stalled {len(stalls)} times (worst {max(s['lag_ms'] for s in stalls):.1f} ms)",
            "evidence": {"source": "vllm_api_event_loop", "stalls": stalls[:50],
                         "hint": "vLLM detokenizes on the event loop; long outputs or many streams block it"},
        })
    return findings
