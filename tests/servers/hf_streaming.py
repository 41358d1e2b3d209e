"""A small FastAPI LLM server written the way a Hugging Face user writes one.

Nothing in here knows about servprof: no phase markers, no imports. A tiny Llama built
from a config (random weights, nothing downloaded), a byte-level BPE tokenizer trained on
a few paragraphs at start-up and wrapped in ``PreTrainedTokenizerFast``, and streaming
through ``model.generate`` + ``TextIteratorStreamer`` in a thread, as transformers'
documentation shows. Before generating, each prompt goes through a synchronous content
screen that runs on the event loop (the kind of helper that blocks a server unnoticed).

    uvicorn tests.servers.hf_streaming:app
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from threading import Thread

import torch
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TextIteratorStreamer

CORPUS = """
The harbour master counted the boats twice before the storm and once after it. Every rope was
checked, every lantern was trimmed, and the old clock on the pier kept its own slow time.
A baker on the hill sold bread to the sailors at dawn; the loaves were warm and the coffee was
strong. Children ran along the sea wall shouting the names of ships they would never board.
In the library the lamps hummed, the pages turned, and a cat slept on the dictionary of tides.
Questions about the weather, the fish, the prices and the roads filled the market every morning.
""".strip().splitlines()
BLOCKLIST = [f"forbidden{i}" for i in range(2000)]


def build_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")


# SERVPROF_TEST_DEVICE=cuda runs the model on a GPU, and SERVPROF_TEST_MODEL=gpu makes it a 16-layer,
# 0.2B-parameter bf16 Llama there, the size people serve with transformers (bench/gpu). The tests run
# the tiny CPU model.
DEVICE = torch.device(os.environ.get("SERVPROF_TEST_DEVICE", "cpu"))
MODEL_SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "gpu": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                num_key_value_heads=4),
}


def build_model(vocab_size: int) -> LlamaForCausalLM:
    """The servers' model, on DEVICE."""
    torch.manual_seed(0)
    size = os.environ.get("SERVPROF_TEST_MODEL", "tiny")
    config = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                         pad_token_id=3, **MODEL_SIZES[size])
    dtype = torch.bfloat16 if size == "gpu" else torch.float32
    return LlamaForCausalLM(config).eval().to(DEVICE, dtype)


tokenizer = build_tokenizer()
model = build_model(len(tokenizer))


class CompletionRequest(BaseModel):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1, le=512)


def generate_text(prompt: str, max_tokens: int) -> str:
    """One prompt's whole completion in one blocking call, for the servers built on this model that
    do not stream (executor.py, rag.py, process_pool.py)."""
    inputs = tokenizer(prompt, return_tensors="pt").to(DEVICE)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return tokenizer.decode(out[0][inputs["input_ids"].shape[1]:])


def screen_prompt(text: str) -> None:
    """Reject prompts with blocked words (plain Python: it runs on the event loop)."""
    words = re.findall(r"\w+", text.lower())
    for word in words:
        for blocked in BLOCKLIST:
            if word == blocked:
                raise ValueError("blocked word")


def create_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest) -> StreamingResponse:
        screen_prompt(request.prompt)
        inputs = tokenizer(request.prompt, return_tensors="pt").to(DEVICE)
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        kwargs = dict(**inputs, streamer=streamer, max_new_tokens=request.max_tokens,
                      min_new_tokens=request.max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        thread = Thread(target=model.generate, kwargs=kwargs)
        thread.start()

        def stream() -> Iterator[str]:
            for text in streamer:
                yield f"data: {json.dumps({'text': text})}\n\n"
            thread.join()
            yield f"data: {json.dumps({'usage': {'completion_tokens': request.max_tokens}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


app = create_app()
