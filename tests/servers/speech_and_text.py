"""Two encoder-decoder models behind one FastAPI app, written the way a Hugging Face user writes it.

Nothing in here knows about servprof. ``/summarize`` runs a T5 (``generate`` on token ids);
``/transcribe`` runs a Whisper on an uploaded clip's log-mel features (``WhisperFeatureExtractor``
on the handler's thread, then ``generate`` on ``input_features``); a clip longer than Whisper's
30 s window is cut into 30 s chunks, transcribed as one batch. Both are tiny models built from
configs (random weights, nothing downloaded) sharing the byte-level BPE tokenizer of
hf_streaming.py. Handlers are plain ``def``: FastAPI runs them on its thread pool.

    uvicorn tests.servers.speech_and_text:app
"""

from __future__ import annotations

import numpy as np
import torch
from fastapi import FastAPI
from pydantic import BaseModel, Field
from servers.hf_streaming import build_tokenizer
from transformers import (
    T5Config,
    T5ForConditionalGeneration,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
)

SAMPLE_RATE = 16_000
WINDOW = 30 * SAMPLE_RATE  # Whisper's: its features are always of 30 s of audio
tokenizer = build_tokenizer()
torch.manual_seed(0)
summarizer = T5ForConditionalGeneration(T5Config(
    vocab_size=len(tokenizer), d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
    decoder_start_token_id=tokenizer.pad_token_id, pad_token_id=tokenizer.pad_token_id,
    eos_token_id=tokenizer.eos_token_id)).eval()
transcriber = WhisperForConditionalGeneration(WhisperConfig(
    vocab_size=len(tokenizer), d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80,
    max_target_positions=128, decoder_start_token_id=tokenizer.bos_token_id, bos_token_id=tokenizer.bos_token_id,
    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, begin_suppress_tokens=None,
    suppress_tokens=None)).eval()
features = WhisperFeatureExtractor(feature_size=80, sampling_rate=SAMPLE_RATE)


class SummaryRequest(BaseModel):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1, le=120)


class TranscriptionRequest(BaseModel):
    seconds: float = Field(default=2.0, gt=0, le=300)
    max_tokens: int = Field(default=16, ge=1, le=120)


def clip(seconds: float) -> np.ndarray:
    """The 'uploaded' audio: a tone (the tests send no files)."""
    t = np.arange(int(seconds * SAMPLE_RATE), dtype=np.float32) / SAMPLE_RATE
    return (0.3 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)


def create_app() -> FastAPI:
    app = FastAPI()

    @app.post("/summarize")
    def summarize(request: SummaryRequest) -> dict[str, str]:
        inputs = tokenizer(request.prompt, return_tensors="pt")
        with torch.inference_mode():
            out = summarizer.generate(**inputs, max_new_tokens=request.max_tokens,
                                      min_new_tokens=request.max_tokens, do_sample=False)
        return {"summary": tokenizer.decode(out[0], skip_special_tokens=True)}

    @app.post("/transcribe")
    def transcribe(request: TranscriptionRequest) -> dict[str, str]:
        audio = clip(request.seconds)
        chunks = [audio[i:i + WINDOW] for i in range(0, audio.size, WINDOW)]
        inputs = features(chunks, sampling_rate=SAMPLE_RATE, return_tensors="pt")
        with torch.inference_mode():
            out = transcriber.generate(inputs.input_features, max_new_tokens=request.max_tokens,
                                       min_new_tokens=request.max_tokens)
        return {"text": " ".join(tokenizer.batch_decode(out, skip_special_tokens=True))}

    return app


app = create_app()
