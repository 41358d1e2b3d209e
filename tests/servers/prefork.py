"""A server loaded the way a pre-fork server loads it: the ASGI app wrapped in servprof's
middleware at import (``app = ServprofMiddleware(api)``), which gunicorn's ``--preload`` does in
its master process; every worker is then a fork of the master, servprof's state included.

    gunicorn --preload -k uvicorn.workers.UvicornWorker servers.prefork:app   (from tests/)
"""

from __future__ import annotations

from typing import Any

import torch
from fastapi import FastAPI

from servprof import ServprofMiddleware

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 256)).eval()


def generate(tokens: int) -> list[int]:
    ids, out = torch.zeros(1, 1, dtype=torch.long), []
    with torch.inference_mode():
        for _ in range(tokens):
            ids = model(ids)[:, -1:].argmax(-1)
            out.append(int(ids))
    return out


api = FastAPI()


@api.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@api.post("/v1/generate")
def completion(body: dict[str, Any]) -> dict[str, list[int]]:
    return {"tokens": generate(int(body.get("max_tokens", 8)))}


app = ServprofMiddleware(api)
