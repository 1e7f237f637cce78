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
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import kombu
import kombu.exceptions
from kombu import Exchange, Queue, binding

from bus import headers as h
from bus.envelope import Envelope
from bus.errors import ConfigurationError
from bus.policies import Backoff
from transports import delays
from transports.base import Delivery, OnDelivery, Transport
from transports.errors import TransportUnavailable

log = logging.getLogger(__name__)

#: Seconds between polls of kombu's virtual transports. kombu's default (1 s) made an idle
#: memory:// consumer wait ~0.5 s per message; on Redis it is also the BRPOP timeout, which
#: bounds how long a consumer takes to notice that it should stop.
_DEFAULT_POLLING_INTERVALS = {"memory": 0.005, "redis": 0.1, "rediss": 0.1}
#: How long one wait for deliveries lasts before the stop flag is looked at again.
_DRAIN_TIMEOUT = 0.1


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
    ) -> None:
        self.url = url
        self._reconnect_backoff = reconnect_backoff or Backoff()
        options = dict(transport_options or {})
        scheme = url.split("://", 1)[0] if "://" in url else url
        if polling_interval is None:
            polling_interval = _DEFAULT_POLLING_INTERVALS.get(scheme)
        if polling_interval is not None:
            options.setdefault("polling_interval", polling_interval)
        self._is_amqp = scheme in ("amqp", "amqps", "pyamqp")
        self.process_local = scheme == "memory"
        self.native_delay = self._is_amqp
        if confirm_publish and self._is_amqp:
            options.setdefault("confirm_publish", True)
        self.publisher_confirms = bool(options.get("confirm_publish"))
        self._transport_options = options
        try:
            # Resolves the scheme and loads its driver; nothing connects yet.
            kombu.Connection(url, transport_options=options).transport  # noqa: B018
        except (KeyError, ImportError, ValueError) as exc:
            raise ConfigurationError(
                f"transport URL {url!r} cannot be used: {exc}. Use a kombu URL such as "
                "memory://, amqp://user:password@host:5672// or redis://host:6379/0 "
                "(redis:// needs the [redis] extra)."
            ) from exc
        self._events = Exchange(exchange, type="topic", durable=True)
        self._local = threading.local()
        self._connections: list[kombu.Connection] = []
        self._connections_lock = threading.Lock()
        self._declared: set[str] = set()
        #: Queues bound to the delay delivery exchange by this transport.
        self._delay_bound: set[str] = set()
        self._delay_levels_declared = False

    @property
    def exchange_name(self) -> str:
        """Name of the topic exchange events are published to."""
        return str(self._events.name)

    # -- topology ---------------------------------------------------------------------

    def declare(self, queue: str, *, subscriptions: Collection[str] = ()) -> None:
        bindings = [binding(self._events, routing_key=name) for name in sorted(subscriptions)]
        with self._channel() as channel:
            if bindings:
                self._events(channel).declare()
            Queue(queue, durable=True, bindings=bindings or None)(channel).declare()
        self._declared.add(queue)

    # -- publishing -------------------------------------------------------------------

    def send(self, envelope: Envelope) -> None:
        queue = envelope.destination
        if not queue:
            raise ValueError(f"message {envelope.message_id} has no destination queue")
        delay = self._delay_of(envelope)
        if delay:
            self._send_delayed(envelope, queue, delay)
            return
        declare = [] if queue in self._declared else [Queue(queue, durable=True)]
        self._publish(envelope, exchange="", routing_key=queue, declare=declare)
        self._declared.add(queue)

    def _delay_of(self, envelope: Envelope) -> int:
        """Seconds the broker must hold ``envelope`` (0: deliver at once)."""
        if not self.native_delay:
            return 0
        deliver_at = delays.parse_time(envelope.headers.get(h.DELIVER_AT))
        return delays.delay_seconds(deliver_at, datetime.datetime.now(datetime.timezone.utc))

    def _send_delayed(self, envelope: Envelope, queue: str, delay: int) -> None:
        key = delays.routing_key(delay, queue)  # refuses a queue name it cannot route first
        if queue not in self._delay_bound:
            self._bind_for_delays(queue)
        try:
            self._publish(envelope, exchange=delays.entry_exchange(delay), routing_key=key,
                          declare=[])
        except TransportUnavailable:
            # The broker may have lost the topology (a reset node): declare it again next time.
            self._delay_levels_declared = False
            self._delay_bound.clear()
            raise

    def _bind_for_delays(self, queue: str) -> None:
        """Declare the delay levels (once) and ``queue``, bound to their delivery exchange."""
        scope = self._channel()
        with scope as channel:
            lost = (*scope.connection.connection_errors, kombu.exceptions.OperationalError)
            try:
                if not self._delay_levels_declared:
                    delays.declare_levels(channel)
                    self._delay_levels_declared = True
                delays.bind_destination(channel, queue)
            except lost as exc:
                raise TransportUnavailable(
                    f"declaring the delay levels on {self.url} failed: {exc}") from exc
        self._delay_bound.add(queue)
        self._declared.add(queue)

    def publish(self, envelope: Envelope) -> None:
        declare = [] if self._events.name in self._declared else [self._events]
        self._publish(envelope, exchange=self._events.name, routing_key=envelope.message_type,
                      declare=declare)
        self._declared.add(self._events.name)

    def _publish(self, envelope: Envelope, *, exchange: str, routing_key: str,
                 declare: list[Any]) -> None:
        connection, producer = self._producer()
        # After its connection died for good, kombu's producer raises AttributeError (it has
        # no connection left); that is an outage too.
        outage: tuple[type[BaseException], ...] = (*_broker_errors(connection), AttributeError)
        try:
            producer.publish(
                envelope.body.encode("utf-8", "surrogateescape"),
                exchange=exchange,
                routing_key=routing_key,
                headers=dict(envelope.headers),
                content_type=envelope.content_type,
                content_encoding="utf-8",
                delivery_mode=2,
                declare=declare,
                retry=True,
                retry_policy={"max_retries": 3, "interval_start": 0.1, "interval_step": 0.5},
            )
        except outage as exc:
            del self._local.publisher
            self._release(connection)
            raise TransportUnavailable(f"publish to {self.url} failed: {exc}") from exc

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
        failures = 0
        while not stop.is_set():
            try:
                connection = self._connect()
            except TransportUnavailable as exc:
                failures = self._pause_after_failure(queue, exc, failures, stop)
                continue
            outage: tuple[type[BaseException], ...] = (
                *_broker_errors(connection), TransportUnavailable)
            try:
                with connection.Consumer(
                    [Queue(queue, durable=True, no_declare=True)],
                    on_message=self._delivering(queue, on_delivery, connection),
                    prefetch_count=prefetch,
                ):
                    failures = 0
                    while not stop.is_set():
                        try:
                            connection.drain_events(timeout=_DRAIN_TIMEOUT)
                        except TimeoutError:
                            continue
            except outage as exc:
                failures = self._pause_after_failure(queue, exc, failures, stop)
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
                    queue, self.url, error, delay)
        stop.wait(delay)
        return failures + 1

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
            taken = self._take(channel, queue, wanted, _broker_errors(scope.connection))
            try:
                yield list(taken)
            except BaseException:
                with contextlib.suppress(Exception):  # logged; the caller's error matters
                    _give_back(taken)
                raise
            _give_back(taken)

    def _take(self, channel: Any, queue: str, count: int,
              outage: tuple[type[BaseException], ...]) -> list[_KombuDelivery]:
        """Up to ``count`` messages of ``queue``, unsettled; all given back on a failure."""
        bound = Queue(queue, durable=True, no_declare=True)(channel)
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
            if isinstance(exc, outage):
                raise TransportUnavailable(
                    f"taking messages of {queue!r} from {self.url} failed: {exc}") from exc
            raise
        return taken

    def pending(self, queue: str) -> int:
        try:
            with self._channel() as channel:
                _, count, _ = channel.queue_declare(queue=queue, passive=True)
        except kombu.exceptions.ChannelError:
            return 0
        except Exception as exc:  # py-amqp raises NotFound (a channel error) for no queue
            if "NOT_FOUND" in str(exc) or "404" in str(exc):
                return 0
            raise
        return int(count)

    def delete_queue(self, queue: str) -> None:
        """Delete ``queue`` and its messages (tests and samples clean up with this)."""
        with self._channel() as channel:
            channel.queue_delete(queue=queue)
        self._declared.discard(queue)
        self._delay_bound.discard(queue)

    def delete_exchange(self) -> None:
        """Delete this transport's events exchange (tests and samples clean up with this)."""
        with self._channel() as channel:
            self._events(channel).delete()
        self._declared.discard(self._events.name)

    # -- connections ------------------------------------------------------------------

    def _connect(self) -> kombu.Connection:
        connection = kombu.Connection(self.url, transport_options=self._transport_options)
        try:
            connection.ensure_connection(max_retries=3, interval_start=0.1, interval_step=0.5)
        except (*connection.connection_errors, kombu.exceptions.OperationalError) as exc:
            raise TransportUnavailable(f"cannot connect to {self.url}: {exc}") from exc
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
        self._channel = self._connection.channel()
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
        super().__init__(
            queue=queue,
            headers=_text_headers(message.headers or {}),
            body=_as_bytes(message.body),
            content_type=message.content_type,
            redelivered=bool(message.delivery_info.get("redelivered")),
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
    """What a lost or refused connection raises, for this connection's kombu transport."""
    return (*connection.connection_errors, *connection.channel_errors,
            kombu.exceptions.OperationalError)


def _text_headers(headers: Mapping[str, Any]) -> dict[str, str]:
    """Header values as text, without the broker's dead-letter bookkeeping (delays add it)."""
    return {str(k): v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
            for k, v in delays.without_dead_letter_headers(headers).items() if v is not None}


def _as_bytes(body: Any) -> bytes:
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode("utf-8")
    return bytes(body)


def _close_quietly(connection: kombu.Connection) -> None:
    try:
        connection.close()
    except Exception:  # closing a broken connection may raise; nothing to do about it
        log.debug("closing a kombu connection failed", exc_info=True)
