"""idembus.tracing at a trust boundary: whoever can publish to an endpoint writes the trace
context and baggage its messages carry (issue 24, finding 9).

By default (``trust_incoming=False``) an incoming context is only *linked* from a new
trace: the endpoint's own sampler decides what is recorded, so a sender can neither force
sampling (a cost it chooses for someone else's tracing backend) nor suppress it; baggage
passes only by an allow-list, so a sender's entries are not copied onto every message the
handlers send. ``trust_incoming=True`` keeps one trace across endpoints
(tests/test_tracing.py).
"""

from __future__ import annotations

import pytest
from opentelemetry import baggage, trace
from opentelemetry.context import Context
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

from idembus.observability.tracing import Tracing
from idembus.pipeline import Pipeline
from tests.test_tracing import incoming_headers, named, one, parent_of, spans, traced_delivery

__all__ = ["spans"]  # the fixture, used by name

#: A sender's trace context, sampled ("-01") or not ("-00"), written by hand as anyone can.
FORGED_SAMPLED = f"00-{'ab' * 16}-{'cd' * 8}-01"
FORGED_UNSAMPLED = f"00-{'ab' * 16}-{'cd' * 8}-00"


def recording(sampler: object) -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler)  # type: ignore[arg-type]
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_by_default_an_incoming_context_is_linked_from_a_trace_of_the_endpoints_own(spans):
    # Before: the process span was the sender's child, in the sender's trace.
    provider, exporter = spans
    with provider.get_tracer("test").start_as_current_span("sender") as sender:
        carrier: dict[str, str] = {}
        inject(carrier)
    _, recorded = traced_delivery(Pipeline([Tracing(provider)]), incoming_headers(**carrier))

    process = one(exporter, "process accounts")
    sender_context = sender.get_span_context()
    assert process.parent is None
    assert process.context.trace_id != sender_context.trace_id
    assert [(link.context.trace_id, link.context.span_id) for link in process.links] == [
        (sender_context.trace_id, sender_context.span_id)]
    # The rest of the delivery is in the new trace, and so is what it sends
    handle = one(exporter, "handle AccountHandler")
    assert parent_of(handle) == process.context.span_id
    assert one(exporter, "send ledger").context.trace_id == process.context.trace_id
    assert recorded[0].headers["traceparent"].startswith(
        f"00-{process.context.trace_id:032x}-{handle.context.span_id:016x}-")


def test_a_sender_cannot_force_this_endpoint_to_record_a_trace():
    # An endpoint that records none of its own traces (its root sampler says no)...
    provider, exporter = recording(ParentBased(ALWAYS_OFF))
    # ... receives a message whose forged context says "sampled". Before: recorded.
    traced_delivery(Pipeline([Tracing(provider)]), incoming_headers(traceparent=FORGED_SAMPLED))
    assert exporter.get_finished_spans() == ()
    # Trusting its senders, it follows their decision
    traced_delivery(Pipeline([Tracing(provider, trust_incoming=True)]),
                    incoming_headers(traceparent=FORGED_SAMPLED))
    assert named(exporter, "process accounts")


def test_a_sender_cannot_keep_this_endpoint_from_recording_a_trace():
    # Before: a context flagged "not sampled" silenced the endpoint's tracing.
    provider, exporter = recording(ParentBased(ALWAYS_ON))
    traced_delivery(Pipeline([Tracing(provider)]),
                    incoming_headers(traceparent=FORGED_UNSAMPLED))
    process = one(exporter, "process accounts")
    assert process.parent is None and process.context.trace_flags.sampled


def sent_baggage(tracing: Tracing, entries: str) -> dict[str, str]:
    """The baggage a message sent by a handler carries, the delivery having carried
    ``entries``."""
    _, recorded = traced_delivery(Pipeline([tracing]), incoming_headers(baggage=entries))
    carried = extract(recorded[0].headers, context=Context())
    return {name: str(value) for name, value in baggage.get_all(carried).items()}


def test_incoming_baggage_reaches_sent_messages_only_by_the_allow_list(spans):
    provider, _ = spans
    entries = "tenant=acme,role=admin"
    # Before: every entry a sender wrote was copied onto every message the handlers sent
    assert sent_baggage(Tracing(provider), entries) == {}
    assert sent_baggage(Tracing(provider, baggage=("tenant",)), entries) == {"tenant": "acme"}
    assert sent_baggage(Tracing(provider, trust_incoming=True, baggage=["role"]),
                        entries) == {"role": "admin"}
    assert sent_baggage(Tracing(provider, trust_incoming=True), entries) == {
        "tenant": "acme", "role": "admin"}


def test_the_handlers_see_only_the_allowed_baggage(spans):
    provider, _ = spans
    seen: list[dict[str, object]] = []
    traced_delivery(Pipeline([Tracing(provider, baggage={"tenant"})]),
                    incoming_headers(baggage="tenant=acme,role=admin"),
                    handler=lambda call: seen.append(dict(baggage.get_all())))
    assert seen == [{"tenant": "acme"}]
    assert not trace.get_current_span().get_span_context().is_valid


def test_baggage_names_are_a_collection_not_one_string():
    with pytest.raises(TypeError, match="collection of names"):
        Tracing(baggage="tenant")
