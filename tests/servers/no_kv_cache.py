"""A FastAPI LLM server whose hand-written decode loop keeps no KV cache.

Nothing in here knows about servprof. A plain ``def`` endpoint runs the servers' tiny
transformers Llama (tests/servers/hf_streaming.py's) token by token, feeding the whole sequence
back each step with ``use_cache=False``: the loop people write first, before they learn about
``past_key_values``.

    uvicorn tests.servers.no_kv_cache:app
"""

from __future__ import annotations

from typing import Any

import torch
from fastapi import FastAPI
from pydantic import BaseModel, Field
from servers.hf_streaming import model, tokenizer


class CompletionRequest(BaseModel):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1, le=256)


def create_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    def complete(request: CompletionRequest) -> dict[str, Any]:
        ids = tokenizer(request.prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            for _ in range(request.max_tokens):
                logits = model(ids, use_cache=False).logits
                ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
        return {"text": tokenizer.decode(ids[0])}

    return app


app = create_app()
