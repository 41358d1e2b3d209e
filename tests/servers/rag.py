"""A retrieval-augmented FastAPI server as the RAG tutorials write one.

Nothing in here knows about servprof. The ``async`` endpoint first fetches context from a search
service over HTTP (here the server's own ``/search`` route, which answers after a vector store's
latency), with an ``httpx.AsyncClient`` opened per request as the quick-start examples do, then
runs ``generate()`` of the tiny Llama of hf_streaming.py on a worker thread.

    uvicorn tests.servers.rag:app
"""

from __future__ import annotations

import asyncio

import httpx
import torch
from fastapi import FastAPI, Request
from servers.hf_streaming import CompletionRequest, model, tokenizer

SEARCH_LATENCY_S = 0.03


def generate(prompt: str, max_tokens: int) -> str:
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return tokenizer.decode(out[0][inputs["input_ids"].shape[1]:])


def create_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/search")
    async def search(q: str) -> dict[str, list[str]]:
        await asyncio.sleep(SEARCH_LATENCY_S)  # the vector store's answer time
        return {"documents": ["The harbour master counted the boats twice before the storm."]}

    @app.post("/v1/generate")
    async def completion(body: CompletionRequest, request: Request) -> dict[str, str]:
        async with httpx.AsyncClient() as client:
            found = await client.get(f"{request.base_url}search", params={"q": body.prompt})
        prompt = "\n".join(found.json()["documents"]) + "\n\n" + body.prompt
        return {"text": await asyncio.to_thread(generate, prompt, body.max_tokens)}

    return app


app = create_app()
