"""A server with two models on two endpoints (tests/servers/speech_and_text.py: a T5 summarizer and a
Whisper transcriber, both encoder-decoders run by ``generate``). A session whose first steps are
one model's still marks every step of the other, which first runs later in the session: the
sampled request's arrival has servprof look for a model it has not seen.

Real parts: uvicorn on loopback, a light session of the real profiler and the real analysis
worker, real transformers models and feature extractor, a real BPE tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from _server_session import PROMPT, session_on

MAX_TOKENS = 12


def _steps(result: dict, rid: str) -> dict[str, int]:
    names = [p["name"] for p in result["requests"][rid]["phases"]]
    return {name: names.count(name) for name in ("prefill", "decode_step")}


def test_the_second_models_steps_are_marked_when_its_request_comes_after_the_firsts(tmp_path: Path) -> None:
    observed = session_on("servers.speech_and_text", tmp_path, ["/summarize", "/transcribe"], MAX_TOKENS,
                          spaced_s=0.1, body=[{"prompt": PROMPT, "max_tokens": MAX_TOKENS},
                                              {"seconds": 2.0, "max_tokens": MAX_TOKENS}])
    (summary_id, transcript_id) = [rid for _path, status, rid in observed["responses"] if status == 200]
    result = observed["result"]
    # Each: the encoder's pass over its input (a prefill), then one decoder step per token.
    assert _steps(result, summary_id) == {"prefill": 1, "decode_step": MAX_TOKENS}
    assert _steps(result, transcript_id) == {"prefill": 1, "decode_step": MAX_TOKENS}
    steps = result["summary"]["detect"]["steps"]
    assert steps["count"] == 2 * (1 + MAX_TOKENS) and steps["source"] == ["servprof_auto"]
    assert set(observed["session"]["auto"]["models"]) == {
        "T5ForConditionalGeneration", "T5Stack", "WhisperForConditionalGeneration", "WhisperEncoder"}


def test_both_models_at_once(tmp_path: Path) -> None:
    paths = ["/summarize", "/transcribe", "/summarize", "/transcribe"]
    bodies = [{"prompt": PROMPT, "max_tokens": MAX_TOKENS} if p == "/summarize" else
              {"seconds": 1.0, "max_tokens": MAX_TOKENS} for p in paths]
    observed = session_on("servers.speech_and_text", tmp_path, paths, MAX_TOKENS, body=bodies)
    ids = [rid for _path, status, rid in observed["responses"] if status == 200]
    assert len(ids) == 4
    for rid in ids:
        assert _steps(observed["result"], rid) == {"prefill": 1, "decode_step": MAX_TOKENS}, rid


def _judged_transcriptions(out: Path, **settings: object) -> dict:
    """Two 75 s recordings (three 30 s chunks each) transcribed one after the other, in one session. (The first request's wait is
    not judged: a step then running would not be in the trace.) The second's is judged whichever pool
    thread ran it (it was only when that thread also ran the first one's steps: a session was taken
    up to 3 times for that)."""
    return session_on("servers.speech_and_text", out, ["/transcribe"] * 2, 4, spaced_s=0.1,
                      body={"seconds": 75.0, "max_tokens": 4}, **settings)


def test_a_deep_window_names_the_handlers_own_compute_before_the_model_call(tmp_path: Path) -> None:
    """``/transcribe`` extracts log-mel features on its handler's thread (torch's STFT) before
    ``generate``: with ops recorded, the wait before the model call names them as the handler's
    compute; a light session (no ops) says only what it measured."""
    deep = _judged_transcriptions(tmp_path / "deep", tier="deep")
    (finding,) = [f for f in deep["result"]["findings"] if f["kind"] == "queue_wait"]
    work = finding["evidence"]["handler_threads"]
    assert finding["evidence"]["cause"] == "before_model_call"
    assert 0 < work["busy_ms"] <= work["window_ms"], work
    names = [f["name"] for f in work["top_frames"]]
    assert any("fft" in name or "stft" in name for name in names), names
    assert names[0] in finding["title"]
    if work["seen"] == "computing":  # (ops over most of the wait: the handler's compute)
        assert "computing outside the model" in finding["title"] and "preprocessing" in finding["fix"]
    else:  # (a busy machine kept the thread off a CPU for over half of it: the ops named as a part)
        assert work["seen"] == "not_recorded" and work["busy_ms"] < 0.5 * work["window_ms"], work
        assert "ran ops outside the model" in finding["title"] and "ops were recorded" in finding["fix"]

    light = _judged_transcriptions(tmp_path / "light")
    measured = light["result"]["summary"]["detect"]["queue_wait"]["waits"]
    assert any(w["own_model_call"] and w["idle_ms"] > 0 for w in measured), measured  # the same wait, measured
    for finding in (f for f in light["result"]["findings"] if f["kind"] == "queue_wait"):  # what it measured
        assert finding["evidence"]["handler_threads"] == {"seen": "not_recorded"}  # (no ops, no frames)
        assert finding["fix"].startswith("Each of these requests called the model from its own handler, so no queue")
        assert finding["fix"].endswith("names the functions it ran.")  # how to get them
