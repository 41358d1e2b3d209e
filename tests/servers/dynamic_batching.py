"""A FastAPI LLM server that batches requests the way batching tutorials write it: each request
puts its prompt and a future on an ``asyncio.Queue``; one background task takes what is queued,
waits up to 10 ms for more (at most 8), and runs one padded ``model.generate()`` for the batch on
a worker thread (``asyncio.to_thread``), then answers every future.

Nothing in here knows about servprof. The tiny Llama and tokenizer of hf_streaming.py.

    uvicorn tests.servers.dynamic_batching:app
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import torch
from fastapi import FastAPI
from servers.hf_streaming import DEVICE, CompletionRequest, build_model, build_tokenizer

MAX_BATCH = 8
BATCH_WAIT_S = 0.010

tokenizer = build_tokenizer()
tokenizer.padding_side = "left"  # decoder-only: pad on the left so every row's next token is last
model = build_model(len(tokenizer))


def generate_batch(prompts: list[str], max_tokens: int) -> list[str]:
    inputs = tokenizer(prompts, return_tensors="pt", padding=True).to(DEVICE)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


async def batcher(queue: asyncio.Queue[tuple[CompletionRequest, asyncio.Future[str]]]) -> None:
    while True:
        batch = [await queue.get()]
        deadline = asyncio.get_running_loop().time() + BATCH_WAIT_S
        while len(batch) < MAX_BATCH:
            timeout = deadline - asyncio.get_running_loop().time()
            if timeout <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(queue.get(), timeout))
            except TimeoutError:
                break
        max_tokens = max(request.max_tokens for request, _ in batch)
        try:
            texts = await asyncio.to_thread(generate_batch, [request.prompt for request, _ in batch], max_tokens)
        except Exception as exc:  # every waiting request gets the error, the batcher lives on
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            continue
        for (_, future), text in zip(batch, texts, strict=True):
            if not future.done():
                future.set_result(text)


def create_app() -> FastAPI:
    queue: asyncio.Queue[tuple[CompletionRequest, asyncio.Future[str]]] = asyncio.Queue()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(batcher(queue))
        yield
        task.cancel()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/generate")
    async def generate(request: CompletionRequest) -> dict[str, str]:
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        await queue.put((request, future))
        return {"text": await future}

    return app


app = create_app()
