"""Reads of device values on the host, told apart by where they fall in a decode step
(detect/host_reads.py): the sampled token read after the step's forward (read it one step
behind), or reads inside the forward, with the step's layers still to run (an MoE layer looping
over the experts it routed to: a grouped or fused MoE). On a GPU both are device syncs; the fix
differs.

Real parts: the real profiler on the CPU around transformers' own generate() of a tiny Mixtral
(random weights from a config, its eager experts: `nonzero()` and a loop over the experts hit) and
of the servers' tiny Llama, and a hand-written loop that reads the last token at the top of each
marked iteration.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from servers.hf_streaming import model as llama
from torch.profiler import ProfilerActivity, profile, schedule

from servprof.detect.analysis import analyse
from servprof.detect.finding import Finding
from servprof.trace import load_trace

transformers = pytest.importorskip("transformers")

PROMPT = torch.arange(3, 40).unsqueeze(0)
NEW_TOKENS = 8


def host_read_finding(tmp_path: Path, run: object) -> Finding:
    path = tmp_path / "trace.json"
    with torch.inference_mode():
        run()  # (warm-up)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
    prof.export_chrome_trace(str(path))
    (finding,) = [f for f in analyse(load_trace(path)).findings if f.evidence.get("cause") == "host_read_per_step"]
    return finding


def mixtral() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                        num_experts_per_tok=2, pad_token_id=0, experts_implementation="eager")
    return transformers.MixtralForCausalLM(config).eval()


def generate(generator: torch.nn.Module) -> None:
    generator.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


def test_an_moe_expert_loop_reads_inside_the_forward(tmp_path: Path) -> None:
    moe = mixtral()
    finding = host_read_finding(tmp_path, lambda: generate(moe))
    evidence = finding.evidence
    # Per layer, the experts hit are iterated on the host: several reads per step, most mid-forward.
    assert evidence["where"] == "in_forward"
    assert evidence["in_forward_per_step"] >= 2 and evidence["in_forward_per_step"] >= 0.5 * evidence["reads_per_step"]
    assert "model's forward" in finding.title and "grouped_mm" in finding.fix and "fused_moe" in finding.fix


def test_a_dense_models_sampled_token_is_read_after_its_forward(tmp_path: Path) -> None:
    finding = host_read_finding(tmp_path, lambda: generate(llama))
    assert finding.evidence["where"] == "per_step" and finding.evidence["in_forward_per_step"] == 0
    assert "one step behind" in finding.fix


def test_a_read_at_the_top_of_a_profiler_step_is_not_inside_the_forward(tmp_path: Path) -> None:
    """prof.step() after each iteration: each ProfilerStep#N opens with the last token's read (an
    end-of-sequence check), then runs the forward. The read has layers after it in its step, but
    none before: it is not the forward's."""
    path = tmp_path / "trace.json"
    out = llama(PROMPT, use_cache=True)
    past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU],
                                         schedule=schedule(wait=0, warmup=1, active=NEW_TOKENS, repeat=1),
                                         on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(NEW_TOKENS + 1):
            if token.item() == -1:  # (never: the check itself is the read)
                break
            out = llama(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            prof.step()
    analysis = analyse(load_trace(path))
    assert {s.source for s in analysis.steps} == {"profiler_step"}
    (finding,) = [f for f in analysis.findings if f.evidence.get("cause") == "host_read_per_step"]
    assert finding.evidence["where"] == "per_step" and finding.evidence["in_forward_per_step"] == 0
