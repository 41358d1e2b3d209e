"""An sse-starlette server whose async generator iterates a TextIteratorStreamer on the event
loop (tests/servers/sse_streaming.py): every next() is a blocking queue.get on the loop's thread.
servprof names the wait, the thread hand-off it is, and the async form to use instead; the same
server with the wait moved off the loop gets no such finding.

Real parts: uvicorn on loopback, sse-starlette, the real profiler, loop watchdog and analysis
worker, a real transformers Llama generating in a thread and a real BPE tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _server_session import session_on

MAX_TOKENS = 32


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_iterating_a_streamer_on_the_loop_is_named_with_the_async_form(tmp_path: Path, loop: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # uvicorn runs uvloop where it is installed (uvicorn[standard]) and asyncio's own loop elsewhere.
    monkeypatch.setenv("SERVPROF_TEST_LOOP", loop)
    observed = session_on("servers.sse_streaming", tmp_path, ["/v1/chat/stream"] * 2, MAX_TOKENS)
    result = observed["result"]
    assert [status for _, status, _ in observed["responses"]] == [200, 200]
    stalls = [f for f in result["findings"] if f["kind"] == "loop_stall" and f["evidence"]["function"] == "events"]
    assert len(stalls) == 1, [f["title"] for f in result["findings"]]
    (stall,) = stalls
    frames = [(frame["function"], Path(frame["file"]).name) for frame in stall["evidence"]["frames"]]
    assert ("__next__", "streamers.py") in frames and ("get", "queue.py") in frames
    assert stall["fix"].startswith("events (sse_streaming.py:")
    assert "waits on the event loop for another thread (get (queue.py:" in stall["fix"]
    assert "AsyncTextIteratorStreamer" in stall["fix"]
    assert sorted(stall["evidence"]["delayed_request_ids"]) == sorted(rid for _, _, rid in observed["responses"])


def test_the_same_stream_awaited_off_the_loop_has_no_such_stall(tmp_path: Path) -> None:
    observed = session_on("servers.sse_streaming", tmp_path, ["/v1/chat/stream-ok"] * 2, MAX_TOKENS)
    result = observed["result"]
    assert [status for _, status, _ in observed["responses"]] == [200, 200]
    assert result["summary"]["detect"]["steps"]["count"] == 2 * MAX_TOKENS
    assert not [f for f in result["findings"] if f["kind"] == "loop_stall" and "AsyncTextIteratorStreamer" in f["fix"]]
