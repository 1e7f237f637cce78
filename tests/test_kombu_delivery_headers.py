"""The headers of a RabbitMQ delivery (idembus.transports.kombu_delivery): a content
header read from ASCII alone (:class:`~idembus.transports.amqp_content.TextTable`) is taken
as it is, and gives the same headers and problems as the full check of any other table."""

from __future__ import annotations

from typing import Any

import amqp
import pytest
from kombu.transport import pyamqp

from idembus.transports import amqp_content
from idembus.transports.base import Delivery
from idembus.transports.kombu_delivery import _KombuDelivery
from idembus.transports.kombu_frames import _RawAmqpBody, _RawBody


class FakeMessage:
    """What a delivery reads of kombu's message."""

    def __init__(self, properties: dict[str, Any], *, body: Any = b"{}",
                 delivery_info: dict[str, Any] | None = None) -> None:
        self.properties = properties
        self.headers = properties.get("application_headers") or {}
        self.body = body
        self.content_type = properties.get("content_type")
        self.content_encoding = properties.get("content_encoding")
        self.delivery_info = delivery_info or {"exchange": "", "routing_key": "q"}


def read(properties: dict[str, Any]) -> dict[str, Any]:
    raw = bytes(amqp.Message(b"", **properties)._serialize_properties())
    return amqp_content.decode_basic(raw, 0)[0]


def as_checked(properties: dict[str, Any]) -> dict[str, Any]:
    """``properties`` with their table as a plain dict: read by the full check."""
    table = properties.get("application_headers")
    return {**properties, "application_headers": dict(table)} if table else properties


def delivered(properties: dict[str, Any], events: str | None = None,
              **message: Any) -> tuple[Any, str | None]:
    delivery = _KombuDelivery("q", FakeMessage(properties, **message),  # type: ignore[arg-type]
                              events_exchange=events)
    return dict(delivery.headers), delivery.wire_error


SHAPES = [
    {"application_headers": {"idembus.message_id": "m-1", "idembus.message_type": "T"},
     "content_type": "application/json"},
    # the core headers as properties, merged into the table's
    {"application_headers": {"idembus.intent": "send"}, "message_id": "m-2", "type": "T",
     "content_type": "application/json", "content_encoding": "utf-8"},
    # a body kombu would decompress, an encoding idembus does not read
    {"application_headers": {"compression": "gzip", "idembus.message_id": "m-3"}},
    {"application_headers": {"idembus.message_id": "m-4"}, "content_encoding": "base64"},
    {"application_headers": {"k": "v"}, "content_encoding": " UTF-8 "},  # plain, told late
    # a broker's own headers: left out
    {"application_headers": {"x-death": "x", "x-delivery-count": "2", "k": "v"}},
    # a property that is not ASCII, one with an encoded surrogate
    {"application_headers": {"k": "v"}, "message_id": "naïve"},
    {"application_headers": {"k": "v"}, "message_id": "\udcff"},
]


@pytest.mark.parametrize("properties", SHAPES)
def test_an_ascii_header_gives_what_the_full_check_gives(properties):
    read_as = read(properties)
    assert delivered(read_as) == delivered(as_checked(read_as))


def test_a_plain_table_is_taken_without_the_check_and_a_foreign_key_still_refused():
    read_as = read({"application_headers": {"idembus.message_type": "Order"}})
    assert read_as["application_headers"].plain
    info = {"exchange": "events", "routing_key": "Other"}
    headers, problem = delivered(read_as, "events", delivery_info=info)
    assert headers == {"idembus.message_type": "Order"}
    assert problem is not None and (problem, headers) == delivered(
        as_checked(read_as), "events", delivery_info=info)[::-1]


def test_a_decoded_body_is_encoded_back_as_before():
    read_as = read({"application_headers": {"k": "v"}, "content_encoding": "latin-1"})
    delivery = _KombuDelivery("q", FakeMessage(read_as, body="\xe9"))  # type: ignore[arg-type]
    assert delivery.body == b"\xe9"


@pytest.mark.parametrize("properties", [
    {"application_headers": {"k": "v"}, "content_type": "application/json",
     "content_encoding": "utf-8", "message_id": "m-1"},
    {},  # no properties at all
    {"application_headers": {"compression": "gzip"}},  # kept raw, never decompressed
])
def test_kombus_message_of_py_amqp_is_built_in_one_call_as_kombu_builds_it(properties):
    raw = amqp.Message(b"body", **properties)
    raw.delivery_info = {"delivery_tag": 7, "redelivered": False, "exchange": "",
                         "routing_key": "q", "consumer_tag": "c"}
    channel = object()
    fast = type("Fast", (_RawAmqpBody, pyamqp.Message), {})(raw, channel=channel)
    kombus = type("Kombus", (_RawBody, pyamqp.Message), {})(raw, channel=channel)

    def fields(message: Any) -> dict[str, Any]:
        names = [name for cls in type(message).__mro__
                 for name in getattr(cls, "__slots__", ()) if name != "__dict__"]
        return {**{name: getattr(message, name) for name in names}, **vars(message)}

    assert fields(fast) == fields(kombus)
    assert fast.body == b"body" and fast.delivery_tag == 7 and fast.errors == []


def test_a_delivery_has_every_field_deliverys_init_sets():
    class Plain(Delivery):
        def _ack(self) -> None: ...

        def _requeue(self) -> None: ...

    plain = Plain(queue="q", headers={}, body=b"", content_type=None, redelivered=False)
    message: Any = FakeMessage(read({"application_headers": {"k": "v"}}))
    ours = _KombuDelivery("q", message)
    assert set(vars(plain)) <= set(vars(ours))
    assert (ours.queue, ours.headers, ours.body, ours.redelivered, ours.wire_error,
            ours.settled) == ("q", {"k": "v"}, b"{}", False, None, False)
