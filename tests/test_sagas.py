"""Sagas on memory:// and MemoryStorage: what starts one (``starts``), what finds none
(``saga_not_found``), ``complete()`` and its tombstone (no resurrection by a late message,
the rebus#1136 trap), timeouts of completed sagas, registration errors, async handlers and
units of work."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from pydantic import BaseModel

from idembus import Command, Endpoint, OutboxPolicy, RejectMessage, message_name
from idembus import headers as h
from idembus.envelope import Envelope
from idembus.errors import HandlerContractError
from idembus.handlers import AggregateHandler, handles
from idembus.handlers.errors import HandlerDefinitionError
from idembus.observability.metrics import Metrics
from idembus.storage.errors import AlreadyProcessed
from idembus.storage.memory import MemoryStorage
from idembus.testing import handle, wait_until_idle
from tests.saga_orders import (
    CloseOrder,
    OrderAccepted,
    OrderPaid,
    OrderProcess,
    OrderSaga,
    PaymentReminder,
    PayOrder,
    PlaceExpressOrder,
    PlaceOrder,
)
from tests.support import SignalCounter
from tests.test_metrics import labels, values

SAGA = "OrderProcess"

MakeSales = Callable[..., Endpoint]


@pytest.fixture
def make_sales(unique: str) -> Iterator[MakeSales]:
    """Endpoints on memory:// and MemoryStorage, closed afterwards: ``make_sales(OrderSaga)``."""
    made: list[Endpoint] = []

    def make(*handlers: Any, **options: Any) -> Endpoint:
        options.setdefault("storage", MemoryStorage())
        endpoint = Endpoint(f"sales-{unique}-{len(made)}", handlers=handlers or [OrderSaga],
                            error_queue=f"error-{unique}", delayed_poll_interval=0.05,
                            status_interval=0, **options)
        made.append(endpoint)
        return endpoint

    yield make
    for endpoint in made:
        endpoint.close()


class Wire:
    """The messages an endpoint put on the wire (its ``dispatched`` signal)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.envelopes: list[Envelope] = []
        self._lock = threading.Lock()
        endpoint.signals.dispatched.connect(self._sent, weak=False)

    def _sent(self, sender: object, **details: Any) -> None:
        with self._lock:
            self.envelopes.append(details["envelope"])

    def ids(self, message_type: str) -> list[str]:
        with self._lock:
            return [e.message_id for e in self.envelopes if e.message_type == message_type]


def send(endpoint: Endpoint, command: Command, message_id: str | None = None) -> None:
    endpoint.bus.send(command, to=endpoint.name, message_id=message_id)


def settle(endpoint: Endpoint, counter: SignalCounter, count: int) -> None:
    """Wait for ``count`` of ``counter``'s signal, then for the endpoint to be idle."""
    assert counter.wait_for(count), f"only {counter.count} of {count}"
    wait_until_idle([endpoint])


def place_and_pay(sales: Endpoint, handled: SignalCounter, *, place_id: str | None = None,
                  pay_id: str | None = None) -> None:
    """Order o-1 placed, then paid: its saga completed (``handled`` counts to 2)."""
    send(sales, PlaceOrder(order_id="o-1"), message_id=place_id)
    send(sales, PayOrder(order_id="o-1"), message_id=pay_id)
    settle(sales, handled, 2)


# -- what starts a saga ---------------------------------------------------------------------


def test_a_starting_message_creates_the_saga_and_so_does_a_subclass_of_its_type(
    make_sales: MakeSales,
) -> None:
    sales = make_sales()
    handled = SignalCounter(sales, "handled")
    sales.start()

    send(sales, PlaceOrder(order_id="o-1"))
    send(sales, PlaceExpressOrder(order_id="o-2"))
    settle(sales, handled, 2)

    assert sales.storage.load(SAGA, "o-1").state == {"express": False, "reminders": 0}
    assert sales.storage.load(SAGA, "o-2").state == {"express": True, "reminders": 0}


def test_a_message_that_does_not_start_the_saga_and_finds_none_is_acknowledged_as_not_found(
    make_sales: MakeSales, caplog: pytest.LogCaptureFixture,
) -> None:
    sales = make_sales()
    wire = Wire(sales)
    not_found = SignalCounter(sales, "not_found")
    sales.start()

    with caplog.at_level(logging.INFO, logger="idembus"):
        send(sales, PayOrder(order_id="o-9"), message_id="m-pay")
        settle(sales, not_found, 1)

    # Nothing was stored or sent, the message is gone from the queue, and it was said
    assert sales.storage.load(SAGA, "o-9").version == 0
    assert wire.envelopes == []
    assert sales.transport.pending(sales.name) == 0
    counts = sales.counters.snapshot()
    assert (counts["not_found"], counts["handled"], counts["dead_lettered"]) == (1, 0, 0)
    assert not_found.details[0]["message_id"] == "m-pay"
    assert not_found.details[0]["handler"] == "OrderSaga"
    assert any(r.levelno == logging.INFO and "found no OrderProcess 'o-9'" in r.getMessage()
               for r in caplog.records)


# -- complete() and what comes late ------------------------------------------------------------


def test_complete_removes_the_state_and_a_late_non_starter_finds_the_saga_not_found(
    make_sales: MakeSales,
) -> None:
    # Given a saga that was placed and paid (completed)
    sales = make_sales()
    wire = Wire(sales)
    handled = SignalCounter(sales, "handled")
    not_found = SignalCounter(sales, "not_found")
    sales.start()
    place_and_pay(sales, handled)
    tombstone = sales.storage.load(SAGA, "o-1")

    # When a message that does not start it comes late (a second payment, a plain reminder)
    send(sales, PayOrder(order_id="o-1"))
    send(sales, PaymentReminder(order_id="o-1"))
    settle(sales, not_found, 2)

    # Then the saga stays completed: no state, nothing committed since, nothing sent
    assert (tombstone.version, tombstone.completed, tombstone.state) == (2, True, None)
    assert sales.storage.load(SAGA, "o-1") == tombstone
    assert len(wire.ids(message_name(OrderPaid))) == 1
    assert sales.counters["handled"] == 2


@pytest.mark.parametrize("compacted", [True, False], ids=["compacted", "bodies-kept"])
def test_a_late_duplicate_of_the_starting_message_is_a_duplicate_and_never_a_new_saga(
    make_sales: MakeSales, compacted: bool,
) -> None:
    # Given a saga started by m-place and completed (the trap of rebus#1136)
    sales = make_sales(OrderSaga, outbox=OutboxPolicy(compact_after_dispatch=compacted))
    wire = Wire(sales)
    handled = SignalCounter(sales, "handled")
    duplicate = SignalCounter(sales, "duplicate")
    sales.start()
    place_and_pay(sales, handled, place_id="m-place")
    accepted = wire.ids(message_name(OrderAccepted))

    # When m-place is delivered again
    send(sales, PlaceOrder(order_id="o-1"), message_id="m-place")
    settle(sales, duplicate, 1)

    # Then it is a duplicate: the saga stays completed, and what m-place stored is sent
    # again with the same ids where the bodies were kept (compaction forgets them once sent)
    record = sales.storage.load(SAGA, "o-1")
    assert (record.version, record.completed) == (2, True)
    assert sales.counters["handled"] == 2
    assert wire.ids(message_name(OrderAccepted)) == accepted * (1 if compacted else 2)


def test_a_new_starting_message_after_completion_starts_a_new_saga_and_old_duplicates_stay(
    make_sales: MakeSales,
) -> None:
    # Given a completed saga
    sales = make_sales()
    handled = SignalCounter(sales, "handled")
    duplicate = SignalCounter(sales, "duplicate")
    sales.start()
    place_and_pay(sales, handled, place_id="m-place", pay_id="m-pay")

    # When a new PlaceOrder (another id) comes for it, then the old messages again
    send(sales, PlaceExpressOrder(order_id="o-1"), message_id="m-again")
    settle(sales, handled, 3)
    send(sales, PlaceOrder(order_id="o-1"), message_id="m-place")
    send(sales, PayOrder(order_id="o-1"), message_id="m-pay")
    settle(sales, duplicate, 2)

    # Then a new saga was started from a fresh state (as NServiceBus does), and the old
    # messages are still duplicates
    record = sales.storage.load(SAGA, "o-1")
    assert (record.version, record.live) == (3, True)
    assert record.state == {"express": True, "reminders": 0}
    assert sales.counters["handled"] == 3


# -- timeouts --------------------------------------------------------------------------------


def test_a_timeout_for_a_live_saga_is_handled(make_sales: MakeSales) -> None:
    sales = make_sales()
    handled = SignalCounter(sales, "handled")
    sales.start()

    send(sales, PlaceOrder(order_id="o-1", remind_after=0))
    settle(sales, handled, 2)

    assert sales.storage.load(SAGA, "o-1").state == {"express": False, "reminders": 1}


def test_a_timeout_that_arrives_after_its_saga_completed_is_dropped_and_counted(
    make_sales: MakeSales,
) -> None:
    # Given an order placed with an immediate reminder and paid, queued in that order: the
    # reminder, sent when the placing commits, arrives after the payment completed the saga
    sales = make_sales()
    wire = Wire(sales)
    dropped = SignalCounter(sales, "timeout_dropped")
    sales.transport.declare(sales.name)
    send(sales, PlaceOrder(order_id="o-1", remind_after=0))
    send(sales, PayOrder(order_id="o-1"))

    # When the endpoint handles them
    sales.start()
    settle(sales, dropped, 1)

    # Then the reminder was dropped and counted, neither handled nor "not found"
    counts = sales.counters.snapshot()
    assert (counts["handled"], counts["timeout_dropped"], counts["not_found"]) == (2, 1, 0)
    assert dropped.details[0]["message_type"] == message_name(PaymentReminder)
    assert sales.storage.load(SAGA, "o-1").completed
    assert wire.ids("sagas.OrderReminded") == []


def test_a_reminder_sent_by_hand_is_not_a_timeout_and_finds_a_completed_saga_not_found(
    make_sales: MakeSales,
) -> None:
    # Given a saga that asked for a reminder in the commit that completed it
    sales = make_sales()
    dropped = SignalCounter(sales, "timeout_dropped")
    not_found = SignalCounter(sales, "not_found")
    sales.start()
    send(sales, PlaceOrder(order_id="o-1"))
    send(sales, CloseOrder(order_id="o-1", remind_after=0))
    settle(sales, dropped, 1)

    # When the same command comes without the timeout header
    send(sales, PaymentReminder(order_id="o-1"))
    settle(sales, not_found, 1)

    # Then only the saga's own timeout was dropped
    assert (dropped.count, not_found.count) == (1, 1)


def test_request_timeout_names_the_saga_in_a_header_of_the_deferred_command() -> None:
    result = handle(OrderSaga, PlaceOrder(order_id="o-1"))

    (reminder,) = [e for e in result.envelopes if e.message_type == "sagas.PaymentReminder"]
    assert reminder.headers[h.SAGA_TIMEOUT] == f"{SAGA}/o-1"
    assert reminder.deliver_at is not None


# -- saga_not_found overridden ---------------------------------------------------------------


class StrictOrderSaga(OrderSaga):
    handler_name = "StrictOrderSaga"

    def saga_not_found(self, message: Any) -> None:
        raise RejectMessage(f"no order {message.order_id}")


class ChattyOrderSaga(OrderSaga):
    handler_name = "ChattyOrderSaga"

    def saga_not_found(self, message: Any) -> None:
        self.bus.publish(OrderPaid(order_id=message.order_id))


def test_saga_not_found_overridden_to_reject_puts_the_message_in_the_error_queue_with_why(
    make_sales: MakeSales,
) -> None:
    sales = make_sales(StrictOrderSaga)
    dead = SignalCounter(sales, "dead_lettered")
    sales.start()

    send(sales, PayOrder(order_id="o-9"), message_id="m-pay")
    settle(sales, dead, 1)

    delivery = sales.transport.get(sales.error_queue)
    assert delivery is not None
    assert delivery.headers[h.MESSAGE_ID] == "m-pay"
    assert delivery.headers[h.EXCEPTION_MESSAGE] == "no order o-9"
    counts = sales.counters.snapshot()
    assert (counts["not_found"], counts["dead_lettered"]) == (0, 1)
    assert sales.storage.load(SAGA, "o-9").version == 0


def test_saga_not_found_may_not_send_and_fails_the_message_saying_why() -> None:
    with pytest.raises(HandlerContractError, match="saga_not_found tried to send"):
        handle(ChattyOrderSaga, PayOrder(order_id="o-9"))


def test_the_handler_test_helper_tells_completion_and_not_found() -> None:
    live = OrderProcess()

    paid = handle(OrderSaga, PayOrder(order_id="o-1"), state=live)
    lost = handle(OrderSaga, PayOrder(order_id="o-1"))
    placed = handle(OrderSaga, PlaceOrder(order_id="o-1"))

    assert (paid.completed, paid.state, paid.published) == (True, None,
                                                             [OrderPaid(order_id="o-1")])
    assert (lost.not_found, lost.state, lost.envelopes) == (True, None, ())
    assert (placed.completed, placed.not_found, placed.state) == (False, False, live)


# -- declaring starts ------------------------------------------------------------------------


class Started(Command, message_name="sagas.Started"):
    saga_id: str


class Other(Command, message_name="sagas.Other"):
    saga_id: str


class Nothing(BaseModel):
    count: int = 0


def saga_class(starts: Any) -> type[AggregateHandler[Nothing]]:
    class Saga(AggregateHandler[Nothing]):
        def aggregate_id(self, message: Started) -> str:
            return message.saga_id

        @handles
        def started(self, message: Started) -> None:
            self.state.count += 1

    Saga.starts = starts
    return Saga


@pytest.mark.parametrize(("starts", "says"), [
    ((Other,), "starts lists sagas.Other, which Saga does not handle: add a @handles method"),
    ((), "is empty, so no message could ever start this saga"),
    (Started, "must be a tuple of message types"),
    ((str,), "is not a message type"),
], ids=["not-handled", "empty", "not-a-tuple", "not-a-message"])
def test_starts_that_cannot_work_is_refused_at_registration_with_what_to_write(
    starts: Any, says: str,
) -> None:
    with pytest.raises(HandlerDefinitionError, match=says):
        Endpoint("sagas", handlers=[saga_class(starts)], storage=MemoryStorage())


class Starter(Command, message_name="sagas.Starter"):
    saga_id: str


class Opened(Starter, message_name="sagas.Opened"):
    pass


class OpenedSaga(AggregateHandler[Nothing]):
    starts = (Starter,)  # a base class: only its subclass Opened is handled

    def aggregate_id(self, message: Opened) -> str:
        return message.saga_id

    @handles
    def opened(self, message: Opened) -> None:
        self.state.count += 1


def test_starts_may_name_a_base_class_of_the_handled_types() -> None:
    assert handle(OpenedSaga, Opened(saga_id="s")).state == Nothing(count=1)


# -- async handlers and units of work -----------------------------------------------------


class AsyncOrderSaga(AggregateHandler[OrderProcess]):
    starts = (PlaceOrder,)

    def aggregate_id(self, message: PlaceOrder | PayOrder) -> str:
        return message.order_id

    @handles
    async def place(self, message: PlaceOrder) -> None:
        self.bus.publish(OrderAccepted(order_id=message.order_id))

    @handles
    async def pay(self, message: PayOrder) -> None:
        self.complete()

    async def saga_not_found(self, message: Any) -> None:
        raise RejectMessage("async: no such order")


def test_async_handlers_start_complete_and_find_no_saga_like_plain_ones(
    make_sales: MakeSales,
) -> None:
    sales = make_sales(AsyncOrderSaga)
    handled = SignalCounter(sales, "handled")
    dead = SignalCounter(sales, "dead_lettered")
    sales.start()

    send(sales, PlaceOrder(order_id="o-1"))
    send(sales, PayOrder(order_id="o-1"))
    settle(sales, handled, 2)
    send(sales, PayOrder(order_id="o-1"))
    settle(sales, dead, 1)

    assert sales.storage.load(SAGA, "o-1").completed
    delivery = sales.transport.get(sales.error_queue)
    assert delivery is not None and delivery.headers[h.EXCEPTION_MESSAGE] == (
        "async: no such order")


def test_a_unit_of_work_completes_an_aggregate_and_a_later_one_starts_it_anew(
    make_sales: MakeSales,
) -> None:
    sales = make_sales()
    with sales.unit_of_work(OrderProcess, "o-1", operation_id="op-1") as work:
        work.state.reminders = 5
    with sales.unit_of_work(OrderProcess, "o-1", operation_id="op-2") as work:
        work.complete()
    tombstone = sales.storage.load(SAGA, "o-1")

    with sales.unit_of_work(OrderProcess, "o-1", operation_id="op-3") as work:
        fresh = work.state.model_copy()
    with pytest.raises(AlreadyProcessed):
        with sales.unit_of_work(OrderProcess, "o-1", operation_id="op-2"):
            pass

    assert (tombstone.version, tombstone.completed, tombstone.state) == (2, True, None)
    assert fresh == OrderProcess()
    assert sales.storage.load(SAGA, "o-1").live


# -- aggregate handlers without starts ----------------------------------------------------------


class Counter(AggregateHandler[Nothing]):
    """No ``starts``: every message creates the aggregate it names, as before sagas."""

    def aggregate_id(self, message: Started | Other) -> str:
        return message.saga_id

    @handles
    def started(self, message: Started) -> None:
        self.state.count += 1

    @handles
    def other(self, message: Other) -> None:
        self.complete()


def test_without_starts_any_message_creates_the_aggregate_also_after_completion(
    make_sales: MakeSales,
) -> None:
    sales = make_sales(Counter)
    handled = SignalCounter(sales, "handled")
    sales.start()

    send(sales, Other(saga_id="c"))  # creates it, completed at once
    settle(sales, handled, 1)
    send(sales, Started(saga_id="c"))
    settle(sales, handled, 2)

    record = sales.storage.load("Nothing", "c")
    assert (record.version, record.live, record.state) == (2, True, {"count": 1})
    assert sales.counters["not_found"] == 0


# -- observing --------------------------------------------------------------------------------


def test_the_metrics_middleware_counts_sagas_not_found_and_timeouts_dropped(
    make_sales: MakeSales,
) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        sales = make_sales(OrderSaga, middleware=[Metrics(meter_provider=provider)])
        dropped = SignalCounter(sales, "timeout_dropped")
        not_found = SignalCounter(sales, "not_found")
        sales.start()

        send(sales, PayOrder(order_id="o-9"))
        send(sales, PlaceOrder(order_id="o-1"))
        send(sales, CloseOrder(order_id="o-1", remind_after=0))
        settle(sales, dropped, 1)
        settle(sales, not_found, 1)

        handler = {"endpoint": sales.name, "handler": "OrderSaga"}
        assert values(reader, "idembus.messages.not_found") == {
            labels(**handler, message_type="sagas.PayOrder"): 1}
        assert values(reader, "idembus.messages.timeouts_dropped") == {
            labels(**handler, message_type="sagas.PaymentReminder"): 1}
    finally:
        provider.shutdown()
