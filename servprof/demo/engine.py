"""The demo server's engine: one thread running continuous batching over a slot KV cache.

Requests arrive tokenized, wait in a queue, are admitted into free slots and
prefilled, and join the running decode batch; every decode step advances every
active request. Finished, stopped or cancelled (client gone) requests leave the
batch and free their slot. Outputs reach asyncio through `loop.call_soon_threadsafe`.

On the clean path the sampled tokens stay on the device: the next step reads them
from a device table, and the host reads step N's tokens only after it has
launched step N+1 (one step behind, like asynchronous schedulers do). The
`sync_per_step` knob reads them right after every step instead.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from servprof.demo.model import LlamaLikeModel
from servprof.demo.sampling import SamplingParams, SlotSampler
from servprof.demo.stats import EngineStats
from servprof.demo.tokenizer import DemoTokenizer, IncrementalDetokenizer
from servprof.phases import phase


@dataclass
class Output:
    """A piece of a request's output; `finish_reason` is set on the last one."""

    text: str
    token_count: int
    finish_reason: str | None = None


@dataclass(eq=False)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    deliver: Callable[[Output], None]
    enqueued_ns: int = 0
    slot: int = -1
    length: int = 0  # tokens held in the KV cache
    launched: int = 0  # tokens sampled so far (some may not be read yet)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # characters of `text` already delivered
    in_batch: bool = False
    finished: bool = False
    cancelled: bool = False
    admitted_ns: int = 0  # prefill start; admitted_ns - enqueued_ns is the time queued
    first_token_ns: int = 0
    detokenizer: IncrementalDetokenizer | None = None


@dataclass
class _Launch:
    """Tokens sampled for `requests` by one prefill or decode step, not read yet."""

    requests: list[EngineRequest]
    tokens: torch.Tensor
    ready: torch.cuda.Event | None = None


def asyncio_sink(loop: asyncio.AbstractEventLoop, target: asyncio.Queue[Output]) -> Callable[[Output], None]:
    def deliver(output: Output) -> None:
        loop.call_soon_threadsafe(target.put_nowait, output)

    return deliver


class Engine:
    def __init__(
        self,
        model: LlamaLikeModel,
        tokenizer: DemoTokenizer,
        *,
        step_delay_ms: float = 0.0,
        sync_per_step: bool = False,
        timeline_size: int = 4096,
        decode: Callable[..., torch.Tensor] | None = None,
        leak_bytes_per_request: int = 0,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.decode = decode or model.decode  # servprof.demo.compiled.CompiledDecode under --compile
        # Fault knob: a per-request cache that never frees (each admitted request keeps this much).
        self.leak_bytes_per_request = leak_bytes_per_request
        self._leaked: list[torch.Tensor] = []
        self.step_delay_ns = int(step_delay_ms * 1e6)
        self.sync_per_step = sync_per_step
        self.device = model.device
        self.stats = EngineStats(timeline_size)
        self.sampler = SlotSampler(model.slots, tokenizer.vocab_size, self.device)
        self.last_token = torch.zeros(model.slots, dtype=torch.long, device=self.device)
        self._incoming: queue.SimpleQueue[EngineRequest | None] = queue.SimpleQueue()
        self._waiting: deque[EngineRequest] = deque()
        self._batch: list[EngineRequest] = []
        self._free_slots = list(range(model.slots))
        self._pending: list[_Launch] = []
        self._stopping = False
        self._closing = threading.Lock()  # submit() against the engine's exit
        self._closed = False
        self._last_step_end_ns = 0
        self._thread = threading.Thread(target=self._run, name="servprof-demo-engine", daemon=True)
        self._error: BaseException | None = None

    # -- called from other threads ------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._incoming.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def submit(self, request: EngineRequest) -> None:
        request.enqueued_ns = time.perf_counter_ns()
        with self._closing:
            self.stats.submitted += 1
            if not self._closed:
                self._incoming.put(request)
                return
        self._finish(request, "error")  # the engine has stopped: answer now rather than never

    def cancel(self, request: EngineRequest) -> None:
        """The client went away: the engine drops the request at its next iteration."""
        if not request.finished:
            request.cancelled = True
            self._incoming.put(None)  # wake the engine if it is idle

    def snapshot(self, steps: int | None = None) -> dict[str, object]:
        return self.stats.snapshot(
            steps,
            batch_size=len(self._batch),
            queue_length=len(self._waiting) + self._incoming.qsize(),
            free_slots=len(self._free_slots),
            slots=self.model.slots,
            engine_alive=self.alive,
            engine_error=repr(self._error) if self._error else None,
            engine_thread_native_id=self._thread.native_id,
            leaked_bytes=self.leak_bytes_per_request * len(self._leaked),
            leaked_requests=len(self._leaked),
        )

    # -- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while not self._stopping:
                    self._iteration()
        except BaseException as exc:  # the engine must not die silently: fail what it holds
            self._error = exc
            self._close()
            raise
        self._close()  # stopped (server shutdown): nobody waits forever

    def _close(self) -> None:
        with self._closing:
            self._closed = True
        self._take_incoming(block=False)
        self._fail_outstanding()

    def _fail_outstanding(self) -> None:
        in_flight = (r for launch in self._pending for r in launch.requests)
        for request in itertools.chain(list(self._batch), self._waiting, in_flight):
            if not request.finished:
                self._finish(request, "error")

    def _iteration(self) -> None:
        self._take_incoming(block=not (self._batch or self._pending or self._waiting))
        self._drop_cancelled()
        launched: list[_Launch] = []
        self._admit(launched)
        if self._batch:
            launched.append(self._decode_step())
        if self.sync_per_step:
            # The knob: block on every step's tokens before the next step is launched.
            ready, self._pending = self._pending + launched, []
            self.stats.blocking_syncs += len(ready)
        else:
            # Read what the previous iteration launched; this iteration's work runs meanwhile.
            ready, self._pending = self._pending, launched
            if not launched:
                ready, self._pending = ready + self._pending, []
        for launch in ready:
            self._process(launch)

    def _take_incoming(self, block: bool) -> None:
        try:
            item = self._incoming.get(timeout=0.5) if block else self._incoming.get_nowait()
            while True:
                if item is not None:
                    self._waiting.append(item)
                item = self._incoming.get_nowait()
        except queue.Empty:
            pass

    def _drop_cancelled(self) -> None:
        for request in [r for r in self._batch if r.cancelled]:
            self._finish(request, "cancelled")
        if any(r.cancelled for r in self._waiting):
            for request in [r for r in self._waiting if r.cancelled]:
                self._waiting.remove(request)
                self._finish(request, "cancelled")

    def _admit(self, launched: list[_Launch]) -> None:
        while self._waiting and self._free_slots:
            request = self._waiting.popleft()
            request.slot = heapq.heappop(self._free_slots)  # lowest first keeps the batch consecutive
            request.admitted_ns = started = time.perf_counter_ns()
            self.stats.record_queue(started - request.enqueued_ns)
            with phase("prefill", request_id=request.request_id):
                prompt = torch.tensor(request.prompt_ids, dtype=torch.long)
                if self.device.type == "cuda":
                    prompt = prompt.pin_memory().to(self.device, non_blocking=True)
                logits = self.model.prefill(request.slot, prompt)
                self.sampler.assign(request.slot, request.params)
                slot_index = self.model.slot_ids[request.slot : request.slot + 1]
                token = self.sampler.sample(logits[None], [request.slot], slot_index)
                self.last_token[request.slot] = token[0]
                if self.leak_bytes_per_request:  # written, so the pages are really held
                    self._leaked.append(torch.ones(self.leak_bytes_per_request, dtype=torch.uint8, device=self.device))
            self.stats.prefills += 1
            self.stats.prefill_tokens += len(request.prompt_ids)
            request.length = len(request.prompt_ids)
            request.launched = 1
            request.detokenizer = self.tokenizer.decode_stream()
            request.in_batch = request.launched < request.params.max_tokens
            if request.in_batch:
                self._batch.append(request)
            launched.append(self._read_later([request], token))

    def _decode_step(self) -> _Launch:
        if self.step_delay_ns:
            _host_delay(self.step_delay_ns)
        start = time.perf_counter_ns()
        # In slot order: when the slots are consecutive, attention reads the KV cache in place.
        batch = sorted(self._batch, key=lambda r: r.slot)
        slots = [r.slot for r in batch]
        first = slots[0]
        rows = slice(first, first + len(slots)) if slots[-1] - first == len(slots) - 1 else None
        with phase("decode_step", request_ids=[r.request_id for r in batch]):
            host_index = torch.tensor([slots, [r.length for r in batch]], dtype=torch.long)
            if self.device.type == "cuda":
                host_index = host_index.pin_memory()
            index = host_index.to(self.device, non_blocking=True)
            slot_index, lengths = index[0], index[1]
            logits = self.decode(
                self.last_token[slot_index], slot_index, lengths, max(r.length for r in batch) + 1, rows
            )
            tokens = self.sampler.sample(logits, slots, slot_index)
            self.last_token[slot_index] = tokens
        for request in batch:
            request.length += 1
            request.launched += 1
            if request.launched >= request.params.max_tokens:
                request.in_batch = False
        self._batch = [r for r in batch if r.in_batch]
        end = time.perf_counter_ns()
        gap = start - self._last_step_end_ns if self._last_step_end_ns else 0
        self.stats.record_step(start, end, len(batch), gap, self.sync_per_step)
        self._last_step_end_ns = end
        return self._read_later(batch, tokens)

    def _read_later(self, requests: list[EngineRequest], tokens: torch.Tensor) -> _Launch:
        if self.device.type != "cuda":
            return _Launch(requests, tokens)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return _Launch(requests, host, ready)

    def _process(self, launch: _Launch) -> None:
        if launch.ready is not None:
            launch.ready.synchronize()
        token_ids = launch.tokens.tolist()
        now = time.perf_counter_ns()
        accepted = [(request, token_id) for request, token_id in zip(launch.requests, token_ids, strict=True)
                    # not stopped or cancelled while this token was in flight, and not its end
                    if not request.finished and self._accept_token(request, token_id, now)]
        if not accepted:
            return
        # One range for the whole batch's detokenization, tagged with each request in it: a range
        # per request would put batch-size ranges per step into the trace, and a session's stop()
        # costs a few µs per range (a light session's budget is counted in ranges).
        with phase("detokenize", request_ids=(request.request_id for request, _ in accepted)):
            pieces = [request.detokenizer.step(token_id) for request, token_id in accepted]  # type: ignore[union-attr]
        for (request, _), piece in zip(accepted, pieces, strict=True):
            self._emit_text(request, piece)

    def _accept_token(self, request: EngineRequest, token_id: int, now: int) -> bool:
        """Count the token; False where it ends the request (its end-of-sequence token)."""
        if not request.first_token_ns:
            request.first_token_ns = now
        self.stats.output_tokens += 1
        if token_id in self.tokenizer.eos_ids and not request.params.ignore_eos:
            self._finish(request, "stop")
            return False
        request.output_ids.append(token_id)
        return True

    def _emit_text(self, request: EngineRequest, piece: str) -> None:
        request.text += piece
        stops = request.params.stop
        if stops:
            # Only the new tail can complete a stop string.
            search_from = max(0, request.emitted - max(len(s) for s in stops))
            hits = [i for i in (request.text.find(s, search_from) for s in stops) if i >= 0]
            if hits:
                request.text = request.text[: min(hits)]
                self._finish(request, "stop")
                return
        if len(request.output_ids) >= request.params.max_tokens:
            self._finish(request, "length")
            return
        # Hold back text that may be the start of a stop string.
        hold = max((len(s) - 1 for s in stops), default=0)
        upto = max(request.emitted, len(request.text) - hold)
        if upto > request.emitted:
            request.deliver(Output(request.text[request.emitted : upto], 1))
            request.emitted = upto
        else:
            request.deliver(Output("", 1))

    def _finish(self, request: EngineRequest, reason: str) -> None:
        request.finished = True
        if request.in_batch:
            request.in_batch = False
            self._batch = [r for r in self._batch if r is not request]
        if request.slot >= 0:
            heapq.heappush(self._free_slots, request.slot)
            request.slot = -1
        self.stats.record_finish(request, reason)
        if reason != "cancelled":
            request.deliver(Output(request.text[request.emitted :], 0, finish_reason=reason))
            request.emitted = len(request.text)


def _host_delay(nanoseconds: int) -> None:
    # Busy host work in the engine thread (a slow scheduler, Python bookkeeping):
    # the device idles between steps for this long.
    deadline = time.perf_counter_ns() + nanoseconds
    while time.perf_counter_ns() < deadline:
        pass
