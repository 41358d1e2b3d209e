"""A FastAPI server with tokenizers of its own, subclassed from transformers' fast tokenizer.

Nothing in here knows about servprof. ``POST /v1/completions`` tokenizes with a subclass that
normalises the prompt character by character in Python first (the work is the tokenizer's);
``POST /v1/tenant/completions`` with one that fetches the tenant's added tokens from a
configuration service on every call, a network round trip inside the tokenizer call (a sleep
stands for the service's latency: the thread waits, it does not work). Both run in FastAPI's
thread pool (plain ``def`` handlers) and then one forward of the model.

    uvicorn tests.servers.custom_tokenizer:app
"""

from __future__ import annotations

import time
import unicodedata
from typing import Any

import torch
from fastapi import FastAPI
from pydantic import BaseModel, Field
from servers.hf_streaming import DEVICE, build_model, build_tokenizer
from transformers import PreTrainedTokenizerFast

CONFIG_SERVICE_LATENCY_S = 0.03


class NormalisingTokenizer(PreTrainedTokenizerFast):
    def __call__(self, text: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(text, str):
            text = "".join(ch if ch.isprintable() else " " for ch in unicodedata.normalize("NFKC", text)).lower()
        return super().__call__(text, *args, **kwargs)


class TenantTokenizer(PreTrainedTokenizerFast):
    def __call__(self, text: Any = None, *args: Any, **kwargs: Any) -> Any:
        time.sleep(CONFIG_SERVICE_LATENCY_S)  # GET /tenants/{id}/added-tokens
        return super().__call__(text, *args, **kwargs)


base = build_tokenizer()
normalising = NormalisingTokenizer(tokenizer_object=base.backend_tokenizer, pad_token="<pad>")
tenant = TenantTokenizer(tokenizer_object=base.backend_tokenizer, pad_token="<pad>")
model = build_model(len(base))


class CompletionRequest(BaseModel):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(default=1, ge=1, le=64)


def complete(tokenizer: PreTrainedTokenizerFast, prompt: str) -> dict[str, Any]:
    inputs = tokenizer(prompt, return_tensors="pt").to(DEVICE)
    ids = inputs["input_ids"][:, -256:]
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
    return {"next_token": base.decode(logits[0, -1].argmax())}


def create_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/completions")
    def completions(request: CompletionRequest) -> dict[str, Any]:
        return complete(normalising, request.prompt)

    @app.post("/v1/tenant/completions")
    def tenant_completions(request: CompletionRequest) -> dict[str, Any]:
        return complete(tenant, request.prompt)

    return app


app = create_app()
