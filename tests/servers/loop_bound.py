"""A FastAPI LLM server that runs its model on the event loop, as a first server is often written.

Nothing in here knows about servprof. The streaming endpoint's async generator runs a tiny
transformers Llama (random weights from a config, nothing downloaded) one forward per token,
with its KV cache, and yields each token as it comes: every forward pass runs on the event
loop's thread. ``/v1/generate`` awaits nothing either: one blocking ``model.generate()`` inside
an ``async def`` handler.

    uvicorn tests.servers.loop_bound:app
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import torch
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from servers.hf_streaming import DEVICE, CompletionRequest, build_model, build_tokenizer

tokenizer = build_tokenizer()
model = build_model(len(tokenizer))


def create_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest) -> StreamingResponse:
        async def stream() -> AsyncIterator[str]:
            ids = tokenizer(request.prompt, return_tensors="pt").input_ids.to(DEVICE)
            past = None
            with torch.no_grad():
                for _ in range(request.max_tokens):
                    out = model(input_ids=ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
                    past = out.past_key_values
                    token = out.logits[:, -1].argmax(-1, keepdim=True)
                    ids = torch.cat([ids, token], dim=1)
                    yield f"data: {json.dumps({'text': tokenizer.decode(token[0])})}\n\n"
                    await asyncio.sleep(0)  # "lets the others run": between steps, not during them
            yield f"data: {json.dumps({'usage': {'completion_tokens': request.max_tokens}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/generate")
    async def generate(request: CompletionRequest) -> dict[str, str]:
        inputs = tokenizer(request.prompt, return_tensors="pt").to(DEVICE)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=request.max_tokens, min_new_tokens=request.max_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)
        return {"text": tokenizer.decode(out[0, inputs.input_ids.shape[1]:])}

    return app


app = create_app()
