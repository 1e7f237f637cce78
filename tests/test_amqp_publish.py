"""``basic.publish`` written as bytes (:mod:`idembus.transports.amqp_publish`): the same
frames py-amqp's own frame writer makes, or ``None`` where it leaves them to py-amqp."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import amqp
import pytest
from amqp import spec
from amqp.method_framing import frame_writer
from amqp.serialization import dumps

from idembus.transports import amqp_properties, amqp_publish

FRAME_MAX = 131072


def py_amqp_frames(channel: int, *, exchange: str, routing_key: str, mandatory: bool,
                   body: bytes, headers: Any, frame_max: int = FRAME_MAX,
                   **properties: Any) -> bytes:
    """What py-amqp writes for the same publish (its frame writer on a fake socket)."""
    written: list[bytes] = []
    connection = SimpleNamespace(frame_max=frame_max, bytes_sent=0)
    transport = SimpleNamespace(write=lambda data: written.append(bytes(data)))
    write = frame_writer(connection, transport)
    message = amqp.Message(body, application_headers=headers, delivery_mode=2, **properties)
    write(1, channel, spec.Basic.Publish,
          dumps("Bssbb", (0, exchange, routing_key, mandatory, False)), message)
    return b"".join(written)


CASES = [
    dict(exchange="", routing_key="orders", mandatory=True, body=b'{"a": 1}',
         headers={"idembus.conversation_id": "c-1", "idembus.intent": "send"},
         content_type="application/json", content_encoding="utf-8",
         message_id="m-1", type="PlaceOrder", app_id="sales"),
    dict(exchange="events.x", routing_key="OrderPlaced", mandatory=False, body=b"",
         headers={}, content_type="application/json", content_encoding="binary"),
    dict(exchange="é", routing_key="ключ", mandatory=True, body="ü".encode() * 500,
         headers={"naïve": "värde \udcff", "x": ""}, content_type="text/plain",
         content_encoding="utf-8", correlation_id="c", reply_to="r", message_id="m",
         type="t", app_id="a"),
]


@pytest.mark.parametrize("case", CASES)
def test_the_frames_are_those_py_amqp_writes(case):
    assert amqp_publish.frames(5, frame_max=FRAME_MAX, **case) == py_amqp_frames(5, **case)


@pytest.mark.parametrize("change", [
    {"headers": {"count": 3}},  # a value of another type than text
    {"headers": {3: "v"}},  # a name of another type than text
    {"headers": {"n" * 256: "v"}},  # a name too long for a short string
    {"message_id": "m" * 256},  # a short string property over 255 bytes
    {"priority": 5},  # a property it does not write
    {"body": b"x" * FRAME_MAX},  # a body over more than one frame
])
def test_what_it_does_not_write_is_left_to_py_amqp(change):
    case = {**CASES[0], **change}
    assert amqp_publish.frames(1, frame_max=FRAME_MAX, **case) is None


# -- idembus's headers as they are, split while they are written -------------------------

IDEMBUS_HEADERS = {
    "idembus.message_id": "4f7c1d52-9b7e-4f8e-8a55-0d3c2b1a9e77",
    "idembus.message_type": "OrderPlaced", "idembus.intent": "publish",
    "idembus.originating_endpoint": "sales", "idembus.reply_to": "sales",
    "idembus.time_sent": "2026-11-28T10:00:00.123456+00:00",
    "idembus.conversation_id": "c-1", "idembus.causation_id": "m-0",
    "idembus.correlation_id": "c-1", "tenant": "t-7"}


def _split_frames(headers: dict[str, str], **place: Any) -> bytes | None:
    table, properties = amqp_properties.split(headers)
    return amqp_publish.frames(3, headers=table, frame_max=FRAME_MAX, **place, **properties)


@pytest.mark.parametrize("headers", [
    IDEMBUS_HEADERS,
    {"tenant": "t", "idembus.message_type": "Placed"},  # some core headers only, after others
    {"idembus.reply_to": "", "x": "värde \udcff"},  # an empty short string; a non-ASCII value
    {},  # no headers at all: an empty table still
])
def test_headers_split_while_written_are_the_frames_of_the_split_headers(headers):
    place = dict(exchange="events", routing_key="OrderPlaced", mandatory=True, body=b"{}",
                 content_type="application/json", content_encoding="utf-8")

    written = amqp_publish.envelope_frames(3, headers=headers, frame_max=FRAME_MAX, **place)

    assert written is not None
    assert written == _split_frames(headers, **place)
    table, properties = amqp_properties.split(headers)
    assert written == py_amqp_frames(3, headers=table, **place, **properties)


@pytest.mark.parametrize("core", [
    {"idembus.originating_endpoint": "försäljning"},  # non-ASCII: split decides (a property)
    {"idembus.message_id": "m" * 256},  # too long for a short string: split keeps it in the table
    {"idembus.message_type": "a\udce9"},  # a surrogate escape: split keeps it in the table
    {"idembus.message_id": 7},  # not text
])
def test_a_core_value_other_than_short_ascii_is_left_to_split(core):
    place = dict(exchange="", routing_key="q", mandatory=True, body=b"{}",
                 content_type="application/json", content_encoding="utf-8")

    assert amqp_publish.envelope_frames(3, headers={**IDEMBUS_HEADERS, **core},
                                        frame_max=FRAME_MAX, **place) is None


def test_a_core_header_once_written_in_a_table_still_becomes_its_property():
    place = dict(exchange="", routing_key="q", mandatory=True, body=b"{}",
                 content_type="application/json", content_encoding="utf-8")
    # Given a message whose id was too long for a property, written with it in its table
    long_id = {**IDEMBUS_HEADERS, "idembus.message_id": "m" * 300}
    assert _split_frames(long_id, **place) is not None

    # Then the next message's short id is its property again, as split puts it
    written = amqp_publish.envelope_frames(3, headers=IDEMBUS_HEADERS, frame_max=FRAME_MAX,
                                           **place)
    assert written == _split_frames(IDEMBUS_HEADERS, **place)
