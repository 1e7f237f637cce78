"""The trace context of a message in its headers, for :mod:`idembus.observability.tracing`.

A :class:`HeaderCodec` reads (extracts) and writes (injects) a trace context through one
OpenTelemetry ``TextMapPropagator``, and knows the header names it writes (a composite
propagator builds that set anew at every call, so it is kept here).

When the propagator is OpenTelemetry's default — W3C trace context, with or without W3C
baggage, as ``opentelemetry.propagate`` builds it when ``OTEL_PROPAGATORS`` is unset or
``tracecontext,baggage`` — the common case is read and written here, in about half the
steps the propagator takes: a well-formed version ``00`` ``traceparent`` with neither
``tracestate`` nor ``baggage`` beside it is parsed with one expression, and a span's context
is written as ``traceparent`` (and ``tracestate``) straight from its ids. The result is the
propagator's own, by construction: whatever the fast path does not recognise exactly
(another version, stray white space, an all-zero id, a ``tracestate`` or ``baggage``
header, baggage in the context, a value that is not a string) goes to the propagator.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import baggage, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
BAGGAGE = "baggage"

#: The only ``traceparent`` the fast path reads: version 00, lower-case hex, nothing else.
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


@dataclass(frozen=True)
class HeaderCodec:
    """Trace context in and out of message headers through ``propagator``; build one
    with :meth:`of`."""

    propagator: TextMapPropagator
    #: The header names the propagator writes.
    fields: frozenset[str]
    #: The propagator is W3C trace context (and baggage) only: the fast path applies.
    w3c: bool = False

    @classmethod
    def of(cls, propagator: TextMapPropagator) -> HeaderCodec:
        return cls(propagator, frozenset(propagator.fields), _is_w3c(propagator))

    def extract(self, headers: Mapping[str, str]) -> Context:
        """The context ``headers`` carry (a fresh one: nothing of the current context)."""
        return self.read(headers)[0]

    def read(self, headers: Mapping[str, str]) -> tuple[Context, dict[str, str] | None]:
        """The context ``headers`` carry, and the headers :meth:`inject` would write for
        it when that is known without writing them (the fast path read exactly those;
        ``None`` otherwise)."""
        if self.w3c and TRACESTATE not in headers and BAGGAGE not in headers:
            value = headers.get(TRACEPARENT)
            if value is None:
                return Context(), None
            match = _TRACEPARENT.fullmatch(value) if isinstance(value, str) else None
            if match is not None:
                trace_id, span_id, flags = match.groups()
                ids = int(trace_id, 16), int(span_id, 16)
                if ids[0] and ids[1]:
                    return trace.set_span_in_context(NonRecordingSpan(SpanContext(
                        ids[0], ids[1], is_remote=True,
                        trace_flags=TraceFlags(int(flags, 16)))), Context()), {
                            TRACEPARENT: value}
        return self.propagator.extract(headers), None

    def inject(self, span: Span, context: Context) -> dict[str, str]:
        """The headers that carry ``context``, whose current span is ``span`` (valid)."""
        if self.w3c and not baggage.get_all(context):
            span_context = span.get_span_context()
            carrier = {TRACEPARENT: f"00-{span_context.trace_id:032x}-"
                                    f"{span_context.span_id:016x}-"
                                    f"{span_context.trace_flags:02x}"}
            if span_context.trace_state:
                carrier[TRACESTATE] = span_context.trace_state.to_header()
            return carrier
        carrier = {}
        self.propagator.inject(carrier, context=context)
        return carrier

    def carries_context(self, headers: Mapping[str, str]) -> bool:
        """Whether ``headers`` already carry a trace context (with a valid span)."""
        for name in self.fields:
            if name in headers:
                return trace.get_current_span(self.extract(headers)).get_span_context(
                ).is_valid
        return False


def _is_w3c(propagator: TextMapPropagator) -> bool:
    """W3C trace context, alone or followed by W3C baggage, and nothing else (exact types:
    a subclass may read and write differently)."""
    if type(propagator) is TraceContextTextMapPropagator:
        return True
    if type(propagator) is not CompositePropagator:
        return False
    members = getattr(propagator, "_propagators", None)  # not public: absent, no fast path
    if not isinstance(members, list | tuple):
        return False
    kinds = [type(member) for member in members]
    return kinds in ([TraceContextTextMapPropagator],
                     [TraceContextTextMapPropagator, W3CBaggagePropagator])
