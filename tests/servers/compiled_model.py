"""A FastAPI LLM server that compiles its model the way transformers documents for ``generate``:
``model.forward = torch.compile(model.forward)``, compiled at start-up by one warm-up request,
then one ``generate()`` per request on FastAPI's thread pool (a plain ``def`` endpoint).

Nothing in here knows about servprof. The tiny Llama and tokenizer of hf_streaming.py (a model
of its own: compiling must not touch the one other servers share). ``dynamic=True``: the
prompt's length and the growing KV cache reuse one graph instead of recompiling per length.

    uvicorn tests.servers.compiled_model:app
"""

from __future__ import annotations

import torch
from fastapi import FastAPI
from servers.hf_streaming import DEVICE, CompletionRequest, build_model, build_tokenizer

tokenizer = build_tokenizer()
model = build_model(len(tokenizer))
model.forward = torch.compile(model.forward, dynamic=True)


def generate(prompt: str, max_tokens: int) -> str:
    inputs = tokenizer(prompt, return_tensors="pt").to(DEVICE)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


# Compiled before serving: two requests, the second finding the graphs the first compiled.
generate("The harbour master counted the boats", 4)
generate("Every rope was checked", 4)


def create_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/generate")
    def completion(request: CompletionRequest) -> dict[str, str]:
        return {"text": generate(request.prompt, request.max_tokens)}

    return app


app = create_app()
