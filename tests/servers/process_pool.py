"""A FastAPI server that runs its model in a worker process, as the "don't block the event loop,
use all the cores" advice writes it: a ``ProcessPoolExecutor`` whose initializer loads the model
(tokenizer and tiny Llama of hf_streaming.py) once per worker, and an ``async`` endpoint that
awaits ``run_in_executor``. The serving process never runs a forward.

Nothing in here knows about servprof.

    uvicorn tests.servers.process_pool:app
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor

from fastapi import FastAPI
from pydantic import BaseModel, Field


class CompletionRequest(BaseModel):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1, le=512)


def load_model() -> None:
    """In each worker process, once: the tokenizer and model are built as the module loads."""
    import servers.hf_streaming  # noqa: F401


def generate(prompt: str, max_tokens: int) -> str:
    from servers.hf_streaming import generate_text

    return generate_text(prompt, max_tokens)


def create_app() -> FastAPI:
    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=load_model)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        pool.shutdown(cancel_futures=True)

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/generate")
    async def completion(request: CompletionRequest) -> dict[str, str]:
        loop = asyncio.get_running_loop()
        return {"text": await loop.run_in_executor(pool, generate, request.prompt, request.max_tokens)}

    return app


app = create_app()
