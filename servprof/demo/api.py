"""OpenAI-compatible request parsing and response shapes for the demo server.

Every malformed request becomes an `APIError` (HTTP 400 with OpenAI's error body),
never a traceback: the parser checks types itself instead of trusting the JSON.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson

from servprof.demo.sampling import SamplingParams

ROLES = ("system", "user", "assistant")
DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 4


class APIError(Exception):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        type_: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ParsedRequest:
    prompt: str  # completions: the prompt; chat: the rendered conversation
    messages: list[dict[str, str]] | None
    params: SamplingParams
    stream: bool
    include_usage: bool


def parse_request(body: bytes, *, chat: bool, max_tokens_limit: int) -> ParsedRequest:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise APIError(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object", code="invalid_type")
    _optional(data, "model", str)
    messages = None
    if chat:
        messages = _messages(data)
        prompt = ""
    else:
        prompt = _prompt(data)
    n = _optional(data, "n", int)
    if n is not None and n != 1:
        raise APIError("only n=1 is supported", param="n", code="unsupported_value")
    max_tokens = _optional(data, "max_tokens", int)
    if chat and max_tokens is None:
        max_tokens = _optional(data, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, max_tokens_limit)
    _require(1 <= max_tokens <= max_tokens_limit, "max_tokens",
             f"max_tokens must be between 1 and {max_tokens_limit} (got {max_tokens})")
    temperature = _optional(data, "temperature", float)
    temperature = 1.0 if temperature is None else temperature
    _require(0.0 <= temperature <= 2.0, "temperature", f"temperature must be between 0 and 2 (got {temperature})")
    top_p = _optional(data, "top_p", float)
    top_p = 1.0 if top_p is None else top_p
    _require(0.0 < top_p <= 1.0, "top_p", f"top_p must be in (0, 1] (got {top_p})")
    seed = _optional(data, "seed", int)
    stream = _optional(data, "stream", bool) or False
    stream_options = _optional(data, "stream_options", dict) or {}
    include_usage = _optional(stream_options, "include_usage", bool, "stream_options.include_usage") or False
    ignore_eos = _optional(data, "ignore_eos", bool) or False
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=_stop(data),
        ignore_eos=ignore_eos,
    )
    return ParsedRequest(prompt, messages, params, stream, include_usage)


def _type_name(expected: type) -> str:
    return {
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "a boolean",
        dict: "an object",
        list: "an array",
    }[expected]


def _require(ok: bool, param: str, message: str) -> None:
    """A field whose value is out of its range: 400 invalid_value naming the field."""
    if not ok:
        raise APIError(message, param=param, code="invalid_value")


def _optional(data: dict[str, Any], key: str, expected: type, param: str | None = None) -> Any:
    value = data.get(key)
    if value is None:
        return None
    ok = isinstance(value, expected) and not (expected in (int, float) and isinstance(value, bool))
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise APIError(
            f"'{param or key}' must be {_type_name(expected)}", param=param or key, code="invalid_type"
        )
    return value


def _prompt(data: dict[str, Any]) -> str:
    if "prompt" not in data or data["prompt"] is None:
        raise APIError("'prompt' is required", param="prompt", code="missing_required_parameter")
    prompt = data["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one
    if not isinstance(prompt, str):
        raise APIError("'prompt' must be a string", param="prompt", code="invalid_type")
    if not prompt:
        raise APIError("'prompt' must not be empty", param="prompt", code="invalid_value")
    return prompt


def _messages(data: dict[str, Any]) -> list[dict[str, str]]:
    if "messages" not in data or data["messages"] is None:
        raise APIError("'messages' is required", param="messages", code="missing_required_parameter")
    messages = data["messages"]
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty array", param="messages", code="invalid_type")
    parsed = []
    for index, message in enumerate(messages):
        param = f"messages[{index}]"
        if not isinstance(message, dict):
            raise APIError(f"'{param}' must be an object", param=param, code="invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise APIError(
                f"'{param}.role' must be one of {', '.join(ROLES)}",
                param=f"{param}.role",
                code="invalid_value",
            )
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text parts are understood
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise APIError(
                    f"'{param}.content' parts must be text parts",
                    param=f"{param}.content",
                    code="invalid_type",
                )
            content = "".join(texts)
        if not isinstance(content, str):
            raise APIError(
                f"'{param}.content' must be a string", param=f"{param}.content", code="invalid_type"
            )
        parsed.append({"role": role, "content": content})
    return parsed


def _stop(data: dict[str, Any]) -> list[str]:
    stop = data.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise APIError(
            f"'stop' must be a non-empty string or up to {MAX_STOP_STRINGS} non-empty strings",
            param="stop",
            code="invalid_type",
        )
    return stop


def _envelope(request_id: str, model: str, created: int, choice: dict[str, Any] | None, *, chat: bool,
              chunk: bool) -> dict[str, Any]:
    """The OpenAI response object around one choice, or none (a usage chunk); chat or text,
    chunk or whole."""
    kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chat and chunk else "")
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}", "object": kind, "created": created,
            "model": model, "choices": [choice] if choice is not None else []}


def usage_chunk(request_id: str, model: str, created: int, prompt_tokens: int, completion_tokens: int,
                *, chat: bool) -> dict[str, Any]:
    """The last chunk of a stream asked for stream_options.include_usage: no choices, the usage."""
    return {**_envelope(request_id, model, created, None, chat=chat, chunk=True),
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_chunk(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    *,
    chat: bool,
    created: int,
    first: bool = False,
) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        if finish_reason is not None and not text:
            delta = {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return _envelope(request_id, model, created, choice, chat=chat, chunk=True)


def completion_body(
    request_id: str, model: str, text: str, finish_reason: str, usage: dict[str, int], *, chat: bool
) -> dict[str, Any]:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    body = _envelope(request_id, model, int(time.time()), choice, chat=chat, chunk=False)
    body["usage"] = usage
    return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
