"""An embeddings server written the way the sentence-embedding tutorials write one.

Nothing in here knows about servprof. A plain ``def`` endpoint (FastAPI runs each request on its
thread pool, so concurrent requests tokenize and run the encoder on their own threads at once),
an OpenAI-style ``/v1/embeddings`` body, a small BERT encoder built from a config (random weights,
nothing downloaded), the byte-level BPE tokenizer of hf_streaming.py, and mean pooling.

    uvicorn tests.servers.embeddings:app
"""

from __future__ import annotations

from typing import Any

import torch
from fastapi import FastAPI
from pydantic import BaseModel, Field
from servers.hf_streaming import DEVICE, build_tokenizer
from transformers import BertConfig, BertModel

tokenizer = build_tokenizer()
torch.manual_seed(0)
model = BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                             intermediate_size=256, pad_token_id=tokenizer.pad_token_id)).eval().to(DEVICE)


class EmbeddingRequest(BaseModel):
    input: str | list[str] = Field(min_length=1)
    model: str = "tiny-bert"


def embed(texts: list[str]) -> torch.Tensor:
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt").to(DEVICE)
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1)
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def create_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/embeddings")
    def embeddings(request: EmbeddingRequest) -> dict[str, Any]:
        texts = [request.input] if isinstance(request.input, str) else request.input
        vectors = embed(texts)
        return {"object": "list", "model": request.model,
                "data": [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)]}

    return app


app = create_app()
