"""A ``torch.compile``d model that marks nothing: each call of it is one step, read from the
``Torch-Compiled Region`` ranges torch records (detect/step_compiled.py), and the wait for a new
request before such a step (whose kind the trace does not say) is not judged a gap.

Real parts: the real profiler and real Dynamo regions around a real tiny transformers Llama,
compiled with inductor as users do (its generated code is what leaves no ``aten::embedding``;
an eager backend runs the graph's ATen ops, and the embedding form finds the same steps). The
graph-break and sampler tests compile with ``backend="eager"``: the regions are Dynamo's (one per
call of a compiled frame) whatever backend builds the graph, and eager compiles in a fraction of
inductor's time. The server test runs real sessions over uvicorn
(tests/servers/compiled_model.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _kineto_builder import KinetoTrace
from _server_session import session_on
from servers.hf_streaming import build_model, build_tokenizer
from torch.profiler import ProfilerActivity, profile

from servprof.capture import get_controller
from servprof.detect.analysis import analyse
from servprof.detect.steps import find_steps
from servprof.trace import load_trace
from servprof.trace.model import Trace

REGION = "Torch-Compiled Region: "
NEW_TOKENS = 6


def traced(tmp_path: Path, work: Callable[[], Any]) -> Trace:
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        work()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    return load_trace(path)


def regions(trace: Trace) -> list[str]:
    return [trace.name(row) for row in range(len(trace)) if trace.name(row).startswith(REGION)]


def test_each_forward_of_a_compiled_generate_is_one_step(tmp_path: Path) -> None:
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer))
    model.forward = torch.compile(model.forward, dynamic=True)  # transformers' recipe
    ids = tokenizer("The harbour master counted the boats", return_tensors="pt").input_ids.to(model.device)

    def generate() -> None:
        model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                       pad_token_id=tokenizer.pad_token_id)

    with torch.inference_mode():
        generate()  # compiles
    trace = traced(tmp_path, generate)
    steps = find_steps(trace)
    # One forward per new token; the graph holds the embedding lookup, so only the regions show them.
    assert len(steps) == NEW_TOKENS == len(regions(trace))
    assert {s.source for s in steps} == {"compiled"} and {s.kind for s in steps} == {"step"}
    assert not [row for row in range(len(trace)) if trace.name(row) == "aten::embedding"]
    summary = analyse(trace).summary
    assert summary["steps"]["count"] == NEW_TOKENS and summary["steps"]["source"] == ["compiled"]
    assert "model steps" not in [m["what"] for m in summary["missing"]]


class BreakingModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.first(x).relu()
        if y.sum().item() > 0:  # a graph break: the rest is a resume frame of its own
            y = y * 2
        return self.second(y)


def test_a_graph_breaks_resume_frame_stays_inside_its_step(tmp_path: Path) -> None:
    model = torch.compile(BreakingModel(), backend="eager")
    x = torch.randn(4, 32)
    model(x)
    trace = traced(tmp_path, lambda: [model(x) for _ in range(3)])
    names = regions(trace)
    assert len(names) == 6 and len({n.split("/")[0] for n in names}) == 2  # two frames per call, nested
    steps = find_steps(trace)
    assert len(steps) == 3 and all(s.label.startswith(REGION) for s in steps)


def test_a_compiled_sampler_beside_the_model_is_not_a_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(6)))  # float in, no embedding
    model = torch.compile(net, backend="eager")
    sample = torch.compile(lambda x: x.argmax(-1), backend="eager")
    x = torch.randn(2, 64)

    def loop() -> None:  # a hand-written loop: the model, then the sampler, each compiled
        for _ in range(4):
            sample(model(x))

    with torch.inference_mode():
        loop()
    trace = traced(tmp_path, loop)
    assert len(regions(trace)) == 8
    steps = find_steps(trace)
    assert len(steps) == 4 and len({s.label.split("/")[0] for s in steps}) == 1
    model_frame = steps[0].label.split("/")[0]
    sampler_rows = [r for r in range(len(trace)) if trace.name(r).startswith(REGION)
                    and not trace.name(r).startswith(model_frame + "/")]
    assert len(sampler_rows) == 4 and all(float(trace.dur[r]) < min(s.dur_us for s in steps) for r in sampler_rows)


def test_an_eager_model_with_a_compiled_sampler_keeps_its_embedding_steps(tmp_path: Path) -> None:
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer))
    sample = torch.compile(lambda logits: logits[:, -1].argmax(-1, keepdim=True), backend="eager", dynamic=True)

    def loop() -> None:
        ids = tokenizer("Every rope was checked", return_tensors="pt").input_ids.to(model.device)
        for _ in range(3):
            ids = torch.cat([ids, sample(model(ids).logits)], dim=1)

    with torch.inference_mode():
        loop()
    steps = find_steps(traced(tmp_path, loop))
    assert len(steps) == 3 and {s.source for s in steps} == {"embedding"}


BASE_NS = 1_700_000_000_000_000_000
GAP_US = 30_000.0


def record(rid: str, arrival_us: float, end_us: float) -> dict[str, Any]:
    """A session's request record (docs/CONTRACTS.md) for a trace whose base time is BASE_NS."""
    perf0 = 5_000_000
    return {"request_id": rid, "arrival_ns": BASE_NS + int(arrival_us * 1000),
            "arrival_perf_ns": perf0 + int(arrival_us * 1000), "end_ns": perf0 + int(end_us * 1000)}


def two_requests(tmp_path: Path, other_thread: bool = False) -> tuple[Trace, float, float]:
    """Compiled-region steps on thread 1: request A's five, 30 ms with nothing recorded, request B's
    five (``other_thread``: meanwhile thread 2 runs steps all along, another request's). Returns the
    trace, when A's last step ended and when B's first began."""
    built = KinetoTrace(metadata={"baseTimeNanoseconds": BASE_NS})
    start, edges = 1000.0, []
    for _request in range(2):
        edges.append(start)
        for _ in range(5):
            built.host(f"{REGION}0/0", start, 400.0)
            built.host("aten::addmm", start + 50.0, 200.0)
            start += 500.0
        edges.append(start - 100.0)
        start += GAP_US
    if other_thread:
        for at in np.arange(1000.0, start, 500.0):
            built.host(f"{REGION}0/0", float(at) + 100.0, 300.0, tid=2)
    return load_trace(built.write(tmp_path / f"two{other_thread}.json", device_name="CPU")), edges[1], edges[2]


def between_step_gaps(summary: dict[str, Any], findings: list[Any]) -> float:
    """ms of between-steps gaps the analysis judged: reported or under the bar."""
    reported = sum(f.cost_ms for f in findings if f.kind == "decode_gap" and f.evidence.get("where") == "between_steps")
    below = sum(b["ms"] for b in summary["decode_gap"].get("below_bar", []) if b["where"] == "between_steps")
    return reported + below


def judged(trace: Trace, records: list[dict[str, Any]] | None) -> tuple[float, int]:
    analysis = analyse(trace, records)
    return (between_step_gaps(analysis.summary, analysis.findings),
            analysis.summary["decode_gap"]["unknown_steps_after_arrival"])


def test_the_wait_for_a_new_request_before_a_step_of_unknown_kind_is_not_a_gap(tmp_path: Path) -> None:
    trace, a_done, b_first = two_requests(tmp_path)
    steps = find_steps(trace)
    assert len(steps) == 10 and {s.kind for s in steps} == {"step"}
    gap_ms = (b_first - a_done) / 1e3
    assert judged(trace, None) == (pytest.approx(gap_ms, abs=0.01), 0)  # no records: all the trace can show
    # A ended, then B arrived inside the gap: the engine had nothing to run, B's first step may be its prefill.
    idle = [record("req-a", 900.0, a_done + 50.0), record("req-b", b_first - 2000.0, b_first + 10_000.0)]
    assert judged(trace, idle) == (0, 1)
    # A still in flight when B arrived: one step thread (an engine) had work and did not run it.
    busy = [record("req-a", 900.0, b_first + 20_000.0), record("req-b", b_first - 2000.0, b_first + 10_000.0)]
    assert judged(trace, busy) == (pytest.approx(gap_ms, abs=0.01), 0)
    # An arrival before the first step only changes nothing.
    assert judged(trace, idle[:1]) == (pytest.approx(gap_ms, abs=0.01), 0)


def test_with_a_thread_per_request_an_arrival_in_a_threads_gap_is_its_next_request(tmp_path: Path) -> None:
    trace, a_done, b_first = two_requests(tmp_path, other_thread=True)
    others = [record("req-c", 0.0, b_first + 40_000.0)]  # thread 2's request, in flight all along
    arrived = [*others, record("req-a", 900.0, a_done + 50.0), record("req-b", b_first - 2000.0, b_first + 10_000.0)]
    gap_ms, fresh = judged(trace, arrived)
    assert fresh == 1 and gap_ms < (b_first - a_done) / 1e3  # thread 1's 30 ms wait is not judged


def test_a_served_compiled_model_gets_its_steps_in_a_deep_window_and_says_what_a_light_one_lacks(
        tmp_path: Path) -> None:
    requests, max_tokens = 3, 8
    # One process is one server: this one starts here (earlier tests' requests would make the
    # compile at import a compile while serving), and compiles at import, before its first request.
    get_controller().first_model_request_ns = None
    importlib.import_module("servers.compiled_model")
    deep = session_on("servers.compiled_model", tmp_path / "deep", ["/v1/generate"] * requests, max_tokens,
                      spaced_s=0.05, tier="deep")
    light = session_on("servers.compiled_model", tmp_path / "light", ["/v1/generate"] * requests, max_tokens,
                       spaced_s=0.05)
    for observed in (deep, light):
        assert [status for _, status, _ in observed["responses"]] == [200] * requests
        assert observed["result"]["error"] is None, observed["result"]["error"]
        assert "torch.compile" in observed["session"]["auto"]["problem"]
    summary = deep["result"]["summary"]["detect"]
    assert summary["tier"] == "deep"
    assert summary["steps"]["count"] == requests * max_tokens and summary["steps"]["source"] == ["compiled"]
    # Requests came one after another: the wait for the next one (its tokenize phase lies in it, on
    # the pool thread that runs it) is never judged a gap between decode steps.
    tokenize_starts = [p["start_us"] for r in deep["result"]["requests"].values() for p in r["phases"]
                       if p["name"] == "tokenize"]
    assert len(tokenize_starts) == requests
    judged = [g for f in deep["result"]["findings"] if f["kind"] == "decode_gap" for g in f["evidence"].get("worst_gaps", [])]
    judged += summary["decode_gap"].get("unreported_gaps", [])
    for gap in (g for g in judged if g["where"] == "between_steps"):
        assert not [t for t in tokenize_starts if gap["start_us"] < t < gap["end_us"]], gap
    assert 0 < summary["decode_gap"]["unknown_steps_after_arrival"] <= requests - 1
    assert not [f for f in deep["result"]["findings"] if f["kind"] == "recompilation"]  # compiled before serving
    for observed in (deep, light):  # the serving side says why, and what a deep window adds
        note = [m["message"] for m in observed["session"]["missing"] if m["what"] == "automatic model steps"]
        assert note and "deep window reads its steps" in note[0], observed["session"]["missing"]
    light_summary = light["result"]["summary"]["detect"]
    assert light_summary["tier"] == "light" and light_summary["steps"]["count"] == 0
    assert "model steps" in [m["what"] for m in light_summary["missing"]]
