"""send / publish / reply: types, routes and the headers of DESIGN §5, without a broker."""

from __future__ import annotations

import uuid

import pytest

from idembus import Bus, Command, Event, RoutingError
from idembus import headers as h
from idembus.context import MessageContext
from idembus.envelope import Envelope
from idembus.routing import Router


class Ship(Command, message_name="api.Ship"):
    order_id: str


class Shipped(Event, message_name="api.Shipped"):
    order_id: str


def outside_bus(sent: list[Envelope]) -> Bus:
    return Bus("sales", Router({Ship: "shipping"}), sent.append)


def handler_bus(sent: list[Envelope], handler: str = "OrderHandler", **incoming: str) -> Bus:
    headers = {h.MESSAGE_ID: "11111111-1111-1111-1111-111111111111", h.MESSAGE_TYPE: "api.Place",
               h.REPLY_TO: "web", h.CORRELATION_ID: "corr-1", h.CONVERSATION_ID: "conv-1",
               **incoming}
    context = MessageContext(headers[h.MESSAGE_ID], "api.Place", headers, handler, "sales")
    return Bus("sales", Router({Ship: "shipping"}), sent.append, context)


def test_a_command_sent_from_outside_a_handler_starts_a_conversation():
    sent: list[Envelope] = []
    message_id = outside_bus(sent).send(Ship(order_id="o1"))

    (envelope,) = sent
    assert uuid.UUID(message_id).version == 4
    assert envelope.destination == "shipping"
    assert envelope.headers[h.MESSAGE_ID] == message_id
    assert envelope.headers[h.MESSAGE_TYPE] == "api.Ship"
    assert envelope.headers[h.INTENT] == "send"
    assert envelope.headers[h.CONVERSATION_ID] == message_id
    assert envelope.headers[h.CORRELATION_ID] == message_id
    assert h.CAUSATION_ID not in envelope.headers
    assert envelope.headers[h.REPLY_TO] == "sales"
    assert envelope.headers[h.ORIGINATING_ENDPOINT] == "sales"
    assert envelope.headers[h.TIME_SENT].endswith("+00:00")
    assert Ship.model_validate_json(envelope.body) == Ship(order_id="o1")


def test_to_overrides_the_route_and_a_given_message_id_is_kept():
    sent: list[Envelope] = []
    outside_bus(sent).send(Ship(order_id="o1"), to="elsewhere", message_id="fixed")
    assert sent[0].destination == "elsewhere"
    assert sent[0].message_id == "fixed"


def test_an_event_is_published_without_a_destination_queue():
    sent: list[Envelope] = []
    outside_bus(sent).publish(Shipped(order_id="o1"))
    assert sent[0].destination is None
    assert sent[0].intent is h.Intent.PUBLISH


def test_sending_an_event_or_publishing_a_command_is_a_type_error_that_names_the_right_call():
    bus = outside_bus([])
    with pytest.raises(TypeError, match="publish events with publish"):
        bus.send(Shipped(order_id="o1"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="send commands with send"):
        bus.publish(Ship(order_id="o1"))  # type: ignore[arg-type]


def test_a_command_without_a_route_says_how_to_add_one():
    class Unrouted(Command):
        pass

    with pytest.raises(RoutingError, match=r"no route for command Unrouted: add routes=\{Unrouted"):
        outside_bus([]).send(Unrouted())


def test_user_headers_travel_but_idembus_headers_are_reserved():
    sent: list[Envelope] = []
    bus = outside_bus(sent)
    bus.publish(Shipped(order_id="o1"), headers={"tenant": "acme"})
    assert sent[0].headers["tenant"] == "acme"
    with pytest.raises(ValueError, match="reserved"):
        bus.publish(Shipped(order_id="o1"), headers={h.MESSAGE_ID: "forged"})


def test_messages_sent_inside_a_handler_get_ids_derived_from_the_incoming_id_and_position():
    first: list[Envelope] = []
    again: list[Envelope] = []
    for sent in (first, again):  # a re-run after a crash before commit
        bus = handler_bus(sent)
        bus.publish(Shipped(order_id="o1"))
        bus.send(Ship(order_id="o1"))

    assert [e.message_id for e in first] == [e.message_id for e in again]
    assert first[0].message_id != first[1].message_id
    assert all(uuid.UUID(e.message_id).version == 5 for e in first)


def test_two_handlers_of_one_message_never_produce_the_same_outgoing_id():
    one: list[Envelope] = []
    other: list[Envelope] = []
    handler_bus(one, "Billing").publish(Shipped(order_id="o1"))
    handler_bus(other, "Audit").publish(Shipped(order_id="o1"))
    assert one[0].message_id != other[0].message_id


def test_messages_sent_inside_a_handler_carry_causation_conversation_and_correlation():
    sent: list[Envelope] = []
    handler_bus(sent).send(Ship(order_id="o1"))
    headers = sent[0].headers
    assert headers[h.CAUSATION_ID] == "11111111-1111-1111-1111-111111111111"
    assert headers[h.CONVERSATION_ID] == "conv-1"
    assert headers[h.CORRELATION_ID] == "corr-1"


def test_a_reply_goes_to_the_reply_address_correlated_with_the_request_id():
    sent: list[Envelope] = []
    handler_bus(sent).reply(Shipped(order_id="o1"))
    assert sent[0].destination == "web"
    assert sent[0].intent is h.Intent.REPLY
    assert sent[0].headers[h.CORRELATION_ID] == "11111111-1111-1111-1111-111111111111"


def test_a_reply_needs_an_incoming_message_with_a_reply_address():
    with pytest.raises(RoutingError, match="only inside a handler"):
        outside_bus([]).reply(Shipped(order_id="o1"))
    with pytest.raises(RoutingError, match="carries no idembus.reply_to header"):
        handler_bus([], **{h.REPLY_TO: ""}).reply(Shipped(order_id="o1"))


def test_the_idempotency_key_is_stable_per_handler_and_message():
    def context(handler: str, message_id: str) -> MessageContext:
        return MessageContext(message_id, "t", {}, handler, "e")

    assert context("A", "m").idempotency_key == context("A", "m").idempotency_key
    assert context("A", "m").idempotency_key != context("B", "m").idempotency_key
    assert context("A", "m").idempotency_key != context("A", "n").idempotency_key
