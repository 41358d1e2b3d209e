"""What the middleware measured for one request, and who is told about it.

The middleware fills a RequestRecord per HTTP request (O(1) work per body chunk)
and tells each RequestObserver at three points; telemetry is one observer.
Observers must be cheap and must never raise into serving: the middleware
catches and counts their errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    method: str
    path: str
    route: str | None = None  # the matched route template, when the app exposes it
    scheme: str = "http"
    client_address: str | None = None
    user_agent: str | None = None
    arrival_ns: int = 0  # time.time_ns() when the request arrived
    arrival_perf_ns: int = 0  # time.perf_counter_ns() at arrival; the other *_ns are perf_counter_ns
    response_start_ns: int | None = None
    first_byte_ns: int | None = None  # first non-empty body chunk: TTFT for streams
    last_byte_ns: int | None = None
    end_ns: int | None = None
    status: int | None = None
    chunks: int = 0
    bytes_sent: int = 0
    disconnected: bool = False
    error_type: str | None = None
    sampled: bool = False
    session_id: str | None = None
    # First bytes of a POST body (at most Settings.body_head_bytes), kept so observers can read
    # OpenAI-style request fields (model, max_tokens, stream) at request end, off the chunk path.
    request_body_head: bytes = b""
    # Filled by serving code through servprof.request_context.annotate_request, e.g.
    # {"gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 40}.
    attributes: dict[str, Any] = field(default_factory=dict)

    def refused_by_app(self) -> bool:
        """The app answered a client error (4xx: unauthorised, invalid, not found, rate-limited):
        it refused the request, as a rule before any model work."""
        return self.status is not None and 400 <= self.status < 500

    def elapsed_ms(self, end_perf_ns: int | None) -> float | None:
        if end_perf_ns is None:
            return None
        return (end_perf_ns - self.arrival_perf_ns) / 1e6


class RequestObserver(Protocol):
    def on_request_start(self, record: RequestRecord, scope: dict[str, Any]) -> Any:
        """Called once when the request arrives, before the app sees the scope; may return
        per-request state (e.g. a span). May rewrite scope["headers"] (traceparent)."""

    def on_request_end(self, record: RequestRecord, state: Any) -> None:
        """Called once when the response is complete, failed, or the client left."""

    def on_analysis(self, result: dict[str, Any], records: list[RequestRecord]) -> None:
        """Called off the event loop after a session's analysis finished (or failed)."""
