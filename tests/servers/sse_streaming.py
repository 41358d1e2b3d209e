"""A FastAPI server that streams with sse-starlette, written the way many chat demos are.

Nothing in here knows about servprof. ``model.generate`` runs in a thread with a
``TextIteratorStreamer``; the SSE endpoint's *async* generator then iterates the streamer
directly: each ``next()`` is a blocking ``queue.get`` on the event loop's thread, so the loop
waits for every token while other requests wait for the loop. (``/v1/chat/stream-ok`` does the
same with the wait moved off the loop, ``await asyncio.to_thread(next, ...)``.)

    uvicorn tests.servers.sse_streaming:app
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from threading import Thread
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, Field
from servers.hf_streaming import DEVICE, build_model, build_tokenizer
from sse_starlette.sse import EventSourceResponse
from transformers import TextIteratorStreamer

tokenizer = build_tokenizer()
model = build_model(len(tokenizer))


class ChatRequest(BaseModel):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1, le=512)


def start_generation(request: ChatRequest) -> TextIteratorStreamer:
    inputs = tokenizer(request.prompt, return_tensors="pt").to(DEVICE)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    Thread(target=model.generate, kwargs=dict(**inputs, streamer=streamer, max_new_tokens=request.max_tokens,
                                              min_new_tokens=request.max_tokens, do_sample=False,
                                              pad_token_id=tokenizer.pad_token_id)).start()
    return streamer


def create_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/chat/stream")
    async def chat_stream(request: ChatRequest) -> EventSourceResponse:
        streamer = start_generation(request)

        async def events() -> AsyncIterator[dict[str, Any]]:
            for text in streamer:  # blocks the loop until the next token
                yield {"data": text}
            yield {"data": "[DONE]"}

        return EventSourceResponse(events())

    @app.post("/v1/chat/stream-ok")
    async def chat_stream_ok(request: ChatRequest) -> EventSourceResponse:
        streamer = start_generation(request)

        async def events() -> AsyncIterator[dict[str, Any]]:
            done = object()
            while (text := await asyncio.to_thread(next, streamer, done)) is not done:
                yield {"data": text}
            yield {"data": "[DONE]"}

        return EventSourceResponse(events())

    return app


app = create_app()
