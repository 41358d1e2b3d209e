"""A FastAPI server built on transformers' ``pipeline`` the way its documentation shows, with a
job queue on FastAPI's ``BackgroundTasks``.

Nothing in here knows about servprof. ``POST /v1/generate`` runs the text-generation pipeline
in a plain ``def`` handler (FastAPI runs it in its thread pool) with beam search;
``POST /v1/jobs`` answers 202 at once with a job id and generates in a background task that
Starlette runs after the response is sent, and ``GET /v1/jobs/{id}`` polls for the result.

    uvicorn tests.servers.pipeline_jobs:app
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from fastapi import BackgroundTasks, FastAPI, HTTPException
from pydantic import BaseModel, Field
from servers.hf_streaming import DEVICE, build_model, build_tokenizer
from transformers import pipeline

tokenizer = build_tokenizer()
generator = pipeline("text-generation", model=build_model(len(tokenizer)), tokenizer=tokenizer, device=DEVICE)


class GenerateRequest(BaseModel):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1, le=512)
    num_beams: int = Field(default=1, ge=1, le=8)


def run_pipeline(request: GenerateRequest) -> str:
    with torch.inference_mode():
        out = generator(request.prompt, max_new_tokens=request.max_tokens, min_new_tokens=request.max_tokens,
                        num_beams=request.num_beams, do_sample=False, return_full_text=False)
    return out[0]["generated_text"]


def create_app() -> FastAPI:
    app = FastAPI()
    jobs: dict[int, dict[str, Any]] = {}
    job_ids = itertools.count(1)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/generate")
    def generate(request: GenerateRequest) -> dict[str, Any]:
        return {"text": run_pipeline(request)}

    def run_job(job_id: int, request: GenerateRequest) -> None:
        jobs[job_id] = {"status": "done", "text": run_pipeline(request)}

    @app.post("/v1/jobs", status_code=202)
    def submit(request: GenerateRequest, background: BackgroundTasks) -> dict[str, Any]:
        job_id = next(job_ids)
        jobs[job_id] = {"status": "queued"}
        background.add_task(run_job, job_id, request)
        return {"id": job_id}

    @app.get("/v1/jobs/{job_id}")
    def job(job_id: int) -> dict[str, Any]:
        if job_id not in jobs:
            raise HTTPException(404, "no such job")
        return {"id": job_id, **jobs[job_id]}

    return app


app = create_app()
