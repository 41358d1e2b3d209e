"""Every bad request to the demo server gets an HTTP 400 with OpenAI's error body, never a
500 or a traceback, and the server keeps serving afterwards."""

from __future__ import annotations

import httpx
import orjson
import pytest
from _demo_helpers import get_stats, start_demo_server

CONTEXT = 256
LIMIT = 64
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
GOOD_MESSAGES = [{"role": "user", "content": "hi"}]

# (path, raw body, expected "param" in the error body)
BAD_REQUESTS = [
    (COMPLETIONS, b"{not json", None),
    (COMPLETIONS, b"", None),
    (COMPLETIONS, b"[1, 2]", None),
    (COMPLETIONS, b'{"max_tokens": 4}', "prompt"),
    (COMPLETIONS, b'{"prompt": 12}', "prompt"),
    (COMPLETIONS, b'{"prompt": ""}', "prompt"),
    (COMPLETIONS, b'{"prompt": ["a", "b"]}', "prompt"),
    (COMPLETIONS, b'{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
    (COMPLETIONS, b'{"prompt": "hi", "max_tokens": -3}', "max_tokens"),
    (COMPLETIONS, b'{"prompt": "hi", "max_tokens": 65}', "max_tokens"),
    (COMPLETIONS, b'{"prompt": "hi", "max_tokens": "8"}', "max_tokens"),
    (COMPLETIONS, b'{"prompt": "hi", "max_tokens": 4.5}', "max_tokens"),
    (COMPLETIONS, b'{"prompt": "hi", "max_tokens": true}', "max_tokens"),
    (COMPLETIONS, b'{"prompt": "hi", "temperature": "hot"}', "temperature"),
    (COMPLETIONS, b'{"prompt": "hi", "temperature": 3}', "temperature"),
    (COMPLETIONS, b'{"prompt": "hi", "top_p": 0}', "top_p"),
    (COMPLETIONS, b'{"prompt": "hi", "seed": "x"}', "seed"),
    (COMPLETIONS, b'{"prompt": "hi", "stop": 3}', "stop"),
    (COMPLETIONS, b'{"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}', "stop"),
    (COMPLETIONS, b'{"prompt": "hi", "stop": [""]}', "stop"),
    (COMPLETIONS, b'{"prompt": "hi", "stream": "yes"}', "stream"),
    (
        COMPLETIONS,
        b'{"prompt": "hi", "stream": true, "stream_options": {"include_usage": 1}}',
        "stream_options.include_usage",
    ),
    (COMPLETIONS, b'{"prompt": "hi", "n": 2}', "n"),
    (COMPLETIONS, b'{"prompt": "hi", "model": 5}', "model"),
    (COMPLETIONS, b'{"prompt": "hi", "ignore_eos": "yes"}', "ignore_eos"),
    (CHAT, b'{"max_tokens": 4}', "messages"),
    (CHAT, b'{"messages": []}', "messages"),
    (CHAT, b'{"messages": "hello"}', "messages"),
    (CHAT, b'{"messages": [3]}', "messages[0]"),
    (CHAT, b'{"messages": [{"role": "robot", "content": "hi"}]}', "messages[0].role"),
    (CHAT, b'{"messages": [{"role": "user", "content": 42}]}', "messages[0].content"),
    (CHAT, b'{"messages": [{"role": "user"}]}', "messages[0].content"),
    (CHAT, orjson.dumps({"messages": GOOD_MESSAGES, "max_completion_tokens": 0}), "max_tokens"),
    (CHAT, orjson.dumps({"messages": GOOD_MESSAGES, "max_tokens": 1000}), "max_tokens"),
]


@pytest.fixture(scope="module")
def base_url():
    with start_demo_server(size="tiny", max_batch=2, context=CONTEXT, max_tokens_limit=LIMIT) as url:
        yield url


def assert_openai_400(response: httpx.Response, param: str | None) -> dict:
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert "Traceback" not in response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    return error


@pytest.mark.parametrize(
    ("path", "body", "param"), BAD_REQUESTS, ids=[f"{p}:{b[:40]!r}" for p, b, _ in BAD_REQUESTS]
)
def test_bad_request_gets_400(base_url, path, body, param):
    response = httpx.post(
        f"{base_url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    assert_openai_400(response, param)


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_context_gets_400(base_url, stream):
    prompt = "The market opened early and the baker counted bread. " * 60  # far over 256 tokens
    response = httpx.post(
        f"{base_url}{COMPLETIONS}", json={"prompt": prompt, "max_tokens": 4, "stream": stream}, timeout=30
    )
    error = assert_openai_400(response, "prompt")
    assert error["code"] == "context_length_exceeded"


def test_prompt_plus_max_tokens_over_context_gets_400(base_url):
    prompt = "word " * (CONTEXT - 20)  # fits alone, not with 64 more tokens
    response = httpx.post(
        f"{base_url}{COMPLETIONS}", json={"prompt": prompt, "max_tokens": LIMIT}, timeout=30
    )
    error = assert_openai_400(response, "max_tokens")
    assert error["code"] == "context_length_exceeded"


def test_chat_longer_than_context_gets_400(base_url):
    messages = [{"role": "user", "content": "Tell me about the harbour and its ships. " * 60}]
    response = httpx.post(f"{base_url}{CHAT}", json={"messages": messages}, timeout=30)
    assert_openai_400(response, "messages")


@pytest.mark.parametrize("declared", [True, False])
def test_oversized_body_gets_413(base_url, declared):
    from servprof.demo.app import MAX_BODY_BYTES

    body = b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 10) + b'"}'
    if declared:
        content: bytes | object = body
    else:  # chunked: no Content-Length to refuse up front

        def chunks():
            for start in range(0, len(body), 1 << 20):
                yield body[start : start + (1 << 20)]

        content = chunks()
    response = httpx.post(f"{base_url}{COMPLETIONS}", content=content, timeout=60)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"


def test_server_still_serves_after_bad_input(base_url):
    for path, body, _ in BAD_REQUESTS[:5]:
        httpx.post(f"{base_url}{path}", content=body, timeout=30)
    response = httpx.post(f"{base_url}{COMPLETIONS}", json={"prompt": "hello", "max_tokens": 3}, timeout=30)
    assert response.status_code == 200
    stats = get_stats(base_url)
    assert stats["engine_alive"] and stats["free_slots"] == 2
    # Rejected requests never reached the engine.
    assert stats["requests_submitted"] == sum(stats["requests_finished"].values())
