"""The API-process probes' summary on its own (no vLLM needed): per sampled request only,
with the tokenizer-pool wait that overlapped each request's tokenization."""

from __future__ import annotations

from servprof.integrations.vllm_probes import ApiProbes, api_findings


def test_summary_is_per_sampled_request_with_its_overlapping_pool_wait() -> None:
    probes = ApiProbes(renderer=object())
    ms = 1_000_000
    probes.tokenize_spans = [("sampled-1", 10 * ms, 40 * ms), ("unsampled", 50 * ms, 90 * ms),
                             ("sampled-2", 100 * ms, 102 * ms), (None, 0, 1)]
    probes.pool_wait = [(5 * ms, 50.0), (20 * ms, 12.0), (30 * ms, 3.0), (60 * ms, 99.0), (101 * ms, 0.5)]
    summary = probes.summary({"sampled-1", "sampled-2"})
    assert set(summary["tokenize"]) == {"sampled-1", "sampled-2"}  # every request has an id; not all are sampled
    assert summary["tokenize"]["sampled-1"]["pool_wait_max_ms"] == 12.0  # 5 ms is before it, 60 ms after
    assert summary["tokenize"]["sampled-1"]["tokenize_ms"] == 30.0
    assert summary["tokenize"]["sampled-2"]["pool_wait_max_ms"] == 0.5
    assert summary["tokenize_calls"] == 4 and summary["tokenize_calls_without_request"] == 1
    findings = api_findings(summary)
    assert [f["request_ids"] for f in findings] == [["sampled-1"]]


def test_summary_without_any_samples() -> None:
    summary = ApiProbes(renderer=object()).summary(set())
    assert summary["tokenize"] == {} and summary["loop_lag_ms"] == {"count": 0}
