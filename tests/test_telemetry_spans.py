"""The request span and GenAI metrics: a real app behind the real ServprofMiddleware on a
loopback uvicorn server. Spans go to the SDK's in-memory exporter through servprof's own
batch processor; metrics to the SDK's in-memory reader."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from _telemetry_helpers import behind_middleware, chat_body, make_app, serve
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from servprof.settings import Settings
from servprof.telemetry import create_observer
from servprof.telemetry.attributes import genai_request_attributes
from servprof.telemetry.observer import REQUEST_DURATION_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS


class Stack:
    def __init__(self, tmp_path: Path, capture_content: bool = False) -> None:
        self.exporter = InMemorySpanExporter()
        self.reader = InMemoryMetricReader()
        settings = Settings(out_dir=tmp_path, capture_content=capture_content)
        self.observer = create_observer(
            settings, environ={}, span_exporter=self.exporter, metric_reader=self.reader
        )
        self.app, self.keeper = behind_middleware(make_app(), self.observer, tmp_path)

    def spans(self) -> list[Any]:
        self.keeper.wait_records(self.keeper.requests_seen)
        self.observer.force_flush()
        return list(self.exporter.get_finished_spans())

    def histograms(self) -> dict[str, Any]:
        self.keeper.wait_records(self.keeper.requests_seen)
        data = self.reader.get_metrics_data()
        found: dict[str, Any] = {}
        for resource_metrics in data.resource_metrics if data else []:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    found[metric.name] = metric.data.data_points
        return found


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    built = Stack(tmp_path)
    with serve(built.app) as url:
        built.url = url
        yield built
    built.observer.shutdown()


def _stream_chat(client: httpx.Client, url: str, body: bytes, headers: dict[str, str] | None = None) -> int:
    events = 0
    with client.stream("POST", url + "/v1/chat/completions", content=body, headers=headers) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            events += line.startswith("data: ")
    return events


def test_one_server_span_per_request_named_by_route(stack: Stack) -> None:
    with httpx.Client() as client:
        assert client.get(stack.url + "/hello", headers={"user-agent": "probe/1"}).status_code == 200
        assert client.get(stack.url + "/items/42").status_code == 200
        assert client.get(stack.url + "/no/such/path").status_code == 404
    spans = stack.spans()
    assert [s.name for s in spans] == ["GET /hello", "GET /items/{item_id}", "GET"]
    hello, item, missing = spans
    assert all(s.kind is SpanKind.SERVER and s.parent is None for s in spans)
    assert hello.attributes["http.request.method"] == "GET"
    assert hello.attributes["url.path"] == "/hello"
    assert hello.attributes["url.scheme"] == "http"
    assert hello.attributes["http.route"] == "/hello"
    assert hello.attributes["http.response.status_code"] == 200
    assert hello.attributes["client.address"] == "127.0.0.1"
    assert hello.attributes["user_agent.original"] == "probe/1"
    # The server as the client addressed it (its Host header), and no query where none was sent.
    port = int(stack.url.rsplit(":", 1)[1])
    assert hello.attributes["server.address"] == "127.0.0.1" and hello.attributes["server.port"] == port
    assert "url.query" not in hello.attributes and hello.attributes["network.protocol.version"] == "1.1"
    assert hello.attributes["servprof.request_id"] == stack.keeper.records[0].request_id
    assert hello.attributes["servprof.sampled"] is False
    assert "gen_ai.operation.name" not in hello.attributes
    # The raw path of a templated route stays in url.path only.
    assert item.attributes["http.route"] == "/items/{item_id}" and item.attributes["url.path"] == "/items/42"
    assert "http.route" not in missing.attributes and missing.attributes["http.response.status_code"] == 404
    # 4xx is the client's error: a server span leaves its status unset.
    assert missing.status.status_code is StatusCode.UNSET
    # Explicit times: the span covers the record's measured interval.
    record = stack.keeper.records[0]
    assert hello.start_time == record.arrival_ns
    assert hello.end_time - hello.start_time == record.end_ns - record.arrival_perf_ns


def test_the_query_string_is_kept_with_its_secrets_redacted_and_the_host_as_addressed(stack: Stack) -> None:
    """url.query (OpenTelemetry: required when the request has one), with the values of key-bearing
    parameters (the conventions' list, and API keys and tokens, as Gemini's `?key=`) replaced;
    server.address / server.port from the Host header the client sent (a proxy's public name)."""
    with httpx.Client() as client:
        query = "alt=sse&key=AIzaSECRET&access_token=tok&sig=abc&page=2"
        assert client.get(stack.url + "/hello?" + query, headers={"host": "llm.example.com"}).status_code == 200
        assert client.get(stack.url + "/hello", headers={"host": "[::1]:8443"}).status_code == 200
    named, ipv6 = stack.spans()
    assert named.attributes["url.query"] == "alt=sse&key=REDACTED&access_token=REDACTED&sig=REDACTED&page=2"
    assert named.attributes["url.path"] == "/hello"
    assert named.attributes["server.address"] == "llm.example.com" and "server.port" not in named.attributes
    assert ipv6.attributes["server.address"] == "::1" and ipv6.attributes["server.port"] == 8443
    assert not [key for key, value in named.attributes.items() if "AIzaSECRET" in str(value)], dict(named.attributes)


def test_streamed_completion_is_one_span_with_genai_and_servprof_attributes(stack: Stack) -> None:
    prompt = "a secret prompt that must not leave the server"
    with httpx.Client() as client:
        events = _stream_chat(client, stack.url, chat_body(prompt, max_tokens=12))
    spans = stack.spans()
    assert len(spans) == 1, "one span per request, never one per chunk"
    span = spans[0]
    record = stack.keeper.records[0]
    assert span.name == "POST /v1/chat/completions"
    attributes = dict(span.attributes)
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == "tiny-lm"
    assert attributes["gen_ai.request.max_tokens"] == 12
    assert attributes["gen_ai.request.temperature"] == 0.5
    assert attributes["gen_ai.request.stream"] is True
    assert attributes["gen_ai.usage.input_tokens"] == len(prompt.encode())
    assert attributes["gen_ai.usage.output_tokens"] == 12
    assert events == 13  # 12 tokens and [DONE]
    assert attributes["servprof.chunks"] == record.chunks >= events
    assert 0 < attributes["servprof.ttft_ms"] <= (span.end_time - span.start_time) / 1e6
    assert not any(prompt in str(value) for value in attributes.values())


def test_capture_content_opt_in_records_the_prompt(tmp_path: Path) -> None:
    built = Stack(tmp_path, capture_content=True)
    with serve(built.app) as url, httpx.Client() as client:
        assert (
            client.post(url + "/v1/chat/completions", content=chat_body("tell me", stream=False)).status_code
            == 200
        )
    (span,) = built.spans()
    messages = orjson.loads(span.attributes["gen_ai.input.messages"])
    assert messages == [{"role": "user", "parts": [{"type": "text", "content": "tell me"}]}]
    built.observer.shutdown()


def test_server_errors_set_error_status_and_type(stack: Stack) -> None:
    # uvicorn closes the connection after an app exception: a fresh client per request.
    with httpx.Client() as client:
        assert client.get(stack.url + "/fail").status_code == 500
    with httpx.Client() as client:
        assert client.get(stack.url + "/unavailable").status_code == 503
        assert client.get(stack.url + "/hello").status_code == 200
    failed, unavailable, ok = stack.spans()
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes["error.type"] == "RuntimeError"
    assert failed.attributes["http.response.status_code"] == 500
    assert unavailable.status.status_code is StatusCode.ERROR
    assert unavailable.attributes["error.type"] == "503"
    assert ok.status.status_code is StatusCode.UNSET and "error.type" not in ok.attributes


def test_traceparent_is_continued_and_reinjected_for_the_app(stack: Stack) -> None:
    incoming_trace, incoming_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with httpx.Client() as client:
        seen = client.get(
            stack.url + "/headers", headers={"traceparent": f"00-{incoming_trace}-{incoming_span}-01"}
        ).json()["traceparent"]
        unparented = client.get(stack.url + "/headers").json()["traceparent"]
    first, second = stack.spans()
    assert format(first.context.trace_id, "032x") == incoming_trace
    assert format(first.parent.span_id, "016x") == incoming_span and first.parent.is_remote
    # What the app saw names servprof's span as the parent, so a downstream span nests under it.
    assert seen == f"00-{incoming_trace}-{first.context.span_id:016x}-{first.context.trace_flags:02x}"
    assert (
        unparented
        == f"00-{second.context.trace_id:032x}-{second.context.span_id:016x}-{second.context.trace_flags:02x}"
    )
    assert first.context.trace_flags.sampled and second.context.trace_flags.sampled
    assert second.parent is None


def test_genai_metrics_with_recommended_buckets(stack: Stack) -> None:
    with httpx.Client() as client:
        for _ in range(3):
            _stream_chat(client, stack.url, chat_body(max_tokens=5))
        assert (
            client.post(stack.url + "/v1/chat/completions", content=chat_body(stream=False)).status_code
            == 200
        )
        assert client.get(stack.url + "/hello").status_code == 200  # not a GenAI request: no metrics
    histograms = stack.histograms()
    (duration,) = histograms["gen_ai.server.request.duration"]
    (ttft,) = histograms["gen_ai.server.time_to_first_token"]
    (tpot,) = histograms["gen_ai.server.time_per_output_token"]
    assert duration.count == 4
    assert ttft.count == 3 and tpot.count == 3  # only streams show when their first token left
    assert list(duration.explicit_bounds) == REQUEST_DURATION_BUCKETS
    assert list(ttft.explicit_bounds) == TTFT_BUCKETS
    assert list(tpot.explicit_bounds) == TPOT_BUCKETS
    assert dict(duration.attributes) == {"gen_ai.operation.name": "chat", "gen_ai.request.model": "tiny-lm"}
    spans = [s for s in stack.spans() if s.name.startswith("POST")]
    span_seconds = sum((s.end_time - s.start_time) / 1e9 for s in spans)
    assert duration.sum == pytest.approx(span_seconds, rel=1e-6)


def test_truncated_body_head_reads_fields_before_the_prompt_only() -> None:
    body = chat_body('"model": "inside-the-prompt" ' * 400, max_tokens=7)
    head = b'{"model":"real","max_tokens":7,"temperature":0.2,' + body[body.index(b'"messages"') :][:4000]
    attributes = genai_request_attributes("POST", "/v1/chat/completions", head)
    assert attributes == {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "real",
        "gen_ai.request.max_tokens": 7,
        "gen_ai.request.temperature": 0.2,
    }
    assert genai_request_attributes("POST", "/upload", b"\x00\xffnot json") == {}
    assert genai_request_attributes("GET", "/v1/completions", b"") == {}
    assert genai_request_attributes("POST", "/generate", b'{"prompt": "x", "max_tokens": true}') == {
        "gen_ai.operation.name": "text_completion"
    }


def _direct_request(
    built: Stack, headers: list[tuple[bytes, bytes]]
) -> tuple[Any, list[tuple[bytes, bytes]]]:
    """The exported request span's context and the headers the app would see."""
    from servprof.observers import RequestRecord

    record = RequestRecord(
        "direct-1", "GET", "/x", route="/x", arrival_ns=1, arrival_perf_ns=1, end_ns=2, status=200
    )
    scope = {"headers": list(headers)}
    state = built.observer.on_request_start(record, scope)
    built.observer.on_request_end(record, state)
    built.observer.force_flush()
    (span,) = built.exporter.get_finished_spans()
    return span.context, scope["headers"]


def test_tracestate_and_baggage_pass_through(tmp_path: Path) -> None:
    built = Stack(tmp_path)
    incoming = [
        (b"host", b"h"),
        (b"traceparent", b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01"),
        (b"tracestate", b"vendor=abc"),
        (b"baggage", b"tenant=42"),
    ]
    context, headers = _direct_request(built, incoming)
    as_dict = dict(headers)
    assert as_dict[b"tracestate"] == b"vendor=abc" and as_dict[b"baggage"] == b"tenant=42"
    assert context.trace_state.get("vendor") == "abc"
    assert as_dict[b"traceparent"].startswith(b"00-" + b"1" * 32 + b"-%016x-" % context.span_id)
    assert [name for name, _ in headers].count(b"traceparent") == 1
    built.observer.shutdown()


@pytest.mark.parametrize("traceparent", [None, b"00-not-a-valid-traceparent-01"])
def test_a_tracestate_without_a_valid_parent_is_dropped(tmp_path: Path, traceparent: bytes | None) -> None:
    """W3C trace context: tracestate belongs to the incoming trace; under a new root it goes."""
    built = Stack(tmp_path)
    incoming = [(b"host", b"h"), (b"tracestate", b"vendor=stale"), (b"baggage", b"tenant=42")]
    if traceparent:
        incoming.append((b"traceparent", traceparent))
    context, headers = _direct_request(built, incoming)
    names = [name for name, _ in headers]
    assert b"tracestate" not in names and dict(headers)[b"baggage"] == b"tenant=42"
    assert dict(headers)[b"traceparent"] == b"00-%032x-%016x-01" % (context.trace_id, context.span_id)
    assert not context.trace_state
    built.observer.shutdown()


def test_other_configured_propagators_are_honoured(tmp_path: Path) -> None:
    from opentelemetry import propagate
    from opentelemetry.propagators.textmap import DefaultSetter, TextMapPropagator

    class TenantPropagator(TextMapPropagator):
        """A non-W3C propagator, as OTEL_PROPAGATORS=b3 (for example) would install."""

        def extract(self, carrier: Any, context: Any = None, getter: Any = None) -> Any:
            return context

        def inject(self, carrier: Any, context: Any = None, setter: Any = None) -> None:
            (setter or DefaultSetter()).set(carrier, "x-tenant-trace", "seen")

        @property
        def fields(self) -> set[str]:
            return {"x-tenant-trace"}

    from opentelemetry.propagators.composite import CompositePropagator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    previous = propagate.get_global_textmap()
    propagate.set_global_textmap(CompositePropagator([TraceContextTextMapPropagator(), TenantPropagator()]))
    try:
        built = Stack(tmp_path)
    finally:
        propagate.set_global_textmap(previous)
    context, headers = _direct_request(built, [(b"x-tenant-trace", b"old"), (b"host", b"h")])
    as_dict = dict(headers)
    assert as_dict[b"x-tenant-trace"] == b"seen" and as_dict[b"host"] == b"h"
    assert as_dict[b"traceparent"] == b"00-%032x-%016x-%02x" % (
        context.trace_id,
        context.span_id,
        context.trace_flags,
    )
    built.observer.shutdown()


def test_an_unsampled_incoming_trace_stays_unsampled(stack: Stack) -> None:
    unsampled = f"00-{'5' * 32}-{'6' * 16}-00"
    with httpx.Client() as client:
        seen = client.get(stack.url + "/headers", headers={"traceparent": unsampled}).json()["traceparent"]
        assert client.get(stack.url + "/hello").status_code == 200
    # The default sampler follows the caller's decision: no span, and the app is told so.
    assert [s.name for s in stack.spans()] == ["GET /hello"]
    assert seen.startswith(f"00-{'5' * 32}-") and seen.endswith("-00") and f"-{'6' * 16}-" not in seen


def test_app_attributes_are_filtered_and_bounded() -> None:
    from servprof.telemetry.attributes import MAX_APP_ATTRIBUTES, app_attributes

    given = {
        "gen_ai.response.finish_reasons": ["stop"],
        "bad": {"a": 1},
        "mixed": [1, "x"],
        "empty": [],
        "gen_ai.output.messages": "the completion text",
        **{f"k{i}": i for i in range(100)},
    }
    kept = app_attributes(given, capture_content=False)
    assert kept["gen_ai.response.finish_reasons"] == ("stop",)
    assert not {"bad", "mixed", "empty", "gen_ai.output.messages"} & set(kept)
    assert len(kept) == MAX_APP_ATTRIBUTES
    assert app_attributes({"gen_ai.output.messages": "text"}, capture_content=True) == {
        "gen_ai.output.messages": "text"
    }


def test_a_downstream_server_span_nests_under_the_request_span(tmp_path: Path) -> None:
    """As vLLM does for its llm_request span: the app extracts traceparent from the headers
    it was given and starts its own span (here with its own provider and exporter)."""
    from opentelemetry import propagate
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    app_exporter = InMemorySpanExporter()
    app_provider = TracerProvider()
    app_provider.add_span_processor(SimpleSpanProcessor(app_exporter))
    app_tracer = app_provider.get_tracer("downstream")

    async def generate(request: Any) -> PlainTextResponse:
        context = propagate.extract(dict(request.headers))
        with app_tracer.start_as_current_span("llm_request", context=context, kind=SpanKind.SERVER):
            return PlainTextResponse("ok")

    built = Stack(tmp_path)
    app, keeper = behind_middleware(
        Starlette(routes=[Route("/generate", generate)]), built.observer, tmp_path
    )
    built.keeper = keeper
    with serve(app) as url, httpx.Client() as client:
        assert client.get(url + "/generate").status_code == 200
    (request_span,) = built.spans()
    (downstream,) = app_exporter.get_finished_spans()
    assert downstream.context.trace_id == request_span.context.trace_id
    assert downstream.parent.span_id == request_span.context.span_id
    built.observer.shutdown()


def _nesting_app(app_tracer: Any, seen: list[dict[str, str]]) -> Any:
    """An app that starts its own spans as users do (the current span as parent), in an async
    endpoint and in a plain def one (run on a worker thread), and records the headers it got."""
    from opentelemetry import trace
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def generate(request: Any) -> PlainTextResponse:
        seen.append(dict(request.headers))
        trace.get_current_span().set_attribute("app.user", "u1")  # "the request's span", as apps annotate it
        with app_tracer.start_as_current_span("app.generate"):
            return PlainTextResponse("ok")

    def tokenize(request: Any) -> PlainTextResponse:
        with app_tracer.start_as_current_span("app.tokenize"):
            return PlainTextResponse("ok")

    return Starlette(routes=[Route("/generate", generate), Route("/tokenize", tokenize)])


@pytest.mark.parametrize("provider", ["servprof", "host"])
@pytest.mark.parametrize("incoming", [None, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"],
                         ids=["new_trace", "incoming_traceparent"])
def test_an_outer_instrumentations_server_span_is_the_parent(tmp_path: Path, provider: str,
                                                             incoming: str | None) -> None:
    """opentelemetry-instrument or FastAPIInstrumentor puts OpenTelemetry's ASGI middleware outside
    servprof's: its SERVER span is current when servprof sees the request. servprof's span is then
    its INTERNAL child (one SERVER span a request), with or without an incoming traceparent (before:
    a second SERVER span, a sibling under the client's parent), and the trace state the app is given
    is the outer span's. The outer span stays the current one: the app's own spans nest under it, and
    what the app sets on "the current span" lands on that recording server span, as without servprof."""
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from servprof.telemetry.observer import TelemetryObserver
    from servprof.telemetry.setup import Pipeline

    host_exporter = InMemorySpanExporter()
    host = TracerProvider()
    host.add_span_processor(SimpleSpanProcessor(host_exporter))
    if provider == "host":  # servprof on the host's provider (SERVPROF_TELEMETRY_EXPORTER=auto under it)
        observer: Any = TelemetryObserver(Pipeline(host, MeterProvider(), "host"))
        servprof_exporter = host_exporter
    else:
        servprof_exporter = InMemorySpanExporter()
        observer = create_observer(Settings(out_dir=tmp_path), environ={}, span_exporter=servprof_exporter)
    seen: list[dict[str, str]] = []
    inner, keeper = behind_middleware(_nesting_app(host.get_tracer("app"), seen), observer, tmp_path)
    app = OpenTelemetryMiddleware(inner, tracer_provider=host, exclude_spans=["receive", "send"])
    headers = {"traceparent": incoming, "tracestate": "vendor=abc"} if incoming else {}
    with serve(app) as url, httpx.Client() as client:
        assert client.get(url + "/generate", headers=headers).status_code == 200
        assert client.get(url + "/tokenize", headers=headers).status_code == 200
    keeper.wait_records(2)
    observer.force_flush()
    spans = list(host_exporter.get_finished_spans())
    ours = [s for s in servprof_exporter.get_finished_spans() if s.instrumentation_scope.name == "servprof"]
    outer = [s for s in spans if s.kind == SpanKind.SERVER and s.instrumentation_scope.name != "servprof"]
    assert len(ours) == len(outer) == 2
    for mine, theirs, app_span in zip(ours, outer, (s for s in spans if s.name.startswith("app.")), strict=True):
        assert mine.kind == SpanKind.INTERNAL
        assert mine.context.trace_id == theirs.context.trace_id == app_span.context.trace_id
        assert mine.parent.span_id == theirs.context.span_id
        assert app_span.parent.span_id == theirs.context.span_id
        if incoming:
            assert f"{theirs.context.trace_id:032x}" == incoming.split("-")[1]
    assert outer[0].attributes["app.user"] == "u1"
    (headers_seen,) = seen
    assert headers_seen["traceparent"].split("-")[2] == f"{ours[0].context.span_id:016x}"
    assert headers_seen.get("tracestate") == ("vendor=abc" if incoming else None)
    observer.shutdown()


def test_the_apps_own_spans_nest_under_the_request_span(tmp_path: Path) -> None:
    """With servprof alone, the request span is the current span while the app runs (as an
    OpenTelemetry server instrumentation's is): the app's spans, on the loop or on a worker thread,
    are its children, not roots of traces of their own, and what the app sets on it is recorded; and
    the context is restored after."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    app_exporter = InMemorySpanExporter()
    app_provider = TracerProvider()
    app_provider.add_span_processor(SimpleSpanProcessor(app_exporter))
    built = Stack(tmp_path)
    app, built.keeper = behind_middleware(_nesting_app(app_provider.get_tracer("app"), []), built.observer, tmp_path)
    with serve(app) as url, httpx.Client() as client:
        assert client.get(url + "/generate").status_code == 200
        assert client.get(url + "/tokenize").status_code == 200
    request_spans = built.spans()
    app_spans = list(app_exporter.get_finished_spans())
    assert [s.kind for s in request_spans] == [SpanKind.SERVER] * 2
    assert [s.name for s in app_spans] == ["app.generate", "app.tokenize"]
    for request_span, app_span in zip(request_spans, app_spans, strict=True):
        assert app_span.context.trace_id == request_span.context.trace_id
        assert app_span.parent.span_id == request_span.context.span_id
    # What the app set on "the current span" is on the request span (built at export from the record).
    assert [s.attributes.get("app.user") for s in request_spans] == ["u1", None]
    assert not trace.get_current_span().get_span_context().is_valid
    built.observer.shutdown()


def test_the_current_request_span_records_attributes_only_when_sampled() -> None:
    """Code that checks ``span.is_recording()`` before annotating (as instrumentations do) is told
    the truth: an unsampled request span is never built, and what is set on it goes nowhere."""
    from servprof.observers import RequestRecord
    from servprof.telemetry.request_span import CurrentRequestSpan

    for sampled in (True, False):
        record = RequestRecord("r1", "POST", "/v1/chat/completions")
        span = CurrentRequestSpan((1, 2, sampled, None, None, None, SpanKind.SERVER), record)
        span.set_attribute("app.user", "u1")
        span.set_attributes({"app.tier": "gold", "app.user": "u2"})
        assert span.is_recording() is sampled
        assert record.attributes == ({"app.user": "u2", "app.tier": "gold"} if sampled else {})
        assert span.get_span_context().trace_flags.sampled is sampled
