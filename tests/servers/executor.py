"""A FastAPI LLM server that keeps the model off the event loop the way answers written before
``asyncio.to_thread`` existed show: ``await loop.run_in_executor(None, generate_text, ...)`` on the
loop's default thread pool. Unlike ``to_thread``, ``run_in_executor`` copies no contextvars into
the worker thread.

Nothing in here knows about servprof. The tokenizer and tiny Llama of hf_streaming.py.

    uvicorn tests.servers.executor:app
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from servers.hf_streaming import CompletionRequest, generate_text


def create_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/generate")
    async def completion(request: CompletionRequest) -> dict[str, str]:
        loop = asyncio.get_running_loop()
        return {"text": await loop.run_in_executor(None, generate_text, request.prompt, request.max_tokens)}

    return app


app = create_app()
