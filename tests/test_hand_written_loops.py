"""A hand-written decode loop, traced the ways users trace it: steps a user marked with
``torch.profiler.record_function`` (detect/step_annotations.py), whatever the names, and ranges
that are not steps; a loop that marks nothing, with and without ``record_shapes``, with and
without a KV cache (detect/step_kinds.label_unknown_kinds, detect/stalled_steps.py).

Real parts: the real profiler around a real transformers Llama (the servers' tiny one) run with
its KV cache the way a hand-written loop runs it, and a plain torch MLP for a model without an
embedding lookup. A ``time.sleep`` after one step per request is the stall the steps must place
between two steps (counted, not timed).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from servers.hf_streaming import model, tokenizer
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from servprof.detect.analysis import analyse
from servprof.detect.finding import Finding
from servprof.detect.steps import find_steps
from servprof.trace import load_trace
from servprof.trace.model import Trace

REQUESTS = 3
NEW_TOKENS = 8
STALL_AFTER = 4  # a sleep after this decode step of every request
STALL_S = 0.02
Range = Callable[[int], contextlib.AbstractContextManager[None]]


def nothing(_: int = 0) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def named(name: str) -> Range:
    return lambda i: record_function(name.format(i=i))


def generate_by_hand(prefill: Range = nothing, step: Range = nothing, decode_phase: Range = nothing,
                     after_step: Callable[[torch.Tensor], None] = lambda token: None, stall: bool = True,
                     kv_cache: bool = True) -> None:
    """A request as a hand-written loop runs it: a prefill, then one forward per new token (over
    the new token with a KV cache, else over the whole sequence)."""
    ids = tokenizer("The harbour master counted the boats", return_tensors="pt").input_ids
    with prefill(0):
        out = model(ids, use_cache=kv_cache)
    past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    with decode_phase(0):
        for i in range(NEW_TOKENS):
            with step(i):
                if kv_cache:
                    out = model(token, past_key_values=past, use_cache=True)
                else:
                    ids = torch.cat([ids, token], dim=1)
                    out = model(ids, use_cache=False)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            after_step(token)
            if stall and i == STALL_AFTER:
                time.sleep(STALL_S)


def traced(tmp_path: Path, request: Callable[[], None], with_stack: bool = False,
           profiler_step_per_request: bool = False, record_shapes: bool = False) -> Trace:
    path = tmp_path / "trace.json"
    # With a schedule, the trace is exported when its cycle ends, as users' on_trace_ready handlers do.
    options = {"schedule": schedule(wait=0, warmup=1, active=REQUESTS, repeat=1),
               "on_trace_ready": lambda p: p.export_chrome_trace(str(path))} if profiler_step_per_request else {}
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], with_stack=with_stack,
                                         record_shapes=record_shapes, **options) as prof:
        for _ in range(REQUESTS + profiler_step_per_request):  # (one more to warm up)
            request()
            if profiler_step_per_request:
                prof.step()
    if not profiler_step_per_request:
        prof.export_chrome_trace(str(path))
    return load_trace(path)


def stall_finding(trace: Trace, stalls: list[tuple[float, float]], inside: bool = False) -> Finding:
    """The decode_gap finding that holds a gap for each stall: the gap is the stall (between two
    steps), or lies within it (``inside``: the stall is the step that holds the sleep). Its gaps
    are all those of its cause and place in its span, not only the worst it lists (a loaded
    machine adds longer ones)."""
    analysis = analyse(trace)
    for finding in analysis.findings:
        if finding.kind != "decode_gap" or "where" not in finding.evidence:
            continue
        gaps = [(g.start_us, g.end_us) for g in analysis.gaps
                if (g.cause, g.where) == (finding.evidence["cause"], finding.evidence["where"])
                and finding.start_us <= g.start_us and g.end_us <= finding.end_us]
        if inside:
            found = [any(a <= g0 and g1 <= b for g0, g1 in gaps) for a, b in stalls]
        else:
            found = [any(g0 == pytest.approx(a) and g1 == pytest.approx(b) for g0, g1 in gaps) for a, b in stalls]
        if all(found):
            return finding
    raise AssertionError(f"no decode_gap finding holds the stalls {stalls}")


def kinds(trace: Trace) -> dict[str, int]:
    steps = find_steps(trace)
    return {kind: sum(1 for s in steps if s.kind == kind) for kind in sorted({s.kind for s in steps})}


def sources(trace: Trace) -> set[str]:
    return {s.source for s in find_steps(trace)}


@pytest.mark.parametrize("with_stack", [False, True])
@pytest.mark.parametrize("step_name", ["decode_step", "generate_token_{i}"])
def test_annotated_steps_are_the_steps_and_a_stall_between_them_is_found(tmp_path: Path, step_name: str,
                                                                          with_stack: bool) -> None:
    trace = traced(tmp_path, lambda: generate_by_hand(prefill=named("prefill"), step=named(step_name)),
                   with_stack=with_stack)
    steps = find_steps(trace)
    assert {s.source for s in steps} == {"annotation"}
    assert kinds(trace) == {"decode": REQUESTS * NEW_TOKENS, "prefill": REQUESTS}
    # The sleep falls between decode step STALL_AFTER and the next one, in every request: one gap each.
    decode = [s for s in steps if s.kind == "decode"]
    stalls = [(decode[r * NEW_TOKENS + STALL_AFTER].end_us, decode[r * NEW_TOKENS + STALL_AFTER + 1].start_us)
              for r in range(REQUESTS)]
    # (A busy machine can add a gap of its own: the stalls must be among those found.)
    gap = stall_finding(trace, stalls)
    assert gap.evidence["where"] == "between_steps"
    if with_stack:  # the sleep is named, and what to do about it
        assert gap.evidence["cause"] == "waiting" and "sleep" in gap.title and "remove it" in gap.fix
    else:  # nothing recorded names it: the finding says so, and how to see it
        assert gap.evidence["cause"] == "untraced_host_time" and "with_stack=True" in gap.fix


def test_ranges_around_phases_label_the_forwards_kinds(tmp_path: Path) -> None:
    """A range per request and per phase (prefill, the whole decode loop): not steps, each holds
    several forwards; the forwards are the steps, of the kind their phase names, and the stall is
    found inside the decode step that holds it."""
    def request() -> None:
        with record_function("generate"):
            generate_by_hand(prefill=named("prefill"), decode_phase=named("decode"))

    trace = traced(tmp_path, request)
    assert sources(trace) == {"embedding"}
    assert kinds(trace) == {"decode": REQUESTS * NEW_TOKENS, "prefill": REQUESTS}
    steps = find_steps(trace)
    holding = [s for s in steps if s.kind == "decode"][STALL_AFTER::NEW_TOKENS]  # the step the sleep ends
    gap = stall_finding(trace, [(s.start_us, s.end_us) for s in holding], inside=True)
    assert gap.evidence["where"] == "inside_step"


def test_host_work_ranges_and_a_prefill_alone_are_not_the_steps(tmp_path: Path) -> None:
    """Sampling and detokenizing ranges next to each step hold no forward (a tokenizer's "decode"
    names a decode but runs no model); a prefill range alone leaves the decode forwards unmarked.
    The forwards stay the steps, the prefills labelled as such."""
    def request() -> None:
        def after(token: torch.Tensor) -> None:
            with record_function("sample_token"):
                token.clone()
            with record_function("decode"):
                tokenizer.decode(token[0])

        generate_by_hand(prefill=named("prefill"), after_step=after, stall=False)

    trace = traced(tmp_path, request)
    assert sources(trace) == {"embedding"}
    assert kinds(trace) == {"prefill": REQUESTS, "step": REQUESTS * NEW_TOKENS}


def test_steps_inside_a_profiler_step_per_request(tmp_path: Path) -> None:
    """prof.step() after each request: each ProfilerStep#N holds a whole request, and the annotated
    steps inside it are the steps."""
    trace = traced(tmp_path, lambda: generate_by_hand(prefill=named("prefill"), step=named("decode_step"),
                                                      stall=False), profiler_step_per_request=True)
    assert any(trace.name(r).startswith("ProfilerStep#") for r in range(len(trace)))
    assert sources(trace) == {"annotation"}
    assert kinds(trace) == {"decode": REQUESTS * NEW_TOKENS, "prefill": REQUESTS}


@contextlib.contextmanager
def mlp_loop(tmp_path: Path, name: str) -> Iterator[Trace]:
    """A model with no embedding lookup (no forward the trace shows) in a loop of named ranges."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).eval()
    x = torch.randn(4, 64)

    def request() -> None:
        for i in range(NEW_TOKENS):
            with record_function(name.format(i=i)):
                mlp(x)

    yield traced(tmp_path, request)


def test_without_forwards_a_step_name_with_ops_is_a_step(tmp_path: Path) -> None:
    with mlp_loop(tmp_path, "inference_step_{i}") as trace:
        steps = find_steps(trace)
        assert {s.source for s in steps} == {"annotation"} and len(steps) == REQUESTS * NEW_TOKENS
    with mlp_loop(tmp_path, "LayerNorm affine=True") as trace:  # (a benchmark's case names: not steps)
        assert find_steps(trace) == []


def test_an_unmarked_loop_says_the_stalls_it_could_not_judge(tmp_path: Path) -> None:
    """No marker, no shapes: the steps' kinds are unknown, and a step far past the median may hold
    the wait between two requests. Not judged, and said so, with what would let it be."""
    trace = traced(tmp_path, generate_by_hand)
    assert sources(trace) == {"embedding"} and kinds(trace) == {"step": REQUESTS * (NEW_TOKENS + 1)}
    analysis = analyse(trace)
    assert not [f for f in analysis.findings if f.kind == "decode_gap"]
    (missing,) = [m for m in analysis.summary["missing"] if m["what"] == "step kinds"]
    # (each request's stall; a busy machine can add a slow step of its own)
    assert int(missing["message"].split(" step(s) of unknown kind")[0]) >= REQUESTS
    assert "record_function" in missing["message"] and "record_shapes=True" in missing["message"]


@pytest.mark.parametrize("kv_cache", [True, False])
def test_shapes_tell_decode_steps_with_or_without_a_kv_cache(tmp_path: Path, kv_cache: bool) -> None:
    """record_shapes: a forward over one new token is a decode step; without a KV cache, each
    forward runs over the whole sequence, one token longer than the last: a decode step too
    (counted), and the stall inside one is judged."""
    trace = traced(tmp_path, lambda: generate_by_hand(kv_cache=kv_cache), record_shapes=True)
    assert kinds(trace) == {"decode": REQUESTS * NEW_TOKENS, "prefill": REQUESTS}
    analysis = analyse(trace)
    assert analysis.summary["steps"]["recompute_prefix"] == (0 if kv_cache else REQUESTS * NEW_TOKENS)
    cache = [f for f in analysis.findings if f.kind == "decode_without_kv_cache"]
    if kv_cache:
        assert cache == []
    else:  # each step ran over the prompt and the tokens so far; its cost is read from the steps' times
        (finding,) = cache
        prompt = len(tokenizer("The harbour master counted the boats").input_ids)
        evidence = finding.evidence
        assert (evidence["steps"], evidence["tokens_min"], evidence["tokens_max"]) == \
            (REQUESTS * NEW_TOKENS, prompt + 1, prompt + NEW_TOKENS)
        decode_ms = sum(s.time_us for s in find_steps(trace) if s.kind == "decode") / 1e3
        assert 0 <= finding.cost_ms <= decode_ms and (finding.cost_ms > 0) == (evidence["us_per_earlier_token"] > 0)
        assert "no KV cache" in finding.title and "past_key_values" in finding.fix
    holding = [s for s in find_steps(trace) if s.kind == "decode"][STALL_AFTER::NEW_TOKENS]
    assert stall_finding(trace, [(s.start_us, s.end_us) for s in holding], inside=True)
    assert not [m for m in analysis.summary["missing"] if m["what"] == "step kinds"]


def test_annotated_steps_beat_a_profiler_step_around_each(tmp_path: Path) -> None:
    """prof.step() after every decode step (the PyTorch recipe's loop): each ProfilerStep#N holds one
    annotated step and the host work after it; the annotated steps, which name their kind, are the
    steps, and the stall after one is a gap between them."""
    path = tmp_path / "trace.json"
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU],
                                         schedule=schedule(wait=0, warmup=1, active=REQUESTS * (NEW_TOKENS + 1), repeat=1),
                                         on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(REQUESTS + 1):
            generate_by_hand(prefill=named("prefill"), step=named("decode_step"),
                             after_step=lambda token: prof.step())
            prof.step()
    trace = load_trace(path)
    assert any(trace.name(r).startswith("ProfilerStep#") for r in range(len(trace)))
    steps = find_steps(trace)
    assert {s.source for s in steps} == {"annotation"}
    decode = [s for s in steps if s.kind == "decode"]
    stalls = [(before.end_us, after.start_us) for before, after in zip(decode, decode[1:], strict=False)
              if after.start_us - before.end_us > STALL_S * 1e6 / 2]
    assert len(stalls) >= REQUESTS - 1  # (the first request warms up; the schedule's window decides the rest)
    assert stall_finding(trace, stalls).evidence["where"] == "between_steps"
