"""Model steps in traces recorded the way most people first profile a model: the real
torch.profiler around a real transformers ``generate()`` or a hand-written decode loop, with no
schedule (no ProfilerStep#N), no with_stack and no servprof marker. Each forward's first
token-embedding lookup opens a step (step_landmarks.py). Small models built from a config (random
weights, no download) on the CPU: the trace's structure, not the model's quality, is under test."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from _tiny_llm import NEW_TOKENS, PROMPT, generate, tiny_gpt2, tiny_llama, transformers
from torch.profiler import ProfilerActivity, profile, schedule

from servprof.detect.analysis import analyse
from servprof.trace import load_trace


def _trace_of(run, path: Path, record_shapes: bool = False):  # noqa: ANN001 - a callable taking nothing
    run()  # (warm: the first call's one-time work stays out of the trace)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=record_shapes) as prof:
        run()
    prof.export_chrome_trace(str(path))
    return load_trace(path)


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_each_forward_of_an_unmarked_generate_is_a_step(tmp_path: Path, build):  # noqa: ANN001
    model = build()
    trace = _trace_of(lambda: generate(model), tmp_path / "t.json")
    analysis = analyse(trace)
    assert [s.source for s in analysis.steps] == ["embedding"] * NEW_TOKENS
    assert "model steps" not in {m["what"] for m in analysis.summary["missing"]}
    lookups = trace.ts[trace.mask_name(lambda s: s == "aten::embedding") & trace.complete()]
    # Each step opens with the forward's first lookup; the steps follow each other.
    assert {s.start_us for s in analysis.steps} <= set(lookups.tolist())
    assert all(a.end_us == b.start_us for a, b in zip(analysis.steps, analysis.steps[1:], strict=False))


def test_record_shapes_tells_the_prefill_from_the_decode_steps(tmp_path: Path):
    model = tiny_llama()
    analysis = analyse(_trace_of(lambda: generate(model), tmp_path / "t.json", record_shapes=True))
    assert [s.kind for s in analysis.steps] == ["prefill"] + ["decode"] * (NEW_TOKENS - 1)
    assert {s.batch for s in analysis.steps} == {1}


def test_a_hand_written_greedy_loop_is_read_the_same_way(tmp_path: Path):
    embed, layer, head = torch.nn.Embedding(128, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 128)

    def loop() -> None:
        ids = PROMPT.clone()
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                hidden = embed(ids)
                for _ in range(20):  # a few dozen ops per forward, as a real model's layers give
                    hidden = torch.relu(layer(hidden)) + hidden
                token = head(hidden[:, -1]).argmax(-1, keepdim=True)
                ids = torch.cat([ids, token], dim=1)

    analysis = analyse(_trace_of(loop, tmp_path / "t.json"))
    assert [s.source for s in analysis.steps] == ["embedding"] * NEW_TOKENS


def test_profiler_steps_each_around_a_whole_generate_give_way_to_its_forwards(tmp_path: Path):
    """The usual schedule (a step per generate() call, the trace written when the cycle ends)."""
    model = tiny_llama()
    path = tmp_path / "t.json"
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(3):
            generate(model)
            prof.step()
    trace = load_trace(path)
    assert trace.mask_name(lambda s: s.startswith("ProfilerStep#")).sum() == 2
    analysis = analyse(trace)
    assert [s.source for s in analysis.steps] == ["embedding"] * (2 * NEW_TOKENS)


SLEEP_S = 0.02


def _inside_step_gaps(analysis) -> list:  # noqa: ANN001
    return [f for f in analysis.findings if f.kind == "decode_gap" and f.evidence.get("where") == "inside_step"]


@pytest.mark.parametrize("record_shapes", [False, True], ids=["no-shapes", "shapes"])
def test_a_wait_in_every_iteration_of_an_unmarked_loop_is_a_gap(tmp_path: Path, record_shapes: bool):
    """A hand-written loop that sleeps before each forward (a per-token callback, a rate limiter):
    its thread records nothing for most of every step, none slower than the others. Said, with
    the time, instead of "no findings": with no shapes every step's kind is unknown; with shapes
    they are decode steps, all judged (not only those slower than their median)."""
    model = tiny_llama()

    def loop() -> None:
        with torch.no_grad():
            out = model(input_ids=PROMPT, use_cache=True)
            for _ in range(NEW_TOKENS):
                time.sleep(SLEEP_S)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)

    analysis = analyse(_trace_of(loop, tmp_path / "t.json", record_shapes))
    kinds = ["prefill"] + ["decode"] * NEW_TOKENS if record_shapes else ["step"] * (NEW_TOKENS + 1)
    assert [s.kind for s in analysis.steps] == kinds
    (finding,) = _inside_step_gaps(analysis)
    assert finding.evidence["cause"] == "untraced_host_time" and finding.evidence["gaps"] >= NEW_TOKENS - 1
    # Each counted gap is the thread's unrecorded time in one step: the sleep and little else.
    assert finding.evidence["median_gap_ms"] >= SLEEP_S * 1000
    assert finding.cost_ms >= (NEW_TOKENS - 1) * SLEEP_S * 1000
    assert "sleeps" in finding.fix


def test_an_idle_spell_between_generate_calls_is_not_a_stall(tmp_path: Path):
    """generate() three times with the server idle between calls: without shapes the last step of
    each call runs to the next call's first forward, across the idle time; it is not judged a stall
    (the trace cannot tell it from the wait for the next request), and a loop without waits gets none."""
    model = tiny_llama()

    def requests() -> None:
        for _ in range(3):
            generate(model)
            time.sleep(0.2)

    analysis = analyse(_trace_of(requests, tmp_path / "t.json"))
    assert len(analysis.steps) == 3 * NEW_TOKENS
    assert max(s.dur_us for s in analysis.steps) >= 200_000  # a step across an idle spell
    assert _inside_step_gaps(analysis) == []


def test_per_token_python_on_a_cpu_trace_is_named_in_host_words(tmp_path: Path):
    """A user's logits processor that walks the vocabulary in Python every step, profiled with
    with_stack on the CPU: the Python between steps is named by its frames, and in the words of a
    trace with no device (nothing waited on a GPU; the fix is the Python itself)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from servprof.detect.cause_texts import HOST_CAUSES

    class PenaliseOddIds(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            row = scores[0].tolist()
            for token_id in range(len(row)):  # the vocabulary, in Python, every step
                if token_id % 2:
                    row[token_id] -= 1.0
            return torch.tensor([row])

    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval()

    def run() -> None:
        with torch.no_grad():
            model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                           logits_processor=LogitsProcessorList([PenaliseOddIds()]))

    run()
    path = tmp_path / "t.json"
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        run()
    prof.export_chrome_trace(str(path))
    analysis = analyse(load_trace(path))
    (finding,) = [f for f in analysis.findings if f.kind == "decode_gap" and f.evidence["cause"] == "host_python"]
    assert HOST_CAUSES["host_python"][0] in finding.title and "device waited" not in finding.title
    assert "test_detect_unmarked_loops.py" in finding.title  # the processor's own frame
    assert finding.fix == HOST_CAUSES["host_python"][1]


def _training_loop(batches: object) -> object:  # noqa: ANN001 - an iterable of (x, y)
    """The PyTorch tutorials' loop over batches the caller makes (tensors in memory, a generator of
    its own): no torch DataLoader, so no enumerate(DataLoader)# fetch opens the iterations."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def train() -> None:
        for x, y in batches():  # type: ignore[operator]
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()

    return train


ITERATIONS = 5


def test_a_training_loop_without_a_data_loader_steps_at_each_optimizer_step(tmp_path: Path):
    """Each iteration's optimizer step (torch records Optimizer.step#SGD.step for every optimizer)
    opens a training step that runs to the next one, the last closing the last step (what follows it
    is no whole iteration): the trace is no longer "no model step"."""
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    trace = _trace_of(_training_loop(lambda: [(x, y)] * ITERATIONS), tmp_path / "t.json")
    analysis = analyse(trace)
    optimizer_steps = trace.ts[trace.mask_name(lambda s: s.startswith("Optimizer.step#")) & trace.complete()]
    assert optimizer_steps.size == ITERATIONS
    assert [(s.source, s.kind) for s in analysis.steps] == [("optimizer", "train")] * (ITERATIONS - 1)
    assert [(s.start_us, s.end_us) for s in analysis.steps] == list(zip(sorted(optimizer_steps.tolist())[:-1],
                                                                         sorted(optimizer_steps.tolist())[1:],
                                                                         strict=True))
    assert "model steps" not in {m["what"] for m in analysis.summary["missing"]}


def test_a_slow_batch_source_in_a_training_loop_is_a_gap_in_its_steps(tmp_path: Path):
    """The user's own batch generator sleeps before each batch (a slow read from disk or the network):
    the wait lies in every step between two optimizer steps, and is said, with its time."""
    x, y = torch.randn(32, 64), torch.randn(32, 8)

    def slow_batches():  # noqa: ANN202
        for _ in range(ITERATIONS):
            time.sleep(SLEEP_S)
            yield x, y

    analysis = analyse(_trace_of(_training_loop(slow_batches), tmp_path / "t.json"))
    assert [s.source for s in analysis.steps] == ["optimizer"] * (ITERATIONS - 1)
    (finding,) = _inside_step_gaps(analysis)
    assert finding.evidence["cause"] == "untraced_host_time" and finding.evidence["gaps"] >= ITERATIONS - 1
    assert finding.evidence["median_gap_ms"] >= SLEEP_S * 1000
    assert "training" in finding.title and "decode" not in finding.title
