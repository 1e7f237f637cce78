"""idembus.observability.tracing: spans by the OpenTelemetry messaging conventions, and one trace
across
endpoints, duplicates and outbox repairs.

Every test has its own TracerProvider with an in-memory exporter: no global state.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import baggage, trace
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagate import get_global_textmap, inject, set_global_textmap
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator, default_getter, default_setter
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from bench.instructions import VARIANTS, run_pipeline
from bench.throughput import main as throughput_main
from idembus import headers as h
from idembus.context import MessageContext
from idembus.envelope import Envelope
from idembus.observability.trace_propagation import HeaderCodec
from idembus.observability.tracing import Tracing
from idembus.pipeline import (
    Dispatch,
    HandlerCall,
    IncomingMessage,
    Middleware,
    Pipeline,
    RetryLater,
    SkipMessage,
)
from idembus.policies import OutboxPolicy
from idembus.storage.errors import AlreadyProcessed
from idembus.storage.postgres import PostgresStorage
from idembus.testing import wait_until_idle
from idembus.testing.faults import CrashPoint, FaultInjector, SimulatedCrash
from tests.conftest import AMQP_URL, POSTGRES_URL, require_service
from tests.support import AccountHandler, Deposit, Ledger, SignalCounter


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def one(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    found = named(exporter, name)
    assert len(found) == 1, f"{name}: {[s.name for s in exporter.get_finished_spans()]}"
    return found[0]


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def incoming_headers(message_id: str = "m-1", **extra: str) -> dict[str, str]:
    return {h.MESSAGE_ID: message_id, h.MESSAGE_TYPE: "test.Deposit",
            h.CONVERSATION_ID: "conv-1", **extra}


def outgoing_envelope(message_id: str = "out-1", destination: str | None = "ledger") -> Envelope:
    return Envelope(headers={h.MESSAGE_ID: message_id, h.MESSAGE_TYPE: "test.Deposited",
                             h.INTENT: "publish" if destination is None else "send",
                             h.CONVERSATION_ID: "conv-1", h.ORIGINATING_ENDPOINT: "accounts"},
                    body="{}", destination=destination)


def handler_call(incoming: IncomingMessage, handler: str = "AccountHandler",
                 attempt: int = 1) -> HandlerCall:
    context = MessageContext(message_id=incoming.headers[h.MESSAGE_ID],
                             message_type=incoming.headers[h.MESSAGE_TYPE],
                             headers=incoming.headers, handler_name=handler,
                             endpoint=incoming.endpoint)
    return HandlerCall(incoming=incoming, context=context,
                       message=Deposit(account="a", amount=1), attempt=attempt)


def traced_delivery(pipeline: Pipeline, headers: dict[str, str],
                    handler: Callable[[HandlerCall], Any] | None = None,
                    outcome: str = "handled",
                    outgoing: int = 1) -> tuple[IncomingMessage, list[Envelope]]:
    """One delivery through the message, handler and commit stages; the handler records
    ``outgoing`` messages (through the outgoing hooks) unless ``handler`` says otherwise;
    then the recorded messages are dispatched, as the endpoint does after the commit."""
    incoming = IncomingMessage("accounts", "accounts", headers)
    recorded: list[Envelope] = []

    def process() -> None:
        call = handler_call(incoming)

        def attempt() -> None:
            if handler is not None:
                handler(call)
            else:
                recorded.extend(pipeline.prepare(outgoing_envelope(f"out-{index + 1}"),
                                                 call.context) for index in range(outgoing))
            call.outgoing = tuple(recorded)
            pipeline.commit(call, lambda: None)

        pipeline.handler(call, attempt)
        for envelope in recorded:
            pipeline.dispatch(Dispatch(envelope, "accounts", "handler"), lambda: None)
        incoming.outcome = outcome

    pipeline.message(incoming, process)
    return incoming, recorded


# -- the span tree of one delivery --------------------------------------------------------


def test_a_delivery_makes_process_handle_commit_and_send_spans_in_one_tree(spans):
    provider, exporter = spans
    pipeline = Pipeline([Tracing(provider, trust_incoming=True)])
    tracer = provider.get_tracer("test")

    # Given a message whose sender's span is in its headers
    with tracer.start_as_current_span("sender") as sender:
        carrier: dict[str, str] = {}
        inject(carrier)
    _, recorded = traced_delivery(pipeline, incoming_headers(**carrier))

    # Then the spans form one tree under the sender's span
    process = one(exporter, "process accounts")
    handle = one(exporter, "handle AccountHandler")
    commit = one(exporter, "commit AccountHandler")
    send = one(exporter, "send ledger")
    assert not named(exporter, "create ledger")  # the handler span is the creation
    trace_id = sender.get_span_context().trace_id
    assert {span.context.trace_id for span in exporter.get_finished_spans()} == {trace_id}
    assert parent_of(process) == sender.get_span_context().span_id
    assert parent_of(handle) == process.context.span_id
    assert parent_of(commit) == handle.context.span_id
    assert parent_of(send) == handle.context.span_id

    # With the kinds and attributes of the messaging conventions
    assert (process.kind, handle.kind, commit.kind, send.kind) == (
        SpanKind.CONSUMER, SpanKind.INTERNAL, SpanKind.INTERNAL, SpanKind.PRODUCER)
    assert process.attributes is not None and dict(process.attributes) == {
        "messaging.system": "idembus", "messaging.operation.type": "process",
        "messaging.operation.name": "process", "messaging.destination.name": "accounts",
        "messaging.message.id": "m-1", "messaging.message.conversation_id": "conv-1",
        "idembus.message_type": "test.Deposit", "idembus.endpoint": "accounts",
        "idembus.outcome": "handled"}
    assert handle.attributes is not None
    assert handle.attributes["idembus.handler"] == "AccountHandler"
    assert handle.attributes["idembus.duplicate"] is False
    assert handle.attributes["idembus.attempt"] == 1
    assert handle.attributes["idembus.outgoing"] == 1
    assert handle.attributes["messaging.message.id"] == "m-1"
    assert handle.attributes["messaging.message.conversation_id"] == "conv-1"
    assert send.attributes is not None
    assert send.attributes["messaging.operation.type"] == "send"
    assert send.attributes["messaging.operation.name"] == "send"
    assert send.attributes["messaging.destination.name"] == "ledger"
    assert send.attributes["idembus.redispatched"] is False
    assert send.attributes["idembus.dispatch.source"] == "handler"
    for span in exporter.get_finished_spans():
        assert span.status.status_code is StatusCode.UNSET, span.name

    # And the message carries the handler span's context, stored with it
    traceparent = recorded[0].headers["traceparent"]
    assert traceparent.startswith(f"00-{trace_id:032x}-{handle.context.span_id:016x}-")


def test_stages_leave_the_current_context_as_they_found_it(spans):
    provider, _ = spans
    before = otel_context.get_current()
    traced_delivery(Pipeline([Tracing(provider)]), incoming_headers())
    assert otel_context.get_current() == before
    assert not trace.get_current_span().get_span_context().is_valid


def test_a_message_without_trace_context_starts_a_trace(spans):
    provider, exporter = spans
    traced_delivery(Pipeline([Tracing(provider)]), incoming_headers())
    process = one(exporter, "process accounts")
    assert process.parent is None
    assert one(exporter, "send ledger").context.trace_id == process.context.trace_id


def test_a_published_event_is_named_by_its_type_and_operation(spans):
    provider, exporter = spans
    pipeline = Pipeline([Tracing(provider)])
    envelope = pipeline.prepare(outgoing_envelope(destination=None), None)
    pipeline.dispatch(Dispatch(envelope, "accounts", "bus"), lambda: None)
    create = one(exporter, "create test.Deposited")
    publish = one(exporter, "publish test.Deposited")
    assert create.parent is None  # nothing was current: the message starts a trace
    assert parent_of(publish) == create.context.span_id
    assert publish.attributes is not None
    assert publish.attributes["messaging.operation.name"] == "publish"
    assert publish.attributes["messaging.destination.name"] == "test.Deposited"


# -- traces the sampler leaves out cost next to nothing ------------------------------------


def test_a_message_of_a_trace_not_sampled_makes_no_spans_and_passes_the_decision_on(spans):
    provider, exporter = spans
    pipeline = Pipeline([Tracing(provider, trust_incoming=True)])
    unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    _, recorded = traced_delivery(pipeline, incoming_headers(traceparent=unsampled))
    for envelope in recorded:
        pipeline.dispatch(Dispatch(envelope, "accounts", "outbox"), lambda: None)
    assert exporter.get_finished_spans() == ()
    # the message it sent carries the same trace, still not sampled
    assert recorded[0].headers["traceparent"].startswith(
        "00-0af7651916cd43dd8448eb211c80319c-")
    assert recorded[0].headers["traceparent"].endswith("-00")
    assert not trace.get_current_span().get_span_context().is_valid


def test_a_trace_the_sampler_drops_at_the_root_makes_no_spans_downstream() -> None:
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    pipeline = Pipeline([Tracing(provider)])
    _, recorded = traced_delivery(pipeline, incoming_headers())
    assert exporter.get_finished_spans() == ()
    flags = int(recorded[0].headers["traceparent"].rsplit("-", 1)[1], 16)
    assert flags & 1 == 0  # not sampled: receivers record nothing either


# -- sending again continues the creator's trace ------------------------------------------


def test_a_redispatch_and_an_outbox_repair_continue_the_trace_of_the_creating_handler(spans):
    provider, exporter = spans
    pipeline = Pipeline([Tracing(provider)])
    _, recorded = traced_delivery(pipeline, incoming_headers())
    create = one(exporter, "handle AccountHandler")  # the span that created the message
    stored = recorded[0]

    # When a duplicate delivery (a trace of its own) sends the stored message again
    duplicate = IncomingMessage("accounts", "accounts", incoming_headers())

    def redispatch() -> None:
        pipeline.dispatch(Dispatch(stored, "accounts", "redispatch"), lambda: None)

    pipeline.message(duplicate, redispatch)
    # And the outbox repairs it from its own thread, with no current span
    pipeline.dispatch(Dispatch(stored, "accounts", "outbox"), lambda: None)

    # Then every send is a child of the creating handler's span, in its trace
    sends = named(exporter, "send ledger")
    assert [span.attributes["idembus.dispatch.source"] for span in sends  # type: ignore[index]
            ] == ["handler", "redispatch", "outbox"]
    for send in sends:
        assert parent_of(send) == create.context.span_id
        assert send.context.trace_id == create.context.trace_id
    assert [span.attributes["idembus.redispatched"] for span in sends  # type: ignore[index]
            ] == [False, True, True]
    # And the redispatch links to the delivery that caused it
    duplicate_process = named(exporter, "process accounts")[1]
    assert [link.context.span_id for link in sends[1].links] == [
        duplicate_process.context.span_id]
    assert not sends[2].links


def test_a_message_that_carries_a_trace_context_keeps_it(spans):
    provider, exporter = spans
    pipeline = Pipeline([Tracing(provider)])
    custom = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    envelope = outgoing_envelope().with_headers({"traceparent": custom})
    assert pipeline.prepare(envelope, None) == envelope
    assert not exporter.get_finished_spans()


# -- errors and outcomes -------------------------------------------------------------------


def test_a_failing_handler_is_an_error_on_its_span_and_on_the_delivery_s(spans):
    provider, exporter = spans
    pipeline = Pipeline([Tracing(provider)])

    def fail(call: HandlerCall) -> None:
        raise LookupError("no such account; amqp://shop:s3cret@broker:5672// was asked")

    with pytest.raises(LookupError):
        traced_delivery(pipeline, incoming_headers(), handler=fail)
    for name in ("handle AccountHandler", "process accounts"):
        span = one(exporter, name)
        assert span.status.status_code is StatusCode.ERROR
        assert span.attributes is not None
        assert span.attributes["error.type"] == "builtins.LookupError"
        [event] = span.events
        assert event.name == "exception"
        assert event.attributes is not None
        assert "s3cret" not in str(event.attributes["exception.message"])
        assert "s3cret" not in str(event.attributes["exception.stacktrace"])
        assert "s3cret" not in (span.status.description or "")


def test_a_duplicate_is_not_an_error(spans):
    provider, exporter = spans
    pipeline = Pipeline([Tracing(provider)])

    def found_processed(call: HandlerCall) -> None:
        call.duplicate = True

    traced_delivery(pipeline, incoming_headers(), handler=found_processed)
    handle = one(exporter, "handle AccountHandler")
    assert handle.attributes is not None and handle.attributes["idembus.duplicate"] is True
    assert handle.status.status_code is StatusCode.UNSET


def test_a_commit_that_finds_the_message_processed_is_a_duplicate_not_an_error(spans):
    provider, exporter = spans
    pipeline = Pipeline([Tracing(provider)])
    incoming = IncomingMessage("accounts", "accounts", incoming_headers())
    call = handler_call(incoming)

    def raced() -> None:
        raise AlreadyProcessed("committed meanwhile", outgoing=())

    with pytest.raises(AlreadyProcessed):
        pipeline.commit(call, raced)
    commit = one(exporter, "commit AccountHandler")
    assert commit.status.status_code is StatusCode.UNSET
    assert commit.attributes is not None and commit.attributes["idembus.duplicate"] is True


@pytest.mark.parametrize("control, outcome", [(SkipMessage("not ours"), "skipped"),
                                              (RetryLater(5), "retry_later")])
def test_steering_a_message_is_not_an_error(spans, control, outcome):
    provider, exporter = spans
    pipeline = Pipeline([Tracing(provider)])
    incoming = IncomingMessage("accounts", "accounts", incoming_headers())

    def steer() -> None:
        raise control

    with pytest.raises(type(control)):
        pipeline.message(incoming, steer)
    process = one(exporter, "process accounts")
    assert process.status.status_code is StatusCode.UNSET
    assert process.attributes is not None and process.attributes["idembus.outcome"] == outcome


def test_a_dead_lettered_message_is_an_error_on_its_delivery(spans):
    provider, exporter = spans
    traced_delivery(Pipeline([Tracing(provider)]), incoming_headers(), outcome="dead_lettered",
                    handler=lambda call: None)
    process = one(exporter, "process accounts")
    assert process.status.status_code is StatusCode.ERROR
    assert process.attributes is not None
    assert process.attributes["idembus.outcome"] == "dead_lettered"


def test_importing_idembus_imports_no_opentelemetry():
    code = ("import sys, idembus, idembus.pipeline; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"


def test_spans_a_crash_leaves_open_end_with_the_delivery(spans):
    # Given tracing outside a fault injector that "kills the process" after the handler
    provider, exporter = spans

    class DiesAfterHandler(Middleware):
        def after_handler(self, call: HandlerCall, error: BaseException | None) -> None:
            raise SimulatedCrash("died after the commit")

    pipeline = Pipeline([Tracing(provider), DiesAfterHandler()])
    before = otel_context.get_current()

    # When the crash skips the tracing's own after_handler
    with pytest.raises(SimulatedCrash):
        traced_delivery(pipeline, incoming_headers())

    # Then the handler span still ends, with the delivery, marked by the crash
    handle = one(exporter, "handle AccountHandler")
    process = one(exporter, "process accounts")
    assert parent_of(handle) == process.context.span_id
    for span in (handle, process):
        assert span.status.status_code is StatusCode.ERROR
        assert span.attributes is not None
        assert span.attributes["error.type"] == "idembus.testing.faults.SimulatedCrash"
    assert otel_context.get_current() == before


# -- end to end: two endpoints on RabbitMQ and PostgreSQL ---------------------------------


class Deliveries(Middleware):
    """Keeps the headers of every delivery an endpoint receives."""

    def __init__(self) -> None:
        self.headers: list[Mapping[str, str]] = []

    def before_message(self, incoming: IncomingMessage) -> None:
        self.headers.append(dict(incoming.headers))


class CrashOnceAfterCommit(FaultInjector):
    """The first message dies after its commit, before anything is sent."""

    def __init__(self) -> None:
        self.crashed = threading.Event()

    def reached(self, point: CrashPoint, message_id: str) -> None:
        if point is CrashPoint.AFTER_COMMIT and not self.crashed.is_set():
            self.crashed.set()
            raise SimulatedCrash(f"simulated crash after the commit of {message_id}")


@pytest.fixture
def postgres_storage(unique: str) -> Iterator[Callable[[str], PostgresStorage]]:
    """PostgreSQL storages with tables of this test's own, dropped afterwards."""
    require_service(POSTGRES_URL, "PostgreSQL")
    created: list[PostgresStorage] = []

    def make(name: str) -> PostgresStorage:
        storage = PostgresStorage(POSTGRES_URL, table_prefix=f"t{unique}_{name}")
        storage.verify()
        created.append(storage)
        return storage

    yield make
    for storage in created:
        storage.drop_tables()
        storage.close()


ON_RABBITMQ = pytest.mark.parametrize(
    "transport_url", [pytest.param(AMQP_URL, id="amqp", marks=pytest.mark.amqp)],
    indirect=True)


def span_tree(exporter: InMemorySpanExporter) -> tuple[dict[int, ReadableSpan], list[str]]:
    """The finished spans by span id, and each as ``name <- parent name`` (for messages)."""
    finished = exporter.get_finished_spans()
    by_id = {span.context.span_id: span for span in finished}
    lines = []
    for span in finished:
        parent = by_id.get(parent_of(span) or 0)
        lines.append(f"{span.name} <- {parent.name if parent is not None else None}")
    return by_id, lines


def ancestors(span: ReadableSpan, by_id: dict[int, ReadableSpan]) -> list[ReadableSpan]:
    found = []
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        found.append(span)
    return found


def attribute(span: ReadableSpan, name: str) -> Any:
    assert span.attributes is not None
    return span.attributes.get(name)


@pytest.mark.postgres
@ON_RABBITMQ
def test_one_trace_across_two_endpoints_and_a_duplicate_delivery(
    spans, make_endpoint, postgres_storage,
):
    # Given accounts (which keeps what it sent, to send it again) and a ledger, traced
    provider, exporter = spans
    tracing = Tracing(provider, trust_incoming=True)
    deliveries = Deliveries()
    ledger = Ledger()
    accounts = make_endpoint("accounts", handlers=[AccountHandler],
                             storage=postgres_storage("accounts"),
                             middleware=[deliveries, tracing],
                             outbox=OutboxPolicy(compact_after_dispatch=False))
    downstream = make_endpoint("ledger", handlers=[ledger], storage=postgres_storage("ledger"),
                               middleware=[tracing])
    handled = SignalCounter(downstream, "handled")
    duplicates = SignalCounter(downstream, "duplicate")
    accounts.start()
    downstream.start()

    # When a client sends a deposit inside its span, and the ledger records the event
    with provider.get_tracer("test").start_as_current_span("client") as client:
        deposit = Deposit(account="a", amount=5)
        accounts.bus.send(deposit)
    assert handled.wait_for(1)
    wait_until_idle([accounts, downstream])

    # Then one trace: client <- process accounts <- handle <- process ledger, and each send
    # under the span that created its message
    by_id, lines = span_tree(exporter)
    trace_id = client.get_span_context().trace_id
    assert {span.context.trace_id for span in by_id.values()} == {trace_id}, lines
    command = accounts.name
    send_command = one(exporter, f"send {command}")
    process_accounts = one(exporter, f"process {command}")
    handle_accounts = one(exporter, "handle AccountHandler")
    commit_accounts = one(exporter, "commit AccountHandler")
    publish_event = one(exporter, "publish test.Deposited")
    process_ledger = one(exporter, f"process {downstream.name}")
    handle_ledger = one(exporter, "handle Ledger")
    create_command = client.get_span_context()  # the client's span created the command
    assert not named(exporter, "create test.Deposited")
    assert parent_of(send_command) == create_command.span_id
    assert parent_of(process_accounts) == create_command.span_id
    assert parent_of(handle_accounts) == process_accounts.context.span_id
    assert parent_of(commit_accounts) == handle_accounts.context.span_id
    create_event = handle_accounts  # the handler's span created the event
    assert parent_of(publish_event) == create_event.context.span_id
    assert parent_of(process_ledger) == create_event.context.span_id
    assert parent_of(handle_ledger) == process_ledger.context.span_id
    assert attribute(process_accounts, "messaging.system") == "rabbitmq"
    assert attribute(handle_accounts, "idembus.duplicate") is False
    assert attribute(process_ledger, "messaging.message.id") == attribute(
        publish_event, "messaging.message.id")
    assert attribute(process_ledger, "messaging.message.conversation_id") == attribute(
        process_accounts, "messaging.message.id")
    # And the trace context went on the wire as W3C traceparent
    [original] = deliveries.headers
    assert original["traceparent"].startswith(
        f"00-{trace_id:032x}-{create_command.span_id:016x}-")

    # When the broker delivers the same deposit again (same bytes, same id)
    exporter.clear()
    accounts.transport.dispatch(Envelope(headers=original, body=deposit.model_dump_json(),
                                         destination=accounts.name))
    assert duplicates.wait_for(1)
    wait_until_idle([accounts, downstream])

    # Then the duplicate's spans are in the same trace: its handler span says duplicate,
    # and the redispatch continues under the handler span of the first handling
    by_id, lines = span_tree(exporter)
    assert {span.context.trace_id for span in by_id.values()} == {trace_id}, lines
    again = one(exporter, f"process {command}")
    assert parent_of(again) == create_command.span_id
    duplicate = one(exporter, "handle AccountHandler")
    assert parent_of(duplicate) == again.context.span_id
    assert attribute(duplicate, "idembus.duplicate") is True
    assert duplicate.status.status_code is StatusCode.UNSET
    redispatch = one(exporter, "publish test.Deposited")
    assert parent_of(redispatch) == create_event.context.span_id
    assert attribute(redispatch, "idembus.redispatched") is True
    assert attribute(redispatch, "idembus.dispatch.source") == "redispatch"
    assert [link.context.span_id for link in redispatch.links] == [again.context.span_id]
    # And the ledger's copy of the event, a duplicate there, is a child of the same span
    ledger_again = one(exporter, f"process {downstream.name}")
    assert parent_of(ledger_again) == create_event.context.span_id
    assert attribute(one(exporter, "handle Ledger"), "idembus.duplicate") is True
    assert len(ledger.entries) == 1


@pytest.mark.postgres
@ON_RABBITMQ
def test_an_outbox_repair_after_a_crash_continues_the_trace_of_the_creating_handler(
    spans, make_endpoint, postgres_storage,
):
    # Given accounts that die once between commit and dispatch, and whose duplicates leave
    # a fresh entry to the outbox (which repairs after 0.2 s); and a ledger; all traced
    provider, exporter = spans
    tracing = Tracing(provider, trust_incoming=True)
    crash = CrashOnceAfterCommit()
    ledger = Ledger()
    accounts = make_endpoint("accounts", handlers=[AccountHandler],
                             storage=postgres_storage("accounts"),
                             middleware=[tracing, crash],
                             outbox=OutboxPolicy(defer_fresh_redispatch=60, grace=0.2))
    downstream = make_endpoint("ledger", handlers=[ledger], storage=postgres_storage("ledger"),
                               middleware=[tracing])
    handled = SignalCounter(downstream, "handled")
    accounts.start()
    downstream.start()

    # When a deposit is handled, committed, the process "dies", the broker redelivers, the
    # duplicate leaves the event to the outbox, and the outbox sends it
    with provider.get_tracer("test").start_as_current_span("client") as client:
        accounts.bus.send(Deposit(account="a", amount=5))
    assert handled.wait_for(1)
    wait_until_idle([accounts, downstream])
    assert crash.crashed.is_set()
    assert accounts.counters["left_to_outbox"] == 1

    # Then it is all one trace
    by_id, lines = span_tree(exporter)
    trace_id = client.get_span_context().trace_id
    assert {span.context.trace_id for span in by_id.values()} == {trace_id}, lines
    # And the outbox's send and the ledger's process span descend from the first handler
    # span, the one that created the event, not from the duplicate's
    first, second = sorted(named(exporter, "handle AccountHandler"),
                           key=lambda span: span.start_time or 0)
    assert attribute(first, "idembus.duplicate") is not True
    assert first.status.status_code is StatusCode.ERROR  # the process died after it
    assert attribute(second, "idembus.duplicate") is True
    create_event = first  # the handler span that created the event
    repair = one(exporter, "publish test.Deposited")
    assert attribute(repair, "idembus.dispatch.source") == "outbox"
    assert attribute(repair, "idembus.redispatched") is True
    assert parent_of(repair) == create_event.context.span_id
    process_ledger = one(exporter, f"process {downstream.name}")
    assert first in ancestors(process_ledger, by_id)
    assert parent_of(process_ledger) == create_event.context.span_id
    # And both deliveries of the deposit continue the client's trace
    deliveries = named(exporter, f"process {accounts.name}")
    assert len(deliveries) == 2
    assert {parent_of(process) for process in deliveries} == {
        client.get_span_context().span_id}
    assert {parent_of(first), parent_of(second)} == {span.context.span_id
                                                     for span in deliveries}
    assert [entry[1:] for entry in ledger.entries] == [("a", 5)]


# -- what tracing costs: reading and writing the trace context once ------------------------


class CountingPropagator(CompositePropagator):
    """W3C trace context through a propagator idembus does not take for the default one
    (a subclass), counting what it is asked to read and write."""

    def __init__(self) -> None:
        super().__init__([TraceContextTextMapPropagator()])
        self.extracted = 0
        self.injected = 0

    def extract(self, carrier: Any, context: Any = None, getter: Any = default_getter) -> Any:
        self.extracted += 1
        return super().extract(carrier, context, getter)

    def inject(self, carrier: Any, context: Any = None, setter: Any = default_setter) -> None:
        self.injected += 1
        super().inject(carrier, context, setter)


def test_a_delivery_reads_its_trace_context_once_and_writes_it_once_per_span(spans):
    # Given tracing through a propagator that counts
    provider, exporter = spans
    propagator = CountingPropagator()
    pipeline = Pipeline([Tracing(provider, propagator=propagator)])
    sender = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

    # When a handler records two messages, which are dispatched after its commit
    _, recorded = traced_delivery(pipeline, incoming_headers(traceparent=sender), outgoing=2)

    # Then the headers were read once (the delivery's) and written once (the handler span's)
    assert (propagator.extracted, propagator.injected) == (1, 1)
    handle = one(exporter, "handle AccountHandler")
    sends = named(exporter, "send ledger")
    assert len(sends) == 2
    assert {parent_of(send) for send in sends} == {handle.context.span_id}
    assert recorded[0].headers["traceparent"] == recorded[1].headers["traceparent"]


def test_an_unsampled_delivery_passes_its_traceparent_on_unchanged(spans):
    provider, exporter = spans
    pipeline = Pipeline([Tracing(provider, trust_incoming=True)])
    unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    _, recorded = traced_delivery(pipeline, incoming_headers(traceparent=unsampled),
                                  outgoing=2)
    assert [envelope.headers["traceparent"] for envelope in recorded] == [unsampled] * 2
    assert exporter.get_finished_spans() == ()


def test_a_commit_span_says_only_what_its_parent_does_not(spans):
    provider, exporter = spans
    traced_delivery(Pipeline([Tracing(provider)]), incoming_headers())
    commit = one(exporter, "commit AccountHandler")
    # the handler, the attempt, the message and what it recorded are the handle span's
    assert commit.attributes is not None and dict(commit.attributes) == {}
    handle = one(exporter, "handle AccountHandler")
    assert parent_of(commit) == handle.context.span_id


def test_traced_deliveries_leave_no_reference_cycles_behind(spans):
    # Given tracing, warmed up, and the garbage collector off
    provider, _ = spans
    pipeline = Pipeline([Tracing(provider)])
    unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    traced_delivery(pipeline, incoming_headers())
    gc.collect()
    gc.disable()
    try:
        # When deliveries are traced, recorded and unrecorded ones
        for index in range(20):
            traced_delivery(pipeline, incoming_headers(f"m-{index}"))
            traced_delivery(pipeline, incoming_headers(f"u-{index}", traceparent=unsampled))
        # Then reference counting freed everything: nothing is left for the collector
        assert gc.collect() == 0
    finally:
        gc.enable()


class KeyValuePropagator(TextMapPropagator):
    """Not W3C: the trace context in one header, ``x-trace: <trace id>/<span id>/<flags>``."""

    def extract(self, carrier: Any, context: Any = None, getter: Any = default_getter) -> Any:
        found = getter.get(carrier, "x-trace")
        if not found:
            return context if context is not None else otel_context.Context()
        trace_id, span_id, flags = (int(part, 16) for part in found[0].split("/"))
        remote = trace.SpanContext(trace_id, span_id, is_remote=True,
                                   trace_flags=trace.TraceFlags(flags))
        return trace.set_span_in_context(trace.NonRecordingSpan(remote), context)

    def inject(self, carrier: Any, context: Any = None, setter: Any = default_setter) -> None:
        span_context = trace.get_current_span(context).get_span_context()
        if span_context.is_valid:
            setter.set(carrier, "x-trace", f"{span_context.trace_id:x}/"
                                           f"{span_context.span_id:x}/{span_context.trace_flags:x}")

    @property
    def fields(self) -> set[str]:
        return {"x-trace"}


@pytest.fixture
def global_propagator() -> Iterator[None]:
    """Puts back the global propagator a test replaces."""
    before = get_global_textmap()
    yield
    set_global_textmap(before)


def test_a_global_propagator_set_later_is_used_from_the_next_message_on(
    spans, global_propagator,
):
    # Given tracing made while the global propagator is the default W3C one
    provider, exporter = spans
    pipeline = Pipeline([Tracing(provider, trust_incoming=True)])
    _, first = traced_delivery(pipeline, incoming_headers("m-1"))
    assert "traceparent" in first[0].headers

    # When the application installs another propagator
    set_global_textmap(KeyValuePropagator())
    _, second = traced_delivery(pipeline, incoming_headers("m-2"))

    # Then the next message carries its header, and the message it carries continues there
    assert "traceparent" not in second[0].headers
    handle = named(exporter, "handle AccountHandler")[-1]
    trace_id, span_id, _ = second[0].headers["x-trace"].split("/")
    assert (int(trace_id, 16), int(span_id, 16)) == (handle.context.trace_id,
                                                     handle.context.span_id)
    exporter.clear()
    traced_delivery(pipeline, incoming_headers("m-3", **{"x-trace": second[0].headers[
        "x-trace"]}))
    assert parent_of(one(exporter, "process accounts")) == handle.context.span_id


# -- the W3C fast path: the default propagator's own result -------------------------------

_HEX = "0123456789abcdef"
hex_digits = st.text(alphabet=_HEX, min_size=0, max_size=34)
traceparents = st.one_of(
    # well formed, the ids now and then all zeros
    st.builds(lambda version, trace_id, span_id, flags: f"{version}-{trace_id}-{span_id}-{flags}",
              st.sampled_from(["00", "00", "00", "01", "ff", "0g"]),
              st.one_of(st.text(alphabet=_HEX, min_size=32, max_size=32), st.just("0" * 32)),
              st.one_of(st.text(alphabet=_HEX, min_size=16, max_size=16), st.just("0" * 16)),
              st.text(alphabet=_HEX, min_size=2, max_size=2)),
    # and bent: other lengths, upper case, white space, a suffix, anything at all
    st.builds(lambda version, trace_id, span_id, flags: f"{version}-{trace_id}-{span_id}-{flags}",
              st.sampled_from(["00", "01"]), hex_digits, hex_digits, hex_digits),
    st.builds(lambda text, bend: bend(text),
              st.text(alphabet=_HEX, min_size=32, max_size=32).map(
                  lambda ids: f"00-{ids}-{ids[:16]}-01"),
              st.sampled_from([str.upper, lambda t: f" {t}", lambda t: f"{t}\t",
                               lambda t: f"{t}-extra", lambda t: f"{t}\n"])),
    st.text(max_size=60),
)
tracestates = st.one_of(st.none(), st.sampled_from(["vendor=value", "a=1,b=2", "bad state"]))
baggages = st.one_of(st.none(), st.sampled_from(["tenant=acme", "a=1,b=2"]))


def span_contexts_of(context: otel_context.Context) -> tuple[Any, dict[str, object]]:
    return trace.get_current_span(context).get_span_context(), dict(baggage.get_all(context))


@settings(max_examples=300, deadline=None)
@given(traceparent=st.one_of(st.none(), traceparents), tracestate=tracestates,
       baggage_header=baggages)
def test_the_w3c_fast_path_reads_what_the_default_propagator_reads(
    traceparent: str | None, tracestate: str | None, baggage_header: str | None,
) -> None:
    propagator = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
    codec = HeaderCodec.of(propagator)
    assert codec.w3c
    headers = {name: value for name, value in (("traceparent", traceparent),
                                               ("tracestate", tracestate),
                                               ("baggage", baggage_header))
               if value is not None}

    context, carrier = codec.read(headers)

    assert span_contexts_of(context) == span_contexts_of(propagator.extract(headers))
    if carrier is not None:  # what the headers carry is exactly what would be written
        written: dict[str, str] = {}
        propagator.inject(written, context=context)
        assert carrier == written


@settings(max_examples=200, deadline=None)
@given(trace_id=st.integers(1, 2**128 - 1), span_id=st.integers(1, 2**64 - 1),
       flags=st.integers(0, 255))
def test_the_w3c_fast_path_reads_a_plain_traceparent_itself_and_knows_its_headers(
    trace_id: int, span_id: int, flags: int,
) -> None:
    propagator = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
    traceparent = f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"

    context, carrier = HeaderCodec.of(propagator).read({"traceparent": traceparent})

    assert carrier == {"traceparent": traceparent}  # the fast path read it
    assert span_contexts_of(context) == span_contexts_of(
        propagator.extract({"traceparent": traceparent}))


@settings(max_examples=200, deadline=None)
@given(trace_id=st.integers(1, 2**128 - 1), span_id=st.integers(1, 2**64 - 1),
       flags=st.integers(0, 255), tracestate=tracestates, baggage_header=baggages)
def test_the_w3c_fast_path_writes_what_the_default_propagator_writes(
    trace_id: int, span_id: int, flags: int, tracestate: str | None,
    baggage_header: str | None,
) -> None:
    propagator = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
    codec = HeaderCodec.of(propagator)
    state = TraceState.from_header([tracestate]) if tracestate else None
    span = trace.NonRecordingSpan(trace.SpanContext(
        trace_id, span_id, is_remote=False, trace_flags=trace.TraceFlags(flags),
        trace_state=state))
    context = trace.set_span_in_context(span)
    if baggage_header:
        for item in baggage_header.split(","):
            name, value = item.split("=")
            context = baggage.set_baggage(name, value, context)

    written: dict[str, str] = {}
    propagator.inject(written, context=context)

    assert codec.inject(span, context) == written


@pytest.mark.parametrize("propagator, fast", [
    (CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()]), True),
    (TraceContextTextMapPropagator(), True),
    (CompositePropagator([W3CBaggagePropagator(), TraceContextTextMapPropagator()]), False),
    (CompositePropagator([TraceContextTextMapPropagator(), KeyValuePropagator()]), False),
    (CountingPropagator(), False),
    (KeyValuePropagator(), False),
])
def test_the_fast_path_is_taken_for_w3c_propagators_only(propagator, fast):
    assert HeaderCodec.of(propagator).w3c is fast


# -- the benchmarks of what tracing costs --------------------------------------------------


@pytest.mark.postgres
def test_the_throughput_benchmark_measures_middleware_on_postgres_at_a_reduced_size(
    tmp_path: Any, capsys: pytest.CaptureFixture[str],
) -> None:
    require_service(POSTGRES_URL, "PostgreSQL")
    assert throughput_main(["--transports", "memory", "--storages", "postgres",
                            "--messages", "10", "--rounds", "1",
                            "--json", str(tmp_path / "throughput.json")]) == 0

    (line,) = [text for text in capsys.readouterr().out.splitlines()
               if text.startswith("bench: ")]
    fields = dict(field.split("=") for field in line.removeprefix("bench: ").split())
    assert float(fields["memory_idembus_postgresstorage"]) > 0
    for cost in ("5_noop_middleware", "tracing", "tracing_sampled"):
        assert float(fields[f"memory_postgres_{cost}_vs_none"]) > 0
        assert fields[f"memory_{cost}_vs_none"] == "n/a"  # MemoryStorage was not measured


@pytest.mark.parametrize("variant", VARIANTS["pipeline"])
def test_each_pipeline_variant_counted_for_instructions_runs_and_leaves_no_span_open(variant):
    run_pipeline(variant, 3)  # what callgrind counts: it must run, and leave no span open
    assert not trace.get_current_span().get_span_context().is_valid
