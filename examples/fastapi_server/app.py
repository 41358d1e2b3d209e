"""The smallest useful servprof set-up: your own FastAPI model server with the middleware on.

    SERVPROF_CONTROL_TOKEN=secret uvicorn examples.fastapi_server.app:app --port 8000
    curl -s localhost:8000/generate -d '{"prompt": "hello", "max_tokens": 16}' -H 'content-type: application/json'
    curl -s -X POST 'localhost:8000/servprof/sample?n=2' -H 'Authorization: Bearer secret'
    curl -s localhost:8000/servprof/status -H 'Authorization: Bearer secret'

The model is a few torch layers so the example runs anywhere; the servprof parts are
the three marked lines: add the middleware, mark phases, annotate the request.
"""

from __future__ import annotations

import anyio.to_thread
import torch
from fastapi import FastAPI
from pydantic import BaseModel, Field

import servprof

app = FastAPI()
app.add_middleware(servprof.ServprofMiddleware)  # servprof: settings from SERVPROF_* env vars

torch.manual_seed(0)
VOCAB, HIDDEN = 256, 128
model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN),
                            torch.nn.SiLU(), torch.nn.Linear(HIDDEN, VOCAB)).eval()


class GenerateRequest(BaseModel):
    prompt: str = Field(min_length=1, max_length=4096)
    max_tokens: int = Field(default=16, ge=1, le=256)


def generate_tokens(prompt: str, max_tokens: int) -> list[int]:
    with servprof.phase("tokenize"):  # servprof: phases carry the request id into the trace
        tokens = list(prompt.encode())
    with torch.inference_mode():
        with servprof.phase("prefill"):
            next_token = int(model(torch.tensor(tokens[-64:]))[-1].argmax())
        out = [next_token]
        for _ in range(max_tokens - 1):
            with servprof.phase("decode_step"):
                out.append(int(model(torch.tensor([out[-1]]))[-1].argmax()))
    return out


@app.post("/generate")
async def generate(request: GenerateRequest) -> dict:
    # The model runs in a worker thread so the event loop keeps serving; the request id
    # travels with the context into that thread.
    tokens = await anyio.to_thread.run_sync(generate_tokens, request.prompt, request.max_tokens)
    servprof.annotate_request(**{"gen_ai.usage.output_tokens": len(tokens)})  # servprof: span attributes
    return {"request_id": servprof.current_request_id(), "tokens": tokens}
