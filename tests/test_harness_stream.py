"""The SSE reader of the harness on hand-made streams with a controlled clock: the
definitions of TTFT, ITL and the token count, and what makes a stream fail.
(Importing servprof.harness.users imports locust, which patches the standard library
through gevent, so this runs in a child interpreter.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHECKS = textwrap.dedent(
    """
    import orjson
    from servprof.harness.users import read_sse

    def chunk(body):
        return b"data: " + orjson.dumps(body)

    def measure(lines, times):
        clock = iter(times).__next__
        return read_sse(iter(lines), start=0.0, clock=clock)

    text = lambda t: {"choices": [{"index": 0, "text": t}]}
    # Keep-alive comments and blank lines take a clock reading but are not chunks.
    result = measure(
        [b": ping", b"", chunk(text("a")), chunk(text("b")), chunk(text("c")),
         chunk({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}), b"data: [DONE]"],
        [0.01, 0.02, 0.100, 0.130, 0.1705, 0.18, 0.19],
    )
    assert result.error is None
    assert result.ttft_s == 0.100
    assert [round(g, 6) for g in result.itl_s] == [0.03, 0.0405]  # sub-millisecond digits kept
    assert result.last_s == 0.1705  # E2EL: the last chunk with choices, not the usage chunk
    assert (result.output_tokens, result.input_tokens, result.chunks) == (3, 5, 3)

    # No usage chunk: the count of chunks stands in for output tokens (the user decides).
    result = measure([chunk(text("a")), chunk(text("b"))], [0.05, 0.06])
    assert result.output_tokens is None and result.chunks == 2

    # A server error inside the stream and an unreadable chunk are failures with a reason.
    result = measure([chunk(text("a")), chunk({"error": {"message": "engine died"}})], [0.05, 0.06])
    assert result.error.startswith("server error in stream") and "engine died" in result.error
    result = measure([b"data: {not json"], [0.05])
    assert result.error.startswith("unreadable stream chunk")

    # Nothing after [DONE] is read.
    result = measure([chunk(text("a")), b"data: [DONE]", chunk(text("late"))], [0.05, 0.06, 0.07])
    assert result.chunks == 1
    print("ok")
    """
)


def test_read_sse_definitions_and_failures() -> None:
    result = subprocess.run([sys.executable, "-c", CHECKS], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
