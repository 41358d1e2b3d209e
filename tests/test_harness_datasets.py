"""Dataset loaders, arrival schedules, SLO parsing and the summary arithmetic of the harness
(no server, no locust process: these run in milliseconds)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import orjson
import pytest

from servprof.harness.arrivals import ArrivalError, Pacer
from servprof.harness.datasets import (
    COMMON_PREFIX_WORDS,
    DatasetError,
    load_custom_jsonl,
    load_dataset,
    load_sharegpt,
    load_trace_jsonl,
    replay_offsets,
    synthetic_mix,
)
from servprof.harness.summary import Collector, SLOError, parse_slo, summarize


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_custom_jsonl_accepts_its_format(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "c.jsonl", ['{"prompt": "hello there", "output_tokens": 7}', "", '{"prompt": "b", "output_tokens": 1}'])
    specs = load_custom_jsonl(path)
    assert [(s.prompt, s.output_tokens, s.input_tokens) for s in specs] == [("hello there", 7, 2), ("b", 1, 1)]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"prompt": "x", "output_tokens": 0}', "'output_tokens' must be a positive integer"),
        ('{"prompt": "", "output_tokens": 3}', "'prompt' must be a non-empty string"),
        ('{"prompt": "x", "output_tokens": "3"}', "'output_tokens' must be a positive integer"),
        ('{"prompt": "x", "output_tokens": 3', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_custom_jsonl_rejects_malformed_lines_naming_the_line(tmp_path: Path, bad_line: str, message: str) -> None:
    path = write_lines(tmp_path / "c.jsonl", ['{"prompt": "ok", "output_tokens": 2}', "", bad_line])
    with pytest.raises(DatasetError) as info:
        load_custom_jsonl(path)
    assert f"{path}:3:" in str(info.value)
    assert message in str(info.value)


def test_trace_jsonl_accepts_its_format_with_shared_prefixes(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 1000, "input_length": 40, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 1500, "input_length": 40, "output_length": 9, "hash_ids": [1, 3]},
        {"timestamp": 3000, "input_length": 8, "output_length": 2},
    ]
    path = write_lines(tmp_path / "t.jsonl", [orjson.dumps(r).decode() for r in rows])
    specs = load_trace_jsonl(path, block_size=16)
    assert [s.timestamp_s for s in specs] == [0.0, 0.5, 2.0]
    assert [s.output_tokens for s in specs] == [5, 9, 2]
    assert [len(s.prompt.split()) for s in specs] == [40, 40, 8]
    first, second = specs[0].prompt.split(), specs[1].prompt.split()
    assert first[:16] == second[:16]  # hash id 1 in both: same first block
    assert first[16:32] != second[16:32]  # hash ids 2 and 3 differ
    assert list(replay_offsets(specs)) == [0.0, 0.5, 2.0]


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"timestamp": 500, "input_length": 4, "output_length": 2}', "earlier than the line before"),
        ('{"timestamp": 2000, "input_length": -1, "output_length": 2}', "'input_length' must be a positive integer"),
        ('{"timestamp": 2000, "input_length": 4}', "'output_length' must be a positive integer"),
        ('{"timestamp": "soon", "input_length": 4, "output_length": 2}', "'timestamp' must be a number"),
        ('{"timestamp": 2000, "input_length": 4, "output_length": 2, "hash_ids": "a"}', "'hash_ids' must be a list"),
    ],
)
def test_trace_jsonl_rejects_malformed_lines_naming_the_line(tmp_path: Path, bad_line: str, message: str) -> None:
    path = write_lines(tmp_path / "t.jsonl", ['{"timestamp": 1000, "input_length": 4, "output_length": 2}', bad_line])
    with pytest.raises(DatasetError) as info:
        load_trace_jsonl(path)
    assert f"{path}:2:" in str(info.value)
    assert message in str(info.value)


def test_sharegpt_accepts_its_format_and_skips_single_turns(tmp_path: Path) -> None:
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "how are you"}, {"from": "gpt", "value": "fine thanks a lot"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "alone"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "one"}, {"from": "human", "value": "x"}]},
    ]
    path = tmp_path / "s.json"
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    specs = load_sharegpt(path)
    assert [(s.prompt, s.output_tokens, s.input_tokens) for s in specs] == [("how are you", 4, 3), ("q", 1, 1)]


def test_sharegpt_rejects_malformed_files_with_where(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text('[\n  {"conversations": []},\n  {"conversations": [}\n]\n')
    with pytest.raises(DatasetError, match=r"broken.json:3: not valid JSON"):
        load_sharegpt(broken)
    wrong_entry = tmp_path / "wrong.json"
    wrong_entry.write_bytes(orjson.dumps([{"conversations": []}, {"turns": []}]))
    with pytest.raises(DatasetError, match=r"wrong.json: entry 1: expected an object with a 'conversations' list"):
        load_sharegpt(wrong_entry)
    not_a_list = tmp_path / "dict.json"
    not_a_list.write_text('{"conversations": []}')
    with pytest.raises(DatasetError, match="expected a JSON list"):
        load_sharegpt(not_a_list)


def test_missing_file_and_unknown_dataset_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="cannot read dataset"):
        load_dataset("custom", tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match="needs a file: pass --dataset-path"):
        load_dataset("sharegpt")
    with pytest.raises(DatasetError, match="unknown dataset"):
        load_dataset("imaginary")
    with pytest.raises(DatasetError, match="no requests"):
        load_custom_jsonl(write_lines(tmp_path / "empty.jsonl", ["", "  "]))


def test_synthetic_mix_is_deterministic_long_tailed_and_has_a_common_prefix() -> None:
    mix = synthetic_mix(num_requests=2000, seed=7)
    assert mix == synthetic_mix(num_requests=2000, seed=7)
    assert mix != synthetic_mix(num_requests=2000, seed=8)
    outputs = np.array([s.output_tokens for s in mix])
    prompts = np.array([s.input_tokens for s in mix])
    # Long right tail: the p99 is several times the median.
    assert np.percentile(outputs, 99) > 3 * np.median(outputs)
    assert np.percentile(prompts, 99) > 3 * np.median(prompts)
    counts = {}
    for spec in mix:
        head = " ".join(spec.prompt.split()[:COMMON_PREFIX_WORDS])
        counts[head] = counts.get(head, 0) + 1
    shared = max(counts.values())
    assert 0.25 * len(mix) < shared < 0.35 * len(mix)  # prefix_share 0.3
    capped = load_dataset("synthetic", num_requests=50, max_output_tokens=5)
    assert max(s.output_tokens for s in capped) == 5


@pytest.mark.parametrize(("kind", "burstiness", "cv"), [("poisson", 1.0, 1.0), ("gamma", 4.0, 0.5), ("gamma", 0.25, 2.0)])
def test_schedule_has_the_target_rate_and_burstiness(kind: str, burstiness: float, cv: float) -> None:
    offsets = Pacer(kind, rate=20.0, burstiness=burstiness, seed=3).schedule(20000)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0
    assert 1 / gaps.mean() == pytest.approx(20.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_workers_interleave_one_global_schedule() -> None:
    whole = Pacer("poisson", rate=5.0, seed=11).schedule(100)
    claimed = {}
    for worker in range(3):
        pacer = Pacer("poisson", rate=5.0, seed=11, worker_index=worker, worker_count=3)
        slots = [pacer.claim() for _ in range(30)]
        start = slots[0].due
        for slot in slots:
            claimed[slot.index] = slot.due - start + whole[worker]
    assert sorted(claimed) == list(range(90))
    for index, offset in claimed.items():
        assert offset == pytest.approx(whole[index], abs=1e-9)


def test_replay_pacer_runs_out_and_closed_loop_has_no_due_time() -> None:
    pacer = Pacer("replay", replay=np.array([0.0, 0.2]))
    assert [pacer.claim() is not None for _ in range(3)] == [True, True, False]
    closed = Pacer("closed")
    assert [(s.index, s.due) for s in (closed.claim(), closed.claim())] == [(0, None), (1, None)]
    with pytest.raises(ArrivalError, match="needs a timed trace"):
        Pacer("replay")
    with pytest.raises(ArrivalError, match="--rate must be > 0"):
        Pacer("poisson", rate=0)
    with pytest.raises(ArrivalError, match="--burstiness must be > 0"):
        Pacer("gamma", burstiness=-1)


def test_parse_slo() -> None:
    assert parse_slo("ttft=500,tpot=50,e2e=4000") == {"ttft_ms": 500.0, "tpot_ms": 50.0, "e2el_ms": 4000.0}
    assert parse_slo("") == {}
    for bad in ("ttft", "latency=3", "ttft=abc", "tpot=-1"):
        with pytest.raises(SLOError, match="--slo"):
            parse_slo(bad)


def test_summary_percentiles_throughput_and_goodput() -> None:
    collector = Collector()
    # send, end, ttft, e2el, tpot, out, in (seconds)
    collector.add_request([100.0, 101.0, 0.1, 1.0, 0.01, 10, 5], [0.0004, 0.0006])
    collector.add_request([100.5, 102.0, 0.3, 1.5, 0.02, 20, 5], [0.0101])
    collector.add_request([101.0, 102.0, 0.2, 1.0, math.nan, 1, 5], [])
    summary = summarize(collector, {"ttft_ms": 250.0})
    assert summary["completed"] == 3
    assert summary["duration_s"] == pytest.approx(2.0)
    assert summary["request_throughput_rps"] == pytest.approx(1.5)
    assert summary["output_token_throughput_tps"] == pytest.approx(31 / 2)
    assert summary["good_requests"] == 2
    assert summary["goodput_rps"] == pytest.approx(1.0)
    assert summary["metrics"]["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert summary["metrics"]["tpot_ms"]["count"] == 2
    # Sub-millisecond ITL survives unrounded.
    assert summary["metrics"]["itl_ms"]["p50"] == pytest.approx(0.6)


def test_collector_drain_and_merge_move_each_sample_once() -> None:
    worker, master = Collector(), Collector()
    worker.add_request([1, 2, 0.1, 1, 0.1, 3, 1], [0.001])
    master.merge(worker.drain(), "w1")
    worker.add_request([2, 3, 0.1, 1, 0.1, 3, 1], [0.002, 0.003])
    worker.failures += 1
    master.merge(worker.drain(), "w1")
    master.merge(worker.drain(), "w1")
    assert len(master.requests) == 2
    assert master.itl_s == [0.001, 0.002, 0.003]
    assert master.failures == 1
