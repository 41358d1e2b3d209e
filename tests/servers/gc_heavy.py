"""A hand-written decode loop that keeps what it generates in a module-level history of Python
objects (each step's record with its candidate list, referring to itself), the way a server keeps
per-request state in memory. Nothing in here knows about servprof, or tunes the garbage collector:
as the history grows, Python's collections of the oldest generation walk all of it, on whichever
serving thread allocated past the threshold.

    uvicorn tests.servers.gc_heavy:app
"""

from __future__ import annotations

from typing import Any

import torch
from fastapi import FastAPI
from pydantic import BaseModel, Field
from servers.hf_streaming import model, tokenizer

CANDIDATES = 30_000  # kept per generated token
HISTORY: list[dict[str, Any]] = []


class CompletionRequest(BaseModel):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1, le=256)


def generate(prompt: str, max_tokens: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    tokens: list[int] = []
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for step in range(max_tokens):
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            record: dict[str, Any] = {"token": int(token), "step": step, "candidates": [[j] for j in range(CANDIDATES)]}
            record["self"] = record
            HISTORY.append(record)
            tokens.append(int(token))
    return tokenizer.decode(tokens)


def create_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    def completions(request: CompletionRequest) -> dict[str, str]:
        return {"text": generate(request.prompt, request.max_tokens)}

    return app


app = create_app()
