"""The request span, picked at arrival and built on the export thread.

Through the SDK's span API a server span costs a sampler call, a lock and an attribute
validation per attribute set, twice (start and end): ~70 us per request on the 2-core
test machine. When servprof owns the tracer provider it knows every attribute it sets is
valid, so it picks the ids when the request arrives (the app needs them in `traceparent`)
and, when the request ends, hands its batch processor a PendingServerSpan: the finished
record and the span's ids. The export thread turns a batch of them into ReadableSpans
(attributes, GenAI fields read from the body head, status) just before the exporter sees
them, so the request pays ~1 us at its end instead of ~6. The provider's sampler, id
generator and resource are still the ones used. A host's provider (vLLM's) gets the
ordinary API path instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, StaticSampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

from servprof.observers import RequestRecord
from servprof.telemetry import attributes as attrs

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
# The SDK's default sampler and ALWAYS_ON decide from the parent's flag alone, with no
# attributes and the parent's trace state; servprof decides those itself (~1.5 us less per
# request). Any other sampler (OTEL_TRACES_SAMPLER) is asked as usual.
_PARENT_BASED_DEFAULT = ParentBased(ALWAYS_ON).get_description()
_ALWAYS_ON = ALWAYS_ON.get_description()


class DirectServerSpans:
    def __init__(
        self,
        provider: TracerProvider,
        processor: SpanProcessor,
        scope: InstrumentationScope,
        capture_content: bool = False,
    ) -> None:
        self._sampler = provider.sampler
        self._ids = provider.id_generator
        self.resource = provider.resource
        self._processor = processor
        self.scope = scope
        self.capture_content = capture_content
        # OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT / OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT, as the SDK's spans
        # apply them (servprof's own provider is built with the default, env-read limits).
        self.limits = SpanLimits()
        sampler_type, description = type(self._sampler), self._sampler.get_description()
        self._follows_parent = sampler_type is ParentBased and description == _PARENT_BASED_DEFAULT
        self._always_on = sampler_type is StaticSampler and description == _ALWAYS_ON

    def start(self, name: str, parent_context: Context | None, kind: SpanKind = SpanKind.SERVER) -> tuple[Any, ...]:
        """(trace id, span id, sampled, trace state, parent span context, sampler attributes,
        kind): the SpanContext itself (~0.7 us) is only built for spans that are exported."""
        parent: SpanContext | None = None
        if parent_context is not None:
            parent = trace.get_current_span(parent_context).get_span_context()
            if not parent.is_valid:
                parent = None
        ids = self._ids
        trace_id = parent.trace_id if parent is not None else ids.generate_trace_id()
        if self._follows_parent or self._always_on:
            sampled = self._always_on or parent is None or parent.trace_flags.sampled
            trace_state = parent.trace_state if parent is not None else None
            return trace_id, ids.generate_span_id(), sampled, trace_state, parent, None, kind
        result = self._sampler.should_sample(parent_context, trace_id, name, kind)
        return (
            trace_id, ids.generate_span_id(), result.decision.is_sampled(), result.trace_state, parent,
            result.attributes, kind,
        )  # fmt: skip

    @staticmethod
    def context_of(state: tuple[Any, ...]) -> SpanContext:
        trace_id, span_id, sampled, trace_state = state[:4]
        flags = _SAMPLED if sampled else _NOT_SAMPLED
        return SpanContext(trace_id, span_id, is_remote=False, trace_flags=flags, trace_state=trace_state)

    def end(
        self,
        record: RequestRecord,
        state: tuple[Any, ...],
        start_ns: int,
        end_ns: int,
        genai: dict[str, Any] | None,
        app: dict[str, Any] | None,
    ) -> None:
        """Queue the finished request's span; `genai` None means "read it from the body later"."""
        if not state[2]:
            return  # the sampler dropped it: nothing is recorded, as with the SDK's spans
        # Cast: the queue holds it until servprof's exporter wrapper (setup.py) builds it.
        pending: Any = PendingServerSpan(self, record, state, start_ns, end_ns, genai, app)
        self._processor.on_end(pending)


class CurrentRequestSpan(trace.NonRecordingSpan):
    """The request span as the app's current span while it runs, on servprof's own provider (which
    builds the real span at export): its SpanContext is built only when something reads it, as
    most requests' apps never do (~0.5 us a request). What the app sets on it as attributes
    (``trace.get_current_span().set_attribute(...)``) goes into the request's record, as
    servprof.annotate_request does, and onto the span at export; events, status and exceptions
    set on it are not kept (servprof sets the status from the response)."""

    def __init__(self, state: tuple[Any, ...], record: RequestRecord) -> None:  # (DirectServerSpans.start's tuple)
        self._state = state
        self._record = record
        self._built: SpanContext | None = None

    def is_recording(self) -> bool:
        return bool(self._state[2])  # (an unsampled span is never built: what is set on it goes nowhere)

    def set_attribute(self, key: str, value: Any) -> None:
        if self._state[2]:
            self._record.attributes[key] = value

    def set_attributes(self, attributes: Any) -> None:
        if self._state[2]:
            self._record.attributes.update(attributes)

    @property
    def _context(self) -> SpanContext:  # what NonRecordingSpan reads
        if self._built is None:
            self._built = DirectServerSpans.context_of(self._state)
        return self._built


class _SampledMark:
    """What the batch processor reads from a queued span: `.trace_flags.sampled`. Only
    sampled spans are queued; the real SpanContext is built with the span on export."""

    __slots__ = ()
    trace_flags = _SAMPLED


@dataclass(slots=True)
class PendingServerSpan:
    """A finished request's span waiting in the batch queue. The batch processor reads only
    `context.trace_flags.sampled`; servprof's exporter wrapper calls build() before export."""

    context: ClassVar[_SampledMark] = _SampledMark()
    owner: DirectServerSpans
    record: RequestRecord
    state: tuple[Any, ...]  # DirectServerSpans.start's tuple, then the request's attrs.Connection and a context token
    start_ns: int
    end_ns: int
    genai: dict[str, Any] | None  # None: read from the body head when built
    app: dict[str, Any] | None

    def build(self) -> ReadableSpan:
        record, owner, state = self.record, self.owner, self.state
        genai = self.genai
        if genai is None and record.request_body_head:
            genai = attrs.genai_request_attributes(
                record.method, record.path, record.request_body_head, owner.capture_content
            )
        app = attrs.app_attributes(self.app, owner.capture_content) if self.app else None
        attributes = attrs.server_span_attributes(record, state[7], genai, app)
        if state[5]:  # the sampler's attributes
            attributes.update(state[5])
        return ReadableSpan(
            name=attrs.span_name(record),
            context=owner.context_of(state),
            parent=state[4],
            resource=owner.resource,
            attributes=BoundedAttributes(owner.limits.max_span_attributes, attributes, immutable=True,
                                         max_value_len=owner.limits.max_span_attribute_length),
            kind=state[6],
            status=attrs.span_status(attributes),
            start_time=self.start_ns,
            end_time=self.end_ns,
            instrumentation_scope=owner.scope,
        )
