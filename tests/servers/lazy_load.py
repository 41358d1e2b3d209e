"""A FastAPI LLM server that loads its model on the first request, as many do (a cached getter).

Nothing in here knows about servprof. The hand-written loop server's tokenizer and model class;
the weights are written to a file once, and the first request to ``/v1/completions`` builds the
model and loads them from that file before its decode loop, on its own pool thread (a plain
``def`` endpoint). Later requests find the model loaded.

    uvicorn tests.servers.lazy_load:app
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from pathlib import Path

import torch
from fastapi import FastAPI
from pydantic import BaseModel, Field
from servers import handwritten_loop as base

WIDTH = 1024  # ~8M parameters: a 34 MB file, some tens of ms to build and load on 2 cores
_folder = Path(tempfile.mkdtemp(prefix="lazy_load_"))
atexit.register(shutil.rmtree, _folder, ignore_errors=True)
WEIGHTS = _folder / "model.pt"
_model: base.TinyLM | None = None
_lock = threading.Lock()


def save_weights() -> None:
    if not WEIGHTS.exists():
        torch.manual_seed(1)
        torch.save(base.TinyLM(base.tokenizer.get_vocab_size(), WIDTH).state_dict(), WEIGHTS)


def get_model() -> base.TinyLM:
    global _model
    with _lock:
        if _model is None:
            model = base.TinyLM(base.tokenizer.get_vocab_size(), WIDTH)
            model.load_state_dict(torch.load(WEIGHTS))
            _model = model.eval()
        return _model


def unload() -> None:
    """Forget the model (the next request loads it again)."""
    global _model
    with _lock:
        _model = None


class CompletionRequest(BaseModel):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1, le=512)


def create_app() -> FastAPI:
    save_weights()
    app = FastAPI()

    @app.post("/v1/completions")
    def completions(request: CompletionRequest) -> dict[str, str]:
        model = get_model()
        ids = base.tokenize_prompt(request.prompt)
        out: list[int] = []
        with torch.inference_mode():
            logits, context = model(torch.tensor([ids]))
            for _ in range(request.max_tokens):
                next_id = int(torch.argmax(logits, dim=-1)[0].item())
                out.append(next_id)
                logits, context = model(torch.tensor([[next_id]]), context)
        return {"text": base.tokenizer.decode(out)}

    return app


app = create_app()
