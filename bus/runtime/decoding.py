"""Turning a delivery into a message, or into the reason it cannot be one; noticing the
messages of ordered types that arrive without their key (:class:`UnorderedArrivals`).

A handler's ordering declaration (``ordered=True``, ``ordered_by=`` on the handler) reaches
only the senders that know the handler (:mod:`idembus.routing`): another service that only
routes the command sends it without a key. Such a message is handled like any other
(deduplicated, its aggregate's state kept right), but not in order with its key: the
endpoint counts it (``unordered``) and says so once per type.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping

import pydantic

from .. import headers as h
from ..errors import InvalidMessage, MalformedMessage
from ..evolution import upcast_body
from ..hierarchy import parse_enclosed
from ..logs import loggable, message_logger
from ..messages import Message, message_name, message_version
from ..registry import MessageRegistry
from ..routing import Router
from ..signals import EndpointSignals
from ..wire import parse_version

_JSON_MEDIA_TYPES = ("", h.CONTENT_TYPE)

log = message_logger(__name__)


def decode(
    headers: Mapping[str, str], body: bytes, content_type: str | None, registry: MessageRegistry
) -> Message:
    """Validate the headers and body of an incoming message and build the message.

    The type is ``idembus.message_type`` (a name or an alias the endpoint knows); if the
    endpoint does not know it, the first type of ``idembus.enclosed_types`` it knows (a
    base type it handles). A body of an older version is upcast first
    (:mod:`idembus.evolution`). Raises ``MalformedMessage``, ``UnknownMessageType`` or
    ``InvalidMessage`` with a reason a person can act on.
    """
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type not in _JSON_MEDIA_TYPES:  # parameters such as charset do not matter
        raise MalformedMessage(f"content type {content_type!r} is not {h.CONTENT_TYPE}")
    for required in (h.MESSAGE_ID, h.MESSAGE_TYPE):
        if not headers.get(required):
            raise MalformedMessage(f"the {required} header is missing")
    message_type, version, name = resolve(headers, registry)
    try:
        if version == message_version(message_type):
            return message_type.model_validate_json(body)
        return message_type.model_validate(upcast_body(message_type, _parsed(body), version))
    except pydantic.ValidationError as exc:
        if any(error["type"] == "json_invalid" for error in exc.errors()):
            raise MalformedMessage(f"the body is not valid JSON: {_first_error(exc)}") from exc
        raise InvalidMessage(f"the body does not match {name}: {_summary(exc)}") from exc


def resolve(headers: Mapping[str, str],
            registry: MessageRegistry) -> tuple[type[Message], int, str]:
    """The class a message is decoded as, the version its body is in, and the wire name
    it was found by: ``idembus.message_type`` with ``idembus.message_version`` (absent:
    1), else the first known entry of ``idembus.enclosed_types``."""
    name = headers[h.MESSAGE_TYPE]
    if name in registry:
        return registry.resolve(name), wire_version(headers), name
    for enclosed, version in parse_enclosed(headers.get(h.ENCLOSED_TYPES)):
        if enclosed != name and enclosed in registry:
            return registry.resolve(enclosed), version, enclosed
    return registry.resolve(name), 1, name  # raises UnknownMessageType


def wire_version(headers: Mapping[str, str]) -> int:
    """The ``idembus.message_version`` of a message: 1 when absent (written before versions
    existed, or by a publisher that does not set it)."""
    text = headers.get(h.MESSAGE_VERSION)
    if text is None or text == "":
        return 1
    version = parse_version(text.strip(" \t"))
    if version is None:
        raise MalformedMessage(
            f"the {h.MESSAGE_VERSION} header {text[:40]!r} is not a whole number from 1 "
            "written in ASCII digits")
    return version


def _parsed(body: bytes) -> object:
    try:
        return json.loads(body)
    except ValueError as exc:
        raise MalformedMessage(f"the body is not valid JSON: {exc}") from exc


def _first_error(exc: pydantic.ValidationError) -> str:
    return str(exc.errors()[0].get("msg", exc))


def _summary(exc: pydantic.ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in error['loc']) or 'body'}: {error['msg']}"
        for error in exc.errors()
    )


class UnorderedArrivals:
    """Notices, for one endpoint, the messages of ordered types that arrive without a key:
    :attr:`types` are the types it receives that are ordered (by their own declaration or
    a handler's, as its ``router`` knows); :meth:`arrived` counts and tells of one."""

    def __init__(self, endpoint: str, received: Iterable[type[Message]], router: Router,
                 signals: EndpointSignals) -> None:
        self._endpoint = endpoint
        self._signals = signals
        #: The types received here whose messages are ordered (empty: nothing to notice).
        self.types = frozenset(t for t in received if router.partitions_of(t))
        self._said: set[type[Message]] = set()
        self._lock = threading.Lock()

    def arrived(self, message: Message, headers: Mapping[str, str]) -> None:
        """``message``, of one of :attr:`types`, came without the ``idembus.ordering.key``
        header: count it, and say so the first time for its type."""
        cls = type(message)
        self._signals.emit("unordered", message_id=headers.get(h.MESSAGE_ID),
                           message_type=headers.get(h.MESSAGE_TYPE))
        with self._lock:
            first = cls not in self._said
            self._said.add(cls)
        if first:
            log.warning(
                "%s received %s without its ordering key: sent unordered by a sender that did "
                "not know the declaration (from %s); it is handled, but not in order with the "
                "other messages of its key (counted as 'unordered'; said once per type)",
                self._endpoint, message_name(cls), loggable(headers.get(h.ORIGINATING_ENDPOINT,
                                                                        "an unnamed sender")))
