"""A tokenizer call's own CPU time, measured while a session runs, names what made it slow: a
server whose tokenizer works (a Python normalisation before the Rust tokenizer) and one whose
tokenizer waits (a configuration service's round trip inside the call; tests/servers/custom_tokenizer.py).

Real parts: uvicorn on loopback, the real profiler and analysis child, a real tiny transformers
Llama and a real BPE tokenizer; the service's latency is a sleep (the thread waits, as on a socket).
"""

from __future__ import annotations

from typing import Any

import pytest
from _server_session import session_on

from servprof.detect.tokenization_stall import FIX_SLOW, FIX_WAITED, FIX_WAITED_AND_SLOW

LONG = "The harbour master counted the boats twice before the storm. " * 500  # ~30k characters
SHORT = "The harbour master counted the boats"
PATHS = ["/v1/completions", "/v1/tenant/completions", "/v1/tenant/completions"]


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # One after another: nothing else runs beside each tokenization.
    return session_on("servers.custom_tokenizer", tmp_path_factory.mktemp("custom_tokenizer"), PATHS, 1,
                      spaced_s=0.05, body=[{"prompt": LONG}, {"prompt": SHORT}, {"prompt": LONG}])


def _stall(observed: dict[str, Any], index: int) -> dict[str, Any]:
    request_id = observed["responses"][index][2]
    (finding,) = [f for f in observed["result"]["findings"]
                  if f["kind"] == "tokenization_stall" and f["evidence"]["request_id"] == request_id]
    return finding


def test_every_tokenization_is_timed_by_its_threads_cpu(observed: dict[str, Any]) -> None:
    assert [status for _, status, _ in observed["responses"]] == [200, 200, 200]
    timed = observed["result"]["summary"]["detect"]["tokenization"]["per_request"]
    assert len(timed) == 3
    for entry in timed.values():
        # Matched to the trace's tokenize range on the same thread: CPU time never above the call's.
        assert entry["thread_cpu_ms"] is not None and 0 <= entry["thread_cpu_ms"] <= entry["tokenize_ms"]


def test_a_tokenizer_that_works_all_along_is_slow(observed: dict[str, Any]) -> None:
    finding = _stall(observed, 0)
    assert finding["evidence"]["thread_cpu_ms"] >= 0.5 * finding["evidence"]["tokenize_ms"]
    assert finding["fix"] == FIX_SLOW and "waited" not in finding["title"]


def test_a_tokenizer_that_waits_is_not_called_slow(observed: dict[str, Any]) -> None:
    finding = _stall(observed, 1)
    evidence = finding["evidence"]
    assert evidence["tokenize_ms"] >= 30.0 and evidence["thread_cpu_ms"] < 0.5 * evidence["tokenize_ms"]
    assert finding["fix"] == FIX_WAITED
    assert finding["title"].endswith(f"its thread ran on a CPU for {evidence['thread_cpu_ms']:.1f} ms of it and "
                                     "waited the rest (the GIL, a CPU, I/O): the tokenizer is not what is slow")


def test_a_tokenizer_that_waits_and_works_long_gets_both_fixes(observed: dict[str, Any]) -> None:
    finding = _stall(observed, 2)
    evidence = finding["evidence"]
    if evidence["thread_cpu_ms"] >= 0.5 * evidence["tokenize_ms"] or evidence["thread_cpu_ms"] < 5.0:
        pytest.skip(f"the Rust tokenizer took {evidence['thread_cpu_ms']} ms of CPU on this machine, not 5-15 ms")
    assert finding["fix"] == FIX_WAITED_AND_SLOW
    assert "waited the rest (the GIL, a CPU, I/O)" in finding["title"] and "not what is slow" not in finding["title"]
