"""An OpenAI-compatible locust user that measures what `vllm bench serve` measures.

TTFT: first streamed chunk carrying `choices` minus send time. ITL: gaps between
consecutive such chunks. E2EL: last such chunk minus send time. TPOT:
(E2EL - TTFT) / (output_tokens - 1). Output tokens come from the server's `usage`
when it sends one, else one per chunk. Each is fired as a locust request event
(type "LLM", names TTFT, ITL, TPOT, E2EL, output_tokens) so it shows in locust's stats,
CSVs and web UI; the unrounded samples go to the harness summary.

It reads the stream with HttpUser (requests) and `iter_lines`, which hands over each
HTTP chunk as it arrives; FastHttpUser reads 1024-byte blocks and would delay TTFT.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from typing import Any

import gevent
import orjson
from locust import HttpUser, constant, task
from locust.exception import StopUser

from servprof.harness.custom import fill, read_custom_json, read_custom_stream
from servprof.harness.datasets import RequestSpec
from servprof.harness.plugin import ENDPOINT_PATHS, HarnessState, harness_state, logger

METRIC_REQUEST_TYPE = "LLM"
# Each request carries an id `h-<process tag>-<slot index>`, so a server (and servprof's
# middleware) can link its own records to the harness's; slot indices are global.
REQUEST_ID_HEADER = "x-request-id"
_PROCESS_TAG = secrets.token_hex(3)
_model_lock = threading.Lock()


class StreamResult:
    """What one response measured, in seconds from the send."""

    def __init__(self) -> None:
        self.ttft_s: float | None = None
        self.last_s: float | None = None
        self.itl_s: list[float] = []
        self.chunks = 0
        self.output_tokens: int | None = None  # from `usage`, when the server sends it
        self.input_tokens: int | None = None
        self.error: str | None = None

    def content_chunk(self, elapsed_s: float) -> None:
        if self.ttft_s is None:
            self.ttft_s = elapsed_s
        else:
            self.itl_s.append(elapsed_s - (self.last_s or 0.0))
        self.last_s = elapsed_s
        self.chunks += 1

    def read_usage(self, body: dict[str, Any]) -> None:
        usage = body.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                self.output_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                self.input_tokens = usage["prompt_tokens"]


def read_sse(lines: Any, start: float, clock: Any = time.perf_counter) -> StreamResult:
    """Measure an OpenAI SSE stream; `lines` yields raw lines as they arrive."""
    result = StreamResult()
    for line in lines:
        now = clock()  # before parsing, so parsing time is not counted as latency
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        try:
            body = orjson.loads(payload)
        except orjson.JSONDecodeError:
            result.error = f"unreadable stream chunk: {payload[:120]!r}"
            return result
        if not isinstance(body, dict):
            continue
        if "error" in body:
            result.error = f"server error in stream: {str(body['error'])[:200]}"
            return result
        if body.get("choices"):
            result.content_chunk(now - start)
        result.read_usage(body)
    return result


class OpenAIUser(HttpUser):
    """Subclass it in a locustfile (it is abstract so importing it adds no user class).

    Override `build_payload` to change the request body. Options come from the command
    line (see servprof.harness.plugin): --endpoint, --stream, --model, --dataset, ...
    """

    abstract = True
    wait_time = constant(0)  # pacing is the pacer's job (or none, in a closed loop)

    def on_start(self) -> None:
        self.harness: HarnessState = harness_state(self.environment)

    @task
    def generate(self) -> None:
        state = self.harness
        if state.pacer is None:
            raise StopUser()
        slot = state.pacer.claim()
        if slot is None:  # a replayed trace has run out
            raise StopUser()
        if slot.due is not None:
            delay = slot.due - time.monotonic()
            if delay > 0:
                gevent.sleep(delay)
            state.collector.arrival_lag_s.append(max(time.monotonic() - slot.due, 0.0))
        self.send(state.specs[slot.index % len(state.specs)], f"h-{_PROCESS_TAG}-{slot.index}")

    def model_name(self) -> str:
        state = self.harness
        if state.options.model:
            return state.options.model
        with _model_lock:
            if state.model is None:
                state.model = "default"
                try:
                    response = self.client.get("/v1/models", name="/v1/models", headers=state.headers)
                    state.model = response.json()["data"][0]["id"]
                except Exception:
                    pass  # servers without /v1/models take any name
        return state.model

    def build_payload(self, spec: RequestSpec) -> Any:
        options = self.harness.options
        if options.endpoint == "custom":  # the --body template (servprof.harness.custom)
            return fill(self.harness.template, spec, options.stream)
        payload: dict[str, Any] = {"model": self.model_name(), "max_tokens": spec.output_tokens, "stream": options.stream}
        if options.endpoint == "chat":
            payload["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            payload["prompt"] = spec.prompt
        if options.stream:
            payload["stream_options"] = {"include_usage": True}
        if options.ignore_eos:
            payload["ignore_eos"] = True
        return payload

    def send(self, spec: RequestSpec, request_id: str) -> None:
        options = self.harness.options
        path = options.path or ENDPOINT_PATHS.get(options.endpoint, "/v1/completions")
        payload = self.build_payload(spec)
        send_unix = time.time()
        start = time.perf_counter()
        headers = {**self.harness.headers, REQUEST_ID_HEADER: request_id}
        with self.client.post(
            path, json=payload, headers=headers, stream=options.stream, catch_response=True, name=path
        ) as response:
            if response.status_code != 200:
                self.harness.collector.failures += 1
                detail = (response.text or str(response.error or "")).strip()[:200]
                response.failure(f"HTTP {response.status_code} {detail}".strip())
                self._say_why_refused(response.status_code)
                return
            try:
                result = self._read(response, start)
            except Exception as exc:  # a stream cut mid-way is a failed request, not a crash
                result = StreamResult()
                result.error = f"{type(exc).__name__}: {exc}"
            if result.error is None and result.ttft_s is None and options.stream:
                result.error = "stream ended without any token"
            if result.error is not None:
                self.harness.collector.failures += 1
                response.failure(result.error)
                return
            response.success()
        self.record(spec, result, send_unix, request_id)

    def _say_why_refused(self, status: int) -> None:
        """Once a run: a server that wants a key (vllm serve --api-key answers 401) fails every request."""
        state = self.harness
        if status in (401, 403) and not state.refusal_logged:
            state.refusal_logged = True
            sent = any(name.lower() == "authorization" for name in state.headers)
            given = "the key given was refused" if sent else "no API key was sent"
            logger.warning("servprof harness: the server answered HTTP %d (%s): give its key with --api-key KEY or "
                           "OPENAI_API_KEY, or the header it expects with --header 'NAME: VALUE'", status, given)

    def _read(self, response: Any, start: float) -> StreamResult:
        options = self.harness.options
        if options.endpoint != "custom":
            return read_sse(response.iter_lines(), start) if options.stream else self._read_json(response, start)
        result = StreamResult()
        if options.stream:  # every piece as it arrives: a plain text stream has no lines to wait for
            read_custom_stream(response.iter_content(chunk_size=None), start, options.tokens_field,
                               time.perf_counter, result)
            return result
        content = response.content
        result.last_s = time.perf_counter() - start
        try:
            body = orjson.loads(content)
        except orjson.JSONDecodeError:  # a plain text answer: its words
            body = {"text": content.decode(errors="replace")}
        read_custom_json(body, options.tokens_field, result)
        return result

    def _read_json(self, response: Any, start: float) -> StreamResult:
        body = response.json()
        result = StreamResult()
        result.last_s = time.perf_counter() - start
        result.read_usage(body)
        if result.output_tokens is None:
            choice = (body.get("choices") or [{}])[0]
            text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
            result.output_tokens = len(text.split())
        return result

    def record(self, spec: RequestSpec, result: StreamResult, send_unix: float, request_id: str = "") -> None:
        e2el = result.last_s or 0.0
        output_tokens = result.output_tokens if result.output_tokens is not None else result.chunks
        ttft = result.ttft_s
        tpot = (e2el - ttft) / (output_tokens - 1) if ttft is not None and output_tokens > 1 else math.nan
        input_tokens = result.input_tokens if result.input_tokens is not None else spec.input_tokens
        row = [send_unix, send_unix + e2el, math.nan if ttft is None else ttft, e2el, tpot, output_tokens, input_tokens]
        self.harness.collector.add_request(row, result.itl_s, request_id)

        fire = self.environment.events.request.fire

        def metric(name: str, value: float, length: int = 0) -> None:
            fire(request_type=METRIC_REQUEST_TYPE, name=name, response_time=value, response_length=length,
                 exception=None, context={})

        if ttft is not None:
            metric("TTFT", ttft * 1000.0)
        for gap in result.itl_s:
            metric("ITL", gap * 1000.0)
        if not math.isnan(tpot):
            metric("TPOT", tpot * 1000.0)
        metric("E2EL", e2el * 1000.0, output_tokens)
        # The value here is a count of tokens, not milliseconds; see the harness docs.
        metric("output_tokens", float(output_tokens), output_tokens)
