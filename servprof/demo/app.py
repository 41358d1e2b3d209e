"""The demo LLM server: an OpenAI-compatible FastAPI app over the batching engine.

    from servprof.demo.app import create_app
    from servprof.demo.config import DemoConfig
    app = create_app(DemoConfig(size="tiny"))

Endpoints: POST /v1/completions, POST /v1/chat/completions (stream or not),
GET /v1/models, GET /health, GET /demo/stats (engine counters and step timeline).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio.to_thread
import orjson
import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from servprof.demo.api import (
    APIError,
    ParsedRequest,
    completion_body,
    completion_chunk,
    parse_request,
    usage,
    usage_chunk,
)
from servprof.demo.config import DemoConfig
from servprof.demo.engine import Engine, EngineRequest, Output, asyncio_sink
from servprof.demo.model import LlamaLikeModel, model_config
from servprof.demo.tokenizer import DemoTokenizer
from servprof.phases import phase
from servprof.request_context import annotate_request, current_request_id, new_request_id

logger = logging.getLogger("servprof.demo")
LOOP_PROBE_INTERVAL_S = 0.01
MAX_BODY_BYTES = 8 << 20


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class DemoServer:
    """What the routes share: config, tokenizer, model, engine, and the event-loop thread."""

    def __init__(self, config: DemoConfig):
        self.config = config
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(
                f"--device {config.device}: this torch ({torch.__version__}) sees no CUDA device"
            )
        dtype = getattr(torch, config.torch_dtype_name)
        if config.model_path:
            from servprof.demo.hf import load_hf

            self.model, self.tokenizer = load_hf(
                config.model_path,
                slots=config.max_batch,
                context=config.context_length,
                device=config.device,
                dtype=dtype,
                slow_us_per_token=config.slow_tokenizer_us_per_token,
            )
        else:
            self.tokenizer = DemoTokenizer(slow_us_per_token=config.slow_tokenizer_us_per_token)
            model_cfg = model_config(config.size, min_vocab=self.tokenizer.vocab_size)
            self.model = LlamaLikeModel(
                model_cfg,
                slots=config.max_batch,
                context=config.context_length,
                device=config.device,
                dtype=dtype,
                seed=config.seed,
            )
        self.compiled = None
        if config.compile:
            from servprof.demo.compiled import CompiledDecode

            self.compiled = CompiledDecode(self.model, config.compile_backend, pad=not config.unpadded_batches)
            self.compiled.warm_up()  # every bucket compiled before the first request
        self.engine = Engine(
            self.model,
            self.tokenizer,
            step_delay_ms=config.step_delay_ms,
            sync_per_step=config.sync_per_step,
            timeline_size=config.step_timeline,
            decode=self.compiled,
            leak_bytes_per_request=int(config.leak_mb_per_request * 1024 * 1024),
        )
        self.loop_thread_id = 0
        self.loop_thread_native_id = 0
        self.created = int(time.time())

    async def tokenize(self, text: str, request_id: str) -> list[int]:
        def work() -> tuple[list[int], int, bool]:
            started = time.perf_counter_ns()
            with phase("tokenize", request_id=request_id):
                ids = self.tokenizer.encode(text)
            return ids, time.perf_counter_ns() - started, threading.get_ident() == self.loop_thread_id

        if self.config.tokenize_on_loop:  # fault knob (a): the event loop does the work
            ids, elapsed, on_loop = work()
        else:
            ids, elapsed, on_loop = await anyio.to_thread.run_sync(work)
        self.engine.stats.record_tokenize(elapsed, on_loop)
        return ids

    async def probe_loop_lag(self) -> None:
        # How late the loop wakes up is how long something blocked it.
        interval_ns = int(LOOP_PROBE_INTERVAL_S * 1e9)
        while True:
            before = time.perf_counter_ns()
            await asyncio.sleep(LOOP_PROBE_INTERVAL_S)
            self.engine.stats.record_loop_lag(max(0, time.perf_counter_ns() - before - interval_ns))


def create_app(config: DemoConfig | None = None) -> FastAPI:
    config = config or DemoConfig.from_env()
    server = DemoServer(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.loop_thread_id = threading.get_ident()
        server.loop_thread_native_id = threading.get_native_id()  # the tid a profiler trace shows
        server.engine.start()
        probe = asyncio.create_task(server.probe_loop_lag())
        try:
            yield
        finally:
            probe.cancel()
            await anyio.to_thread.run_sync(server.engine.stop)

    app = FastAPI(title="servprof demo LLM server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.demo = server

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("demo server: unexpected error")
        return error_response(APIError("internal error in the demo server", status=500, type_="server_error"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(server, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(server, request, chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        card = {
            "id": config.served_model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "servprof",
            "max_model_len": config.context_length,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> Response:
        ok = server.engine.alive
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503)

    @app.get("/demo/stats")
    async def stats(steps: int | None = None) -> Response:
        body = server.engine.snapshot(steps)
        body["config"] = dict(vars(config))
        if server.compiled is not None:
            body["compile"] = server.compiled.info()
        body["model"] = config.served_model_name
        body["event_loop_thread_native_id"] = server.loop_thread_native_id
        return JSONResponse(body)

    if config.servprof:
        _add_servprof(app)
    return app


def _add_servprof(app: FastAPI) -> None:
    if importlib.util.find_spec("servprof.middleware") is None:
        logger.info("servprof.middleware is not available: serving without servprof")
        return
    try:
        middleware = importlib.import_module("servprof.middleware").ServprofMiddleware
        app.add_middleware(middleware)
    except Exception as exc:  # serving comes first: a broken profiler must not stop the server
        logger.warning("servprof middleware could not be added (%s): serving without it", exc)


async def _generate(server: DemoServer, request: Request, *, chat: bool) -> Response:
    config = server.config
    parsed = parse_request(await _read_body(request), chat=chat, max_tokens_limit=config.tokens_limit)
    if not server.engine.alive:
        raise APIError("the engine has stopped", status=503, type_="server_error", code="engine_stopped")
    request_id = current_request_id() or new_request_id()
    text = server.tokenizer.chat_prompt(parsed.messages) if parsed.messages is not None else parsed.prompt
    prompt_ids = await server.tokenize(text, request_id)
    _check_length(len(prompt_ids), parsed, config.context_length)
    outputs: asyncio.Queue[Output] = asyncio.Queue()
    engine_request = EngineRequest(
        request_id, prompt_ids, parsed.params, asyncio_sink(asyncio.get_running_loop(), outputs)
    )
    server.engine.submit(engine_request)
    if parsed.stream:
        stream = _stream(server, engine_request, outputs, parsed, chat=chat)
        return StreamingResponse(
            stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    pieces: list[str] = []
    watcher = asyncio.create_task(_cancel_on_disconnect(server, request, engine_request))
    try:
        while True:
            output = await outputs.get()
            pieces.append(output.text)
            if output.finish_reason is not None:
                break
    finally:
        watcher.cancel()
        if not engine_request.finished:
            server.engine.cancel(engine_request)
    if engine_request.cancelled:
        raise APIError("the client disconnected", status=499, code="client_disconnected")
    _annotate(server, engine_request, output.finish_reason)
    if output.finish_reason == "error":
        raise APIError("the engine failed while generating", status=500, type_="server_error")
    body = completion_body(
        request_id,
        config.served_model_name,
        "".join(pieces),
        output.finish_reason,
        usage(len(prompt_ids), len(engine_request.output_ids)),
        chat=chat,
    )
    return JSONResponse(body)


async def _read_body(request: Request) -> bytes:
    # A bounded read: a huge body is refused before it is buffered and tokenized.
    too_large = APIError(
        f"the request body is over {MAX_BODY_BYTES // (1 << 20)} MiB", status=413, code="request_too_large"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def _cancel_on_disconnect(server: DemoServer, request: Request, engine_request: EngineRequest) -> None:
    # The body is read, so the next ASGI message is the client going away: free the slot
    # then, instead of generating for nobody.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            server.engine.cancel(engine_request)
            engine_request.deliver(Output("", 0, finish_reason="cancelled"))
            return


def _check_length(prompt_tokens: int, parsed: ParsedRequest, context: int) -> None:
    param = "messages" if parsed.messages is not None else "prompt"
    if prompt_tokens == 0:
        raise APIError("the prompt has no tokens", param=param, code="invalid_value")
    if prompt_tokens >= context:
        raise APIError(
            f"the prompt is {prompt_tokens} tokens; this model's context is {context}",
            param=param,
            code="context_length_exceeded",
        )
    if prompt_tokens + parsed.params.max_tokens > context:
        raise APIError(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({parsed.params.max_tokens}) exceeds "
            f"the context of {context} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )


async def _stream(
    server: DemoServer,
    engine_request: EngineRequest,
    outputs: asyncio.Queue[Output],
    parsed: ParsedRequest,
    *,
    chat: bool,
) -> AsyncIterator[bytes]:
    model, request_id, created = server.config.served_model_name, engine_request.request_id, int(time.time())
    finish_reason: str | None = None
    first = True
    try:
        while finish_reason is None:
            output = await outputs.get()
            finish_reason = output.finish_reason
            if not output.text and finish_reason is None:
                continue  # a token whose text is still incomplete (partial UTF-8, possible stop string)
            chunk = completion_chunk(
                request_id, model, output.text, finish_reason, chat=chat, created=created, first=first
            )
            first = False
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        if parsed.include_usage:
            chunk = usage_chunk(request_id, model, created, len(engine_request.prompt_ids),
                                len(engine_request.output_ids), chat=chat)
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        # Client gone (or any early exit): the engine frees the slot at its next iteration.
        if not engine_request.finished:
            server.engine.cancel(engine_request)
        _annotate(server, engine_request, finish_reason or "cancelled")


def _annotate(server: DemoServer, engine_request: EngineRequest, finish_reason: str | None) -> None:
    annotate_request(
        **{
            "gen_ai.usage.input_tokens": len(engine_request.prompt_ids),
            "gen_ai.usage.output_tokens": len(engine_request.output_ids),
            "gen_ai.response.model": server.config.served_model_name,
            "gen_ai.response.finish_reasons": [finish_reason or "unknown"],
        }
    )
