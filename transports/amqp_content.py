"""Reading RabbitMQ's content headers without py-amqp's generic table reader.

py-amqp reads a delivery's content header (its basic properties and headers table)
through ``decode_properties_basic`` and ``loads``: per table item a format look-up, a
``chr``, a ``struct`` call and a helper that decodes the text. :func:`frame_handler` is
py-amqp's own frame handler (the same frames, states and errors) whose messages read a
basic content header with :func:`decode_basic`: the same properties, the same values
(text as py-amqp decodes it, bytes where it is not UTF-8), for a table whose values are
all long strings, as idembus' are; any other table, or a payload that is not ``bytes``,
is read by py-amqp's reader as before.

A whole ``basic.deliver`` (method, header, body) then goes to its channel as py-amqp's
``dispatch_method`` would send it, with its arguments read by :func:`deliver_arguments`
instead of py-amqp's generic ``loads`` (a format string walked item by item): the same
values, the same listeners, the same checks (:func:`_dispatch_delivery`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from struct import Struct
from typing import Any

import amqp
from amqp import spec
from amqp.exceptions import RecoverableConnectionError, UnexpectedFrame
from amqp.serialization import decode_properties_basic

#: Methods whose content (header, then body) follows them.
_CONTENT_METHODS = frozenset([spec.Basic.Return, spec.Basic.Deliver, spec.Basic.GetOk])
_SHORT, _LONG, _OCTET = Struct(">H").unpack_from, Struct(">I").unpack_from, Struct(">B")
_TIMESTAMP = _LONGLONG = Struct(">Q").unpack_from
_DELIVER = spec.Basic.Deliver
#: How a basic content header's payload starts: its class id.
_BASIC_CLASS = spec.Basic.CLASS_ID.to_bytes(2, "big")
_METHOD = Struct(">HH").unpack_from
#: The short-string properties after the headers and the octets, by flag bit, in order.
_LATER: tuple[tuple[int, str], ...] = (
    (0x0400, "correlation_id"), (0x0200, "reply_to"), (0x0100, "expiration"),
    (0x0080, "message_id"))
_LAST: tuple[tuple[int, str], ...] = (
    (0x0020, "type"), (0x0010, "user_id"), (0x0008, "app_id"), (0x0004, "cluster_id"))
_S = ord("S")
_UTF8, _ERRORS = "utf-8", "surrogatepass"  # as py-amqp decodes text
#: Where a content header may have a header name that starts with ``x-``: such a name is
#: these bytes after its size octet; their absence from the header proves there is none.
_BROKER_NAME = b"x-"


def decode_basic(buf: bytes, offset: int) -> tuple[dict[str, Any], int]:
    """The basic properties at ``offset`` of ``buf`` and the offset after them, as
    py-amqp's ``decode_properties_basic`` reads them; through it for a headers table with
    a value that is not a long string."""
    start = offset
    (flags,) = _SHORT(buf, offset)
    offset += 2
    properties: dict[str, Any] = {}
    wide = 0  # octets beyond one a character in the short strings: 0 when all are ASCII
    if flags & 0x8000:
        size = buf[offset]
        properties["content_type"] = text = buf[offset + 1:offset + 1 + size].decode(
            _UTF8, _ERRORS)
        offset += 1 + size
        wide += size - len(text)
    if flags & 0x4000:
        size = buf[offset]
        properties["content_encoding"] = text = buf[offset + 1:offset + 1 + size].decode(
            _UTF8, _ERRORS)
        offset += 1 + size
        wide += size - len(text)
    if flags & 0x2000:
        (size,) = _LONG(buf, offset)
        offset += 4
        limit = offset + size
        ascii_table = _ascii_table(buf, offset, limit)
        if ascii_table is not None:
            properties["application_headers"] = ascii_table
            offset = limit
        else:
            table: dict[Any, Any] = {}
            while offset < limit:
                key_size = buf[offset]
                raw_key = buf[offset + 1:offset + 1 + key_size]
                offset += 1 + key_size
                if buf[offset] != _S:
                    return decode_properties_basic(buf, start)  # type: ignore[no-any-return]
                (value_size,) = _LONG(buf, offset + 1)
                offset += 5
                raw_value = buf[offset:offset + value_size]
                offset += value_size
                try:
                    key: Any = raw_key.decode(_UTF8, _ERRORS)
                except UnicodeDecodeError:
                    key = raw_key
                try:
                    table[key] = raw_value.decode(_UTF8, _ERRORS)
                except UnicodeDecodeError:
                    table[key] = raw_value
            properties["application_headers"] = table
    if flags & 0x1000:
        properties["delivery_mode"] = buf[offset]
        offset += 1
    if flags & 0x0800:
        properties["priority"] = buf[offset]
        offset += 1
    for bit, name in _LATER:
        if flags & bit:
            size = buf[offset]
            properties[name] = text = buf[offset + 1:offset + 1 + size].decode(_UTF8, _ERRORS)
            offset += 1 + size
            wide += size - len(text)
    if flags & 0x0040:
        (properties["timestamp"],) = _TIMESTAMP(buf, offset)
        offset += 8
    for bit, name in _LAST:
        if flags & bit:
            size = buf[offset]
            properties[name] = text = buf[offset + 1:offset + 1 + size].decode(_UTF8, _ERRORS)
            offset += 1 + size
            wide += size - len(text)
    read = properties.get("application_headers")
    if type(read) is TextTable and wide:  # plain: the short strings are ASCII too
        read.plain = False
    return properties, offset


class TextTable(dict):  # type: ignore[type-arg]
    """A headers table :func:`decode_basic` read from ASCII bytes alone: every name and
    value is ``str``, as py-amqp would decode it, and valid UTF-8 text. ``plain``: every
    short-string property of its content header is ASCII too, and no header name starts
    with ``x-`` (a broker's own: dead-letter history, delivery counts), so that a
    consumer may take the headers as they are, without checking them again."""

    __slots__ = ("plain",)

    def __init__(self) -> None:
        super().__init__()
        self.plain = False


def _ascii_table(buf: bytes, offset: int, limit: int) -> TextTable | None:
    """The headers table in ``buf[offset:limit]`` when it holds only ASCII bytes and only
    long-string values: decoded once as a whole (an ASCII character is one byte, so the
    sizes the table gives in bytes are sizes in characters), each name and value a slice
    of that text. ``None`` for any other table, or one whose sizes do not add up: the
    caller reads it byte by byte, or py-amqp's reader does."""
    raw = buf[offset:limit]
    if not raw.isascii():
        return None
    text = raw.decode("ascii")
    size = limit - offset
    table = TextTable()
    table.plain = _BROKER_NAME not in raw  # may be in a size too: then not plain, wrongly
    at = 0
    while at < size:
        key_at = at + 1
        value_at = key_at + raw[at]  # the type octet, then the value's size
        if value_at + 5 > size or raw[value_at] != _S:
            return None
        (value_size,) = _LONG(raw, value_at + 1)
        at = value_at + 5 + value_size
        if at > size:
            return None
        table[text[key_at:value_at]] = text[value_at + 5:at]
    return table


def deliver_arguments(buf: bytes) -> list[Any]:
    """``basic.deliver``'s arguments in its method frame's payload ``buf`` — consumer tag,
    delivery tag, redelivered, exchange, routing key — as py-amqp's ``loads("sLbss", buf,
    4)`` reads them."""
    size = buf[4]
    offset = 5 + size
    consumer_tag = buf[5:offset].decode(_UTF8, _ERRORS)
    (delivery_tag,) = _LONGLONG(buf, offset)
    redelivered = buf[offset + 8] & 1 == 1
    size = buf[offset + 9]
    start, offset = offset + 10, offset + 10 + size
    exchange = buf[start:offset].decode(_UTF8, _ERRORS)
    size = buf[offset]
    routing_key = buf[offset + 1:offset + 1 + size].decode(_UTF8, _ERRORS)
    return [consumer_tag, delivery_tag, redelivered, exchange, routing_key]


def _dispatch_delivery(connection: Any, channel_id: int, msg: Any) -> None:
    """What py-amqp's ``Connection.on_inbound_method`` and ``AbstractChannel.
    dispatch_method`` do with a whole ``basic.deliver``, its arguments read by
    :func:`deliver_arguments`; a channel that would decode the body, or a payload that
    is not ``bytes``, goes through them as before."""
    channels = connection.channels
    if channels is None:
        raise RecoverableConnectionError("Connection already closed")
    channel = channels[channel_id]
    buf = msg.frame_args
    if channel.auto_decode or type(buf) is not bytes or channel.is_closing:
        channel.dispatch_method(_DELIVER, buf, msg)
        return
    listener = channel._callbacks.get(_DELIVER)
    one_shot = channel._pending.pop(_DELIVER, None)
    if listener is None and one_shot is None:
        return
    arguments = deliver_arguments(buf)
    arguments.append(msg)
    if listener is not None:
        listener(*arguments)
    if one_shot:
        one_shot(_DELIVER, *arguments)


class _Message(amqp.Message):  # type: ignore[misc]
    """py-amqp's message, whose basic content header :func:`decode_basic` reads."""

    @classmethod
    def started(cls, frame_method: tuple[int, int], frame_args: bytes) -> _Message:
        """``_Message(frame_method=frame_method, frame_args=frame_args)``: the fields
        py-amqp's ``Message`` and ``GenericContent`` set, in one call instead of two with
        their keywords."""
        msg = cls.__new__(cls)
        msg.frame_method, msg.frame_args, msg.properties = frame_method, frame_args, {}
        msg._pending_chunks, msg.body_received, msg.body_size = [], 0, 0
        msg.ready, msg.delivery_info, msg.body, msg.channel = False, None, "", None
        return msg

    def _load_properties(self, class_id: int, buf: Any, offset: int) -> int:
        if class_id != spec.Basic.CLASS_ID or type(buf) is not bytes:
            return super()._load_properties(class_id, buf, offset)  # type: ignore[no-any-return]
        self.properties, offset = decode_basic(buf, offset)
        return offset


def frame_handler(connection: Any, callback: Callable[..., Any], *,
                  reread: Callable[[bytes], bytes] | None = None) -> Callable[[Any], bool]:
    """py-amqp's frame handler (``amqp.method_framing.frame_handler``), step for step,
    with :class:`_Message` for the content that comes with a method. ``reread``: what a
    content header that raises ``UnicodeDecodeError`` is read again as (else it raises).
    A delivery goes to its channel through :func:`_dispatch_delivery` when ``callback`` is
    the connection's own ``on_inbound_method``."""
    expected_types: defaultdict[int, int] = defaultdict(lambda: 1)
    partial_messages: dict[int, _Message] = {}
    quick_deliveries = (getattr(callback, "__self__", None) is connection
                        and getattr(callback, "__func__", None)
                        is amqp.Connection.on_inbound_method)

    def on_frame(frame: Any) -> bool:
        frame_type, channel, buf = frame
        connection.bytes_recv += 1
        if frame_type not in (expected_types[channel], 8):
            raise UnexpectedFrame(
                f"Received frame {frame_type} while expecting type: "
                f"{expected_types[channel]}")
        if frame_type == 1:
            method_sig = _METHOD(buf, 0)
            if method_sig in _CONTENT_METHODS:
                partial_messages[channel] = _Message.started(method_sig, buf)
                expected_types[channel] = 2
                return False
            callback(channel, method_sig, buf, None)
            return True
        if frame_type == 2:
            msg = partial_messages[channel]
            try:
                if type(buf) is bytes and buf[:2] == _BASIC_CLASS:  # inbound_header's work
                    (msg.body_size,) = _LONGLONG(buf, 4)
                    msg.properties, _ = decode_basic(buf, 12)
                    if not msg.body_size:
                        msg.ready = True
                else:
                    msg.inbound_header(buf)
            except UnicodeDecodeError:
                if reread is None:
                    raise
                msg.inbound_header(reread(bytes(buf)))
            if not msg.ready:
                expected_types[channel] = 3
                return False
        elif frame_type == 3:
            msg = partial_messages[channel]
            # py-amqp's inbound_body, for a body in one frame without its call
            received = msg.body_received + len(buf)
            if received >= msg.body_size and not msg._pending_chunks:
                msg.body_received, msg.body, msg.ready = received, buf, True
            else:
                msg.inbound_body(buf)
                if not msg.ready:
                    return False
        else:  # a heartbeat
            return False
        # a method's content complete: to its channel
        expected_types[channel] = 1
        partial_messages.pop(channel, None)
        if msg.frame_method == _DELIVER and quick_deliveries:
            _dispatch_delivery(connection, channel, msg)
        else:
            callback(channel, msg.frame_method, msg.frame_args, msg)
        return True

    return on_frame
