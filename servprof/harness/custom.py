"""LLM servers with an API of their own (not OpenAI's): the request body from a JSON template,
the answer read whatever its shape.

Most hand-written FastAPI servers take something like ``{"prompt": ..., "max_tokens": ...}``
on a path of their own (TGI: ``{"inputs": ..., "parameters": {"max_new_tokens": ...}}``) and
answer with one JSON object, server-sent events, or plain text streamed as it is generated.

``--endpoint custom --path /generate --body '{"prompt": "{prompt}", "max_tokens": "{max_tokens}"}'``:
in the template, a string that is exactly ``"{max_tokens}"`` becomes the request's output-token
count (a number), ``"{stream}"`` true or false, and ``{prompt}`` anywhere inside a string the
prompt. A stream's every SSE event (other than ``[DONE]``; its ``data:`` lines up to a blank line,
an event without text included), every line of a JSON-lines stream, or every piece of a plain
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


SSE, NDJSON, TEXT = "sse", "ndjson", "text"


class CustomStream:
    """Reads a custom server's streamed answer as it arrives: SSE, JSON lines or plain text, told
    from the first bytes.

    ``feed(data, at)`` and ``finish(at)`` return the times (``at``: the caller's clock, when the
    bytes arrived) of the content chunks they completed. An SSE event is its ``data:`` lines up to
    the blank line that ends it (sse-starlette writes a text with newlines as several ``data:``
    lines of one event); an event with no text is still one (a token the server's detokenizer held
    back). A stream that never sends a blank line (``yield f"data: {x}\\n"``) is read one event per
    ``data:`` line, each at its own arrival. A stream that starts with ``{`` is JSON lines (NDJSON,
    as Ollama's API and many hand-written servers stream): one event per line. A JSON event that
    carries the token count (``--tokens-field``) and no text is a summary, not content."""

    def __init__(self, tokens_field: str) -> None:
        self.tokens_field = tokens_field
        self.mode: str | None = None  # told from the first bytes
        self.buffer = b""
        self.output_tokens: int | None = None
        self.error: str | None = None
        self.done = False
        self._event: list[tuple[float, bytes]] = []  # the data lines of the event being read, with arrivals
        self._blank_seen = False  # a blank line ended an event: the stream keeps to SSE's framing

    def feed(self, data: bytes, at: float = 0.0) -> list[float]:
        if self.mode is None:
            head = (self.buffer + data).lstrip()
            if not head or any(len(head) < len(p) and p.startswith(head) for p in SSE_PREFIXES):
                self.buffer += data  # too little yet to tell ("da" may become "data:")
                return []
            self.mode = SSE if head.startswith(SSE_PREFIXES) else NDJSON if head.startswith(b"{") else TEXT
            if self.mode == TEXT:
                self.buffer = b""
                return [at]
        if self.mode == TEXT:
            return [at] if data.strip() else []
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        return [t for line in lines for t in self._line(line.rstrip(b"\r"), at)]

    def finish(self, at: float = 0.0) -> list[float]:
        """The end of the stream: a last line without its newline, an event without its blank line
        (or a few bytes of text)."""
        if self.mode is None and self.buffer.strip():
            self.buffer = b""
            return [at]
        if self.mode not in (SSE, NDJSON):
            return []
        line, self.buffer = self.buffer.rstrip(b"\r"), b""
        times = self._line(line, at) if line else []
        if self._event and not self._blank_seen:  # no framing at all: each data line was an event
            events, self._event = self._event, []
            return times + [t for arrived, payload in events for t in self._dispatch([(arrived, payload)], arrived)]
        return times + self._dispatch_pending(at)

    def _line(self, line: bytes, at: float) -> list[float]:
        if self.mode == NDJSON:
            return self._dispatch([(at, line)], at) if line.strip() else []
        if not line:  # the blank line that ends an event
            self._blank_seen = True
            return self._dispatch_pending(at)
        if line.startswith(b"data:"):
            payload = line[5:]
            self._event.append((at, payload[1:] if payload.startswith(b" ") else payload))
        return []  # event:, id:, retry: and comments (": ping") carry no content

    def _dispatch_pending(self, at: float) -> list[float]:
        events, self._event = self._event, []
        return self._dispatch(events, at) if events else []

    def _dispatch(self, lines: list[tuple[float, bytes]], at: float) -> list[float]:
        if self.done or self.error:
            return []
        payload = b"\n".join(data for _, data in lines)
        if payload.strip() == b"[DONE]":
            self.done = True
            return []
        try:
            body = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return [at]  # a plain text event (empty too): one chunk of text
        if isinstance(body, dict) and "error" in body and len(body) <= 3:
            self.error = f"server error in stream: {str(body['error'])[:200]}"
            return []
        tokens = tokens_in(body, self.tokens_field)
        if tokens is not None:
            self.output_tokens = tokens
            # A chunk that only reports the count (a usage chunk, Ollama's last line) carries no text.
            if not answer_text(body):
                return []
        return [at]


def read_custom_stream(chunks: Iterable[bytes], start: float, tokens_field: str, clock: Any, result: Any) -> None:
    """Fill ``result`` (users.StreamResult) from a streamed custom answer."""
    reader = CustomStream(tokens_field)
    for data in chunks:
        now = clock()  # before parsing, so parsing time is not counted as latency
        for at in reader.feed(data, now - start):
            result.content_chunk(at)
        if reader.error or reader.done:
            break
    if reader.error is None:
        for at in reader.finish(clock() - start):
            result.content_chunk(at)
    result.error = reader.error
    result.output_tokens = reader.output_tokens


def read_custom_json(body: Any, tokens_field: str, result: Any) -> None:
    """Fill ``result`` from a whole JSON answer."""
    tokens = tokens_in(body, tokens_field)
    if tokens is None:
        text = answer_text(body)
        tokens = len(text.split()) if text is not None else None
    result.output_tokens = tokens
