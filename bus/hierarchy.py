r"""Message hierarchies on the wire: the ``idembus.enclosed_types`` header and the routing
keys of events that derive from other events.

A message of ``OrderPlaced(OrderEvent)`` carries ``idembus.enclosed_types:
sales.OrderPlaced,sales.OrderEvent`` (most derived first; a name is followed by ``:N``
where its ``message_version`` N is above 1). An endpoint that knows only ``OrderEvent``
decodes the body as an ``OrderEvent``.

On the topic exchange an event without message-type bases keeps its wire name as routing
key. An event with bases is published with a key of one word per enclosed type, between
two ``~`` words: ``~.sales~OrderPlaced.sales~OrderEvent.~`` (a name's own dots written
``~``, which wire names cannot hold, so that each name is one word). A subscriber of a type
binds its exact name (events without bases, foreign and older publishers) and the
patterns ``~.<name with ~>.#`` and ``~.#.<name with ~>.#``: one publish reaches every queue
subscribed to any enclosed type, one copy each. The ``~`` words at both ends let kombu's
emulated topic exchanges (memory://, Redis), whose ``#`` needs the dot beside it, match a
name at either end as RabbitMQ does (RabbitMQ needs only the second pattern, kombu's
emulation both; the same topology is declared everywhere).

Bindings are anchored at the first word: no binding starts with ``#``, so only a routing key
that is the exact name, or that starts with the ``~`` word, reaches a subscriber. An account
that RabbitMQ's topic permissions restrict to keys such as ``^partner\.`` cannot reach a
subscriber of another type (before, ``#.<name>.#`` matched ``partner.sales~RefundApproved``);
one allowed to publish the hierarchies of its own types is given
``^~(\.partner~[^.]+)+\.~$``. And the consumer checks the key against the headers
(:func:`unexpected_routing_key`): a delivery from the events exchange whose routing key is
neither its type's name nor the hierarchy key of its ``idembus.enclosed_types`` goes to the
error queue — so a key that reached a queue cannot be paired with a type header of another's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from . import headers as h
from .errors import ConfigurationError
from .messages import Event, Message, enclosed_types, message_name, message_version
from .wire import parse_version, shown

#: What a wire name's dots are written as inside a routing key word (no wire name has it).
_DOT = "~"
#: The first and last word of a hierarchy's routing key.
_EDGE = "~"
#: The AMQP limit of a routing key (and of a binding key), in bytes.
MAX_ROUTING_KEY_BYTES = 255


#: The class attribute :func:`type_headers` keeps its answer in (each class its own).
_TYPE_HEADERS = "__idembus_type_headers__"


def type_headers(message_type: type[Message]) -> Mapping[str, str]:
    """The headers every message of ``message_type`` carries, whoever sends it:
    ``idembus.message_type``, ``idembus.message_version`` and ``idembus.enclosed_types``.
    Worked out at the class's first send and kept on the class itself (a subclass has its
    own), so a send does not walk the class's MRO again. Read it, never change it."""
    cached: dict[str, str] | None = message_type.__dict__.get(_TYPE_HEADERS)
    if cached is None:
        cached = {h.MESSAGE_TYPE: message_name(message_type),
                  h.MESSAGE_VERSION: str(message_version(message_type)),
                  h.ENCLOSED_TYPES: enclosed_header(message_type)}
        setattr(message_type, _TYPE_HEADERS, cached)
    return cached


def enclosed_header(message_type: type[Message]) -> str:
    """The ``idembus.enclosed_types`` value of ``message_type``."""
    return ",".join(_entry(cls) for cls in enclosed_types(message_type))


def _entry(cls: type[Message]) -> str:
    version = message_version(cls)
    return message_name(cls) if version == 1 else f"{message_name(cls)}:{version}"


def parse_enclosed(value: str | None) -> list[tuple[str, int]]:
    """The (wire name, version) pairs of an ``idembus.enclosed_types`` value, in order;
    entries that cannot be read are left out (the header only helps a receiver that does
    not know ``idembus.message_type``)."""
    pairs: list[tuple[str, int]] = []
    for item in (value or "").split(","):
        name, _, version = item.strip().partition(":")
        if not name:
            continue
        if not version:
            pairs.append((name, 1))
        elif (number := parse_version(version)) is not None:
            pairs.append((name, number))
    return pairs


def routing_key(names: Sequence[str]) -> str:
    """The routing key of an event enclosing the types ``names`` (most derived first)."""
    if len(names) <= 1:
        return names[0] if names else ""
    return ".".join([_EDGE, *(_word(name) for name in names), _EDGE])


def routing_key_of(message_type: type[Message]) -> str:
    """The routing key events of ``message_type`` are published with."""
    return routing_key([message_name(cls) for cls in enclosed_types(message_type)])


def binding_keys(name: str) -> tuple[str, str, str]:
    """The binding keys of a subscription to the event type ``name``: its exact name, and
    the patterns that match it as the first or any later word of a hierarchy's routing key,
    both anchored at the key's first word (``~``), never starting with ``#``."""
    word = _word(name)
    return name, f"{_EDGE}.{word}.#", f"{_EDGE}.#.{word}.#"


def legacy_binding_key(name: str) -> str:
    """The unanchored pattern earlier idembus versions bound for ``name`` (``#.<name>.#``),
    which any routing key containing the word matched; ``declare`` removes it."""
    return f"#.{_word(name)}.#"


def expected_routing_key(message_type: str, enclosed: str | None) -> str:
    """The routing key an event with these ``idembus.message_type`` and
    ``idembus.enclosed_types`` values is published with: the hierarchy key when the
    enclosed types are several and start with the type, else the type's name."""
    if not enclosed or "," not in enclosed:  # one type at most: nothing to parse
        return message_type
    names = [name for name, _ in parse_enclosed(enclosed)]
    if len(names) > 1 and names[0] == message_type:
        return routing_key(names)
    return message_type


def unexpected_routing_key(routing: str, message_type: str | None,
                           enclosed: str | None) -> str | None:
    """Why a delivery that came through the events exchange with key ``routing`` does not
    belong to its headers (``None``: it does). Its key must be its type's name or the
    hierarchy key of its enclosed types, so that an account allowed to publish some keys
    cannot reach a subscriber of another type by setting that type's header."""
    if message_type is None:
        return None  # refused later, for the missing header
    if routing == message_type or routing == expected_routing_key(message_type, enclosed):
        return None
    return (f"its routing key {shown(routing)} is neither its type "
            f"{shown(message_type)} nor that type's hierarchy key: it was published with "
            "another type's key (refused, not handled)")


def _word(name: str) -> str:
    return name.replace(".", _DOT)


def key_bytes(key: str) -> int:
    """How many bytes ``key`` takes on the wire."""
    return len(key.encode("utf-8"))


def check_routing_keys(message_types: Sequence[type[Message]]) -> None:
    """Refuse, when an endpoint is built, an event type whose routing key or binding key
    would exceed the AMQP limit of 255 bytes (a deep hierarchy of long names)."""
    for message_type in message_types:
        if not issubclass(message_type, Event):
            continue
        keys = (routing_key_of(message_type), *binding_keys(message_name(message_type)))
        longest = max(keys, key=key_bytes)
        if key_bytes(longest) > MAX_ROUTING_KEY_BYTES:
            raise ConfigurationError(
                f"{message_type.__qualname__}: its routing key {longest[:60]!r}... takes "
                f"{key_bytes(longest)} bytes, over the AMQP limit of {MAX_ROUTING_KEY_BYTES}; "
                "give it and its base events shorter names (message_name=...)")
