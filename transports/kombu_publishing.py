"""The kombu transport's sends and publishes: delayed sends through the delay levels,
mandatory publishes whose returns say a queue is missing or an event unrouted, pipelined
publisher confirms for a batch (:mod:`.confirms`), and refusing what an AMQP frame cannot
carry before the broker closes the connection over it."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from typing import Any

import kombu

from .. import headers as h
from .. import hierarchy
from ..envelope import Envelope
from ..redaction import redact
from . import amqp_properties, confirms, delays
from .errors import DestinationRefused, TransportUnavailable
from .kombu_errors import _classified
from .kombu_frames import _as_sent
from .kombu_in_process import in_process_message, in_process_tags, routed_queues
from .kombu_topology import KombuTopology

log = logging.getLogger(f"{__package__}.kombu")  # one logger for the kombu transport

#: Room left in an AMQP frame for what a content header holds besides the headers.
_FRAME_MARGIN = 1024


class KombuPublishing(KombuTopology):
    """Sending, publishing and dispatching batches."""

    def send(self, envelope: Envelope) -> None:
        queue = envelope.destination
        if not queue:
            raise ValueError(f"message {envelope.headers.get(h.MESSAGE_ID)} has no destination "
                             "queue")
        delay = self._delay_of(envelope)
        if delay:
            self._send_delayed(envelope, queue, delay)
            return
        if not self._is_amqp and queue not in self._known_queues:
            self._look_up(queue)
        # RabbitMQ: mandatory, so that a queue nobody declared returns the message.
        self._publish(envelope, exchange="", routing_key=queue, mandatory=self._is_amqp)
        self._replied(queue)

    def _delay_of(self, envelope: Envelope) -> int:
        """Seconds the broker must hold ``envelope`` (0: deliver at once)."""
        if not self.native_delay:
            return 0
        deliver_at = delays.parse_time(envelope.headers.get(h.DELIVER_AT))
        return delays.delay_seconds(deliver_at, datetime.datetime.now(datetime.timezone.utc))

    def _send_delayed(self, envelope: Envelope, queue: str, delay: int) -> None:
        levels = self._delay_levels
        try:
            key = delays.routing_key(delay, queue)
        except ValueError as exc:  # a name the delay levels cannot route
            raise DestinationRefused(str(exc)) from exc
        if queue not in self._delay_bound:
            self._bind_for_delays(queue)
        try:
            self._publish(envelope, exchange=levels.entry_exchange(delay), routing_key=key)
        except TransportUnavailable:
            # The broker may have lost the topology (a reset node): declare it again next time.
            self._delay_levels_declared = False
            self._delay_bound.clear()
            raise

    def publish(self, envelope: Envelope) -> bool | None:
        """Publish the event to every queue subscribed to one of its types; False if the
        broker reports that none took it (None: it cannot tell, see the module docstring)."""
        declare = [] if self._exchange_declared else [self._events]
        key = event_routing_key(envelope)
        returned = self._publish(envelope, exchange=self._events.name, routing_key=key,
                                 declare=declare, mandatory=self._is_amqp)
        self._exchange_declared = True
        if self._is_amqp:
            return None if not self.publisher_confirms else not returned
        if self.process_local and declare == []:
            return bool(self._local.routed)  # matched as it was put (_put_in_process)
        return self._routed(key)

    def _routed(self, routing_key: str) -> bool | None:
        """memory:// and redis://: whether the events exchange has a binding for
        ``routing_key``, as kombu routes it (None if the lookup fails)."""
        _, producer = self._producer()
        channel = producer.channel
        try:
            table = channel.get_table(self.exchange_name)
            return bool(channel.typeof(self.exchange_name).lookup(
                table, self.exchange_name, routing_key, None))
        except KeyError:  # memory://: the exchange has no bindings at all
            return False
        except Exception:
            log.debug("could not look up the queues of %r", routing_key, exc_info=True)
            return None

    def _publish(self, envelope: Envelope, *, exchange: str, routing_key: str,
                 declare: list[Any] | None = None, mandatory: bool = False) -> bool:
        """Publish; True if RabbitMQ returned the message as unroutable (``mandatory``)."""
        if self.process_local and not declare:
            return self._put_in_process(envelope, exchange, routing_key)
        connection, producer = self._producer()
        what = (f"publishing {envelope.headers.get(h.MESSAGE_ID, 'a message without id')} to "
                f"{exchange or 'queue'} {routing_key!r}")
        self._check_fits(connection, envelope, routing_key, what)
        returns: list[str] = self._local.returns
        returns.clear()
        # On RabbitMQ the core headers travel as properties (:mod:`.amqp_properties`).
        headers, properties = (amqp_properties.split(envelope.headers) if self._is_amqp
                               else (dict(envelope.headers), {}))
        try:
            producer.publish(
                envelope.body.encode("utf-8", "surrogateescape"),
                exchange=exchange,
                routing_key=routing_key,
                headers=headers,
                content_type=_as_sent(envelope.content_type),
                content_encoding=_as_sent(envelope.content_encoding),
                delivery_mode=2,
                declare=declare or [],
                mandatory=mandatory,
                # A confirm that never comes (its node died, or lost its quorum) is an
                # outage of this publish, retried on a new connection, not a hang.
                confirm_timeout=_CONFIRM_TIMEOUT if self.publisher_confirms else None,
                retry=True,
                retry_policy={"max_retries": 3, "interval_start": 0.1, "interval_step": 0.5},
                **properties,
            )
        except Exception as exc:
            # Whatever happened, the channel may be closed: this thread publishes on a new
            # connection next time.
            del self._local.publisher
            self._release(connection)
            classified = _classified(exc, connection, what, refusal=DestinationRefused,
                                     url=self.safe_url)
            if classified is None:
                raise
            raise classified from exc
        if returns and exchange == "":  # a send: the queue does not exist
            raise DestinationRefused(f"{what} on {self.safe_url}: {returns[0]}")
        return bool(returns)

    def _put_in_process(self, envelope: Envelope, exchange: str, routing_key: str) -> bool:
        """memory://: the message kombu's ``Producer.publish`` would make
        (:func:`.kombu_in_process.in_process_message`), put on its queues directly: no
        retry wrapper (this broker cannot be unreachable) and, for an event, the exchange's
        bindings matched once (the queues it went to say whether it was routed: kept for
        :meth:`publish` in this thread's ``routed``). Returns ``False``, as ``_publish``
        does for a broker without returns."""
        _, producer = self._producer()
        channel = producer.channel
        body = envelope.body.encode("utf-8", "surrogateescape")
        content_type = _as_sent(envelope.content_type)
        content_encoding = _as_sent(envelope.content_encoding)
        if not content_type:  # what kombu makes of a body without a content type
            body, content_type, content_encoding = producer._prepare(
                body, None, content_type, content_encoding)
        message = in_process_message(body, content_type, content_encoding, envelope.headers,
                                     exchange, routing_key)
        if not exchange:
            channel._put(routing_key, message)
            return False
        queues = routed_queues(channel, exchange, routing_key)
        dead_letters = channel.deadletter_queue
        for queue in queues:
            if queue and queue != dead_letters:
                channel._put(queue, message)
        self._local.routed = bool(queues)
        return False

    def dispatch_many(self, envelopes: Sequence[Envelope]) -> list[bool | None | Exception]:
        """On RabbitMQ with publisher confirms: publish every envelope, then wait for their
        confirms once (:mod:`idembus.transports.confirms`); through :meth:`dispatch` one at
        a time where a subclass overrides it, :meth:`send` or :meth:`publish`. A message the
        broker refuses (``basic.nack``) raises ``TransportUnavailable`` for its sender, which
        sends it again with the same id; a send nobody takes is refused as :meth:`send` refuses it.
        Delayed sends, a first publish (which declares the exchange) and anything after a
        failure of the connection go one by one, each with the answer it gets alone."""
        if not (self._is_amqp and self.publisher_confirms) or self._overrides(
                "dispatch", "send", "publish"):
            return super().dispatch_many(envelopes)
        results: list[bool | None | Exception | _Unanswered] = [_UNANSWERED] * len(envelopes)
        handles: dict[int, int] = {}
        #: (content type, content encoding) -> as sent (:func:`_as_sent`): a batch's
        #: messages have one or two kinds.
        kinds: dict[tuple[str, str | None], tuple[Any, Any]] = {}
        try:
            confirming = self._confirming()
            frame_max = _frame_max(confirming.connection)  # once a batch, not a message
            for index, envelope in enumerate(envelopes):
                route = self._pipelined_route(envelope)
                if route is None:
                    confirming.flush()  # those published before it go out first
                    results[index] = self._dispatch_or_error(envelope)
                    continue
                exchange, key = route
                try:
                    self._check_fits(confirming.connection, envelope, key, None, frame_max)
                except DestinationRefused as refused:
                    results[index] = refused
                    continue
                kind = (envelope.content_type, envelope.content_encoding)
                sent_as = kinds.get(kind)
                if sent_as is None:
                    sent_as = kinds[kind] = (_as_sent(kind[0]), _as_sent(kind[1]))
                handles[confirming.publish(
                    envelope.body.encode("utf-8", "surrogateescape"), headers=envelope.headers,
                    exchange=exchange, routing_key=key, content_type=sent_as[0],
                    content_encoding=sent_as[1])] = index
            ends = confirming.wait(_CONFIRM_TIMEOUT) if handles else {}
        except Exception as exc:
            log.info("publishing %d messages with one confirm wait failed (%s); each goes "
                     "alone", len(envelopes), redact(str(exc)))
            self._drop_confirming()
            handles, ends = {}, {}
            for index, envelope in enumerate(envelopes):
                if isinstance(results[index], _Unanswered):
                    results[index] = self._dispatch_or_error(envelope)
        for tag, index in handles.items():
            end, reason = ends[tag]
            envelope = envelopes[index]
            if end == confirms.NACKED:
                results[index] = TransportUnavailable(
                    f"{self.safe_url} refused {_what(envelope, '')} (basic.nack); it is sent "
                    "again with the same id")
            elif envelope.destination is not None:
                results[index] = (DestinationRefused(
                    f"{_what(envelope, envelope.destination)} on {self.safe_url}: {reason}")
                    if end == confirms.RETURNED else None)
            else:
                results[index] = end != confirms.RETURNED
        answered: list[bool | None | Exception] = []
        for result in results:
            if isinstance(result, _Unanswered):  # every place is filled above
                raise RuntimeError("a message of the batch was not answered")
            answered.append(result)
        return answered

    def _pipelined_route(self, envelope: Envelope) -> tuple[str, str] | None:
        """Exchange and routing key of an envelope that can be published in a pipeline;
        ``None`` for one that goes alone (delayed, no destination, the first publish)."""
        if envelope.destination is None:
            if not self._exchange_declared:
                return None
            return self._events.name, event_routing_key(envelope)
        if not envelope.destination or self._delay_of(envelope):
            return None
        return "", envelope.destination

    def _confirming(self) -> confirms.ConfirmingChannel:
        """This thread's channel for pipelined confirms; new after a failure."""
        confirming: confirms.ConfirmingChannel | None = getattr(self._local, "confirming",
                                                                None)
        if confirming is None:
            options = {name: value for name, value in self._transport_options.items()
                       if name != "confirm_publish"}
            connection = self._connect(options)
            try:
                confirming = confirms.ConfirmingChannel(connection)
            except Exception:
                self._release(connection)
                raise
            self._local.confirming = confirming
        return confirming

    def _drop_confirming(self) -> None:
        confirming: confirms.ConfirmingChannel | None = getattr(self._local, "confirming",
                                                                None)
        if confirming is not None:
            del self._local.confirming
            self._release(confirming.connection)

    def _check_fits(self, connection: kombu.Connection, envelope: Envelope, routing_key: str,
                    what: str | None, frame_max: Any = None) -> None:
        """Refuse, before the broker does it by closing the connection, what AMQP cannot
        carry: a routing key over 255 bytes, headers that do not fit one frame
        (``frame_max``: the connection's, when the caller has read it already). ``what``
        names the publish in the refusal (``None``: :func:`_what` names it)."""
        if not self._is_amqp:
            return
        if (4 * len(routing_key) > delays.MAX_KEY_BYTES  # no encoding for a short key
                and len(routing_key.encode("utf-8", "surrogateescape")) > delays.MAX_KEY_BYTES):
            what = what or _what(envelope, routing_key)
            raise DestinationRefused(f"{what}: the routing key is longer than "
                                     f"{delays.MAX_KEY_BYTES} bytes, the AMQP limit")
        if frame_max is None:
            frame_max = _frame_max(connection)
        if not isinstance(frame_max, int) or frame_max <= 0:
            return
        headers = envelope.headers
        characters = len("".join(headers)) + len("".join(headers.values()))
        if 4 * characters + 6 * len(headers) + _FRAME_MARGIN <= frame_max:
            return  # fits even at UTF-8's four bytes a character
        weight = sum(len(name.encode("utf-8", "surrogateescape"))
                     + len(value.encode("utf-8", "surrogateescape")) + 6
                     for name, value in headers.items())
        if weight + _FRAME_MARGIN > frame_max:
            what = what or _what(envelope, routing_key)
            raise DestinationRefused(
                f"{what}: its headers take {weight} bytes and the broker's frames hold "
                f"{frame_max} (frame_max)")

    def _producer(self) -> tuple[kombu.Connection, kombu.Producer]:
        """This thread's publishing connection and producer; new after a failure."""
        publisher: tuple[kombu.Connection, kombu.Producer] | None = getattr(
            self._local, "publisher", None)
        if publisher is None:
            connection = self._connect()
            returns: list[str] = []
            self._local.returns = returns

            def on_return(error: Exception, exchange: str, routing_key: str,
                          message: Any) -> None:
                returns.append(redact(str(error)))

            channel = connection.default_channel
            if self.process_local:
                in_process_tags(channel)
            publisher = (connection, kombu.Producer(
                channel, on_return=on_return if self._is_amqp else None))
            self._local.publisher = publisher
        return publisher


class _Unanswered:
    """A place in :meth:`KombuTransport.dispatch_many`'s answers not filled yet."""


_UNANSWERED = _Unanswered()
#: Seconds a batch's publishes wait for their confirms before each goes alone.
_CONFIRM_TIMEOUT = 30.0


def _frame_max(connection: kombu.Connection) -> Any:
    """The largest frame ``connection``'s broker takes (what py-amqp says it is)."""
    return getattr(getattr(connection, "connection", None), "frame_max", None)


def _what(envelope: Envelope, routing_key: str) -> str:
    """How an error names a publish."""
    return (f"publishing {envelope.headers.get(h.MESSAGE_ID, 'a message without id')} to "
            f"{'queue' if envelope.destination else 'exchange'} {routing_key!r}")


def event_routing_key(envelope: Envelope) -> str:
    """The routing key of a published event: its type's name, or, for an event that
    encloses several types (``idembus.enclosed_types``), the key that reaches the
    subscribers of each (:func:`idembus.hierarchy.routing_key`)."""
    headers = envelope.headers
    return hierarchy.expected_routing_key(headers[h.MESSAGE_TYPE],
                                          headers.get(h.ENCLOSED_TYPES))

