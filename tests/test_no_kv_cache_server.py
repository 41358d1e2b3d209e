"""A server whose decode loop keeps no KV cache (tests/servers/no_kv_cache.py): in a deep session
with shapes, servprof's automatic steps over it are decode steps that run over the whole
sequence, and ``decode_without_kv_cache`` says so; the same session on a server that keeps its
cache (tests/servers/handwritten_loop.py) says nothing of the kind. Real parts: uvicorn on
loopback, the real profiler with record_shapes, the analysis child, a real transformers Llama."""

from __future__ import annotations

from pathlib import Path

from _server_session import session_on

REQUESTS = 2
MAX_TOKENS = 10


def test_a_loop_without_a_kv_cache_is_named_and_one_with_it_is_not(tmp_path: Path) -> None:
    out = session_on("servers.no_kv_cache", tmp_path / "no_cache", ["/v1/completions"] * REQUESTS, MAX_TOKENS,
                     spaced_s=0.05, tier="deep", record_shapes=True)
    assert [status for _path, status, _rid in out["responses"]] == [200] * REQUESTS
    steps = out["result"]["summary"]["detect"]["steps"]
    # Each request: its first forward is the prefill, each later one runs over one more token.
    assert steps["by_kind"] == {"decode": REQUESTS * (MAX_TOKENS - 1), "prefill": REQUESTS}
    assert steps["recompute_prefix"] == REQUESTS * (MAX_TOKENS - 1)
    (finding,) = [f for f in out["result"]["findings"] if f["kind"] == "decode_without_kv_cache"]
    assert finding["evidence"]["steps"] == REQUESTS * (MAX_TOKENS - 1) and "past_key_values" in finding["fix"]
    assert sorted(finding["request_ids"]) == sorted(rid for _path, _status, rid in out["responses"])

    cached = session_on("servers.handwritten_loop", tmp_path / "cache", ["/v1/completions"] * REQUESTS, MAX_TOKENS,
                        spaced_s=0.05, tier="deep", record_shapes=True)
    assert cached["result"]["summary"]["detect"]["steps"]["recompute_prefix"] == 0
    assert not [f for f in cached["result"]["findings"] if f["kind"] == "decode_without_kv_cache"]
