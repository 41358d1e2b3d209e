"""The harness against servers with an API of their own (``--endpoint custom``): the body from a
JSON template, the answer read as SSE, as plain text streamed piece by piece, or as one JSON
object. Real locust processes against a real server on loopback (tests/_harness_helpers.py, whose
routes record when each request arrived and each piece left) and against a FastAPI server running
a real transformers model (tests/servers/thread_pool.py)."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import orjson
import pytest
from _harness_helpers import TimedServer, read_summary, run_locust, running_server
from _middleware_helpers import serve
from test_harness_locust import CHUNK_ARRIVAL_TOLERANCE_MS, ITL_TOLERANCE_MS, TTFT_TOLERANCE_MS

from servprof.harness.custom import CustomStream, TemplateError, fill, parse_template
from servprof.harness.datasets import RequestSpec

TGI_BODY = '{"inputs": "{prompt}", "parameters": {"max_new_tokens": "{max_tokens}"}, "stream": "{stream}"}'


def _run(server: TimedServer, tmp_path: Path, *args: str) -> tuple[dict, list[dict]]:
    with running_server(server):
        result = run_locust(server.url, "--headless", "-u", "2", "-r", "2", "-t", "3s", "--endpoint", "custom",
                            "--body", TGI_BODY, "--max-output-tokens", "40", "--summary-json", str(tmp_path / "s.json"),
                            "--requests-jsonl", str(tmp_path / "r.jsonl"), *args)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [orjson.loads(line) for line in (tmp_path / "r.jsonl").read_bytes().splitlines()]
    return read_summary(tmp_path / "s.json"), rows


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/generate", "/generate_text", "/api/generate"])
def test_a_custom_stream_is_timed_piece_by_piece(tmp_path: Path, path: str) -> None:
    """SSE (TGI's shape), bare text, and JSON lines (Ollama's: its last line, the count and no text,
    is not a piece)."""
    server = TimedServer(ttft_s=0.06, itl_s=0.025, max_chunks=6)
    field = {"/generate": "details.generated_tokens", "/api/generate": "eval_count"}.get(path)
    summary, rows = _run(server, tmp_path, "--path", path, *(["--tokens-field", field] if field else []))
    assert summary["completed"] > 0 and summary["failed"] == 0
    served = {r.request_id: r for r in server.requests}
    for body in (r.body for r in server.requests):  # the template, filled in
        assert isinstance(body["inputs"], str) and body["inputs"] and body["stream"] is True
        assert isinstance(body["parameters"]["max_new_tokens"], int)
    ttft_gap, last_gap, itl = [], [], []
    for row in rows:
        record = served[row["request_id"]]
        assert row["output_tokens"] == len(record.chunk_unix)  # the count from the answer, or one per piece
        ttft_gap.append((row["ttft_s"] - (record.chunk_unix[0] - record.received_unix)) * 1000)
        last_gap.append((row["end_unix_s"] - record.chunk_unix[-1]) * 1000)
        itl.extend(np.diff(record.chunk_unix) * 1000)
    assert -1.0 <= np.median(ttft_gap) <= TTFT_TOLERANCE_MS
    assert -1.0 <= np.median(last_gap) <= CHUNK_ARRIVAL_TOLERANCE_MS
    assert abs(summary["metrics"]["itl_ms"]["p50"] - np.median(itl)) <= ITL_TOLERANCE_MS


@pytest.mark.slow
def test_a_custom_json_answer_gives_e2el_and_its_token_count(tmp_path: Path) -> None:
    server = TimedServer(ttft_s=0.02, itl_s=0.005, max_chunks=5)
    summary, rows = _run(server, tmp_path, "--path", "/generate", "--no-stream", "--tokens-field",
                         "details.generated_tokens")
    assert summary["completed"] > 0 and summary["metrics"]["ttft_ms"]["count"] == 0
    served = {r.request_id: r for r in server.requests}
    assert all(row["output_tokens"] == min(served[row["request_id"]].max_tokens, 5) for row in rows)
    assert all(r.body["stream"] is False for r in server.requests)


@pytest.mark.slow
def test_a_fastapi_model_server_of_its_own_shape(tmp_path: Path) -> None:
    """A plain FastAPI server (tests/servers/thread_pool.py: POST /v1/generate {"prompt",
    "max_tokens"} -> {"text"}) running a real transformers model: no token count in the answer, so
    the words of its text."""
    app = importlib.import_module("servers.thread_pool").create_app()
    with serve(app) as (url, _server):
        result = run_locust(url, "--headless", "-u", "2", "-r", "2", "-t", "3s", "--endpoint", "custom",
                            "--path", "/v1/generate", "--no-stream", "--max-output-tokens", "8",
                            "--body", '{"prompt": "{prompt}", "max_tokens": "{max_tokens}"}',
                            "--summary-json", str(tmp_path / "s.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(tmp_path / "s.json")
    assert summary["completed"] > 0 and summary["failed"] == 0
    assert summary["metrics"]["e2el_ms"]["count"] == summary["completed"] and summary["total_output_tokens"] > 0


@pytest.mark.parametrize(("args", "message"), [
    (["--endpoint", "custom"], "--endpoint custom needs --path"),
    (["--endpoint", "custom", "--path", "/g", "--body", "{not json"], "--body is not JSON"),
    (["--endpoint", "custom", "--path", "/g", "--body", '{"max_tokens": "{max_tokens}"}'], 'no "{prompt}"'),
    (["--path", "generate"], "--path must start with '/'"),
])
def test_a_custom_endpoint_described_wrong_stops_with_a_clear_message(args: list[str], message: str) -> None:
    result = run_locust("http://127.0.0.1:9", "--headless", "-u", "1", "-t", "2s", *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_the_template_is_filled_with_typed_values() -> None:
    template = parse_template('{"inputs": "User: {prompt}\\nAssistant:", "parameters": {"max_new_tokens": '
                              '"{max_tokens}", "stop": ["\\n"]}, "stream": "{stream}", "n": 1}')
    body = fill(template, RequestSpec(prompt='say "hi"', output_tokens=12, input_tokens=2), True)
    assert body == {"inputs": 'User: say "hi"\nAssistant:', "parameters": {"max_new_tokens": 12, "stop": ["\n"]},
                    "stream": True, "n": 1}
    with pytest.raises(TemplateError):
        parse_template("[1, 2]")


def test_a_stream_split_anywhere_counts_each_event_once() -> None:
    events = b"".join(b'data: {"token": {"text": "w"}}\n\n' for _ in range(5)) + b"data: [DONE]\n\n"
    for size in (1, 3, 7, 1000):
        reader = CustomStream("")
        counted = sum(len(reader.feed(events[i:i + size])) for i in range(0, len(events), size)) + len(reader.finish())
        assert counted == 5 and reader.done


def _read(stream: bytes, arrivals: list[tuple[float, int]] | None = None) -> tuple[list[float], CustomStream]:
    """Chunk times of ``stream`` fed as it would arrive: (time, bytes up to here) pairs, else whole at 1.0."""
    reader = CustomStream("")
    times, fed = [], 0
    for at, upto in arrivals or [(1.0, len(stream))]:
        times += reader.feed(stream[fed:upto], at)
        fed = upto
    return times + reader.finish(9.0), reader


def test_json_lines_are_one_event_each_wherever_the_bytes_break() -> None:
    lines = b"".join(orjson.dumps({"response": w, "done": False}) + b"\n" for w in ("The", " boats", "")) + \
        orjson.dumps({"response": "", "done": True, "eval_count": 3})
    for size in (1, 5, 1000):
        reader = CustomStream("eval_count")
        times = [t for i in range(0, len(lines), size) for t in reader.feed(lines[i:i + size], float(i))]
        times += reader.finish(99.0)
        assert len(times) == 3 and reader.output_tokens == 3  # the last line (count, no text) is no piece


def test_an_sse_event_is_its_data_lines_up_to_the_blank_line() -> None:
    """As sse-starlette writes them: CRLF, a text with a newline as two data lines of one event,
    tokens its streamer held back as events without text, keep-alive comments."""
    stream = (b"data: The\r\n\r\n: ping - 2026-11-27\r\n\r\ndata: \r\n\r\ndata: \r\n\r\n"
              b"data:  harbour\r\ndata: master\r\n\r\nevent: end\r\ndata: [DONE]\r\n\r\n")
    times, reader = _read(stream)
    assert times == [1.0] * 4 and reader.done  # "The", two held back, " harbour\nmaster"


def test_each_event_counts_when_its_blank_line_arrives() -> None:
    stream = b"data: a\n\ndata: b\n\ndata: c\n"
    times, _reader = _read(stream, [(1.0, 5), (2.0, 9), (3.0, 15), (4.0, len(stream))])
    assert times == [2.0, 4.0, 9.0]  # a ends at its blank line (2.0); c has none: the stream's end


def test_a_stream_without_blank_lines_is_one_event_per_data_line() -> None:
    """``yield f"data: {token}\\n"``: no framing at all, each line read at its own arrival."""
    stream = b"data: a\ndata: b\ndata: c\ndata: [DONE]\n"
    times, reader = _read(stream, [(1.0, 8), (2.0, 16), (3.0, len(stream))])
    assert times == [1.0, 2.0, 3.0] and reader.done
