"""A FastAPI LLM server with a plain ``def`` endpoint: FastAPI runs each request's
``transformers`` pipeline call in its thread pool, so concurrent requests each run their own
``generate()`` on their own thread, all at once.

Nothing in here knows about servprof. A tiny Llama (random weights from a config, nothing
downloaded) and a byte-level BPE tokenizer trained at start-up.

    uvicorn tests.servers.thread_pool:app
"""

from __future__ import annotations

from fastapi import FastAPI
from servers.hf_streaming import DEVICE, CompletionRequest, build_model, build_tokenizer
from transformers import pipeline

tokenizer = build_tokenizer()
generator = pipeline("text-generation", model=build_model(len(tokenizer)), tokenizer=tokenizer, device=DEVICE)


def create_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/generate")
    def generate(request: CompletionRequest) -> dict[str, str]:
        out = generator(request.prompt, max_new_tokens=request.max_tokens, min_new_tokens=request.max_tokens,
                        do_sample=False, return_full_text=False)
        return {"text": out[0]["generated_text"]}

    return app


app = create_app()
