"""transformers ``generate()`` traced as users trace it (torch.profiler on the CPU,
``record_shapes``), where its steps are not one token each or its calls are not one request's
steps (detect/step_kinds.py):

- steps that feed several tokens at once: assisted generation (a draft model proposes tokens, the
  target verifies them: speculative decoding), prompt lookup, and a chat's next turn prefilled
  over the KV cache the last turn passed back. A step of several tokens over a cache that already
  holds tokens is a decode step of a running sequence, whose gaps are the decode loop's own; a
  ``generate()`` call's prefill over such a cache (a new turn) is a prefill, the wait before it
  the user's;
- an encoder-decoder (T5), whose first decoder step is a decode step: the wait for the next request
  before it (outside any ``generate()`` call, with_stack) is not a gap of the decode loop; a loop
  calling ``generate()`` once per token is one.

Real parts: the real profiler around the servers' tiny transformers Llama
(tests/servers/hf_streaming.py), a second one as the draft, and a tiny T5 built from its config; a
logits processor that sleeps (as a slow grammar mask holds every step), and a sleep between requests,
are the stalls the gaps must hold or leave out (counted, not timed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from servers.hf_streaming import build_model, model, tokenizer
from torch.profiler import ProfilerActivity, profile

from servprof.detect.analysis import analyse
from servprof.detect.steps import Step, find_steps
from servprof.trace import load_trace
from servprof.trace.model import Trace

transformers = pytest.importorskip("transformers")

REQUESTS = 2
WAIT_S = 0.03  # between two requests
NEW_TOKENS = 8
PROMPT = tokenizer("The harbour master counted the boats and the harbour master counted the boats",
                   return_tensors="pt").input_ids


class SlowLogitsProcessor(transformers.LogitsProcessor):
    """A per-step logits processor that holds the loop (a grammar mask built in Python, say)."""

    calls = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        SlowLogitsProcessor.calls += 1
        time.sleep(0.004)
        return scores


def traced(tmp_path: Path, requests: Callable[[], None], with_stack: bool) -> Trace:
    path = tmp_path / "trace.json"
    requests()  # (warm-up, not traced)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                                         with_stack=with_stack) as prof:
        requests()
    prof.export_chrome_trace(str(path))
    return load_trace(path)


def multi_token(steps: list[Step], kind: str) -> list[Step]:
    return [s for s in steps if s.kind == kind and s.tokens is not None and s.tokens > 1]


@pytest.mark.parametrize("with_stack", [True, False])
def test_assisted_generation_verifies_drafts_in_decode_steps(tmp_path: Path, with_stack: bool) -> None:
    draft = build_model(len(tokenizer))
    processors = transformers.LogitsProcessorList([SlowLogitsProcessor()])

    def requests() -> None:
        for _ in range(REQUESTS):
            model.generate(PROMPT, assistant_model=draft, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                           do_sample=False, logits_processor=processors, pad_token_id=tokenizer.pad_token_id)

    trace = traced(tmp_path, requests, with_stack)
    steps = find_steps(trace)
    prompt = PROMPT.shape[1]
    # Per request, the draft's first forward prefills the prompt and the target's first verifies its
    # first draft token over the prompt (no cache yet): every other forward extends a cached sequence.
    prefill = [s for s in steps if s.kind == "prefill"]
    assert len(prefill) == 2 * REQUESTS and all(s.tokens in (prompt, prompt + 1) for s in prefill)
    assert multi_token(steps, "decode"), "the drafts' verifications (several tokens over a cache) are decode steps"
    assert not any(s.recomputes_prefix for s in steps)  # (the target's prefill is not the draft's one token longer)
    analysis = analyse(trace)
    gaps = [f for f in analysis.findings if f.kind == "decode_gap" and f.severity != "info"]
    assert gaps, "the logits processor's sleeps between the decode steps are the loop's own gaps"
    # (The target's prefill holds the processor's first call too: with it, "model steps".)
    assert "decode steps" in gaps[0].title or "model steps" in gaps[0].title, gaps[0].title
    assert any(g.cause == gaps[0].evidence["cause"] and analysis.steps[g.step].kind == "decode" for g in analysis.gaps)
    if with_stack:
        assert gaps[0].evidence["cause"] == "waiting" and "sleep" in gaps[0].title
    assert analysis.summary["kv_cache"]["steps"] == 0


def test_prompt_lookup_verifies_in_decode_steps(tmp_path: Path) -> None:
    """Prompt lookup: the candidates come from the prompt itself (no draft model); recorded without
    stacks, the shapes alone say the multi-token steps continue the sequence."""
    def requests() -> None:
        for _ in range(REQUESTS):
            model.generate(PROMPT, prompt_lookup_num_tokens=3, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                           do_sample=False, pad_token_id=tokenizer.pad_token_id)

    steps = find_steps(traced(tmp_path, requests, with_stack=False))
    # Each request's first forward: its prompt (and the first candidates found in it), no cache yet.
    prefill = [s.tokens for s in steps if s.kind == "prefill"]
    assert len(prefill) == REQUESTS and all(t is not None and t >= PROMPT.shape[1] for t in prefill)
    assert multi_token(steps, "decode")


def test_a_next_turn_over_the_cache_is_a_prefill(tmp_path: Path) -> None:
    """A chat's next turn passed the last turn's KV cache: generate() prefills the new message over it
    (several tokens over a cache, as a verification is), and the user's think time before it is not
    the decode loop's (with_stack: generate()'s ``_prefill`` frame says which it is)."""
    turns = 3

    def requests() -> None:
        out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
        for _ in range(turns - 1):
            time.sleep(0.03)  # the user reads and types
            ids = torch.cat([out.sequences, PROMPT[:, :6]], dim=1)
            out = model.generate(ids, past_key_values=out.past_key_values, max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True,
                                 pad_token_id=tokenizer.pad_token_id)

    trace = traced(tmp_path, requests, with_stack=True)
    steps = find_steps(trace)
    assert sum(1 for s in steps if s.kind == "prefill") == turns
    assert multi_token(steps, "decode") == []
    # (Where the think time falls, not whether any decode gap was found: generate()'s own Python
    # between steps, prepare_inputs_for_generation's signature lookups, passes 5% of step time on a
    # busy machine, a true finding of its own.)
    assert_waits_outside(trace, steps, [i for i, s in enumerate(steps) if s.kind == "prefill" and i > 0])
    assert not any(s.recomputes_prefix for s in steps)


def t5() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=tokenizer.pad_token_id, eos_token_id=2)
    return transformers.T5ForConditionalGeneration(config).eval()


def decode_gaps(trace: Trace) -> list[str]:
    """Titles of the decode_gap findings above info."""
    return [f.title for f in analyse(trace).findings if f.kind == "decode_gap" and f.severity != "info"]


def test_the_wait_between_an_encoder_decoders_requests_is_not_a_decode_gap(tmp_path: Path) -> None:
    """T5's generate(): the encoder's pass, then decoder steps of one token each. The sleep between
    two requests falls before a decode step, outside the generate() calls: not the loop's."""
    summarizer = t5()

    def requests() -> None:
        for _ in range(REQUESTS + 1):
            time.sleep(0.03)  # waiting for the next request
            summarizer.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)

    trace = traced(tmp_path, requests, with_stack=True)
    steps = find_steps(trace)
    assert {s.kind for s in steps} == {"decode"} and len(steps) >= (REQUESTS + 1) * (NEW_TOKENS - 1)
    assert sum(1 for s in steps if s.opens_request) == REQUESTS + 1
    assert_waits_outside(trace, steps, [i for i, s in enumerate(steps) if s.opens_request and i > 0])


def test_a_generate_call_per_token_is_the_loop(tmp_path: Path) -> None:
    """generate(max_new_tokens=1) per token (each call one step, over the KV cache passed back): the
    set-up and the sleep between the calls are the decode loop's own."""
    def requests() -> None:
        out = model.generate(PROMPT, max_new_tokens=1, do_sample=False, return_dict_in_generate=True,
                             pad_token_id=tokenizer.pad_token_id)
        for _ in range(NEW_TOKENS):
            time.sleep(0.004)
            out = model.generate(out.sequences, past_key_values=out.past_key_values, max_new_tokens=1,
                                 do_sample=False, return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)

    trace = traced(tmp_path, requests, with_stack=True)
    assert not any(s.opens_request for s in find_steps(trace))
    assert decode_gaps(trace), "the sleeps between the per-token calls are gaps of the decode loop"


@pytest.mark.parametrize("which", ["t5", "llama"])
def test_the_wait_between_requests_is_no_gap_without_stacks(tmp_path: Path, which: str) -> None:
    """Traced without stacks, the steps are each forward's embedding lookup, running to the next one:
    the step before a request's prefill ends with its last op (the wait for the request, then
    generate()'s set-up, lie between), not at the next request's start."""
    generator = t5() if which == "t5" else model

    def requests() -> None:
        for _ in range(REQUESTS + 1):
            time.sleep(WAIT_S)  # waiting for the next request
            generator.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=tokenizer.pad_token_id)

    trace = traced(tmp_path, requests, with_stack=False)
    steps = find_steps(trace)
    assert {s.source for s in steps} == {"embedding"}
    assert sum(1 for s in steps if s.kind == "prefill") == REQUESTS + 1
    assert_waits_outside(trace, steps, [i for i, s in enumerate(steps) if s.kind == "prefill" and i > 0])


def assert_waits_outside(trace: Trace, steps: list[Step], openers: list[int]) -> None:
    """The wait before each of the ``openers`` (indices of the steps that open a request after
    the first) lies between the step before it and it, and no gap, of any cause, holds it. (A busy
    machine or a collection can make gaps of its own as long as a wait: where they fall is what
    tells them apart.)"""
    assert len(openers) == REQUESTS
    waits = [(steps[i - 1].end_us, steps[i].start_us) for i in openers]
    assert all(b - a >= 0.9 * WAIT_S * 1e6 for a, b in waits), [(b - a) / 1e3 for a, b in waits]
    gaps = analyse(trace).gaps
    held = [(g.cause, g.where, g.idle_us) for g in gaps for a, b in waits
            if min(g.end_us, b) - max(g.start_us, a) > 0.1 * WAIT_S * 1e6]
    assert held == []


class OneSlowStep(transformers.LogitsProcessor):
    """Holds one step of each request longer than the wait between requests (as a loaded machine's
    preemption does): earlier steps then run as long as the wait, yet hold no more events."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls % NEW_TOKENS == 3:
            time.sleep(2 * WAIT_S)
        return scores


@pytest.mark.parametrize("which", ["t5", "llama"])
def test_a_step_slower_than_the_wait_does_not_stretch_the_step_before_a_request(tmp_path: Path, which: str) -> None:
    generator = t5() if which == "t5" else model
    processors = transformers.LogitsProcessorList([OneSlowStep()])

    def requests() -> None:
        for _ in range(REQUESTS + 1):
            time.sleep(WAIT_S)  # waiting for the next request
            generator.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                               logits_processor=processors, pad_token_id=tokenizer.pad_token_id)

    trace = traced(tmp_path, requests, with_stack=False)
    steps = find_steps(trace)
    assert max(s.dur_us for s in steps) >= 2 * WAIT_S * 1e6  # (the slow steps are there)
    assert_waits_outside(trace, steps, [i for i, s in enumerate(steps) if s.kind == "prefill" and i > 0])


def whisper() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.WhisperConfig(vocab_size=len(tokenizer), d_model=32, encoder_layers=2, decoder_layers=2,
                                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                        decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=64,
                                        max_target_positions=64, decoder_start_token_id=1,
                                        pad_token_id=tokenizer.pad_token_id, eos_token_id=2,
                                        begin_suppress_tokens=None, suppress_tokens=None)
    return transformers.WhisperForConditionalGeneration(config).eval()


def test_the_wait_before_an_audio_encoders_pass_is_no_gap_without_stacks(tmp_path: Path) -> None:
    """Whisper's encoder looks its positions up ([frames], one dimension: no token ids, a step of
    no kind), then its decoder steps one token at a time. The wait for the next request lies after
    the last decode step of the one before, before the encoder's pass: neither inside that step
    nor a gap between the loop's steps."""
    transcriber = whisper()
    features = torch.randn(1, 16, 128)

    def requests() -> None:
        for _ in range(REQUESTS + 1):
            time.sleep(WAIT_S)  # waiting for the next request
            transcriber.generate(features, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)

    trace = traced(tmp_path, requests, with_stack=False)
    steps = find_steps(trace)
    encoder = [i for i, s in enumerate(steps) if s.kind == "step"]
    assert len(encoder) == REQUESTS + 1 and sum(1 for s in steps if s.kind == "decode") >= (REQUESTS + 1) * 2
    assert all(steps[i].opens_request for i in encoder[1:])
    assert_waits_outside(trace, steps, encoder[1:])
