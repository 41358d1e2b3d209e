"""The RequestObserver that turns request records into spans and GenAI metrics.

Per request: one SERVER span whose context exists from the request's arrival (so it can be
re-injected into the headers the app sees) and which is ended with explicit start and end
times when the response is complete (see request_span.py for why it is built on the export
thread when servprof owns the provider).
Nothing happens per body chunk. Sampled requests keep their span context until the
session's analysis has been turned into child spans.
"""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import context as context_api
from opentelemetry import metrics, propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind

from servprof import __version__
from servprof.observers import RequestRecord
from servprof.telemetry import attributes as attrs
from servprof.telemetry.analysis_spans import AnalysisSpanEmitter, SampledParent, SampledParents
from servprof.telemetry.request_span import CurrentRequestSpan, DirectServerSpans
from servprof.telemetry.setup import Pipeline

# Recommended explicit bucket boundaries from the GenAI metrics semantic conventions.
REQUEST_DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]  # fmt: skip
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]


class TelemetryObserver:
    def __init__(
        self, pipeline: Pipeline, capture_content: bool = False, max_sampled_parents: int = 4096
    ) -> None:
        self.pipeline = pipeline
        self.capture_content = capture_content
        self._tracer = pipeline.tracer_provider.get_tracer("servprof", __version__)
        meter = pipeline.meter_provider.get_meter("servprof", __version__)
        self._request_duration = meter.create_histogram(
            "gen_ai.server.request.duration",
            unit="s",
            description="Generative AI server request duration: time to the last byte or output token.",
            explicit_bucket_boundaries_advisory=REQUEST_DURATION_BUCKETS,
        )
        self._time_to_first_token = meter.create_histogram(
            "gen_ai.server.time_to_first_token",
            unit="s",
            description="Time to generate first token for successful responses.",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS,
        )
        self._time_per_output_token = meter.create_histogram(
            "gen_ai.server.time_per_output_token",
            unit="s",
            description="Time per output token generated after the first token for successful responses.",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS,
        )
        self._propagator = propagate.get_global_textmap()
        # Header names the propagator reads and writes (traceparent, tracestate, baggage).
        self._propagation_headers = frozenset(
            name.lower().encode("latin-1") for name in self._propagator.fields
        )
        self._w3c_only = b"traceparent" in self._propagation_headers and self._propagation_headers <= {
            b"traceparent",
            b"tracestate",
            b"baggage",
        }
        self._direct: DirectServerSpans | None = None
        if isinstance(pipeline.tracer_provider, TracerProvider) and pipeline.span_processor is not None:
            scope = InstrumentationScope("servprof", __version__)
            self._direct = DirectServerSpans(
                pipeline.tracer_provider, pipeline.span_processor, scope, capture_content
            )
        # With no meter provider (the host set none, no metrics endpoint) nothing is recorded.
        self._metrics_on = not isinstance(pipeline.meter_provider, metrics.NoOpMeterProvider)
        self._parents = SampledParents(max_sampled_parents)
        self._analysis = AnalysisSpanEmitter(self._tracer, self._parents)
        self.requests_started = 0
        self.requests_ended = 0

    # -- per request -----------------------------------------------------------------

    def on_request_start(self, record: RequestRecord, scope: dict[str, Any]) -> tuple[Any, ...]:
        self.requests_started += 1
        headers = scope.get("headers") or []
        # An instrumentation outside servprof (opentelemetry-instrument, FastAPIInstrumentor) has
        # made this request's SERVER span and made it current: servprof's span is its INTERNAL
        # child, as nested OpenTelemetry instrumentations do (one SERVER span a request), whatever
        # the headers say (that span has read them).
        current_context = context_api.get_current()
        outer = trace.get_current_span(current_context).get_span_context()
        nested = outer.is_valid
        if self._w3c_only:
            # The default propagators: only traceparent changes (the span continues any
            # incoming tracestate and baggage unchanged), so it is formatted directly.
            kept = [header for header in headers if header[0] != b"traceparent" and header[0] != b"tracestate"]
            parent_context = None
            if nested:
                parent_context = current_context
            elif len(kept) != len(headers):
                parent_context = self._propagator.extract(self._carrier(headers))
            state = self._start(record, parent_context, nested)
            if self._direct is not None:
                trace_id, span_id, flags = state[0], state[1], 1 if state[2] else 0
                continued = state[4] is not None
            else:
                context = state[0]
                trace_id, span_id, flags = context.trace_id, context.span_id, context.trace_flags
                continued = parent_context is not None and trace.get_current_span(
                    parent_context).get_span_context().is_valid
            if nested:  # the trace state is the outer span's (it may have started a new trace)
                if outer.trace_state:
                    kept.append((b"tracestate", outer.trace_state.to_header().encode("latin-1")))
            elif continued:  # W3C: tracestate belongs to the incoming trace; a new root drops it
                kept.extend(header for header in headers if header[0] == b"tracestate")
            kept.append((b"traceparent", b"00-%032x-%016x-%02x" % (trace_id, span_id, flags)))
        else:
            kept = [header for header in headers if header[0] not in self._propagation_headers]
            if nested:
                parent_context = current_context
            else:
                parent_context = (
                    self._propagator.extract(self._carrier(headers)) if len(kept) != len(headers) else None
                )
            state = self._start(record, parent_context, nested)
            span = trace.NonRecordingSpan(self._context_of(state))
            outgoing: dict[str, str] = {}
            self._propagator.inject(outgoing, context=trace.set_span_in_context(span, parent_context))
            kept.extend((name.encode("latin-1"), value.encode("latin-1")) for name, value in outgoing.items())
        # The app (and a server under it, like vLLM) sees this span as its parent in the headers.
        # Without an outer server span, it is also the current span while the request runs (made
        # current here and restored at its end, in the same task: the middleware calls both ends
        # from its request coroutine), so that the app's own spans nest under it. Under an outer
        # instrumentation, that one's recording span stays current: an app that annotates "the
        # current span" (trace.get_current_span().set_attribute) keeps annotating the server span.
        scope["headers"] = kept
        if record.sampled:
            context = self._context_of(state)
            if context.trace_flags.sampled:
                # Kept from the start: the session's analysis can arrive before a long stream ends.
                start_ns = record.arrival_ns or time.time_ns()
                self._parents.put(record.request_id, SampledParent(context, start_ns))
        token = None
        if not nested:  # an outer instrumentation's server span stays current: the app annotates that one
            current = state[1] if self._direct is None else CurrentRequestSpan(state, record)
            token = context_api.attach(
                trace.set_span_in_context(current, current_context if parent_context is None else parent_context))
        # What the span reads of the scope (its Host header, query string), only if and when it is built.
        return (*state, attrs.connection_of(scope), token)

    def _carrier(self, headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
        return {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in headers
            if name in self._propagation_headers
        }

    def _start(self, record: RequestRecord, parent_context: Any, nested: bool) -> tuple[Any, ...]:
        """What the end needs: a deferred span's ids on servprof's own provider (see
        DirectServerSpans.start), or (span context, API span) on a host's provider, whose
        attributes are all set at the end (cheaper than twice)."""
        kind = SpanKind.INTERNAL if nested else SpanKind.SERVER
        if self._direct is not None:
            return self._direct.start(record.method, parent_context, kind)
        span = self._tracer.start_span(
            record.method, context=parent_context, kind=kind, start_time=record.arrival_ns or None
        )
        return span.get_span_context(), span

    def _context_of(self, state: tuple[Any, ...]) -> SpanContext:
        return self._direct.context_of(state) if self._direct is not None else state[0]

    def on_request_end(self, record: RequestRecord, state: Any) -> None:
        if state is None:
            return
        if state[-1] is not None:
            context_api.detach(state[-1])
        self.requests_ended += 1
        end_perf_ns = record.end_ns or record.last_byte_ns
        if end_perf_ns is not None and record.arrival_ns:
            end_ns = record.arrival_ns + (end_perf_ns - record.arrival_perf_ns)
        else:
            end_ns = time.time_ns()
        start_ns = record.arrival_ns or end_ns
        # GenAI fields are read here only when metrics need them now; otherwise the export
        # thread reads them from the body head while building the span.
        genai = (
            attrs.genai_request_attributes(
                record.method, record.path, record.request_body_head, self.capture_content
            )
            if record.request_body_head and (self._metrics_on or self._direct is None)
            else None
        )
        app = None
        if record.attributes:
            # Filtered now when read now; otherwise a copy (the app may annotate late) is
            # filtered on the export thread.
            app = (
                attrs.app_attributes(record.attributes, self.capture_content)
                if genai or self._direct is None
                else dict(record.attributes)
            )
        if self._direct is not None:
            self._direct.end(record, state, start_ns, end_ns, genai, app)
        else:
            span = state[1]
            attributes = attrs.server_span_attributes(record, state[2], genai, app)
            span.update_name(attrs.span_name(record))
            span.set_attributes(attributes)
            if attrs.ERROR_TYPE in attributes:
                span.set_status(attrs.span_status(attributes))
            span.end(end_time=end_ns)
        if genai and self._metrics_on:
            self._record_metrics(record, genai, app or {}, end_perf_ns)
        if record.sampled:
            self._parents.ended(record.request_id, end_ns)

    def _record_metrics(
        self, record: RequestRecord, genai: dict[str, Any], app: dict[str, Any], end_perf_ns: int | None
    ) -> None:
        merged = {**genai, **app}  # what the app annotated wins, as on the span
        error = merged.get(attrs.ERROR_TYPE) or attrs.error_type(record)
        metric_attributes = {
            key: merged[key] for key in (attrs.GEN_AI_OPERATION_NAME, attrs.GEN_AI_REQUEST_MODEL) if key in merged
        }
        if error:
            metric_attributes[attrs.ERROR_TYPE] = error
        if end_perf_ns is not None:
            self._request_duration.record((end_perf_ns - record.arrival_perf_ns) / 1e9, metric_attributes)
        if error or record.first_byte_ns is None:
            return
        # Only a streamed response shows when its first token left; a whole JSON body does not.
        if merged.get(attrs.GEN_AI_REQUEST_STREAM) or record.chunks > 1:
            self._time_to_first_token.record(
                (record.first_byte_ns - record.arrival_perf_ns) / 1e9, metric_attributes
            )
            output_tokens = merged.get(attrs.GEN_AI_USAGE_OUTPUT_TOKENS)
            if isinstance(output_tokens, int) and output_tokens > 1 and record.last_byte_ns is not None:
                per_token = (record.last_byte_ns - record.first_byte_ns) / 1e9 / (output_tokens - 1)
                self._time_per_output_token.record(per_token, metric_attributes)

    # -- after a session's analysis ------------------------------------------------------

    def on_analysis(self, result: dict[str, Any], records: list[RequestRecord]) -> None:
        if not isinstance(result, dict):
            self._analysis.counts.errors += 1
            return
        self._analysis.emit(result, [record.request_id for record in records if record.sampled])

    # -- status and lifecycle ------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        counts = self._analysis.counts
        return {
            **self.pipeline.status(),
            "capture_content": self.capture_content,
            "requests_started": self.requests_started,
            "requests_ended": self.requests_ended,
            "sampled_parents_kept": len(self._parents),
            "analyses": counts.analyses,
            "analysed_requests": counts.requests,
            "analysis_spans": counts.spans,
            "analysis_session_spans": counts.session_spans,
            "analysis_orphaned_requests": counts.orphaned_requests,
            "analysis_errors": counts.errors,
        }

    @property
    def dropped_spans(self) -> int | None:
        """Spans lost on the way out (failed exports and a full queue); None when the host's
        provider exports them and servprof cannot see its losses. /servprof/status shows it."""
        processor = self.pipeline.span_processor
        return processor.counts.as_dict()["spans_dropped"] if processor is not None else None

    def force_flush(self, timeout_millis: int = 5000) -> None:
        self.pipeline.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self.pipeline.shutdown()
