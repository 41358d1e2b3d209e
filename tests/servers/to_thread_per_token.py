"""A FastAPI LLM server that streams one token per ``await asyncio.to_thread(...)``: each decode
step of the model runs on the default executor's threads, one call per token, and the event loop
awaits it, as people write a streaming endpoint that must not block the loop.

Nothing in here knows about servprof. The tiny Llama and tokenizer of hf_streaming.py.

    uvicorn tests.servers.to_thread_per_token:app
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import torch
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from servers.hf_streaming import DEVICE, CompletionRequest, build_model, build_tokenizer

tokenizer = build_tokenizer()
model = build_model(len(tokenizer))


def forward(input_ids: torch.Tensor, past: Any) -> tuple[int, Any]:
    with torch.no_grad():
        out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
    return int(out.logits[0, -1].argmax()), out.past_key_values


def create_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest) -> StreamingResponse:
        ids = tokenizer(request.prompt, return_tensors="pt")["input_ids"].to(DEVICE)

        async def stream() -> AsyncIterator[str]:
            token, past = await asyncio.to_thread(forward, ids, None)
            for _ in range(request.max_tokens):
                yield f"data: {json.dumps({'text': tokenizer.decode([token])})}\n\n"
                token, past = await asyncio.to_thread(forward, torch.tensor([[token]], device=DEVICE), past)
            yield f"data: {json.dumps({'usage': {'completion_tokens': request.max_tokens}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


app = create_app()
