"""Message hierarchies on the wire: the ``idembus.enclosed_types`` header and the routing
keys of events that derive from other events.

A message of ``OrderPlaced(OrderEvent)`` carries ``idembus.enclosed_types:
sales.OrderPlaced,sales.OrderEvent`` (most derived first; a name is followed by ``:N``
where its ``message_version`` N is above 1). An endpoint that knows only ``OrderEvent``
decodes the body as an ``OrderEvent``.

On the topic exchange an event without message-type bases keeps its wire name as routing
key. An event with bases is published with a key of one word per enclosed type, between
two ``~`` words: ``~.sales~OrderPlaced.sales~OrderEvent.~`` (a name's own dots written
``~``, which wire names cannot hold, so that each name is one word). A subscriber of a type
binds its exact name (events without bases, foreign and older publishers) and
``#.<name with ~>.#``: one publish reaches every queue subscribed to any enclosed type, one
copy each. The ``~`` words at both ends let kombu's emulated topic exchanges (memory://,
Redis), whose ``#`` needs the dot beside it, match a name at either end as RabbitMQ does.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import ConfigurationError
from .messages import Event, Message, enclosed_types, message_name, message_version
from .wire import parse_version

#: What a wire name's dots are written as inside a routing key word (no wire name has it).
_DOT = "~"
#: The first and last word of a hierarchy's routing key.
_EDGE = "~"
#: The AMQP limit of a routing key (and of a binding key), in bytes.
MAX_ROUTING_KEY_BYTES = 255


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


def binding_keys(name: str) -> tuple[str, str]:
    """The binding keys of a subscription to the event type ``name``: its exact name, and
    the pattern that matches it anywhere in a hierarchy's routing key."""
    return name, f"#.{_word(name)}.#"


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
