"""A small FastAPI LLM server with a hand-written torch decode loop.

Nothing in here knows about servprof: no phase markers, no imports. The prompt is
normalised by a slow pure-Python routine and encoded with a real BPE tokenizer
(``tokenizers``, trained on a few paragraphs at start-up), both on the event loop; a
thread per request runs the decode loop, reading each next token to the host with
``.item()``; the stream detokenizes each token on the loop.

    uvicorn tests.servers.handwritten_loop:app
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import unicodedata
from collections.abc import AsyncIterator

import torch
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from torch import nn

CORPUS = """
Rivers carry the snow of the mountains down to the plain, and the plain gives it back as rain.
The miller's wheel turned all summer; in winter the ice held it still and the village went quiet.
Letters came by the morning coach: bills, invitations, a postcard from a cousin by the sea.
The surveyor measured the field three times and wrote a different number each time.
Lamps were lit at six, the soup was served at seven, and the stories began at eight.
""".strip().splitlines()


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "[EOS]"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return tokenizer


class TinyLM(nn.Module):
    """Embedding, two residual MLP blocks over a running context vector, and a head."""

    def __init__(self, vocab_size: int, width: int = 96):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(),
                                                  nn.Linear(2 * width, width)) for _ in range(2))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, ids: torch.Tensor, context: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.embed(ids).mean(dim=1)  # [batch, width] summary of the new tokens
        if context is not None:
            hidden = hidden + 0.9 * context
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return self.head(hidden), hidden


tokenizer = build_tokenizer()
torch.manual_seed(0)
# SERVPROF_TEST_DEVICE=cuda runs the model on a GPU (the GPU checks, bench/gpu/device_checks.sh).
DEVICE = torch.device(os.environ.get("SERVPROF_TEST_DEVICE", "cpu"))
model = TinyLM(tokenizer.get_vocab_size()).eval().to(DEVICE)


class CompletionRequest(BaseModel):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1, le=512)


def slow_normalize(text: str) -> str:
    """Unicode clean-up one character at a time (pure Python: slow on long prompts)."""
    out = []
    for char in text:
        char = unicodedata.normalize("NFKC", char)
        if unicodedata.category(char).startswith("C") and char not in "\n\t":
            continue
        out.append(char.lower() if char.isupper() else char)
    return "".join(out)


def tokenize_prompt(text: str) -> list[int]:
    return tokenizer.encode(slow_normalize(text)).ids


def decode_loop(ids: list[int], max_tokens: int, out: asyncio.Queue[int | None],
                loop: asyncio.AbstractEventLoop) -> None:
    with torch.inference_mode():
        logits, context = model(torch.tensor([ids], device=DEVICE))
        for _ in range(max_tokens):
            next_id = int(torch.argmax(logits, dim=-1)[0].item())
            loop.call_soon_threadsafe(out.put_nowait, next_id)
            logits, context = model(torch.tensor([[next_id]], device=DEVICE), context)
    loop.call_soon_threadsafe(out.put_nowait, None)


def create_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest) -> StreamingResponse:
        ids = tokenize_prompt(request.prompt)
        out: asyncio.Queue[int | None] = asyncio.Queue()
        threading.Thread(target=decode_loop, args=(ids, request.max_tokens, out, asyncio.get_running_loop()),
                         daemon=True).start()

        async def stream() -> AsyncIterator[str]:
            count = 0
            while (token := await out.get()) is not None:
                count += 1
                yield f"data: {json.dumps({'text': tokenizer.decode([token])})}\n\n"
            yield f"data: {json.dumps({'usage': {'completion_tokens': count}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


app = create_app()
