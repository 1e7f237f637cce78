"""A delivery of the kombu transport (:class:`_KombuDelivery`), and how tools give
deliveries back: natively on RabbitMQ, as a copy to their own queue on memory:// and
redis://."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import kombu

from .. import headers as h
from .. import hierarchy, wire
from ..wire import encoding_problem as _encoding_problem
from ..wire import joined as _joined
from . import amqp_properties, delays
from .amqp_content import TextTable
from .base import Delivery
from .errors import TransportUnavailable
from .kombu_frames import _as_bytes

log = logging.getLogger(f"{__package__}.kombu")  # one logger for the kombu transport

#: Headers a broker adds to a delivery for its own bookkeeping (RabbitMQ's quorum queues
#: count redeliveries): not the sender's, so neither read nor listed as dropped.
_BROKER_HEADERS = frozenset({"x-delivery-count"})


class _KombuDelivery(Delivery):
    def __init__(self, queue: str, message: kombu.Message, *, settled: bool = False,
                 native_requeue: bool = True,
                 outage: tuple[type[BaseException], ...] = (),
                 events_exchange: str | None = None) -> None:
        try:
            table = message.headers
            if type(table) is TextTable and table.plain:
                # Read from ASCII alone, properties included, without a broker's x- name:
                # text as it is, nothing to leave out (see TextTable).
                raw: Mapping[Any, Any] = table
                if message.properties.keys() & amqp_properties.NAMES:
                    raw = amqp_properties.merged(table, message.properties)
                headers: Mapping[str, str] = dict(table) if raw is table else raw
                problem = None
            else:
                raw = _senders_headers(table or {})
                if message.properties.keys() & amqp_properties.NAMES:  # set logic, no call
                    raw = amqp_properties.merged(raw, message.properties)
                headers, problem = wire.text_headers(raw)
            content_encoding = message.content_encoding
            # the usual case told at once: no compression, a plain encoding, not an event
            encoding = (None if "compression" not in raw and (
                content_encoding is None or content_encoding in wire.PLAIN_ENCODINGS)
                else _encoding_problem(raw, content_encoding))
            foreign = (None if events_exchange is None or (message.delivery_info or {}).get(
                "exchange") != events_exchange
                else _foreign_key(message, headers, events_exchange))
            if problem or encoding or foreign:
                problem = _joined(problem, encoding, foreign)
        except Exception as exc:  # input nobody foresaw: refused, never a stopped consumer
            log.exception("could not read the headers of a message of %r", queue)
            headers, problem = {}, f"its headers could not be read: {wire.shown(exc)}"
        # Delivery.__init__'s fields, set here without its call with seven keywords (as
        # Delivery._stand_for sets them), once a delivery
        self.queue = queue
        self.headers = headers
        body = message.body
        self.body = body if type(body) is bytes else _as_bytes(body, message.content_encoding)
        self.content_type = message.content_type
        self.content_encoding = message.content_encoding
        self.redelivered = bool(message.delivery_info.get("redelivered"))
        self.wire_error = problem
        self._message = message
        self.settled = settled
        self._native_requeue = native_requeue
        #: What the delivery's connection raises once it is gone.
        self._outage = outage

    def _ack(self) -> None:
        try:  # what _outage_translated does, without a generator (once per delivery)
            self._message.ack()
        except self._outage as exc:
            raise self._unavailable("acknowledge", exc) from exc

    @property
    def delivery_tag(self) -> int:
        tag: int = self._message.delivery_tag
        return tag

    @property
    def channel(self) -> Any:
        return self._message.channel

    def ack_up_to_here(self) -> None:
        """Acknowledge this delivery and every earlier one of its channel not settled
        yet (``basic.ack`` with ``multiple``)."""
        if self.settled:
            raise RuntimeError(f"delivery from {self.queue!r} was already settled")
        with self._outage_translated("acknowledge"):
            self._message.ack(multiple=True)
        self.settled = True

    def _requeue(self) -> None:
        with self._outage_translated("requeue"):
            self._requeue_on_its_queue()

    def requeue_fresh(self) -> None:
        """Give the message back as a new one: a copy without the broker's delivery
        count and dead-letter history is published to its queue (confirmed where the
        broker confirms), then the original acknowledged. Unlike :meth:`requeue`, this
        never counts as a redelivery towards a quorum queue's ``x-delivery-limit``."""
        message = self._message
        headers = {name: value for name, value
                   in delays.without_dead_letter_headers(message.headers or {}).items()
                   if name not in _BROKER_HEADERS}

        def publish_then_ack() -> None:
            with self._outage_translated("give back"):
                kombu.Producer(message.channel).publish(
                    message.body, exchange="", routing_key=self.queue, headers=headers,
                    content_type=message.content_type,
                    content_encoding=message.content_encoding, delivery_mode=2,
                    **amqp_properties.carried(message.properties))
                message.ack()

        self._settle(publish_then_ack)

    @contextlib.contextmanager
    def _outage_translated(self, action: str) -> Iterator[None]:
        try:
            yield
        except self._outage as exc:
            raise self._unavailable(action, exc) from exc

    def _unavailable(self, action: str, exc: BaseException) -> TransportUnavailable:
        return TransportUnavailable(
            f"could not {action} a message of {self.queue!r} ({exc}); its connection is "
            "gone, so the broker delivers it again")

    def _requeue_on_its_queue(self) -> None:
        if self._native_requeue:
            self._message.requeue()
            return
        # kombu's virtual transports (memory://, redis://) route a requeued message through
        # its exchange again, which would copy an event into every subscribed queue. Put it
        # back on the queue it came from instead, then let the original go.
        message = self._message
        kombu.Producer(message.channel).publish(
            message.body,
            exchange="",
            routing_key=self.queue,
            headers=message.headers,
            content_type=message.content_type,
            content_encoding=message.content_encoding,
            delivery_mode=2,
            **amqp_properties.carried(message.properties),
        )
        message.ack()



def _senders_headers(headers: Mapping[Any, Any]) -> Mapping[Any, Any]:
    """``headers`` without what the broker added: its dead-letter history and its
    bookkeeping (:data:`_BROKER_HEADERS`), all named ``x-...``; ``headers`` itself when no
    name starts with ``x-`` (looked for in one joined string, at C speed)."""
    try:
        names = "\n".join(headers)
    except TypeError:  # a name that is not text: the slow way
        names = "\nx-"
    if not names.startswith("x-") and "\nx-" not in names:
        return headers
    return {name: value for name, value in delays.without_dead_letter_headers(headers).items()
            if name not in _BROKER_HEADERS}


def _foreign_key(message: kombu.Message, headers: Mapping[str, str],
                 events_exchange: str | None) -> str | None:
    """Why a delivery from the events exchange does not belong to its headers: its routing
    key is neither its type's name nor that type's hierarchy key (``None``: it does, or it
    came otherwise — sent to the queue, a delayed retry). Topic permissions bound the keys
    an account publishes with; this check binds the type header to the key."""
    info = message.delivery_info or {}
    if events_exchange is None or info.get("exchange") != events_exchange:
        return None
    routing = info.get("routing_key")
    if not isinstance(routing, str):
        return None
    return hierarchy.unexpected_routing_key(routing, headers.get(h.MESSAGE_TYPE),
                                            headers.get(h.ENCLOSED_TYPES))


def _give_back(deliveries: list[_KombuDelivery]) -> None:
    """Requeue every unsettled delivery; try them all, then raise the first failure.

    A delivery that could not be requeued (the broker is unreachable) stays unacknowledged
    and is not lost: RabbitMQ requeues it when the connection closes; on redis:// kombu
    restores it when the channel closes or after its visibility timeout, through the
    exchange it came from (for a message sent to the queue directly, as everything in an
    error queue is, that is the queue itself). memory:// cannot fail here.
    """
    failures: list[Exception] = []
    for delivery in deliveries:
        if delivery.settled:
            continue
        try:
            delivery.requeue()
        except Exception as exc:
            log.warning("could not give a message back to %r: %s", delivery.queue, exc)
            failures.append(exc)
    if failures:
        raise failures[0]


def _give_fresh(deliveries: list[_KombuDelivery]) -> None:
    """Give back, as fresh copies, those of ``deliveries`` left unsettled."""
    for delivery in deliveries:
        if not delivery.settled:
            delivery.requeue_fresh()

