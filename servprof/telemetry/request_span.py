"""The request span, built in one piece when the request ends.

Through the SDK's span API a server span costs a sampler call, a lock and an attribute
validation per attribute set, twice (start and end): ~70 us per request on the 2-core
test machine. When servprof owns the tracer provider it knows every attribute it sets is
valid, so it picks the ids when the request arrives (the app needs them in `traceparent`)
and hands one finished ReadableSpan to its batch processor at the end: ~13 us. The
provider's sampler, id generator and resource are still the ones used. A host's provider
(vLLM's) gets the ordinary API path instead.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, TraceFlags


class DirectServerSpans:
    def __init__(
        self, provider: TracerProvider, processor: SpanProcessor, scope: InstrumentationScope
    ) -> None:
        self._sampler = provider.sampler
        self._ids = provider.id_generator
        self._resource = provider.resource
        self._processor = processor
        self._scope = scope

    def start(self, name: str, parent_context: Context | None) -> tuple[SpanContext, SpanContext | None, Any]:
        """The new span's context (as the sampler decided), its parent, and sampler attributes."""
        parent: SpanContext | None = None
        if parent_context is not None:
            parent = trace.get_current_span(parent_context).get_span_context()
            if not parent.is_valid:
                parent = None
        trace_id = parent.trace_id if parent is not None else self._ids.generate_trace_id()
        result = self._sampler.should_sample(parent_context, trace_id, name, SpanKind.SERVER)
        flags = TraceFlags(TraceFlags.SAMPLED if result.decision.is_sampled() else TraceFlags.DEFAULT)
        context = SpanContext(
            trace_id,
            self._ids.generate_span_id(),
            is_remote=False,
            trace_flags=flags,
            trace_state=result.trace_state,
        )
        return context, parent, result.attributes

    def end(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        start_ns: int,
        end_ns: int,
        attributes: dict[str, Any],
        status: Status,
    ) -> None:
        if not context.trace_flags.sampled:
            return  # the sampler dropped it: nothing is recorded, as with the SDK's spans
        span = ReadableSpan(
            name=name,
            context=context,
            parent=parent,
            resource=self._resource,
            attributes=attributes,
            kind=SpanKind.SERVER,
            status=status,
            start_time=start_ns,
            end_time=end_ns,
            instrumentation_scope=self._scope,
        )
        self._processor.on_end(span)
