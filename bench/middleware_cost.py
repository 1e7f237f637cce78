"""The middleware whose cost ``bench.throughput`` measures (issue 13, point 7).

``five_no_ops()``: five middleware overriding every hook with nothing, so that the pipeline
calls each of them at every stage. ``tracing()`` (every trace recorded) and
``tracing_sampled()`` (one in ten): the OpenTelemetry middleware on an SDK
tracer provider whose spans are exported to nowhere (a no-op exporter behind the SDK's
simple processor), so the figure is what creating, ending and propagating spans costs
idembus's hot path.

The OpenTelemetry SDK's own cost per recorded span (120,000 to 190,000 instructions with
the attributes idembus gives it, some 10 µs on this machine) is part of the figure: the four
spans of a message cost about three quarters of idembus's whole work for a message on
memory:// with MemoryStorage (``python -m bench.instructions`` counts both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from idembus.context import MessageContext
from idembus.envelope import Envelope
from idembus.pipeline import Dispatch, HandlerCall, IncomingMessage, Middleware


class NoOp(Middleware):
    """Every hook, doing nothing."""

    def before_message(self, incoming: IncomingMessage) -> None:
        pass

    def after_message(self, incoming: IncomingMessage, error: BaseException | None) -> None:
        pass

    def before_handler(self, call: HandlerCall) -> None:
        pass

    def after_handler(self, call: HandlerCall, error: BaseException | None) -> None:
        pass

    def before_commit(self, call: HandlerCall) -> None:
        pass

    def after_commit(self, call: HandlerCall, error: BaseException | None) -> None:
        pass

    def outgoing(self, envelope: Envelope, origin: MessageContext | None) -> Envelope:
        return envelope

    def before_dispatch(self, dispatch: Dispatch) -> None:
        pass

    def after_dispatch(self, dispatch: Dispatch, error: BaseException | None) -> None:
        pass


def five_no_ops() -> list[Middleware]:
    return [NoOp() for _ in range(5)]


def tracing() -> list[Middleware]:
    """The tracing middleware on its own SDK provider, whose spans are handed to an
    exporter that drops them (a simple processor: no export thread competing for the
    interpreter, whose cost would be the SDK's, not idembus's). Every trace is recorded."""
    return _tracing(None)


def tracing_sampled() -> list[Middleware]:
    """The same, keeping one trace in ten (``ParentBased(TraceIdRatioBased(0.1))``, decided
    where a trace starts and followed downstream)."""
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    return _tracing(ParentBased(TraceIdRatioBased(0.1)))


def _tracing(sampler: Any) -> list[Middleware]:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import (
        SimpleSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    from idembus.observability.tracing import Tracing

    class Nowhere(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider(sampler=sampler) if sampler is not None else TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Nowhere()))
    return [Tracing(tracer_provider=provider)]


def none() -> list[Any]:
    return []
