"""Message hierarchies: a handler of a base message type receives its subclasses.

The wire carries ``idembus.enclosed_types``; the handler table picks each handler class's
most specific method, once; events with bases are routed on the topic exchange to the
subscribers of every enclosed type, one copy per queue, on memory://, RabbitMQ and Redis;
a foreign publisher setting only ``idembus.message_type`` still reaches the exact type's
subscribers; an event nobody subscribes to is counted as ``unrouted``.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

import kombu
import pytest
from pydantic import BaseModel

from idembus import Command, Endpoint, Event, RetryPolicy
from idembus import headers as h
from idembus.envelope import Envelope
from idembus.errors import ConfigurationError, UnknownMessageType
from idembus.handlers import AggregateHandler, Handler, handles
from idembus.handlers.errors import HandlerDefinitionError
from idembus.handlers.registration import HandlerTable
from idembus.hierarchy import (
    binding_keys,
    enclosed_header,
    parse_enclosed,
    routing_key,
    routing_key_of,
)
from idembus.registry import MessageRegistry
from idembus.runtime.decoding import decode
from idembus.runtime.recoverability.policy import Recoverability
from idembus.storage.memory import MemoryStorage
from idembus.testing import wait_until_idle
from idembus.transports.kombu import KombuTransport, event_routing_key
from tests.conftest import foreign_connection
from tests.support import SignalCounter

MakeEndpoint = Callable[..., Endpoint]


class OrderEvent(Event, message_name="shop.OrderEvent"):
    order_id: str


class OrderPlaced(OrderEvent, message_name="shop.OrderPlaced", message_version=3):
    amount: int


class RushOrderPlaced(OrderPlaced, message_name="shop.RushOrderPlaced"):
    deadline: str


class Unrelated(Event, message_name="shop.Unrelated"):
    note: str = ""


class Refund(Command, message_name="shop.Refund"):
    order_id: str


class UrgentRefund(Refund, message_name="shop.UrgentRefund"):
    reason: str


class Seen:
    """What handlers saw, shared with the test (handler classes are copied per message)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    def add(self, handler: str, method: str, message: Any) -> None:
        with self._lock:
            self.calls.append((handler, method, type(message).__name__))


class Everything(Handler):
    """Handles three levels of the hierarchy: the nearest method must win."""

    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    @handles
    def any_order(self, message: OrderEvent) -> None:
        self.seen.add("Everything", "any_order", message)

    @handles
    def placed(self, message: OrderPlaced) -> None:
        self.seen.add("Everything", "placed", message)


class BaseOnly(Handler):
    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    @handles
    def any_order(self, message: OrderEvent) -> None:
        self.seen.add("BaseOnly", "any_order", message)


class PlacedOnly(Handler):
    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    @handles
    def placed(self, message: OrderPlaced) -> None:
        self.seen.add("PlacedOnly", "placed", message)


# -- the wire ---------------------------------------------------------------------------


def test_the_enclosed_types_header_lists_the_class_and_its_message_bases_most_derived_first():
    assert enclosed_header(OrderEvent) == "shop.OrderEvent"
    assert enclosed_header(RushOrderPlaced) == (
        "shop.RushOrderPlaced,shop.OrderPlaced:3,shop.OrderEvent")


def test_every_message_idembus_writes_carries_its_version_and_enclosed_types():
    endpoint = Endpoint(f"wire-{uuid.uuid4().hex[:8]}", storage=MemoryStorage(),
                        routes={Refund: "refunds"})
    sent: list[Envelope] = []
    endpoint.dispatcher.dispatch = sent.append  # type: ignore[method-assign]

    endpoint.bus.publish(RushOrderPlaced(order_id="o-1", amount=5, deadline="today"))
    endpoint.bus.send(UrgentRefund(order_id="o-1", reason="late"))

    event, command = sent
    assert event.headers[h.MESSAGE_TYPE] == "shop.RushOrderPlaced"
    assert event.headers[h.MESSAGE_VERSION] == "1"
    assert event.headers[h.ENCLOSED_TYPES] == enclosed_header(RushOrderPlaced)
    assert command.headers[h.ENCLOSED_TYPES] == "shop.UrgentRefund,shop.Refund"
    assert command.destination == "refunds"  # routes look through the MRO
    endpoint.close()


def test_an_unreadable_enclosed_types_entry_is_left_out():
    assert parse_enclosed("a.B:2, c.D ,x:0,y:two,,e") == [("a.B", 2), ("c.D", 1), ("e", 1)]
    assert parse_enclosed(None) == []


def test_events_without_bases_keep_their_name_as_routing_key_and_others_name_every_type():
    assert routing_key_of(OrderEvent) == "shop.OrderEvent"
    assert routing_key_of(RushOrderPlaced) == (
        "~.shop~RushOrderPlaced.shop~OrderPlaced.shop~OrderEvent.~")
    assert binding_keys("shop.OrderEvent") == (
        "shop.OrderEvent", "~.shop~OrderEvent.#", "~.#.shop~OrderEvent.#")
    assert routing_key(["a"]) == "a"


def test_the_transport_routes_by_the_enclosed_types_only_when_they_start_with_the_type():
    def envelope(**headers: str) -> Envelope:
        return Envelope({h.MESSAGE_ID: "m", h.MESSAGE_TYPE: "shop.OrderPlaced", **headers}, "{}")

    assert event_routing_key(envelope()) == "shop.OrderPlaced"
    assert event_routing_key(envelope(**{h.ENCLOSED_TYPES: "shop.OrderPlaced"})) == (
        "shop.OrderPlaced")
    assert event_routing_key(envelope(**{
        h.ENCLOSED_TYPES: "shop.OrderPlaced:3,shop.OrderEvent"})) == (
        "~.shop~OrderPlaced.shop~OrderEvent.~")
    assert event_routing_key(envelope(**{h.ENCLOSED_TYPES: "other.X,shop.OrderEvent"})) == (
        "shop.OrderPlaced")


def test_a_routing_key_over_the_amqp_limit_is_refused_when_the_endpoint_is_built():
    long_base = type("LongBase", (Event,), {"__annotations__": {}},
                     message_name="x." + "b" * 120)
    long_event = type("LongEvent", (long_base,), {"__annotations__": {}},
                      message_name="x." + "e" * 140)

    class Listener(Handler):
        @handles(long_event)
        def on(self, message: Any) -> None: ...

    with pytest.raises(ConfigurationError, match="over the AMQP limit of 255"):
        Endpoint(f"long-{uuid.uuid4().hex[:8]}", storage=MemoryStorage(), handlers=[Listener])


# -- decoding ---------------------------------------------------------------------------


def body_and_headers(message: Event, **extra: str) -> tuple[dict[str, str], bytes]:
    headers = {h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: type(message).__message_name__,
               h.ENCLOSED_TYPES: enclosed_header(type(message)),
               h.MESSAGE_VERSION: str(type(message).__message_version__), **extra}
    return headers, message.model_dump_json().encode()


def test_an_endpoint_that_knows_only_a_base_decodes_the_message_as_that_base():
    headers, body = body_and_headers(RushOrderPlaced(order_id="o-1", amount=3, deadline="d"))

    as_base = decode(headers, body, h.CONTENT_TYPE, MessageRegistry([OrderEvent]))
    as_middle = decode(headers, body, h.CONTENT_TYPE, MessageRegistry([OrderEvent, OrderPlaced]))

    assert as_base == OrderEvent(order_id="o-1")  # the subclass's fields are ignored
    assert as_middle == OrderPlaced(order_id="o-1", amount=3)


def test_the_exact_type_wins_over_its_bases_when_the_endpoint_knows_it():
    headers, body = body_and_headers(OrderPlaced(order_id="o-2", amount=9))

    message = decode(headers, body, h.CONTENT_TYPE, MessageRegistry([OrderEvent, OrderPlaced]))

    assert type(message) is OrderPlaced


def test_a_foreign_publisher_with_only_the_message_type_is_decoded():
    headers = {h.MESSAGE_ID: "m-1", h.MESSAGE_TYPE: "shop.OrderEvent"}

    message = decode(headers, b'{"order_id": "o-3"}', None, MessageRegistry([OrderEvent]))

    assert message == OrderEvent(order_id="o-3")


def test_a_message_none_of_whose_types_is_known_is_an_unknown_type():
    headers, body = body_and_headers(RushOrderPlaced(order_id="o", amount=1, deadline="d"))

    with pytest.raises(UnknownMessageType, match="shop.RushOrderPlaced"):
        decode(headers, body, h.CONTENT_TYPE, MessageRegistry([Unrelated]))


# -- the handler table ------------------------------------------------------------------


def names(bindings: list[Any]) -> list[tuple[str, str]]:
    return [(type(b.handler).__name__, b.method_name) for b in bindings]


def test_each_handler_class_gets_a_message_once_through_its_most_specific_method():
    seen = Seen()
    table = HandlerTable([Everything(seen), BaseOnly(seen), PlacedOnly(seen)])

    assert names(table.bindings_for(RushOrderPlaced)) == [
        ("Everything", "placed"), ("BaseOnly", "any_order"), ("PlacedOnly", "placed")]
    assert names(table.bindings_for(OrderPlaced)) == [
        ("Everything", "placed"), ("BaseOnly", "any_order"), ("PlacedOnly", "placed")]
    assert names(table.bindings_for(OrderEvent)) == [
        ("Everything", "any_order"), ("BaseOnly", "any_order")]
    assert table.bindings_for(Unrelated) == []


class Order(BaseModel):
    events: int = 0


class OrderEvents(AggregateHandler[Order]):
    def aggregate_id(self, message: OrderEvent) -> str:
        return message.order_id

    @handles
    def any_order(self, message: OrderEvent) -> None:
        self.state.events += 1


class OrderPlacements(AggregateHandler[Order]):
    def aggregate_id(self, message: OrderPlaced) -> str:
        return message.order_id

    @handles
    def placed(self, message: OrderPlaced) -> None:
        self.state.events += 1


def test_two_aggregate_handlers_of_one_aggregate_on_overlapping_levels_are_refused():
    with pytest.raises(HandlerDefinitionError, match="both change aggregate 'Order' on "
                                                     "shop.OrderPlaced"):
        HandlerTable([OrderEvents, OrderPlacements])


def test_a_handler_of_a_base_command_receives_its_subclass_through_the_endpoint():
    seen: list[str] = []

    class Refunds(Handler):
        @handles
        def refund(self, message: Refund) -> None:
            seen.append(type(message).__name__)

    refunds = Endpoint(f"refunds-{uuid.uuid4().hex[:8]}", storage=MemoryStorage(),
                       handlers=[Refunds])
    with refunds:
        refunds.bus.send(UrgentRefund(order_id="o", reason="r"))
        refunds.bus.send(Refund(order_id="o"))
        wait_until_idle([refunds])
    assert sorted(seen) == ["Refund", "Refund"]  # the endpoint knows only Refund


def test_a_route_to_itself_for_a_subclass_of_a_handled_command_is_accepted():
    class Refunds(Handler):
        @handles(Refund)
        def refund(self, message: Any) -> None: ...

    name = f"refunds-{uuid.uuid4().hex[:8]}"
    endpoint = Endpoint(name, storage=MemoryStorage(), handlers=[Refunds],
                        routes={UrgentRefund: name})
    assert endpoint.router.destination_for(UrgentRefund) == name
    with pytest.raises(ConfigurationError, match="no handler of"):
        Endpoint(name, storage=MemoryStorage(), handlers=[Refunds], routes={Unrouted: name})
    endpoint.close()


class Unrouted(Command, message_name="shop.Unrouted"):
    pass


# -- routing on every transport ---------------------------------------------------------


def test_one_publish_reaches_the_subscribers_of_every_enclosed_type_one_copy_each(
    make_endpoint: MakeEndpoint, make_transport: Callable[..., KombuTransport],
    transport_url: str,
):
    # Given endpoints subscribed to the base, to the subclass, to both, and to another type
    seen = Seen()
    transport = make_transport()  # one exchange for all of them
    base = make_endpoint("base", transport=transport, handlers=[BaseOnly(seen)])
    placed = make_endpoint("placed", transport=transport, handlers=[PlacedOnly(seen)])
    both = make_endpoint("both", transport=transport, handlers=[Everything(seen)])
    other = make_endpoint("other", transport=transport, handlers=[UnrelatedHandler])
    endpoints = [base, placed, both, other]
    received = {e.name: SignalCounter(e, "received") for e in endpoints}
    for endpoint in endpoints:
        endpoint.start()

    # When one RushOrderPlaced and one plain OrderEvent are published
    base.bus.publish(RushOrderPlaced(order_id="o-1", amount=2, deadline="d"))
    base.bus.publish(OrderEvent(order_id="o-2"))
    assert received[base.name].wait_for(2) and received[both.name].wait_for(2)
    assert received[placed.name].wait_for(1)
    wait_until_idle(endpoints)

    # Then each queue got one copy of what it subscribes to, handled by the nearest method
    assert sorted(seen.calls) == sorted([
        ("BaseOnly", "any_order", "OrderEvent"),  # knows only the base: decoded as it
        ("BaseOnly", "any_order", "OrderEvent"),
        ("PlacedOnly", "placed", "OrderPlaced"),
        ("Everything", "placed", "OrderPlaced"),
        ("Everything", "any_order", "OrderEvent"),
    ])
    assert {e.name: received[e.name].count for e in endpoints} == {
        base.name: 2, placed.name: 1, both.name: 2, other.name: 0}
    assert sum(e.counters["unrouted"] for e in endpoints) == 0


class UnrelatedHandler(Handler):
    @handles
    def on(self, message: Unrelated) -> None: ...


def test_a_foreign_publisher_setting_only_the_message_type_reaches_the_exact_subscriber(
    make_endpoint: MakeEndpoint, make_transport: Callable[..., KombuTransport],
    transport_url: str,
):
    # Given a subscriber of OrderEvent, a type with subclasses
    seen = Seen()
    transport = make_transport()
    base = make_endpoint("base", transport=transport, handlers=[BaseOnly(seen)])
    handled = SignalCounter(base, "handled")
    base.start()

    # When a client that knows nothing of idembus publishes one with the type name as key
    with foreign_connection(transport_url) as connection:
        exchange = kombu.Exchange(transport.exchange_name, type="topic", durable=True)
        connection.Producer().publish(
            b'{"order_id": "o-9"}', exchange=exchange,
            routing_key="shop.OrderEvent", content_type="application/json",
            headers={h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "shop.OrderEvent"})

    # Then it is handled as if idembus had sent it
    assert handled.wait_for(1)
    assert seen.calls == [("BaseOnly", "any_order", "OrderEvent")]


def test_an_event_nobody_subscribes_to_is_counted_as_unrouted_and_logged_once_at_info(
    make_endpoint: MakeEndpoint, caplog: pytest.LogCaptureFixture, transport_url: str,
):
    seen = Seen()
    publisher = make_endpoint("publisher", handlers=[BaseOnly(seen)],
                              recoverability=Recoverability(retries=RetryPolicy(delayed=())))
    publisher.start()
    unrouted = SignalCounter(publisher, "unrouted")

    with caplog.at_level(logging.DEBUG, logger="idembus.runtime.endpoint"):
        publisher.bus.publish(Unrelated(note="nobody listens"))
        publisher.bus.publish(Unrelated(note="still nobody"))
        publisher.bus.publish(OrderPlaced(order_id="o", amount=1))  # the publisher hears it

    assert unrouted.count == 2
    assert {d["message_type"] for d in unrouted.details} == {"shop.Unrelated"}
    assert publisher.counters["unrouted"] == 2
    lines = [r for r in caplog.records if "reached no queue" in r.getMessage()]
    # publishing for subscribers still to come is normal: INFO once per type, then DEBUG
    assert [r.levelno for r in lines] == [logging.INFO, logging.DEBUG]
    wait_until_idle([publisher])
    assert seen.calls == [("BaseOnly", "any_order", "OrderEvent")]
