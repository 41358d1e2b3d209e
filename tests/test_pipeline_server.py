"""A server on transformers' ``pipeline`` with beam search, and a job queue on FastAPI's
``BackgroundTasks`` whose model work runs after the 202 went out (tests/servers/pipeline_jobs.py).
servprof finds every model step of each request with no marker in the server, beam search's
included, and keeps the steps a background task ran after its response on its request.

Real parts: uvicorn on loopback, a light session of the real profiler and the real analysis
worker, a real transformers ``text-generation`` pipeline over a tiny Llama and a real BPE tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from _server_session import PROMPT, session_on

MAX_TOKENS = 6


def _steps_by_request(result: dict) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for rid, entry in result["requests"].items():
        names = [p["name"] for p in entry["phases"]]
        out[rid] = {name: names.count(name) for name in ("tokenize", "prefill", "decode_step")}
    return out


def test_beam_search_through_a_pipeline_has_every_step(tmp_path: Path) -> None:
    observed = session_on("servers.pipeline_jobs", tmp_path, ["/v1/generate"] * 2, MAX_TOKENS,
                          body={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "num_beams": 2})
    result = observed["result"]
    assert [status for _, status, _ in observed["responses"]] == [200, 200]
    assert result["error"] is None, result["error"]
    # One forward over both beams per token: a prefill, then one decode step per further token.
    expected = {"tokenize": 1, "prefill": 1, "decode_step": MAX_TOKENS - 1}
    assert _steps_by_request(result) == {rid: expected for _, _, rid in observed["responses"]}
    assert result["summary"]["detect"]["steps"]["by_kind"] == {"prefill": 2, "decode": 2 * (MAX_TOKENS - 1)}


def test_a_background_tasks_model_work_stays_on_its_request(tmp_path: Path) -> None:
    observed = session_on("servers.pipeline_jobs", tmp_path, ["/v1/jobs"] * 2, MAX_TOKENS, spaced_s=0.0,
                          body={"prompt": PROMPT, "max_tokens": MAX_TOKENS})
    result, session = observed["result"], observed["session"]
    assert [status for _, status, _ in observed["responses"]] == [202, 202]
    expected = {"tokenize": 1, "prefill": 1, "decode_step": MAX_TOKENS - 1}
    assert _steps_by_request(result) == {rid: expected for _, _, rid in observed["responses"]}
    # The 202 went out first; the request's steps came after it (Starlette runs the task after the
    # response, inside the same ASGI call, so the request's record ends after them).
    clock = result["clock"]["trace_us_to_unix_ns_offset"]
    for record in session["requests"]:
        sent_unix_ns = record["arrival_ns"] + (record["last_byte_ns"] - record["arrival_perf_ns"])
        phases = result["requests"][record["request_id"]]["phases"]
        first_step_unix_ns = clock + min(p["start_us"] for p in phases if p["name"] == "prefill") * 1000
        assert first_step_unix_ns > sent_unix_ns
        assert record["end_ns"] > record["last_byte_ns"]
