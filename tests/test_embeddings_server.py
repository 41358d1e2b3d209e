"""An embeddings server (tests/servers/embeddings.py): a plain ``def`` endpoint, so each request
tokenizes and runs a BERT encoder on its own thread of FastAPI's pool. Its forwards are steps named
for their request; nothing speaks of decoding; and a tokenization that ran while other requests'
forwards held the CPUs says so, with the time they covered measured as the requests' own phases
show it, and a fix that starts from that contention rather than from a slow tokenizer.

Real parts: uvicorn on loopback, a light session of the real profiler and the real analysis
worker, a real transformers BERT and a real ``tokenizers`` BPE tokenizer.
"""

from __future__ import annotations

from typing import Any

import pytest
from _kineto_builder import covered_in, union
from _server_session import session_on

# Long texts: tokenizing 32 of them takes ~17 ms alone here, and the encoder's forward over the
# batch ~100 ms, so the later requests tokenize while the first one's forward runs.
TEXTS = [f"The harbour master counted the boats twice before the storm {i}. " * 30 for i in range(32)]
START_AT_S = [0.0, 0.06, 0.06, 0.06]


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return session_on("servers.embeddings", tmp_path_factory.mktemp("embeddings"), ["/v1/embeddings"] * len(START_AT_S),
                      0, body={"input": TEXTS}, start_at_s=START_AT_S)


def _phases(result: dict[str, Any], name: str) -> dict[str, list[tuple[float, float]]]:
    return {rid: [(p["start_us"], p["end_us"]) for p in record["phases"] if p["name"] == name]
            for rid, record in result["requests"].items()}


def test_each_forward_is_its_requests_step_and_nothing_is_called_decoding(observed: dict[str, Any]) -> None:
    result = observed["result"]
    assert [status for _, status, _ in observed["responses"]] == [200] * len(START_AT_S)
    assert result["error"] is None, result["error"]
    detect = result["summary"]["detect"]
    assert detect["tier"] == "light"
    assert detect["steps"]["by_kind"] == {"prefill": len(START_AT_S)}
    steps = _phases(result, "prefill")
    assert len(steps) == len(START_AT_S) and all(len(spans) == 1 for spans in steps.values()), steps
    assert all(len(spans) == 1 for spans in _phases(result, "tokenize").values())
    assert not [f for f in result["findings"] if f["kind"] == "decode_gap"]


def test_a_tokenization_beside_other_requests_forwards_names_them(observed: dict[str, Any]) -> None:
    result = observed["result"]
    steps, tokenizations = _phases(result, "prefill"), _phases(result, "tokenize")
    stalls = {f["evidence"]["request_id"]: f for f in result["findings"] if f["kind"] == "tokenization_stall"}
    contended = []
    for rid, finding in stalls.items():
        ((start, end),) = tokenizations[rid]
        others = union([span for other, spans in steps.items() if other != rid for span in spans])
        covered = covered_in(others, start, end)
        threads = finding["evidence"]["other_steps"]["threads"]
        assert finding["evidence"]["other_steps"]["us"] == pytest.approx(covered, abs=1.0), finding["title"]
        assert threads <= len(START_AT_S) - 1
        if covered >= 0.5 * (end - start):
            contended.append(rid)
            assert finding["title"].endswith(f"; model steps ran on {threads} other thread(s) for "
                                             f"{covered / 1000:.1f} ms of it"), finding["title"]
            assert finding["fix"].startswith("It ran while model calls on other threads"), finding["fix"]
        else:
            assert "model steps ran on" not in finding["title"] and finding["fix"].startswith("Use a fast"), finding
    # The requests sent 60 ms after the first tokenized inside its ~100 ms forward.
    assert contended, {rid: f["title"] for rid, f in stalls.items()}
