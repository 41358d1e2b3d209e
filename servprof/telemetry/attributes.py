"""Span attributes for one request: stable HTTP names, GenAI names, servprof's own.

The GenAI semantic conventions are still "Development" and their Python constants are
deprecated-but-unchanged, so the names are spelled out here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import orjson
from opentelemetry.trace import Status, StatusCode

from servprof.observers import RequestRecord

HTTP_REQUEST_METHOD = "http.request.method"
HTTP_ROUTE = "http.route"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"
URL_PATH = "url.path"
URL_SCHEME = "url.scheme"
ERROR_TYPE = "error.type"
CLIENT_ADDRESS = "client.address"
USER_AGENT_ORIGINAL = "user_agent.original"
NETWORK_PROTOCOL_VERSION = "network.protocol.version"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
URL_QUERY = "url.query"
# Query parameters whose values url.query never shows: the semantic conventions' list (matched as
# given), and names that hold keys or tokens in the query string (Gemini's `key`), in any case.
REDACTED_QUERY_KEYS = frozenset({"AWSAccessKeyId", "Signature", "sig", "X-Goog-Signature"})
SECRET_QUERY_KEYS = re.compile(r"(?i)^(?:.*[_-])?(?:key|apikey|token|secret|password|passwd|auth|signature|sig|"
                               r"credential|credentials|session|code)$")

GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"

SERVPROF_REQUEST_ID = "servprof.request_id"
SERVPROF_SAMPLED = "servprof.sampled"
SERVPROF_SESSION_ID = "servprof.session_id"
SERVPROF_TTFT_MS = "servprof.ttft_ms"
SERVPROF_CHUNKS = "servprof.chunks"
SERVPROF_DISCONNECTED = "servprof.disconnected"

# Attributes that carry prompt or completion text: kept off spans unless capture_content.
CONTENT_ATTRIBUTES = frozenset(
    {
        GEN_AI_INPUT_MESSAGES,
        "gen_ai.output.messages",
        "gen_ai.system_instructions",
        "gen_ai.prompt",
        "gen_ai.completion",
    }
)

# OpenAI-style request fields -> GenAI attribute and the Python types accepted for it.
_REQUEST_FIELDS: dict[str, tuple[str, tuple[type, ...]]] = {
    "model": (GEN_AI_REQUEST_MODEL, (str,)),
    "max_tokens": (GEN_AI_REQUEST_MAX_TOKENS, (int,)),
    "max_completion_tokens": (GEN_AI_REQUEST_MAX_TOKENS, (int,)),
    "temperature": (GEN_AI_REQUEST_TEMPERATURE, (int, float)),
    "top_p": (GEN_AI_REQUEST_TOP_P, (int, float)),
    "stream": (GEN_AI_REQUEST_STREAM, (bool,)),
}
# For a body cut off by the head limit: scalar fields read from the text *before* the first
# field that carries user text, so nothing inside a prompt can be mistaken for a field.
_CONTENT_FIELD = re.compile(rb'"(messages|prompt|input)"\s*:')
_SCALAR_FIELD = re.compile(
    rb'"(model|max_tokens|max_completion_tokens|temperature|top_p|stream)"\s*:\s*'
    rb'("(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false)'
)


def operation_name(path: str, body: dict[str, Any] | None) -> str | None:
    """chat / text_completion for an OpenAI-style completion request, else None."""
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/completions"):
        return "text_completion"
    if body is not None:
        if "messages" in body:
            return "chat"
        if "prompt" in body:
            return "text_completion"
    return None


def _scan_truncated(head: bytes) -> dict[str, Any]:
    match = _CONTENT_FIELD.search(head)
    prefix = head[: match.start()] if match else head
    fields: dict[str, Any] = {}
    for name, raw in _SCALAR_FIELD.findall(prefix):
        try:
            fields.setdefault(name.decode(), orjson.loads(raw))
        except orjson.JSONDecodeError:
            continue
    if match:  # the kind of request is known even if its text is cut off
        fields[match.group(1).decode()] = None
    return fields


def _input_messages(body: dict[str, Any]) -> str | None:
    """Prompt text in the GenAI input-messages shape, only ever called with capture_content."""
    if isinstance(body.get("messages"), list):
        messages = [
            {"role": m.get("role"), "parts": [{"type": "text", "content": m["content"]}]}
            if isinstance(m, dict) and isinstance(m.get("content"), str)
            else m
            for m in body["messages"]
        ]
    elif isinstance(body.get("prompt"), str):
        messages = [{"role": "user", "parts": [{"type": "text", "content": body["prompt"]}]}]
    else:
        return None
    return orjson.dumps(messages).decode()


def genai_request_attributes(
    method: str, path: str, body_head: bytes, capture_content: bool = False
) -> dict[str, Any]:
    """GenAI request attributes from an OpenAI-style body head; empty for anything else."""
    if method != "POST":
        return {}
    body: dict[str, Any] | None
    complete = True
    try:
        parsed = orjson.loads(body_head) if body_head else None
        body = parsed if isinstance(parsed, dict) else None
    except orjson.JSONDecodeError:
        body, complete = _scan_truncated(body_head), False
    operation = operation_name(path, body)
    if operation is None:
        return {}
    attributes: dict[str, Any] = {GEN_AI_OPERATION_NAME: operation}
    for field_name, (attribute, types) in _REQUEST_FIELDS.items():
        value = (body or {}).get(field_name)
        # bool is an int in Python; only "stream" takes it.
        if isinstance(value, types) and (attribute == GEN_AI_REQUEST_STREAM or not isinstance(value, bool)):
            attributes.setdefault(attribute, value)
    if capture_content and complete and body is not None:
        messages = _input_messages(body)
        if messages is not None:
            attributes[GEN_AI_INPUT_MESSAGES] = messages
    return attributes


def _valid_value(value: Any) -> bool:
    if isinstance(value, str | bool | int | float):
        return True
    return (
        isinstance(value, list | tuple)
        and len(value) > 0
        and all(isinstance(item, str | bool | int | float) for item in value)
        and len({type(item) for item in value}) == 1
    )


MAX_APP_ATTRIBUTES = 64  # with servprof's own, under the SDK's default limit of 128 per span


def app_attributes(record_attributes: dict[str, Any], capture_content: bool) -> dict[str, Any]:
    """What serving code attached with annotate_request, keeping only values OTel accepts
    (sequences as tuples, as the SDK stores them) and at most MAX_APP_ATTRIBUTES."""
    kept: dict[str, Any] = {}
    for key, value in record_attributes.items():
        if len(kept) == MAX_APP_ATTRIBUTES:
            break
        if (
            isinstance(key, str)
            and _valid_value(value)
            and (capture_content or key not in CONTENT_ATTRIBUTES)
        ):
            kept[key] = tuple(value) if isinstance(value, list) else value
    return kept


def error_type(record: RequestRecord) -> str | None:
    if record.error_type:
        return record.error_type
    if record.status is not None and record.status >= 500:
        return str(record.status)
    return None


def redacted_query(query: str) -> str:
    """``query`` with the values of secret-bearing parameters replaced by REDACTED, keys kept."""
    parts = query.split("&")
    for i, part in enumerate(parts):
        key, equals, _value = part.partition("=")
        if equals and (key in REDACTED_QUERY_KEYS or SECRET_QUERY_KEYS.match(key)):
            parts[i] = key + "=REDACTED"
    return "&".join(parts)


class Connection(NamedTuple):
    """What the span needs of the request's ASGI scope, kept (as references: nothing parsed while
    the request is served) instead of the scope, which holds the app's per-request objects."""

    http_version: str | None
    headers: Any  # the scope's list of (name, value) byte pairs
    query_string: bytes | None
    server: Any  # (host, port) of the listening socket, or None


def connection_of(scope: Mapping[str, Any]) -> Connection:
    return Connection(scope.get("http_version"), scope.get("headers"), scope.get("query_string"), scope.get("server"))


def connection_attributes(connection: Connection | None) -> dict[str, Any]:
    """Read when the request's span is built (off the serving path with servprof's provider): the
    HTTP version, the server's name and port as the client addressed it (the Host header; the
    socket the server listens on where there is none), and the query string, secrets redacted."""
    if connection is None:
        return {}
    out: dict[str, Any] = {}
    if connection.http_version:
        out[NETWORK_PROTOCOL_VERSION] = connection.http_version
    host = next((value for name, value in connection.headers or () if name == b"host"), None)
    address: str | None = None
    port: int | None = None
    if host:
        try:
            parts = urlsplit("//" + host.decode("latin-1"))
            address, port = parts.hostname, parts.port
        except ValueError:  # (a malformed Host: no address rather than a wrong one)
            address = port = None
    elif connection.server:
        address, port = connection.server[0], connection.server[1]
    if address:
        out[SERVER_ADDRESS] = address
        if port:
            out[SERVER_PORT] = int(port)
    if connection.query_string:
        out[URL_QUERY] = redacted_query(connection.query_string.decode("latin-1"))
    return out


def request_attributes(record: RequestRecord, connection: Connection | None) -> dict[str, Any]:
    """HTTP and servprof attributes of a finished request, set on its span in one call (the
    SDK validates every attribute set, so each one and each call costs serving time).
    ``connection``: what connection_attributes reads of the request's scope."""
    attributes: dict[str, Any] = {
        HTTP_REQUEST_METHOD: record.method,
        URL_PATH: record.path,
        URL_SCHEME: record.scheme,
        SERVPROF_REQUEST_ID: record.request_id,
        SERVPROF_SAMPLED: record.sampled,
        SERVPROF_CHUNKS: record.chunks,
    }
    if record.client_address:
        attributes[CLIENT_ADDRESS] = record.client_address
    if record.user_agent:
        attributes[USER_AGENT_ORIGINAL] = record.user_agent
    attributes.update(connection_attributes(connection))
    if record.route:
        attributes[HTTP_ROUTE] = record.route
    if record.status is not None:
        attributes[HTTP_RESPONSE_STATUS_CODE] = record.status
    error = error_type(record)
    if error:
        attributes[ERROR_TYPE] = error
    ttft_ms = record.elapsed_ms(record.first_byte_ns)
    if ttft_ms is not None:
        attributes[SERVPROF_TTFT_MS] = ttft_ms
    if record.disconnected:
        attributes[SERVPROF_DISCONNECTED] = True
    if record.session_id:
        attributes[SERVPROF_SESSION_ID] = record.session_id
    return attributes


def server_span_attributes(
    record: RequestRecord,
    connection: Connection | None,
    genai: dict[str, Any] | None,
    app: dict[str, Any] | None,
) -> dict[str, Any]:
    """Every attribute of a request's SERVER span: HTTP and servprof's, then the GenAI request
    fields, then what the app annotated (already filtered by app_attributes)."""
    attributes = request_attributes(record, connection)
    if genai:
        attributes.update(genai)
    if app:
        attributes.update(app)
    return attributes


def span_name(record: RequestRecord) -> str:
    """`{method} {route}` (never the raw path, whose ids would make names unbounded)."""
    return f"{record.method} {record.route}" if record.route else record.method


_UNSET = Status(StatusCode.UNSET)


def span_status(attributes: dict[str, Any]) -> Status:
    error = attributes.get(ERROR_TYPE)
    return Status(StatusCode.ERROR, str(error)) if error else _UNSET
