"""A FastAPI LLM server that checks each answer before it goes out.

Nothing in here knows about servprof. A plain ``def`` endpoint (FastAPI's thread pool) runs the
hand-written server's tiny model and tokenizer (tests/servers/handwritten_loop.py) in a decode
loop, then passes the text through a slow pure-Python safety filter (a list of patterns applied
one after another, many times over) before answering with JSON. ``"filter": false`` in the body
answers without it. ``/v1/async/completions`` does the same from an ``async def`` endpoint through
``asyncio.to_thread`` (the loop's default executor, whose threads start on first use), and
``/v1/loop-filter/completions`` runs only the model there and the filter on the event loop.

    uvicorn tests.servers.post_filter:app
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import torch
from fastapi import FastAPI
from pydantic import BaseModel, Field
from servers import handwritten_loop as base

BANNED = [re.compile(r"\b" + letter * 3 + r"\w*") for letter in "abcdefghijklmnopqrstuvwxyz"]
FILTER_ROUNDS = 300


class FilteredRequest(BaseModel):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1, le=512)
    filter: bool = True


def safety_filter(text: str) -> str:
    for _ in range(FILTER_ROUNDS):
        for pattern in BANNED:
            text = pattern.sub("*", text)
    return text


def generate(prompt: str, max_tokens: int) -> list[int]:
    out = []
    with torch.inference_mode():
        logits, context = base.model(torch.tensor([base.tokenize_prompt(prompt)], device=base.DEVICE))
        for _ in range(max_tokens):
            next_id = int(torch.argmax(logits, dim=-1)[0].item())
            out.append(next_id)
            logits, context = base.model(torch.tensor([[next_id]], device=base.DEVICE), context)
    return out


def create_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    def complete(request: FilteredRequest) -> dict[str, Any]:
        text = base.tokenizer.decode(generate(request.prompt, request.max_tokens)) * 20
        started = time.perf_counter()
        if request.filter:
            text = safety_filter(text)
        return {"text": text[:200], "filter_ms": round((time.perf_counter() - started) * 1e3, 3)}

    @app.post("/v1/async/completions")
    async def complete_off_the_loop(request: FilteredRequest) -> dict[str, Any]:
        return await asyncio.to_thread(complete, request)

    @app.post("/v1/loop-filter/completions")
    async def generate_off_the_loop_then_filter_on_it(request: FilteredRequest) -> dict[str, Any]:
        ids = await asyncio.to_thread(generate, request.prompt, request.max_tokens)
        text = base.tokenizer.decode(ids) * 20
        started = time.perf_counter()
        if request.filter:
            text = safety_filter(text)  # (on the event loop: the worker thread that ran the model is idle)
        return {"text": text[:200], "filter_ms": round((time.perf_counter() - started) * 1e3, 3)}

    return app


app = create_app()
