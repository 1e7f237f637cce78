"""Content headers read by :mod:`idembus.transports.amqp_content`: the same properties
py-amqp's own reader gives, for every shape, and the same frames handled the same way."""

from __future__ import annotations

import datetime
from typing import Any

import amqp
import amqp.method_framing
import pytest
from amqp import spec
from amqp.exceptions import RecoverableConnectionError, UnexpectedFrame
from amqp.serialization import decode_properties_basic, dumps, loads

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


ASCII_SHAPES = [
    {"application_headers": {"idembus.message_id": "m-1", "": "", "k": "\x00\x7f"}},
    {"content_type": "application/json", "message_id": "m-1", "type": "PlaceOrder",
     "application_headers": {"idembus.intent": "send", "idembus.time_sent": "2026"}},
    {"application_headers": {"a" * 100: "v" * 1100}},  # sizes of ASCII octets alone
]


@pytest.mark.parametrize("properties", ASCII_SHAPES)
def test_an_ascii_table_reads_as_py_amqp_reads_it_in_one_decode(properties):
    raw = b"prefix" + header(**properties) + b"rest"
    ours = amqp_content.decode_basic(raw, 6)
    assert ours == decode_properties_basic(raw, 6)
    table = ours[0]["application_headers"]
    assert type(table) is amqp_content.TextTable
    assert all(type(name) is str and type(value) is str for name, value in table.items())
    assert table.plain


@pytest.mark.parametrize("properties", [
    {"application_headers": {"x-death": "x", "k": "v"}},  # a broker's name
    {"application_headers": {"k": "v"}, "type": "naïve"},  # a property that is not ASCII
    {"application_headers": {"k": "x-v"}},  # maybe a broker's name: read as before
])
def test_a_header_with_a_broker_name_or_beyond_ascii_is_not_plain(properties):
    raw = header(**properties)
    ours = amqp_content.decode_basic(raw, 0)
    assert ours == decode_properties_basic(raw, 0)
    assert not getattr(ours[0]["application_headers"], "plain", False)


def test_a_table_with_a_size_octet_beyond_ascii_is_read_byte_by_byte():
    raw = header(application_headers={"a" * 200: "v"})  # 200: a size octet beyond ASCII
    ours = amqp_content.decode_basic(raw, 0)
    assert ours == decode_properties_basic(raw, 0)
    assert type(ours[0]["application_headers"]) is dict


def test_an_ascii_table_whose_sizes_overrun_it_is_read_as_before():
    raw = bytearray(header(application_headers={"k": "value"}))
    at = raw.index(b"value") - 4
    raw[at:at + 4] = (200).to_bytes(4, "big")  # the value's size runs past the table
    ours = amqp_content.decode_basic(bytes(raw) + b"\0" * 300, 0)
    assert type(ours[0]["application_headers"]) is dict


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


@pytest.mark.parametrize("body", [b"", b"hello"])
def test_a_body_in_one_frame_or_none_completes_the_delivery_as_py_amqp_does(body):
    ours: list[tuple[Any, ...]] = []
    theirs: list[tuple[Any, ...]] = []
    method = b"\x00\x3c\x00\x3c" + b"args"
    content = (b"\x00\x3c\x00\x00" + len(body).to_bytes(8, "big")
               + header(message_id="m", application_headers={"h": "v"}))
    frames = [(1, 1, method), (2, 1, content)] + ([(3, 1, body)] if body else [])
    for made, into in ((amqp_content.frame_handler, ours),
                       (amqp.method_framing.frame_handler, theirs)):
        on_frame = made(type("Connection", (), {"bytes_recv": 0})(),
                        lambda *args, into=into: into.append(args))
        assert [on_frame(frame) for frame in frames][-1] is True
    [(*call, message)], [(*expected, py_amqps)] = ours, theirs
    assert call == expected
    assert (message.body, message.properties, message.body_received, message.ready) == (
        py_amqps.body, py_amqps.properties, py_amqps.body_received, py_amqps.ready)


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


@pytest.mark.parametrize("arguments", [
    ["amq.ctag-1", 1, False, "", "orders"],
    ["ctag", 2**63 + 5, True, "events.x", "sales.OrderPlaced"],
    ["", 0, False, "naïve", "é" * 100],
])
def test_deliver_arguments_read_as_py_amqp_reads_them(arguments):
    payload = b"\x00\x3c\x00\x3c" + dumps("sLbss", arguments)
    assert amqp_content.deliver_arguments(payload) == loads("sLbss", payload, 4)[0] == arguments


def test_deliver_arguments_refuse_text_that_is_not_utf8_as_py_amqp_does():
    payload = bytearray(b"\x00\x3c\x00\x3c" + dumps("sLbss", ["ab", 1, True, "", "k"]))
    payload[payload.index(b"ab"):payload.index(b"ab") + 2] = b"\xff\xfe"
    with pytest.raises(UnicodeDecodeError):
        loads("sLbss", bytes(payload), 4)
    with pytest.raises(UnicodeDecodeError):
        amqp_content.deliver_arguments(bytes(payload))


class _Channel:
    """What :func:`_dispatch_delivery` reads of a py-amqp channel, recording what it gets."""

    def __init__(self, *, auto_decode: bool = False, is_closing: bool = False) -> None:
        self.auto_decode, self.is_closing = auto_decode, is_closing
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self._callbacks = {spec.Basic.Deliver: lambda *a: self.calls.append(("listener", a))}
        self._pending = {spec.Basic.Deliver: lambda *a: self.calls.append(("one shot", a))}

    def dispatch_method(self, *args: Any) -> None:
        self.calls.append(("py-amqp", args))


class _Connection:
    def __init__(self, channel: _Channel) -> None:
        self.bytes_recv, self.channels = 0, {1: channel}

    def on_inbound_method(self, *args: Any) -> None:  # replaced below by py-amqp's own
        raise AssertionError("not called")


def _deliver(connection: Any) -> tuple[bytes, Any]:
    on_frame = amqp_content.frame_handler(
        connection, amqp.Connection.on_inbound_method.__get__(connection))
    method = b"\x00\x3c\x00\x3c" + dumps("sLbss", ["ctag", 7, True, "ex", "key"])
    on_frame((1, 1, method))
    on_frame((2, 1, b"\x00\x3c\x00\x00" + (2).to_bytes(8, "big") + header(message_id="m")))
    assert on_frame((3, 1, b"hi")) is True
    return method, connection.channels[1]


def test_a_delivery_goes_to_its_channel_listener_and_one_shot_as_py_amqp_sends_it():
    method, channel = _deliver(_Connection(_Channel()))
    [(kind, listened), (shot, once)] = channel.calls
    assert (kind, shot) == ("listener", "one shot")
    assert listened[:5] == ("ctag", 7, True, "ex", "key") and listened[5].body == b"hi"
    assert once[0] == spec.Basic.Deliver and once[1:] == listened
    assert spec.Basic.Deliver not in channel._pending  # a one-shot waiter is used up


@pytest.mark.parametrize("options", [{"auto_decode": True}, {"is_closing": True}])
def test_a_channel_that_decodes_bodies_or_is_closing_gets_py_amqps_dispatch(options):
    method, channel = _deliver(_Connection(_Channel(**options)))
    [(kind, (signature, payload, message))] = channel.calls
    assert (kind, signature, payload, message.body) == (
        "py-amqp", spec.Basic.Deliver, method, b"hi")


def test_a_delivery_on_a_closed_connection_raises_as_py_amqp_does():
    connection = _Connection(_Channel())
    connection.channels = None  # type: ignore[assignment]
    with pytest.raises(RecoverableConnectionError):
        _deliver(connection)


def test_a_started_message_has_the_fields_py_amqp_gives_it():
    def fields(message: Any) -> dict[str, Any]:
        return {name: getattr(message, name) for cls in type(message).__mro__
                for name in getattr(cls, "__slots__", ())}

    method = spec.Basic.Deliver
    started = amqp_content._Message.started(method, b"args")
    assert fields(started) == fields(amqp_content._Message(frame_method=method,
                                                           frame_args=b"args"))
