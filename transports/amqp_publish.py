"""A ``basic.publish`` written as the bytes of its three frames, without py-amqp's
generic serialisers.

py-amqp writes a publish through ``dumps`` (its method arguments, by a format string,
item by item) and ``Message._serialize_properties`` (the content header: a loop over all
fourteen basic properties, then ``dumps`` again, the headers table item by item with a
type check each). For the messages idembus publishes — a few short-string properties, a
delivery mode and a table of text headers — :func:`frames` builds the same bytes
directly: the method frame, the content header frame and the body frame, ready for one
``sendall``. Anything else (a property or header value of another type, a name or short
string over 255 bytes, a message that needs more than one body frame) gets ``None``, and
goes through py-amqp as before.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from . import amqp_properties
from .amqp_properties import SHORTSTR_MAX

#: The basic properties :func:`frames` writes, in the content header's order, each with
#: its flag bit; all short strings except ``delivery_mode`` (an octet) and the headers.
_SHORT = ("content_type", "content_encoding")
_LATER: tuple[tuple[str, int], ...] = (
    ("correlation_id", 0x0400), ("reply_to", 0x0200), ("message_id", 0x0080),
    ("type", 0x0020), ("app_id", 0x0008))
_KNOWN = frozenset(name for name, _ in _LATER)
_LATER_FLAGS = tuple(flag for _, flag in _LATER)
#: No header goes elsewhere than the table (:func:`_table`).
_NOWHERE: Mapping[str, int] = MappingProxyType({})
#: Core header (:data:`.amqp_properties.CORE`) -> the place of its property in _LATER.
_CORE_PLACES = {header: [name for name, _ in _LATER].index(name)
                for header, name in amqp_properties.CORE}
_HEADERS_FLAG, _DELIVERY_MODE_FLAG = 0x2000, 0x1000
#: A frame's header (type, channel, size) and its end octet.
_FRAME = struct.Struct(">BHI")
_FRAME_END = b"\xce"
_LONG = struct.Struct(">I").pack
#: ``basic.publish``'s class and method ids and its ticket (0); the content header's class,
#: weight and body size.
_PUBLISH_PREFIX = struct.pack(">HHH", 60, 40, 0)
_CONTENT = struct.Struct(">HHQH")
_OCTETS = tuple(bytes((n,)) for n in range(256))
#: ``delivery_mode`` 2 (persistent), as the content header holds it.
_PERSISTENT = _OCTETS[2]
#: What a frame adds to its payload (header and end).
_OVERHEAD = 8
#: How many method frames and header names :func:`frames` keeps encoded (each memory).
_REMEMBERED = 1024
#: (channel, exchange, routing key, mandatory) -> the method frame.
_methods: dict[tuple[int, str, str, bool], bytes] = {}
#: (content type, content encoding) -> their flags and bytes in a content header.
_kinds: dict[tuple[str, str], tuple[int, bytes]] = {}
#: header name -> its length octet, bytes and type tag in a table.
_names: dict[str, bytes] = {}


def frames(channel: int, *, exchange: str, routing_key: str, mandatory: bool, body: bytes,
           headers: Mapping[str, Any] | None, frame_max: int, content_type: str,
           content_encoding: str, delivery_mode: int = 2,
           **properties: Any) -> bytes | None:
    """The frames of one ``basic.publish`` on ``channel`` (method, content header, and the
    body when it is not empty), as py-amqp writes them; ``None`` for what this does not
    write (see the module docstring)."""
    if not _KNOWN.issuperset(properties) or not 0 <= delivery_mode <= 255:
        return None
    method = _method_frame(channel, exchange, routing_key, mandatory)
    leading = _leading(content_type, content_encoding)
    if method is None or leading is None:
        return None
    flags, first = leading
    parts = [first]
    if headers is not None:  # py-amqp writes an empty table too
        table = _table(headers)
        if table is None:
            return None
        flags |= _HEADERS_FLAG
        parts.append(table)
    flags |= _DELIVERY_MODE_FLAG
    parts.append(_OCTETS[delivery_mode])
    for name, flag in _LATER:
        value = properties.get(name)
        if value is not None:
            encoded = _short(value)
            if encoded is None:
                return None
            flags |= flag
            parts.append(encoded)
    return _written(channel, method, flags, parts, body, frame_max)


def envelope_frames(channel: int, *, exchange: str, routing_key: str, mandatory: bool,
                    body: bytes, headers: Mapping[str, Any], frame_max: int,
                    content_type: str, content_encoding: str) -> bytes | None:
    """:func:`frames` of a persistent message with idembus's headers as they are, not yet
    split (:func:`.amqp_properties.split`): in one pass over them, a core header whose
    value is ASCII of at most 255 characters becomes its property, as ``split`` puts it,
    and every other header goes into the table. ``None`` for anything else — a core value
    that is not such text (``split`` then decides where it goes), or what :func:`frames`
    does not write."""
    method = _method_frame(channel, exchange, routing_key, mandatory)
    leading = _leading(content_type, content_encoding)
    if method is None or leading is None:
        return None
    shorts: list[bytes | None] = [None] * len(_LATER)
    table = _table(headers, _CORE_PLACES, shorts)
    if table is None:
        return None
    flags, first = leading
    parts = [first, table, _PERSISTENT]
    flags |= _HEADERS_FLAG | _DELIVERY_MODE_FLAG
    for flag, encoded in zip(_LATER_FLAGS, shorts, strict=True):
        if encoded is not None:
            flags |= flag
            parts.append(encoded)
    return _written(channel, method, flags, parts, body, frame_max)


def _written(channel: int, method: bytes, flags: int, parts: list[bytes], body: bytes,
             frame_max: int) -> bytes | None:
    """The three frames, from the method frame and the content header's flags and parts
    (``None`` for what does not fit a frame)."""
    header = _CONTENT.pack(60, 0, len(body), flags) + b"".join(parts)
    if max(len(method), len(header), len(body)) + 2 * _OVERHEAD > frame_max:
        return None  # a body split over frames, or a header py-amqp would refuse
    written = [method, _FRAME.pack(2, channel, len(header)), header, _FRAME_END]
    if body:
        written += (_FRAME.pack(3, channel, len(body)), body, _FRAME_END)
    return b"".join(written)


def _method_frame(channel: int, exchange: str, routing_key: str,
                  mandatory: bool) -> bytes | None:
    """The method frame (``None`` for a name over 255 bytes); the last
    :data:`_REMEMBERED` are kept (a batch publishes a few kinds many times)."""
    place = (channel, exchange, routing_key, mandatory)
    method = _methods.get(place)
    if method is not None:
        return method
    exchange_bytes = exchange.encode("utf-8", "surrogatepass")
    key_bytes = routing_key.encode("utf-8", "surrogatepass")
    if len(exchange_bytes) > 255 or len(key_bytes) > 255:
        return None
    payload = b"".join((_PUBLISH_PREFIX, _OCTETS[len(exchange_bytes)], exchange_bytes,
                        _OCTETS[len(key_bytes)], key_bytes, _OCTETS[1 if mandatory else 0]))
    method = _FRAME.pack(1, channel, len(payload)) + payload + _FRAME_END
    _remember(_methods, place, method)
    return method


def _leading(content_type: str, content_encoding: str) -> tuple[int, bytes] | None:
    """The flags and bytes of the content type and encoding (``None``: not short
    strings), kept as :func:`_method_frame` keeps its frames."""
    kind = (content_type, content_encoding)
    known = _kinds.get(kind)
    if known is not None:
        return known
    flags, parts = 0, []
    for flag, value in ((0x8000, content_type), (0x4000, content_encoding)):
        if value:
            encoded = _short(value)
            if encoded is None:
                return None
            flags |= flag
            parts.append(encoded)
    known = (flags, b"".join(parts))
    _remember(_kinds, kind, known)
    return known


def _remember(memory: dict[Any, Any], key: Any, value: Any) -> None:
    if len(memory) >= _REMEMBERED:
        memory.clear()  # a bound, not a cache policy: names are few in practice
    memory[key] = value


def _short(value: Any) -> bytes | None:
    """A short string property: its length octet and UTF-8 bytes (``None`` if it is not a
    string of at most 255 bytes)."""
    if type(value) is not str:
        return None
    encoded = value.encode("utf-8", "surrogatepass")
    if len(encoded) > 255:
        return None
    return _OCTETS[len(encoded)] + encoded


def _table(headers: Mapping[str, Any], places: Mapping[str, int] = _NOWHERE,
           shorts: list[bytes | None] | None = None) -> bytes | None:
    """A headers table of text values, each a long string (``S``), as py-amqp writes it
    (``None`` for a value that is not text, or a name over 255 bytes). A header named in
    ``places`` goes into ``shorts`` at its place instead, as a short string: ``None`` if
    its value is not ASCII of at most 255 characters."""
    items: list[bytes] = []
    names, long = _names, _LONG  # a dozen headers a message: locals, not globals
    try:
        for name, value in headers.items():
            named = names.get(name)  # never a name of ``places`` (see _name)
            if named is None:
                if name in places and shorts is not None:
                    if type(value) is not str or len(value) > SHORTSTR_MAX or (
                            not value.isascii()):
                        return None
                    shorts[places[name]] = _OCTETS[len(value)] + value.encode()
                    continue
                named = _name(name)
                if named is None:
                    return None
            value_bytes = value.encode("utf-8", "surrogatepass")
            items += (named, long(len(value_bytes)), value_bytes)
    except AttributeError:  # a value that is not text (no ``encode``): py-amqp writes it
        return None
    content = b"".join(items)
    return _LONG(len(content)) + content


def _name(name: str) -> bytes | None:
    """A header name's length octet, bytes and value type tag (``S``) in a table, kept in
    :data:`_names` unless it is a core header's; ``None`` for a name over 255 bytes (or
    not text)."""
    if type(name) is not str:
        return None
    name_bytes = name.encode("utf-8", "surrogatepass")
    if len(name_bytes) > 255:
        return None
    named = _OCTETS[len(name_bytes)] + name_bytes + b"S"
    if name not in _CORE_PLACES:  # a core header's name is looked up in places first
        _remember(_names, name, named)
    return named
