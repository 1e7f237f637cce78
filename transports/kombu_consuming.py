"""The kombu transport's consumers: one delivery or a batch at a time, reconnecting with
backoff after an outage (one WARNING per queue and cause every 10 s), raising what only an
operator can end; and acknowledging a batch with one ``basic.ack``."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from queue import Empty
from typing import Any

import kombu
from kombu import Queue

from .. import routing
from ..redaction import redact
from . import amqp_reads
from .base import Delivery, OnBatch, OnDelivery
from .errors import BrokerAccessDenied, TransportUnavailable
from .kombu_core import _DRAIN_TIMEOUT, KombuCore
from .kombu_delivery import _KombuDelivery
from .kombu_errors import _broker_errors, _classified
from .kombu_in_process import InProcessMessage
from .redis_leases import PartitionLeases

log = logging.getLogger(f"{__package__}.kombu")  # one logger for the kombu transport


class KombuConsuming(KombuCore):
    """Consuming a queue, one delivery or a batch at a time."""

    def consume(
        self, queue: str, on_delivery: OnDelivery, *, stop: threading.Event, prefetch: int = 1
    ) -> None:
        """See the contract; outages are waited out here, and a refusal that only an
        operator can end (``BrokerAccessDenied``) is raised."""
        self._consuming(queue, stop, prefetch,
                        lambda connection: self._delivering(queue, on_delivery, connection),
                        lambda connection: None)

    def consume_replies(self, queue: str, on_delivery: OnDelivery, *,
                        stop: threading.Event, ready: threading.Event) -> None:
        """See the contract. On RabbitMQ the queue is declared exclusive and auto-delete
        on the consuming connection (again after a reconnection): the broker deletes it
        when that connection ends, whatever ends it. Elsewhere, the default."""
        if not self._is_amqp:
            super().consume_replies(queue, on_delivery, stop=stop, ready=ready)
            return
        private = Queue(queue, durable=False, exclusive=True, auto_delete=True)
        try:
            self._consuming(queue, stop, 64,
                            lambda connection: self._delivering(queue, on_delivery, connection),
                            lambda connection: None, declared=private, ready=ready)
        finally:
            ready.clear()

    def consume_batches(
        self, queue: str, on_batch: OnBatch, *, stop: threading.Event, prefetch: int = 1,
        size: int = 1, linger: float = 0.0,
    ) -> None:
        """See the contract: once a delivery is ready, the next ones are taken as they come,
        up to ``size`` or for ``linger`` seconds; outages as :meth:`consume`. On AMQP the
        linger is waited only under load, when a second delivery comes within
        :data:`AT_ONCE` of the first: a delivery that comes alone (light load) is handed
        over after that look, without the linger; and no wait goes past the linger.

        On Redis batches hold one delivery: a wait for more leaves a ``BRPOP`` pending while
        the batch is processed, which takes the message a stopping consumer gives back.
        A subclass that overrides :meth:`consume` gets its batches through it, one delivery
        each."""
        if self._overrides("consume"):
            super().consume_batches(queue, on_batch, stop=stop, prefetch=prefetch)
            return
        if self.process_local:
            self._consume_in_process(queue, on_batch, stop, size, linger)
            return
        if self._is_redis:
            size = 1
        # Virtual transports (memory://) poll: a short wait there is a poll interval's sleep.
        probe = self._is_amqp
        drain = _drain_within if self._is_amqp else _drain_with(False)
        ready: list[Delivery] = []

        def receiving(connection: kombu.Connection) -> Callable[[kombu.Message], None]:
            ready.clear()  # what a lost connection had delivered, the broker delivers again
            outage = _broker_errors(connection)

            native_requeue, events_exchange = self._is_amqp, self.exchange_name

            def on_message(message: kombu.Message) -> None:
                ready.append(_KombuDelivery(queue, message, outage=outage,
                                            native_requeue=native_requeue,
                                            events_exchange=events_exchange))

            return on_message

        def after_drain(connection: kombu.Connection) -> None:
            deadline = time.monotonic() + linger
            # A message alone (light load) goes at once: no linger, no second look.
            alone = (probe and len(ready) == 1 and size > 1
                     and not _arrives_within(connection, ready, AT_ONCE))
            while not alone and ready and len(ready) < size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    # RabbitMQ: past the linger, what the broker has sent already (it is in
                    # the socket, nothing is waited for) still joins the batch. Under load,
                    # when the consumer is what is slow, batches fill up to ``size``.
                    if probe and _arrives_within(connection, ready, 0.0):
                        continue
                    break
                try:
                    drain(connection, remaining)
                except TimeoutError:
                    break
            while ready:  # a drain may bring more than one: never more than size a batch
                batch = ready[:size]
                del ready[:size]
                self.deliver_batch(batch, on_batch)

        self._consuming(queue, stop, prefetch, receiving, after_drain)

    def _consume_in_process(self, queue: str, on_batch: OnBatch, stop: threading.Event,
                            size: int, linger: float) -> None:
        """memory://: batches taken from the queue itself, on a channel of this consumer.
        A wait for the first delivery blocks on the queue (it wakes when a message is put,
        instead of kombu's polling every few milliseconds), and each message becomes the
        channel's kombu ``Message``, held by the channel's QoS until it is settled, as a
        ``basic_get`` makes it. A batch is settled before the next is taken: at most
        ``size`` deliveries are unacknowledged at a time (within the prefetch, which the
        endpoint keeps at least as large). Outages (a subclass's) as :meth:`consume`."""
        def taking(connection: kombu.Connection, channel: Any,
                   started: Callable[[], None]) -> None:
            started()
            self._take_in_process(channel, queue, on_batch, stop, size, linger,
                                  _broker_errors(connection))

        self._reconnecting(queue, stop, taking)

    def _take_in_process(self, channel: Any, queue: str, on_batch: OnBatch,
                         stop: threading.Event, size: int, linger: float,
                         outage: tuple[type[BaseException], ...]) -> None:
        """The loop of :meth:`_consume_in_process` on one channel."""
        exchange = self.exchange_name

        def delivery(raw: Any) -> _KombuDelivery:
            return _KombuDelivery(queue, InProcessMessage(raw, channel),
                                  outage=outage, native_requeue=False,
                                  events_exchange=exchange)

        while not stop.is_set():
            waiting = channel._queue_for(queue)  # anew: a deleted queue is made again
            try:
                batch = [delivery(waiting.get(timeout=_DRAIN_TIMEOUT))]
            except Empty:
                continue
            deadline = time.monotonic() + linger if size > 1 else 0.0
            while len(batch) < size:
                try:
                    raw = waiting.get_nowait()
                except Empty:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    try:
                        raw = waiting.get(timeout=remaining)
                    except Empty:
                        break
                batch.append(delivery(raw))
            self.deliver_batch(batch, on_batch)

    def _consuming(
        self, queue: str, stop: threading.Event, prefetch: int,
        receiving: Callable[[kombu.Connection], Callable[[kombu.Message], None]],
        after_drain: Callable[[kombu.Connection], None], *,
        declared: Queue | None = None, ready: threading.Event | None = None,
    ) -> None:
        """Consume ``queue`` with the callback ``receiving(connection)`` makes, calling
        ``after_drain`` after each delivery, until ``stop`` is set; reconnect after outages.
        ``declared``: a queue the consumer declares on its connection (else ``queue``
        must exist); ``ready`` is set each time the consumer is in place."""
        def consumers(connection: kombu.Connection, channel: Any) -> list[kombu.Consumer]:
            return [kombu.Consumer(
                channel, [declared or Queue(queue, durable=True, no_declare=True)],
                on_message=receiving(connection), prefetch_count=prefetch)]

        self._consuming_with(queue, stop, consumers, after_drain, ready=ready)

    def consume_partitions(self, queue: str, partitions: Sequence[int],
                           on_delivery: OnDelivery, *, stop: threading.Event) -> None:
        """Consume the partition queues ``partitions`` of ``queue``'s ordered messages
        (:meth:`declare_partitions`) on one connection, one delivery at a time, each
        partition's consumer with a prefetch of 1, until ``stop`` is set; outages as
        :meth:`consume`. On RabbitMQ the broker makes one consumer of each partition
        active at a time: while this one is, the partition's messages come here in order,
        the next one only once the previous one is settled."""
        if self._is_redis:
            self._consume_leased(queue, partitions, on_delivery, stop)
            return
        self._consume_partition_queues(queue, partitions, on_delivery, stop)

    def _consume_partition_queues(self, queue: str, partitions: Collection[int],
                                  on_delivery: OnDelivery, stop: threading.Event) -> None:
        names = [routing.partition_queue(queue, index) for index in sorted(partitions)]
        leaving = self._is_redis

        def consumers(connection: kombu.Connection, channel: Any) -> list[kombu.Consumer]:
            made = [kombu.Consumer(
                channel, [Queue(name, durable=True, no_declare=True)],
                on_message=self._delivering(name, on_delivery, connection,
                                            unless=stop if leaving else None),
                prefetch_count=1)
                for name in names]
            return [*made, _PendingRead(channel)] if leaving else made

        self._consuming_with(", ".join(names), stop, consumers, lambda connection: None)

    def _consume_leased(self, queue: str, partitions: Sequence[int], on_delivery: OnDelivery,
                        stop: threading.Event) -> None:
        """Redis: consume those of ``partitions`` whose lease this process holds
        (:mod:`.redis_leases`), again each time they change, until ``stop`` is set."""
        leases = self._partition_leases(queue, partitions)
        changed = threading.Event()
        leases.watch(partitions, changed)
        try:
            while not stop.is_set():
                changed.clear()
                mine = leases.consumable(partitions)
                # Those given up are no longer consumed: their leases go back.
                leases.release([index for index in partitions if index not in mine])
                if not mine:
                    _wait_either(changed, stop)
                    continue
                with leases.consuming(mine):
                    self._consume_partition_queues(queue, mine, on_delivery,
                                                   _EitherEvent(stop, changed))
        finally:
            leases.release(partitions, unwatch=True)

    def _partition_leases(self, queue: str, partitions: Sequence[int]) -> PartitionLeases:
        with self._connections_lock:
            leases = self._leases.get(queue)
            if leases is None:
                count = self._partition_counts.get(queue, max(partitions, default=0) + 1)
                leases = PartitionLeases(self._connect, self._release, queue, count,
                                         ttl=self.partition_lease)
                self._leases[queue] = leases
            return leases

    def _consuming_with(
        self, queue: str, stop: threading.Event,
        consumers: Callable[[kombu.Connection, Any], list[kombu.Consumer]],
        after_drain: Callable[[kombu.Connection], None], *,
        ready: threading.Event | None = None,
    ) -> None:
        """Consume with the consumers ``consumers(connection, channel)`` makes (``queue``
        names what they consume, in warnings), calling ``after_drain`` after each
        delivery, until ``stop`` is set; reconnect after outages."""
        drain = _drain_with(self._is_amqp)

        def draining(connection: kombu.Connection, channel: Any,
                     started: Callable[[], None]) -> None:
            with contextlib.ExitStack() as consuming:
                for consumer in consumers(connection, channel):
                    consuming.enter_context(consumer)
                started()
                if ready is not None:
                    ready.set()
                # Heartbeats (``?heartbeat=`` in the URL) tell a node that vanished
                # without closing the socket from a quiet queue.
                beating = self._is_amqp and bool(connection.heartbeat)
                while not stop.is_set():
                    try:
                        drain(connection, _DRAIN_TIMEOUT)
                    except TimeoutError:
                        if beating:
                            connection.heartbeat_check()
                        continue
                    if beating:
                        connection.heartbeat_check()
                    after_drain(connection)

        self._reconnecting(queue, stop, draining)

    def _reconnecting(self, queue: str, stop: threading.Event,
                      session: Callable[[kombu.Connection, Any, Callable[[], None]], None],
                      ) -> None:
        """Run ``session(connection, channel, started)`` on a connection of the pool until
        ``stop`` is set, connecting again after each outage, paused by the reconnect backoff
        (whose count starts again once the session calls ``started``: its consumers are in
        place); a refused login ends it."""
        failures = 0

        def started() -> None:
            nonlocal failures
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
                session(connection, channel, started)
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

    def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        """On RabbitMQ, deliveries with consecutive tags on one channel (a batch, every
        earlier delivery settled) are acknowledged with one ``basic.ack`` (``multiple``);
        others one by one."""
        held = [delivery for delivery in deliveries if isinstance(delivery, _KombuDelivery)]
        if not self._is_amqp or len(held) < 2 or len(held) != len(deliveries):
            super().ack_many(deliveries)
            return
        # one look at each (its kombu message's tag and channel), no call for each
        channel = held[0]._message.channel
        tags: list[int] = []
        for delivery in held:
            message = delivery._message
            if delivery.settled or message.channel is not channel:
                super().ack_many(deliveries)
                return
            tags.append(message.delivery_tag)
        ordered = sorted(tags)
        if ordered != list(range(ordered[0], ordered[0] + len(ordered))):
            super().ack_many(deliveries)
            return
        held[tags.index(ordered[-1])].ack_up_to_here()
        for delivery in held:
            delivery.settled = True

    def _delivering(self, queue: str, on_delivery: OnDelivery, connection: kombu.Connection,
                    *, unless: threading.Event | None = None,
                    ) -> Callable[[kombu.Message], None]:
        """The kombu callback that hands each message of ``queue`` to ``on_delivery``;
        once ``unless`` is set, a message is left unacknowledged instead, for the channel's
        closing to put back first in line (kombu's Redis transport)."""
        outage = _broker_errors(connection)

        def on_message(message: kombu.Message) -> None:
            if unless is not None and unless.is_set():
                return
            delivery = _KombuDelivery(queue, message, outage=outage,
                                      native_requeue=self._is_amqp,
                                      events_exchange=self.exchange_name)
            self.deliver(delivery, on_delivery)

        return on_message

    def _pause_after_failure(
        self, queue: str, error: BaseException, failures: int, stop: threading.Event
    ) -> int:
        delay = self._reconnect_backoff.delay(failures)
        held = self.reconnect_lines.allow(f"{queue} {type(error).__name__}")
        if held is not None:
            log.warning("consuming %r from %s failed (%s); reconnecting in %.1fs%s",
                        queue, self.safe_url, redact(str(error)), delay,
                        self.reconnect_lines.said(held))
        stop.wait(delay)
        return failures + 1


#: How long a batch's first delivery waits to see whether another came with it (under load
#: the broker has sent the next ones already; they are in the socket's buffer).
AT_ONCE = 0.0002


def _drain_with(amqp: bool) -> Callable[[kombu.Connection, float], None]:
    """How a consumer waits for the next method: on RabbitMQ the frames already read come
    first (:func:`.amqp_reads.drain`); elsewhere as kombu drains."""
    if amqp:
        return amqp_reads.drain
    return lambda connection, timeout: connection.drain_events(timeout=timeout)


def _drain_within(connection: kombu.Connection, timeout: float) -> None:
    """:func:`.amqp_reads.drain` for a batch's short waits on RabbitMQ: ``TimeoutError``
    unless something comes within ``timeout`` (waited for to the microsecond,
    :func:`.amqp_reads.readable_within`; a socket timeout waits whole milliseconds), then
    every frame read already, or one method read. Never a non-blocking read: py-amqp
    spins on one that stops mid-frame."""
    if not amqp_reads.readable_within(connection, timeout):
        raise TimeoutError
    # a batch's consumer only collects deliveries: every frame read already at once
    amqp_reads.drain(connection, max(timeout, AT_ONCE), every=True)


def _arrives_within(connection: kombu.Connection, ready: list[Delivery],
                    timeout: float) -> bool:
    """Whether another delivery joins ``ready`` within ``timeout`` (0: only one the broker
    has sent already)."""
    before = len(ready)
    try:
        _drain_within(connection, timeout)
    except TimeoutError:
        pass
    return len(ready) > before


class _EitherEvent(threading.Event):
    """Set when either of two events is (what a consumer's loop looks at to stop)."""

    def __init__(self, first: threading.Event, second: threading.Event) -> None:
        super().__init__()
        self._either = (first, second)

    def is_set(self) -> bool:
        return any(event.is_set() for event in self._either)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            remaining = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if remaining <= 0:
                return False
            self._either[0].wait(remaining)
        return True


def _wait_either(first: threading.Event, second: threading.Event) -> None:
    """Wait until ``first`` or ``second`` is set."""
    _EitherEvent(first, second).wait()


class _PendingRead:
    """Reads, on leaving, the reply of a BRPOP a kombu Redis channel left pending, while the
    consumers' callbacks are still in place (they leave its message unacknowledged, and the
    channel's closing puts it back first in line). Without it, the channel's closing reads
    the reply with no consumer left, and kombu requeues the message at the back of its queue,
    behind later messages of its key."""

    def __init__(self, channel: Any) -> None:
        self._channel = channel

    def __enter__(self) -> _PendingRead:
        return self

    def __exit__(self, *exc: object) -> None:
        if getattr(self._channel, "_in_poll", None):
            try:
                self._channel._brpop_read()
            except Exception:  # Empty, or the connection is gone: nothing was taken
                log.debug("reading a pending BRPOP failed", exc_info=True)
