"""What the kombu transport does so that a message is taken as the broker holds it: bodies
kept raw (never decompressed nor decoded by kombu or py-amqp), content types and encodings
sent back as the bytes they arrived as, and content headers whose short strings are not
UTF-8 read with surrogate escapes instead of stopping the consumer."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import amqp.method_framing

from . import amqp_content


class _RawBody:
    """Mixed into a channel's kombu ``Message`` class: the body stays as the broker holds
    it. kombu decompresses a body with a ``compression`` header while it builds the
    message — before anyone could refuse it — unless the message already has errors, so
    the message has one while it is built and none after."""

    errors: list[Any] | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.errors = [(None, None, None)]
        super().__init__(*args, **kwargs)
        self.errors = []


class _RawAmqpBody(_RawBody):
    """:class:`_RawBody` for kombu's message of py-amqp (``kombu.transport.pyamqp.
    Message``, called with py-amqp's message and the channel): its fields set here as
    that class and kombu's base set them from py-amqp's message — body, tag, content
    type and encoding, delivery info, headers, properties — in one call instead of three
    with their keywords, the body kept raw; any other call goes through them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if len(args) != 1 or kwargs.keys() - {"channel"}:
            super().__init__(*args, **kwargs)
            return
        (msg,) = args
        properties = msg.properties
        info = msg.delivery_info
        self.errors = []
        self.channel = kwargs.get("channel")
        self.delivery_tag = info.get("delivery_tag")  # py-amqp's delivery_tag property
        self.content_type = properties.get("content_type")
        self.content_encoding = properties.get("content_encoding")
        self.delivery_info = info or {}
        self.headers = properties.get("application_headers") or {}
        self.properties = properties or {}
        self._decoded_cache = None
        self._state = "RECEIVED"
        self.accept = None
        self.body = msg.body


def _as_bytes(body: Any, encoding: str | None) -> bytes:
    """The body's bytes. Channels here do not decode bodies (:meth:`KombuTransport.
    _raw_channel`); should a driver have decoded one anyway, it is encoded back with the
    encoding it was decoded by, never re-encoded as UTF-8 (a latin-1 ``b"\\xe9"`` would
    become ``b"\\xc3\\xa9"``). An empty body stays empty (``"".encode("utf-16")`` is a
    byte order mark)."""
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        if not body:  # py-amqp's body of a message without one (no body frame)
            return b""
        try:
            return body.encode(encoding or "utf-8", "surrogateescape")
        except LookupError:  # an encoding Python does not know cannot have decoded it
            return body.encode("utf-8", "surrogateescape")
    return bytes(body)


def _as_sent(text: str | None) -> Any:
    """A content type or encoding as its bytes went over the wire: text that a content
    header carried as bytes that are not UTF-8 (see :func:`_lenient_frames`) goes back out
    as those bytes (py-amqp writes bytes as they are), not as the escapes."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            return text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # surrogates that were on the wire as such
            return text.encode("utf-8", "surrogatepass")
    return text


#: The properties of a basic content header, by flag bit, in wire order, by kind: a short
#: string (``s``), the headers table (``F``), an octet (``o``), a timestamp (``T``).
_PROPERTIES = ((0x8000, "s"), (0x4000, "s"), (0x2000, "F"), (0x1000, "o"), (0x0800, "o"),
               (0x0400, "s"), (0x0200, "s"), (0x0100, "s"), (0x0080, "s"), (0x0040, "T"),
               (0x0020, "s"), (0x0010, "s"), (0x0008, "s"), (0x0004, "s"))
#: Where a content header's property flags start: after class id, weight and body size.
_FLAGS_AT = 12
_SHORTSTR_MAX = 255


def _lenient_frames(connection: Any, callback: Any, **options: Any) -> Callable[[Any], Any]:
    """py-amqp's frame reader for the connections here, except for a content header whose
    short-string properties (content type and encoding, message id, type, ...) are not
    UTF-8: py-amqp raised ``UnicodeDecodeError`` on it, the consumer died, and the broker
    gave the same message to the next one — one message stopped an endpoint for good.
    Such a header is read again with those bytes as surrogate escapes (at most 255 bytes
    of them), so the message arrives: a content type or encoding that is not text is
    refused, and so is a core property (``message_id``, ``type``, ... read as idembus
    headers, :mod:`.amqp_properties`) that is not, as an ``idembus.*`` header would be."""
    if not options:  # py-amqp's handler with a faster reader of content headers
        return amqp_content.frame_handler(connection, callback, reread=_escaped_header)
    on_frame = amqp.method_framing.frame_handler(connection, callback, **options)

    def on_any_frame(frame: Any) -> Any:
        try:
            return on_frame(frame)
        except UnicodeDecodeError:
            frame_type, channel, payload = frame
            if frame_type != 2:  # only a content header carries what a publisher chose
                raise
            return on_frame((frame_type, channel, _escaped_header(bytes(payload))))

    return on_any_frame


def _escaped_header(payload: bytes) -> bytes:
    """A basic content header with every short string that is not UTF-8 escaped."""
    (flags,) = struct.unpack_from(">H", payload, _FLAGS_AT)
    offset = _FLAGS_AT + 2
    rewritten = bytearray(payload[:offset])
    for bit, kind in _PROPERTIES:
        if not flags & bit:
            continue
        if kind == "s":
            size = payload[offset]
            text = _escaped(payload[offset + 1:offset + 1 + size])
            rewritten += bytes([len(text)]) + text
            offset += 1 + size
            continue
        (size,) = struct.unpack_from(">I", payload, offset) if kind == "F" else (0,)
        width = {"F": 4 + size, "o": 1, "T": 8}[kind]
        rewritten += payload[offset:offset + width]
        offset += width
    return bytes(rewritten + payload[offset:])


def _escaped(raw: bytes) -> bytes:
    """``raw`` if it is UTF-8 (surrogates allowed, as py-amqp reads it); else its
    surrogate-escaped form, cut to a short string's 255 bytes between characters."""
    try:
        raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", "surrogateescape")
        escaped = text.encode("utf-8", "surrogatepass")
        while len(escaped) > _SHORTSTR_MAX:
            text = text[:-1]
            escaped = text.encode("utf-8", "surrogatepass")
        return escaped
    return raw

