"""A retrieval-augmented FastAPI server as the RAG tutorials write one.

Nothing in here knows about servprof. The ``async`` endpoint first fetches context from a search
service over HTTP (here the server's own ``/search`` route, which answers after a vector store's
latency), with an ``httpx.AsyncClient`` opened per request as the quick-start examples do, then
runs the tiny Llama of hf_streaming.py (its ``generate_text``) on a worker thread.

    uvicorn tests.servers.rag:app
"""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI, Request
from servers.hf_streaming import CompletionRequest, generate_text

SEARCH_LATENCY_S = 0.03


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
        return {"text": await asyncio.to_thread(generate_text, prompt, body.max_tokens)}

    return app


app = create_app()
