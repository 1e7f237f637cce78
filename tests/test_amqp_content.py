"""Content headers read by :mod:`idembus.transports.amqp_content`: the same properties
py-amqp's own reader gives, for every shape, and the same frames handled the same way."""

from __future__ import annotations

import datetime
from typing import Any

import amqp
import pytest
from amqp import spec
from amqp.exceptions import UnexpectedFrame
from amqp.serialization import decode_properties_basic

from idembus.transports import amqp_content


def header(**properties: Any) -> bytes:
    """A basic content header's property flags and list, as py-amqp writes them."""
    return bytes(amqp.Message(b"", **properties)._serialize_properties())


SHAPES = [
    {},
    {"content_type": "application/json", "content_encoding": "utf-8", "delivery_mode": 2,
     "application_headers": {"idembus.intent": "send", "naïve": "värde", "empty": ""},
     "message_id": "m-1", "type": "PlaceOrder", "app_id": "sales"},
    {"content_type": "t", "priority": 3, "correlation_id": "c", "reply_to": "r",
     "expiration": "100", "timestamp": 1_700_000_000, "user_id": "guest",
     "cluster_id": "x", "application_headers": {}},
    # values that are not long strings: read by py-amqp's reader
    {"application_headers": {"a": "text", "n": 3, "f": 1.5, "b": True, "none": None,
                             "list": ["x", 1], "table": {"k": "v"},
                             "when": datetime.datetime(2026, 1, 2, 3, 4, 5)}},
    {"application_headers": {"surrogate": "\udcff"}},
]


@pytest.mark.parametrize("properties", SHAPES)
def test_a_header_reads_as_py_amqp_reads_it(properties):
    raw = b"prefix" + header(**properties) + b"rest"
    assert amqp_content.decode_basic(raw, 6) == decode_properties_basic(raw, 6)


def test_table_text_that_is_not_utf8_stays_bytes_as_py_amqp_leaves_it():
    raw = bytearray(header(application_headers={"k": "ab", "kk": "x"}))
    raw[raw.index(b"ab"):raw.index(b"ab") + 2] = b"\xff\xfe"
    raw[raw.index(b"kk"):raw.index(b"kk") + 2] = b"\xfek"
    ours = amqp_content.decode_basic(bytes(raw), 0)
    assert ours == decode_properties_basic(bytes(raw), 0)
    assert ours[0]["application_headers"] == {"k": b"\xff\xfe", b"\xfek": "x"}


def test_a_short_string_that_is_not_utf8_raises_as_py_amqp_does():
    raw = bytearray(header(message_id="ab"))
    raw[raw.index(b"ab"):raw.index(b"ab") + 2] = b"\xff\xfe"
    with pytest.raises(UnicodeDecodeError):
        decode_properties_basic(bytes(raw), 0)
    with pytest.raises(UnicodeDecodeError):
        amqp_content.decode_basic(bytes(raw), 0)


def test_the_frame_handler_assembles_a_delivery_and_refuses_frames_out_of_order():
    received: list[tuple[Any, ...]] = []
    connection = type("Connection", (), {"bytes_recv": 0})()
    on_frame = amqp_content.frame_handler(connection, lambda *args: received.append(args))
    method = b"\x00\x3c\x00\x3c" + b"args"  # basic.deliver
    content = (b"\x00\x3c\x00\x00" + (5).to_bytes(8, "big")
               + header(message_id="m", application_headers={"h": "v"}))

    assert on_frame((1, 1, method)) is False
    assert on_frame((2, 1, content)) is False
    assert on_frame((3, 1, b"he")) is False
    assert on_frame((8, 0, b"")) is False  # a heartbeat between body frames
    assert on_frame((3, 1, b"llo")) is True
    [(channel, signature, args, message)] = received
    assert (channel, signature, args) == (1, spec.Basic.Deliver, method)
    assert message.body == b"hello"
    assert message.properties == {"message_id": "m", "application_headers": {"h": "v"}}
    assert connection.bytes_recv == 5
    with pytest.raises(UnexpectedFrame):
        on_frame((3, 1, b"x"))


def test_a_header_that_is_not_utf8_is_read_again_as_the_handler_is_told():
    received: list[Any] = []
    connection = type("Connection", (), {"bytes_recv": 0})()
    raw = bytearray(b"\x00\x3c\x00\x00" + (0).to_bytes(8, "big") + header(message_id="ab"))
    raw[raw.index(b"ab"):raw.index(b"ab") + 2] = b"\xff\xfe"
    strict = amqp_content.frame_handler(connection, lambda *args: received.append(args))
    strict((1, 1, b"\x00\x3c\x00\x3c"))
    with pytest.raises(UnicodeDecodeError):
        strict((2, 1, bytes(raw)))

    lenient = amqp_content.frame_handler(
        connection, lambda *args: received.append(args),
        reread=lambda payload: payload.replace(b"\xff\xfe", b"??"))
    lenient((1, 1, b"\x00\x3c\x00\x3c"))
    assert lenient((2, 1, bytes(raw))) is True  # no body: the delivery is complete
    assert received[-1][3].properties == {"message_id": "??"}
