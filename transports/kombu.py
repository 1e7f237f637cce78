"""A transport over kombu: one implementation for every kombu URL.

Features
========
* ``amqp://`` (RabbitMQ): a durable queue per endpoint; a durable topic exchange for events,
  routed by the message type name; publisher confirms on by default; consumer prefetch.
  Publishing happens on connections of its own: on one connection that also consumes,
  deliveries re-enter the consumer callback while a publish waits for its confirm.
  Delayed delivery is native (``native_delay``) and needs no plugin: a message whose
  ``idembus.deliver_at`` is in the future goes through the delay levels of
  ``transports/delays.py``, which hold it in the broker until then (rounded up to a second).
  Deliveries do not show the ``x-death`` / ``x-first-death-*`` / ``x-last-death-*`` headers
  dead-lettering adds: they are broker bookkeeping.
* ``redis://``: the same topology emulated by kombu; no publisher confirms.
* ``memory://``: the embedded default. Its broker state is shared by every connection in
  the process (even across virtual hosts), so give every test its own queue and exchange
  names. An unacknowledged message is dropped when its channel closes; idembus requeues a
  delivery whose processing stopped abruptly, which is the redelivery a real broker makes.
  The polling interval defaults to 5 ms instead of kombu's 1 s.
* ``inspect(queue)`` (tools such as ``idembus errors``) takes the waiting messages with
  ``basic_get`` on one channel, unacknowledged. RabbitMQ puts the ones not acknowledged
  back in their original places (and does the same if the tool dies meanwhile). On
  memory:// and redis:// each goes back as a copy published to that queue, after which the
  original is acknowledged: they end up behind the messages not taken, in the order they
  were taken. (kombu's own requeue there would route an event through its exchange again,
  into every subscribed queue, and memory:// drops unacknowledged messages when a channel
  closes.) A tool that dies on redis:// leaves them to kombu's visibility timeout (1 h).
* On ``redis://`` the polling interval (kombu's BRPOP timeout) defaults to 0.1 s, so a
  consumer stops within a fraction of a second.

Failures
========
Broker errors are classified here, once, from kombu's and py-amqp's own classes
(:func:`_classified`): kombu's ``recoverable_*`` errors, lost connections and timeouts are
*transient* (``TransportUnavailable``: wait and try again); a login or virtual host the
broker refuses, or the endpoint's own queue refused, is *permanent for the endpoint*
(``BrokerAccessDenied``: ``consume`` raises it for the endpoint to report and retry); every
other channel error on a publish — no such exchange or queue, a reserved ``amq.*`` name,
a message over the broker's size, headers that cannot fit its frame — is *permanent for
this message* (``DestinationRefused``). A channel the broker closed is replaced.

Sends are loud: a command sent to a queue nobody declared fails with
``DestinationRefused`` instead of creating the queue and stranding the message there. On
RabbitMQ sends are published ``mandatory`` (an unroutable message comes back as
``NO_ROUTE``); memory:// asks its broker (a passive declare); on redis://, where an empty
queue does not exist as a key, ``declare`` records every queue in the set
``_idembus.queues`` and sends look there.

Received messages are taken as the broker holds them: kombu would decompress a body with a
``compression`` header before anyone could refuse it (a 242-byte bz2 body took a consumer to
2.6 GiB), so channels here keep bodies raw, and such a message, one with another content
encoding, or one whose ``idembus.*`` headers are not text (:func:`bus.wire.text_headers`)
arrives with ``Delivery.wire_error`` set, for the endpoint to send to the error queue as is.

Connection String
=================
Any kombu URL: ``memory://``, ``amqp://guest:guest@127.0.0.1:5672//``,
``redis://127.0.0.1:6379/0``.

Options
=======
``exchange``         name of the topic exchange for events (``idembus.events``)
``confirm_publish``  wait for publisher confirms where the broker has them (``True``)
``polling_interval`` seconds between polls of virtual transports (memory:// 5 ms, redis:// 0.1 s)
``transport_options`` passed to kombu unchanged
``reconnect_backoff`` waits between attempts to reconnect a consumer (bus.policies.Backoff)
``queue_type``       RabbitMQ queues: ``"quorum"`` (default: replicated, and dead-lettering
                     at least once, which the delay levels need) or ``"classic"``
``queue_arguments``  further arguments of every queue declared (RabbitMQ ``x-*``)
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import logging
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import amqp.exceptions
import kombu
import kombu.exceptions
from kombu import Exchange, Queue, binding

from .. import headers as h
from .. import wire
from ..envelope import Envelope
from ..errors import ConfigurationError
from ..policies import Backoff
from ..redaction import redact
from . import delays
from .base import Delivery, OnDelivery, Transport
from .errors import (
    BrokerAccessDenied,
    DestinationRefused,
    TransportError,
    TransportUnavailable,
)

log = logging.getLogger(__name__)

#: Seconds between polls of kombu's virtual transports. kombu's default (1 s) made an idle
#: memory:// consumer wait ~0.5 s per message; on Redis it is also the BRPOP timeout, which
#: bounds how long a consumer takes to notice that it should stop.
_DEFAULT_POLLING_INTERVALS = {"memory": 0.005, "redis": 0.1, "rediss": 0.1}
#: How long one wait for deliveries lasts before the stop flag is looked at again.
_DRAIN_TIMEOUT = 0.1
QUEUE_TYPES = ("quorum", "classic")
#: The Redis set in which ``declare`` records queues, for sends to look in.
REDIS_QUEUES = "_idembus.queues"
#: Content encodings of a body that is the bytes themselves (kombu writes ``binary`` for
#: bytes and ``utf-8`` for text).
_PLAIN_ENCODINGS = frozenset({"", "utf-8", "utf8", "binary", "identity"})
#: Room left in an AMQP frame for what a content header holds besides the headers.
_FRAME_MARGIN = 1024
#: What py-amqp raises when the broker refuses a login or its virtual host at connection.
_LOGIN_REFUSED: tuple[type[BaseException], ...] = (amqp.exceptions.AccessRefused,
                                                   amqp.exceptions.NotAllowed)
#: Errors that a publish's content caused: the same publish would fail again.
_MESSAGE_CAUSED: tuple[type[BaseException], ...] = (
    amqp.exceptions.ContentTooLarge, amqp.exceptions.FrameError,
    amqp.exceptions.FrameSyntaxError)


class KombuTransport(Transport):
    """Transport for any kombu URL; see the module docstring."""

    def __init__(
        self,
        url: str = "memory://",
        *,
        exchange: str = "idembus.events",
        confirm_publish: bool = True,
        polling_interval: float | None = None,
        transport_options: Mapping[str, Any] | None = None,
        reconnect_backoff: Backoff | None = None,
        queue_type: str = "quorum",
        queue_arguments: Mapping[str, Any] | None = None,
    ) -> None:
        self.url = url
        #: The URL as it may be shown: without its password.
        self.safe_url = redact(url)
        self._reconnect_backoff = reconnect_backoff or Backoff()
        options = dict(transport_options or {})
        scheme = url.split("://", 1)[0] if "://" in url else url
        if polling_interval is None:
            polling_interval = _DEFAULT_POLLING_INTERVALS.get(scheme)
        if polling_interval is not None:
            options.setdefault("polling_interval", polling_interval)
        self._is_amqp = scheme in ("amqp", "amqps", "pyamqp")
        self._is_redis = scheme in ("redis", "rediss")
        if self._is_redis and importlib.util.find_spec("redis") is None:
            raise ConfigurationError(
                f"{self.safe_url} needs the redis library: pip install 'idembus[redis]'")
        self.process_local = scheme == "memory"
        self.native_delay = self._is_amqp
        if confirm_publish and self._is_amqp:
            options.setdefault("confirm_publish", True)
        self.publisher_confirms = bool(options.get("confirm_publish"))
        self._transport_options = options
        if queue_type not in QUEUE_TYPES:
            raise ConfigurationError(
                f"queue_type {queue_type!r} is not one of {', '.join(QUEUE_TYPES)}")
        #: RabbitMQ's type of every queue this transport declares (ignored elsewhere).
        self.queue_type = queue_type
        self._queue_arguments: dict[str, Any] = (
            {"x-queue-type": queue_type, **(queue_arguments or {})} if self._is_amqp else {})
        self._delay_levels = delays.Topology.for_queue_type(queue_type)
        try:
            # Resolves the scheme and loads its driver; nothing connects yet.
            kombu.Connection(url, transport_options=options).transport  # noqa: B018
        except (KeyError, ImportError, ValueError) as exc:
            raise ConfigurationError(
                f"transport URL {self.safe_url!r} cannot be used: {redact(str(exc))}. Use a "
                "kombu URL such as memory://, amqp://user:password@host:5672// or "
                "redis://host:6379/0 (redis:// needs the [redis] extra)."
            ) from exc
        self._events = Exchange(exchange, type="topic", durable=True)
        self._local = threading.local()
        self._connections: list[kombu.Connection] = []
        self._connections_lock = threading.Lock()
        #: Queues known to exist (declared or looked up); sends to others are checked.
        self._known_queues: set[str] = set()
        self._exchange_declared = False
        #: Queues bound to the delay delivery exchange by this transport.
        self._delay_bound: set[str] = set()
        self._delay_levels_declared = False
        self._raw_message_classes: dict[type, type] = {}

    @property
    def exchange_name(self) -> str:
        """Name of the topic exchange events are published to."""
        return str(self._events.name)

    # -- topology ---------------------------------------------------------------------

    def declare(self, queue: str, *, subscriptions: Collection[str] = ()) -> None:
        """Declare ``queue`` (durable, of this transport's queue type) bound to the event
        types ``subscriptions``. A queue that exists with other arguments is a
        configuration error saying what differs; a refusal of the endpoint's own queue is
        ``BrokerAccessDenied``."""
        bindings = [binding(self._events, routing_key=name) for name in sorted(subscriptions)]
        scope = self._channel()
        with scope as channel:
            try:
                if bindings:
                    self._events(channel).declare()
                Queue(queue, durable=True, bindings=bindings or None,
                      queue_arguments=self._queue_arguments or None)(channel).declare()
                if self._is_redis:
                    channel.client.sadd(REDIS_QUEUES, queue)
            except Exception as exc:
                raise self._declare_failure(queue, exc, scope.connection) from exc
        self._known_queues.add(queue)

    def _declare_failure(self, queue: str, error: Exception,
                         connection: kombu.Connection) -> Exception:
        if "inequivalent arg" in str(error):
            return ConfigurationError(
                f"queue {queue!r} exists on {self.safe_url} with other arguments than "
                f"{self._queue_arguments or 'none'} ({error}). Declare it as it is — "
                f"KombuTransport(queue_type='classic' or 'quorum', queue_arguments=...) — "
                "or move its messages elsewhere, delete it and start again.")
        classified = _classified(error, connection, f"declaring queue {queue!r}",
                                 refusal=BrokerAccessDenied, url=self.safe_url)
        return classified if classified is not None else error

    # -- publishing -------------------------------------------------------------------

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

    def _look_up(self, queue: str) -> None:
        """memory:// and redis://: refuse a queue that nobody declared (RabbitMQ's sends are
        mandatory instead)."""
        scope = self._channel()
        with scope as channel:
            try:
                if self._is_redis:
                    known = bool(channel.client.sismember(REDIS_QUEUES, queue))
                else:
                    channel.queue_declare(queue=queue, passive=True)
                    known = True
            except Exception as exc:
                classified = _classified(exc, scope.connection, f"looking up queue {queue!r}",
                                         refusal=DestinationRefused, url=self.safe_url)
                if isinstance(classified, DestinationRefused):
                    known = False
                else:
                    raise classified if classified is not None else exc from exc
        if not known:
            raise DestinationRefused(
                f"no queue {queue!r} on {self.safe_url}: no endpoint declared it (start the "
                "endpoint that consumes it, or correct the route)")
        self._known_queues.add(queue)

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

    def _bind_for_delays(self, queue: str) -> None:
        """Declare the delay levels (once) and bind ``queue`` to their delivery exchange;
        a queue that does not exist is refused, as a send to it is."""
        scope = self._channel()
        with scope as channel:
            try:
                if not self._delay_levels_declared:
                    self._delay_levels.declare(channel)
                    self._delay_levels_declared = True
                self._delay_levels.bind_destination(channel, queue)
            except Exception as exc:
                classified = _classified(exc, scope.connection,
                                         f"binding {queue!r} to the delay levels",
                                         refusal=DestinationRefused, url=self.safe_url)
                if isinstance(classified, DestinationRefused) and "inequivalent arg" in str(exc):
                    raise ConfigurationError(
                        f"the delay levels on {self.safe_url} exist with other arguments "
                        f"({exc}); once its {self._delay_levels.prefix}.* queues have "
                        "delivered their messages, delete those queues and exchanges and "
                        "start again") from exc
                raise classified if classified is not None else exc from exc
        self._delay_bound.add(queue)

    def publish(self, envelope: Envelope) -> None:
        declare = [] if self._exchange_declared else [self._events]
        self._publish(envelope, exchange=self._events.name, routing_key=envelope.message_type,
                      declare=declare)
        self._exchange_declared = True

    def _publish(self, envelope: Envelope, *, exchange: str, routing_key: str,
                 declare: list[Any] | None = None, mandatory: bool = False) -> None:
        connection, producer = self._producer()
        what = (f"publishing {envelope.headers.get(h.MESSAGE_ID, 'a message without id')} to "
                f"{exchange or 'queue'} {routing_key!r}")
        self._check_fits(connection, envelope, routing_key, what)
        try:
            producer.publish(
                envelope.body.encode("utf-8", "surrogateescape"),
                exchange=exchange,
                routing_key=routing_key,
                headers=dict(envelope.headers),
                content_type=envelope.content_type,
                content_encoding="utf-8",
                delivery_mode=2,
                declare=declare or [],
                mandatory=mandatory,
                retry=True,
                retry_policy={"max_retries": 3, "interval_start": 0.1, "interval_step": 0.5},
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

    def _check_fits(self, connection: kombu.Connection, envelope: Envelope, routing_key: str,
                    what: str) -> None:
        """Refuse, before the broker does it by closing the connection, what AMQP cannot
        carry: a routing key over 255 bytes, headers that do not fit one frame."""
        if not self._is_amqp:
            return
        if len(routing_key.encode("utf-8", "surrogateescape")) > delays.MAX_KEY_BYTES:
            raise DestinationRefused(f"{what}: the routing key is longer than "
                                     f"{delays.MAX_KEY_BYTES} bytes, the AMQP limit")
        frame_max = getattr(getattr(connection, "connection", None), "frame_max", None)
        if not isinstance(frame_max, int) or frame_max <= 0:
            return
        weight = sum(len(name.encode("utf-8", "surrogateescape"))
                     + len(value.encode("utf-8", "surrogateescape")) + 6
                     for name, value in envelope.headers.items())
        if weight + _FRAME_MARGIN > frame_max:
            raise DestinationRefused(
                f"{what}: its headers take {weight} bytes and the broker's frames hold "
                f"{frame_max} (frame_max)")

    def _producer(self) -> tuple[kombu.Connection, kombu.Producer]:
        """This thread's publishing connection and producer; new after a failure."""
        publisher: tuple[kombu.Connection, kombu.Producer] | None = getattr(
            self._local, "publisher", None)
        if publisher is None:
            connection = self._connect()
            publisher = (connection, kombu.Producer(connection.default_channel))
            self._local.publisher = publisher
        return publisher

    # -- consuming --------------------------------------------------------------------

    def consume(
        self, queue: str, on_delivery: OnDelivery, *, stop: threading.Event, prefetch: int = 1
    ) -> None:
        """See the contract; outages are waited out here, and a refusal that only an
        operator can end (``BrokerAccessDenied``) is raised."""
        failures = 0
        while not stop.is_set():
            try:
                connection = self._connect()
            except BrokerAccessDenied:
                raise
            except TransportUnavailable as exc:
                failures = self._pause_after_failure(queue, exc, failures, stop)
                continue
            try:
                channel = self._raw_channel(connection)
                with kombu.Consumer(
                    channel, [Queue(queue, durable=True, no_declare=True)],
                    on_message=self._delivering(queue, on_delivery, connection),
                    prefetch_count=prefetch,
                ):
                    failures = 0
                    while not stop.is_set():
                        try:
                            connection.drain_events(timeout=_DRAIN_TIMEOUT)
                        except TimeoutError:
                            continue
            except TransportUnavailable as exc:  # a delivery's connection went away
                failures = self._pause_after_failure(queue, exc, failures, stop)
            except Exception as exc:
                classified = _classified(exc, connection, f"consuming {queue!r}",
                                         refusal=BrokerAccessDenied, url=self.safe_url)
                if classified is None:
                    raise
                if isinstance(classified, BrokerAccessDenied):
                    raise classified from exc
                failures = self._pause_after_failure(queue, classified, failures, stop)
            finally:
                self._release(connection)

    def _delivering(self, queue: str, on_delivery: OnDelivery,
                    connection: kombu.Connection) -> Callable[[kombu.Message], None]:
        """The kombu callback that hands each message of ``queue`` to ``on_delivery``."""
        outage = _broker_errors(connection)

        def on_message(message: kombu.Message) -> None:
            delivery = _KombuDelivery(queue, message, outage=outage,
                                      native_requeue=self._is_amqp)
            self.deliver(delivery, on_delivery)

        return on_message

    def _pause_after_failure(
        self, queue: str, error: BaseException, failures: int, stop: threading.Event
    ) -> int:
        delay = self._reconnect_backoff.delay(failures)
        log.warning("consuming %r from %s failed (%s); reconnecting in %.1fs",
                    queue, self.safe_url, redact(str(error)), delay)
        stop.wait(delay)
        return failures + 1

    def _raw_channel(self, connection: kombu.Connection) -> Any:
        """A new channel whose messages keep their bodies as the broker holds them."""
        channel = connection.channel()
        base = type(channel).Message
        raw = self._raw_message_classes.get(base)
        if raw is None:
            raw = type(f"Raw{base.__name__}", (_RawBody, base), {})
            self._raw_message_classes[base] = raw
        channel.Message = raw
        return channel

    def get(self, queue: str) -> Delivery | None:
        with self._channel() as channel:
            message = Queue(queue, durable=True, no_declare=True)(channel).get(no_ack=True)
        if message is None:
            return None
        return _KombuDelivery(queue, message, settled=True)

    @contextlib.contextmanager
    def inspect(self, queue: str, *, limit: int | None = None) -> Iterator[list[Delivery]]:
        """The messages waiting in ``queue`` now, taken unsettled; see the contract.

        They are taken with ``basic_get`` (no auto-acknowledgement) on one channel, which
        never hands out a message it already holds. At the end every unsettled one goes
        back: on RabbitMQ by a native requeue, which puts it back in its original place
        (and had the process died, the broker would have done the same); on memory:// and
        redis:// by publishing a copy to ``queue`` itself and then acknowledging the
        original, as :class:`_KombuDelivery` requeues, so they end up behind the messages
        not taken, in the order they were taken.
        """
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be at least 0, got {limit}")
        waiting = self.pending(queue)  # also: a missing queue has nothing to inspect
        wanted = waiting if limit is None else min(waiting, limit)
        if wanted == 0:
            yield []
            return
        scope = self._channel()
        with scope as channel:
            taken = self._take(channel, queue, wanted, scope.connection)
            try:
                yield list(taken)
            except BaseException:
                with contextlib.suppress(Exception):  # logged; the caller's error matters
                    _give_back(taken)
                raise
            _give_back(taken)

    def _take(self, channel: Any, queue: str, count: int,
              connection: kombu.Connection) -> list[_KombuDelivery]:
        """Up to ``count`` messages of ``queue``, unsettled; all given back on a failure."""
        bound = Queue(queue, durable=True, no_declare=True)(channel)
        outage = _broker_errors(connection)
        taken: list[_KombuDelivery] = []
        try:
            while len(taken) < count:
                message = bound.get(no_ack=False)
                if message is None:
                    break
                taken.append(_KombuDelivery(queue, message, outage=outage,
                                            native_requeue=self._is_amqp))
        except BaseException as exc:
            with contextlib.suppress(Exception):  # logged; the failure to take matters
                _give_back(taken)
            classified = (_classified(exc, connection, f"taking messages of {queue!r}",
                                      refusal=DestinationRefused, url=self.safe_url)
                          if isinstance(exc, Exception) else None)
            if classified is None:
                raise
            raise classified from exc
        return taken

    def pending(self, queue: str) -> int:
        scope = self._channel()
        with scope as channel:
            try:
                _, count, _ = channel.queue_declare(queue=queue, passive=True)
            except Exception as exc:
                if "NOT_FOUND" in str(exc) or "404" in str(exc):
                    return 0  # no such queue: nothing waits in it
                classified = _classified(exc, scope.connection, f"counting {queue!r}",
                                         refusal=BrokerAccessDenied, url=self.safe_url)
                raise classified if classified is not None else exc from exc
        return int(count)

    def delete_queue(self, queue: str) -> None:
        """Delete ``queue`` and its messages (tests and samples clean up with this)."""
        with self._channel() as channel:
            channel.queue_delete(queue=queue)
            if self._is_redis:
                channel.client.srem(REDIS_QUEUES, queue)
        self._known_queues.discard(queue)
        self._delay_bound.discard(queue)

    def delete_exchange(self) -> None:
        """Delete this transport's events exchange (tests and samples clean up with this)."""
        with self._channel() as channel:
            self._events(channel).delete()
        self._exchange_declared = False

    # -- connections ------------------------------------------------------------------

    def _connect(self) -> kombu.Connection:
        connection = kombu.Connection(self.url, transport_options=self._transport_options)
        try:
            connection.ensure_connection(max_retries=3, interval_start=0.1, interval_step=0.5)
        except Exception as exc:
            _close_quietly(connection)
            raise _connection_failure(exc, connection, self.safe_url) from exc
        with self._connections_lock:
            self._connections.append(connection)
        return connection

    def _release(self, connection: kombu.Connection) -> None:
        with self._connections_lock:
            if connection in self._connections:
                self._connections.remove(connection)
        _close_quietly(connection)

    def _channel(self) -> _ChannelScope:
        return _ChannelScope(self)

    def close(self) -> None:
        with self._connections_lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            _close_quietly(connection)
        self._local = threading.local()


class _ChannelScope:
    """A short-lived channel on a short-lived connection."""

    def __init__(self, transport: KombuTransport) -> None:
        self._transport = transport

    def __enter__(self) -> Any:
        self._connection = self._transport._connect()
        self._channel = self._transport._raw_channel(self._connection)
        return self._channel

    def __exit__(self, *exc: object) -> None:
        self._transport._release(self._connection)

    @property
    def connection(self) -> kombu.Connection:
        return self._connection


class _KombuDelivery(Delivery):
    def __init__(self, queue: str, message: kombu.Message, *, settled: bool = False,
                 native_requeue: bool = True,
                 outage: tuple[type[BaseException], ...] = ()) -> None:
        raw = delays.without_dead_letter_headers(message.headers or {})
        headers, problem = wire.text_headers(raw)
        super().__init__(
            queue=queue,
            headers=headers,
            body=_as_bytes(message.body),
            content_type=message.content_type,
            redelivered=bool(message.delivery_info.get("redelivered")),
            wire_error=_joined(problem, _encoding_problem(raw, message.content_encoding)),
        )
        self._message = message
        self.settled = settled
        self._native_requeue = native_requeue
        #: What the delivery's connection raises once it is gone.
        self._outage = outage

    def _ack(self) -> None:
        with self._outage_translated("acknowledge"):
            self._message.ack()

    def _requeue(self) -> None:
        with self._outage_translated("requeue"):
            self._requeue_on_its_queue()

    @contextlib.contextmanager
    def _outage_translated(self, action: str) -> Iterator[None]:
        try:
            yield
        except self._outage as exc:
            raise TransportUnavailable(
                f"could not {action} a message of {self.queue!r} ({exc}); its connection is "
                "gone, so the broker delivers it again"
            ) from exc

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
        )
        message.ack()


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


def _broker_errors(connection: kombu.Connection) -> tuple[type[BaseException], ...]:
    """What a delivery's connection raises once it is gone (acknowledging then fails)."""
    return (*connection.connection_errors, *connection.channel_errors,
            kombu.exceptions.OperationalError)


def _causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and what it was raised from (kombu wraps driver errors)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _classified(error: BaseException, connection: kombu.Connection, what: str, *,
                refusal: type[TransportError], url: str,
                preposition: str = "on") -> TransportError | None:
    """The failure taxonomy for a broker error met while doing ``what``: transient
    (``TransportUnavailable``), or ``refusal`` — ``DestinationRefused`` where the broker
    refused this message's destination or content, ``BrokerAccessDenied`` where it refused
    the endpoint's own queue. ``None``: not a broker error."""
    text = f"{what} {preposition} {url}: {redact(str(error))}"
    if isinstance(error, TransportError):
        return error
    recoverable = _recoverable(connection)
    for cause in _causes(error):
        if isinstance(cause, _MESSAGE_CAUSED):
            return refusal(text)
        if isinstance(cause, recoverable):
            return TransportUnavailable(text)
        if isinstance(cause, tuple(connection.channel_errors)):
            return refusal(text)
        if isinstance(cause, (*connection.connection_errors,
                              kombu.exceptions.OperationalError)):
            return TransportUnavailable(text)
    if isinstance(error, AttributeError):
        # After its connection died for good, kombu's producer has no connection left.
        return TransportUnavailable(text)
    return None


def _recoverable(connection: kombu.Connection) -> tuple[type[BaseException], ...]:
    """The errors that kombu's transport says go away by themselves. Where a transport does
    not say (memory://, redis://), kombu counts every channel error as recoverable, so a
    missing queue would be waited out forever: only connection errors are, then."""
    transport = connection.get_transport_cls()
    if hasattr(transport, "recoverable_connection_errors"):
        return (*transport.recoverable_connection_errors,
                *getattr(transport, "recoverable_channel_errors", ()))
    return tuple(connection.connection_errors)


def _connection_failure(error: Exception, connection: kombu.Connection,
                        url: str) -> Exception:
    """A failure to connect: a refused login or virtual host is the endpoint's to fix
    (``BrokerAccessDenied``); anything else a broker can say, an outage."""
    for cause in _causes(error):
        if isinstance(cause, _LOGIN_REFUSED) or _is_redis_auth_error(cause):
            return BrokerAccessDenied(f"{url} refused this endpoint: {redact(str(cause))}")
    classified = _classified(error, connection, "cannot connect", refusal=TransportUnavailable,
                             url=url, preposition="to")
    return classified if classified is not None else TransportUnavailable(
        f"cannot connect to {url}: {redact(str(error))}")


def _is_redis_auth_error(error: BaseException) -> bool:
    """redis-py's refusal of a password (or of a missing one)."""
    name = type(error).__name__
    return (type(error).__module__.startswith("redis") and name.startswith("Authentication")
            or "NOAUTH" in str(error) or "WRONGPASS" in str(error))


def _encoding_problem(headers: Mapping[str, Any], encoding: str | None) -> str | None:
    """A body idembus would have to decode or decompress to read: refused as received."""
    if headers.get("compression") is not None:
        return (f"the body is compressed ({wire.shown(headers['compression'])}); idembus "
                "does not decompress what it receives")
    if (encoding or "").strip().lower() not in _PLAIN_ENCODINGS:
        return f"the content encoding {wire.shown(encoding)} is not one idembus reads"
    return None


def _joined(*problems: str | None) -> str | None:
    return "; ".join(problem for problem in problems if problem) or None


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


def _as_bytes(body: Any) -> bytes:
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode("utf-8", "surrogateescape")
    return bytes(body)


def _close_quietly(connection: kombu.Connection) -> None:
    try:
        connection.close()
    except Exception:  # closing a broken connection may raise; nothing to do about it
        log.debug("closing a kombu connection failed", exc_info=True)
