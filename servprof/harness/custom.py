"""LLM servers with an API of their own (not OpenAI's): the request body from a JSON template,
the answer read whatever its shape.

Most hand-written FastAPI servers take something like ``{"prompt": ..., "max_tokens": ...}``
on a path of their own (TGI: ``{"inputs": ..., "parameters": {"max_new_tokens": ...}}``) and
answer with one JSON object, server-sent events, or plain text streamed as it is generated.

``--endpoint custom --path /generate --body '{"prompt": "{prompt}", "max_tokens": "{max_tokens}"}'``:
in the template, a string that is exactly ``"{max_tokens}"`` becomes the request's output-token
count (a number), ``"{stream}"`` true or false, and ``{prompt}`` anywhere inside a string the
prompt. A stream's every SSE ``data:`` line (other than ``[DONE]``), or every piece of a plain
text stream as it arrives, is one chunk (TTFT, ITL). Output tokens: ``--tokens-field`` (a dotted
path in the JSON answer or in any streamed JSON chunk, e.g. ``usage.completion_tokens``), else
one per streamed chunk, else the words of the answer's text.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

from servprof.harness.datasets import RequestSpec

PROMPT, MAX_TOKENS, STREAM = "{prompt}", "{max_tokens}", "{stream}"
# Where an answer's generated text usually is, in the order tried (the first string found).
TEXT_KEYS = ("generated_text", "text", "completion", "output", "response", "content", "answer")
SSE_PREFIXES = (b"data:", b"event:", b"id:", b":")


class TemplateError(ValueError):
    """A --body that is not a JSON template with a {prompt}."""


def parse_template(text: str) -> Any:
    """The --body template, checked: JSON, with {prompt} somewhere in a string."""
    try:
        template = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise TemplateError(f"--body is not JSON ({exc}): give e.g. "
                            '\'{"prompt": "{prompt}", "max_tokens": "{max_tokens}"}\'') from None
    if PROMPT not in orjson.dumps(template).decode():
        raise TemplateError("--body has no \"{prompt}\": put it where the server reads the prompt, e.g. "
                            '\'{"prompt": "{prompt}", "max_tokens": "{max_tokens}"}\'')
    return template


def fill(template: Any, spec: RequestSpec, stream: bool) -> Any:
    """The template with this request's values in it."""
    if isinstance(template, dict):
        return {key: fill(value, spec, stream) for key, value in template.items()}
    if isinstance(template, list):
        return [fill(value, spec, stream) for value in template]
    if template == MAX_TOKENS:
        return spec.output_tokens
    if template == STREAM:
        return stream
    if isinstance(template, str):
        return template.replace(PROMPT, spec.prompt)
    return template


def field_at(body: Any, dotted: str) -> Any:
    """The value at a dotted path (``usage.completion_tokens``, ``details.generated_tokens``,
    list indices as numbers: ``choices.0.text``), or None."""
    for part in dotted.split("."):
        if isinstance(body, dict):
            body = body.get(part)
        elif isinstance(body, list) and part.lstrip("-").isdigit() and -len(body) <= int(part) < len(body):
            body = body[int(part)]
        else:
            return None
    return body


def answer_text(body: Any) -> str | None:
    """The generated text of a JSON answer: the first string under one of TEXT_KEYS, searched
    breadth first (a list's first item stands for it)."""
    level = [body]
    while level:
        for node in level:
            if isinstance(node, dict):
                for key in TEXT_KEYS:
                    if isinstance(node.get(key), str):
                        return node[key]
        nxt: list[Any] = []
        for node in level:
            if isinstance(node, dict):
                nxt.extend(node.values())
            elif isinstance(node, list) and node:
                nxt.append(node[0])
        level = nxt
    return None


def tokens_in(body: Any, tokens_field: str) -> int | None:
    value = field_at(body, tokens_field) if tokens_field else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class CustomStream:
    """Reads a custom server's streamed answer as it arrives: SSE or plain text."""

    def __init__(self, tokens_field: str) -> None:
        self.tokens_field = tokens_field
        self.sse: bool | None = None  # told from the first bytes
        self.buffer = b""
        self.output_tokens: int | None = None
        self.error: str | None = None
        self.done = False

    def feed(self, data: bytes) -> int:
        """New bytes; returns how many content chunks they completed."""
        if self.sse is None:
            head = (self.buffer + data).lstrip()
            if not head or any(len(head) < len(p) and p.startswith(head) for p in SSE_PREFIXES):
                self.buffer += data  # too little yet to tell ("da" may become "data:")
                return 0
            self.sse = head.startswith(SSE_PREFIXES)
            if not self.sse:
                self.buffer = b""
                return 1
        if not self.sse:
            return 1 if data.strip() else 0
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        return sum(self._line(line.strip()) for line in lines)

    def finish(self) -> int:
        """The end of the stream: a last SSE line without its newline (or a few bytes of text)."""
        if self.sse is None and self.buffer.strip():
            self.buffer = b""
            return 1
        if self.sse and self.buffer.strip():
            line, self.buffer = self.buffer.strip(), b""
            return self._line(line)
        return 0

    def _line(self, line: bytes) -> int:
        if self.done or not line.startswith(b"data:"):
            return 0
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return 0
        try:
            body = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return 1 if payload else 0  # a plain text event: one chunk of text
        if isinstance(body, dict) and "error" in body and len(body) <= 3:
            self.error = f"server error in stream: {str(body['error'])[:200]}"
            return 0
        tokens = tokens_in(body, self.tokens_field)
        if tokens is not None:
            self.output_tokens = tokens
            # A chunk that only reports the count (a usage chunk) carries no text.
            if answer_text(body) is None:
                return 0
        return 1


def read_custom_stream(chunks: Iterable[bytes], start: float, tokens_field: str, clock: Any, result: Any) -> None:
    """Fill ``result`` (users.StreamResult) from a streamed custom answer."""
    reader = CustomStream(tokens_field)
    for data in chunks:
        now = clock()  # before parsing, so parsing time is not counted as latency
        for _ in range(reader.feed(data)):
            result.content_chunk(now - start)
        if reader.error or reader.done:
            break
    if reader.error is None:
        for _ in range(reader.finish()):
            result.content_chunk(clock() - start)
    result.error = reader.error
    result.output_tokens = reader.output_tokens


def read_custom_json(body: Any, tokens_field: str, result: Any) -> None:
    """Fill ``result`` from a whole JSON answer."""
    tokens = tokens_in(body, tokens_field)
    if tokens is None:
        text = answer_text(body)
        tokens = len(text.split()) if text is not None else None
    result.output_tokens = tokens
