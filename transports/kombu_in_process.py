"""memory://, the broker kombu keeps in this process, reached without kombu's producer and
consumer machinery: the messages :mod:`.kombu_publishing` puts on its queues
(:func:`in_process_message`, the fields kombu's ``Producer.publish`` gives them) and the
messages :mod:`.kombu_consuming` takes from them (:class:`InProcessMessage`, what kombu's
``Message`` shows a delivery). Messages stay in kombu's format, so kombu's own channels
(a foreign producer, ``basic_get`` of the tools) read and write the same queues."""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import Any

#: Delivery tags of the messages this process puts on memory:// (``m1``, ``m2``, ...): one
#: count for every channel, so that no two messages share a tag; drawn in C, without the
#: random bytes and the ``UUID`` object of kombu's own tag (which it makes per message).
_TAGS = map("m{}".format, itertools.count(1)).__next__


def in_process_tags(channel: Any) -> None:
    """Give a memory:// ``channel`` the process's cheap delivery tags (a tag only has to be
    unique among the messages of the process's broker)."""
    channel._next_delivery_tag = _TAGS


def in_process_message(body: bytes, content_type: Any, content_encoding: Any,
                       headers: Mapping[str, str], exchange: str,
                       routing_key: str) -> dict[str, Any]:
    """The message kombu's ``Producer.publish`` puts on a memory:// queue for ``body``
    (bytes, ``content_type`` given: not serialized, ``binary`` when it names no encoding),
    persistent, priority 0; the body kept as it is (``body_encoding`` ``None``, which
    kombu's channels read as such) instead of base64 text."""
    return {"body": body, "content-encoding": content_encoding or "binary",
            "content-type": content_type, "headers": dict(headers),
            "properties": {"delivery_mode": 2, "priority": 0, "body_encoding": None,
                           "delivery_tag": _TAGS(),
                           "delivery_info": {"exchange": exchange,
                                             "routing_key": routing_key}}}


#: Topic bindings' patterns, compiled once each (as kombu's topic exchange keeps them).
_PATTERNS: dict[str, re.Pattern[str]] = {}


def routed_queues(channel: Any, exchange: str, routing_key: str) -> AbstractSet[str]:
    """The queues a memory:// ``exchange`` routes ``routing_key`` to, as kombu routes it:
    for a topic exchange, every binding whose key is ``routing_key`` or whose pattern
    matches it (kombu's own look-up, a function call a binding, otherwise); none when the
    exchange has no bindings at all. A topic exchange's answer is remembered on the
    channel per routing key, with the bindings it was worked out from: used again while
    the exchange's bindings are still those (compared, not trusted)."""
    try:
        declared = channel.state.exchanges[exchange]
        table = declared["table"]
    except KeyError:
        return frozenset()
    if declared.get("type") != "topic":
        return set(channel.typeof(exchange).lookup(table, exchange, routing_key, None))
    try:
        routes = channel.idembus_routes
    except AttributeError:
        routes = channel.idembus_routes = {}
    remembered: tuple[list[Any], frozenset[str]] | None = routes.get((exchange, routing_key))
    if remembered is not None and remembered[0] == table:  # the same bindings: the same
        return remembered[1]                                # queues (one compare, in C)
    found = frozenset(_matched(table, routing_key))
    routes[exchange, routing_key] = (list(table), found)
    return found


def _matched(table: list[Any], routing_key: str) -> set[str]:
    """The queues of the topic bindings in ``table`` that ``routing_key`` matches."""
    found = set()
    for key, pattern, queue in table:
        if key == routing_key:  # a key matches its own pattern
            found.add(queue)
            continue
        if pattern is None:
            continue
        compiled = _PATTERNS.get(pattern)
        if compiled is None:
            compiled = _PATTERNS[pattern] = re.compile(pattern)
        if compiled.match(routing_key):
            found.add(queue)
    return found


class InProcessMessage:
    """A message taken from a memory:// queue, with what kombu's ``Message`` shows of it to
    a delivery (:class:`~.kombu_delivery._KombuDelivery`): body (decoded from its
    ``body_encoding``, never decompressed), content type and encoding, headers, properties,
    delivery info and tag, channel. Taken off the queue already, it needs no broker to be
    acknowledged: :meth:`ack` only notes it; a requeue puts a copy back (the delivery
    does that through :attr:`channel`)."""

    __slots__ = ("body", "channel", "content_encoding", "content_type", "delivery_info",
                 "delivery_tag", "headers", "properties", "acknowledged")

    def __init__(self, raw: Mapping[str, Any], channel: Any) -> None:
        properties = raw["properties"]
        body = raw.get("body")
        encoding = properties.get("body_encoding")
        if body and encoding:
            body = channel.decode_body(body, encoding)
        self.body = body
        self.channel = channel
        self.content_type = raw.get("content-type")
        self.content_encoding = raw.get("content-encoding")
        self.headers = raw.get("headers") or {}
        self.properties = properties
        self.delivery_info = properties.get("delivery_info") or {}
        self.delivery_tag = properties.get("delivery_tag")
        self.acknowledged = False

    def ack(self, multiple: bool = False) -> None:
        """Note the message acknowledged (it left its queue when it was taken)."""
        self.acknowledged = True
