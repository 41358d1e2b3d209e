"""A FastAPI LLM server with a hand-written engine thread that polls its queue, as such loops are
often first written: when the queue is empty it sleeps 20 ms and looks again, so a request that
arrives while it sleeps waits for the sleep to end with the model idle.

Nothing in here knows about servprof. One engine thread runs a tiny transformers Llama (random
weights from a config, nothing downloaded) one request at a time, greedy, with its KV cache.

    uvicorn tests.servers.polling_engine:app
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any

import torch
from fastapi import FastAPI
from servers.hf_streaming import DEVICE, CompletionRequest, build_model, build_tokenizer

POLL_S = 0.02
tokenizer = build_tokenizer()
model = build_model(len(tokenizer))
requests: queue.Queue[tuple[list[int], int, asyncio.AbstractEventLoop, asyncio.Future[str]]] = queue.Queue()


def generate(ids: list[int], max_tokens: int) -> list[int]:
    tokens = torch.tensor([ids], device=DEVICE)
    past: Any = None
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(input_ids=tokens if past is None else tokens[:, -1:], past_key_values=past, use_cache=True)
            past = logits.past_key_values
            token = int(logits.logits[0, -1].argmax())
            out.append(token)
            tokens = torch.cat([tokens, torch.tensor([[token]], device=DEVICE)], dim=1)
    return out


def engine() -> None:
    while True:
        try:
            ids, max_tokens, loop, future = requests.get_nowait()
        except queue.Empty:
            time.sleep(POLL_S)
            continue
        text = tokenizer.decode(generate(ids, max_tokens))
        loop.call_soon_threadsafe(future.set_result, text)


threading.Thread(target=engine, name="engine", daemon=True).start()


def create_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/generate")
    async def complete(request: CompletionRequest) -> dict[str, str]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str] = loop.create_future()
        requests.put((tokenizer(request.prompt).input_ids, request.max_tokens, loop, future))
        return {"text": await future}

    return app


app = create_app()
