"""The transport contract.

A transport moves envelopes between endpoint queues. It must:

* ``declare(queue, subscriptions)`` — create a durable queue and bind it to the event
  types in ``subscriptions``. This method must be idempotent: every endpoint calls it on
  every start.
* ``send(envelope)`` — put a message on the queue ``envelope.destination``; if the
  transport has ``native_delay`` and the envelope carries a future ``idembus.deliver_at``,
  the broker holds it back until then (the endpoint keeps delayed messages in its storage
  for transports without native delay);
  ``publish(envelope)`` — deliver an event to every queue subscribed to its type. Both
  return once the broker has the message (after the publisher confirm, where the
  transport has confirms).
* ``consume(queue, on_delivery, stop=...)`` — block, calling ``on_delivery`` once per
  message, until ``stop`` is set. The callback settles each delivery with ``ack()`` or
  ``requeue()``. If the callback raises instead, the transport requeues the delivery —
  what the broker does when a consumer dies — and keeps consuming.
* ``consume_batches(queue, on_batch, stop=..., size=..., linger=...)`` — the same, calling
  ``on_batch`` with the deliveries that are ready, up to ``size``, waiting at most
  ``linger`` seconds for more (batched consumption, :mod:`idembus.policies`);
  ``dispatch_many(envelopes)`` — dispatch several, with one wait for their confirms;
  ``ack_many(deliveries)`` — acknowledge several. The defaults do one at a time.
* ``get(queue)`` — take one message, if any (tools and tests); ``pending(queue)`` — how
  many messages wait; ``depth(queue)`` — what the broker or database can tell of a queue
  now (:class:`QueueDepth`: ready, unacknowledged, consumers, the oldest ready message's
  wait; ``None`` for what it cannot tell); ``close()``.
* ``inspect(queue, limit=...)`` — for tools that look at a queue without losing anything
  (``idembus errors``): a context manager yielding the deliveries waiting in the queue
  now, taken unsettled. Inside the block the caller may ``ack()`` some (removed for good)
  or ``requeue()`` them; when the block ends, however it ends, every delivery still
  unsettled goes back to the queue. Their order in the queue may change (it depends on
  the broker). If the process dies meanwhile, the broker gives them back as it does for
  a consumer that dies. Transports that cannot do this raise ``NotImplementedError``.

Capability flags say what the broker offers natively; the endpoint compensates for what
it lacks.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from ..envelope import Envelope
from .errors import TransportUnavailable
from .reply_leases import LeaseKeeper

log = logging.getLogger(__name__)


class Delivery(ABC):
    """A received message, settled once with :meth:`ack` or :meth:`requeue`."""

    def __init__(
        self,
        *,
        queue: str,
        headers: Mapping[str, str],
        body: bytes,
        content_type: str | None,
        redelivered: bool,
        wire_error: str | None = None,
        content_encoding: str | None = None,
    ) -> None:
        self.queue = queue
        #: Every header whose value is text; a transport that met a value it could not
        #: take as text (bytes, numbers, tables) shows it here as its ``repr`` and says
        #: so in ``wire_error``.
        self.headers = headers
        #: The body as the broker holds it: never decompressed or decoded.
        self.body = body
        self.content_type = content_type
        #: The content encoding the message arrived with (``None``: it had none). The body
        #: is never decoded by it; an error-queue copy is published with it unchanged.
        self.content_encoding = content_encoding
        self.redelivered = redelivered
        #: Why the message cannot be read as idembus's wire format, found by the transport
        #: before anything was decoded (a header that is not text, a compressed body); the
        #: endpoint sends such a delivery to the error queue with this reason.
        self.wire_error = wire_error
        self.settled = False

    def _stand_for(self, original: Delivery) -> None:
        """Take the fields ``__init__`` sets from ``original``'s (not settled yet): for a
        delivery that stands for another, without a call of ``__init__`` with seven
        keywords for every message."""
        self.queue = original.queue
        self.headers = original.headers
        self.body = original.body
        self.content_type = original.content_type
        self.content_encoding = original.content_encoding
        self.redelivered = original.redelivered
        self.wire_error = original.wire_error
        self.settled = False

    def ack(self) -> None:
        """Remove the message from its queue for good."""
        self._settle(self._ack)

    def requeue(self) -> None:
        """Give the message back to the broker for redelivery."""
        self._settle(self._requeue)

    def _settle(self, action: Callable[[], None]) -> None:
        if self.settled:
            raise RuntimeError(f"delivery from {self.queue!r} was already settled")
        action()
        self.settled = True

    @abstractmethod
    def _ack(self) -> None: ...

    @abstractmethod
    def _requeue(self) -> None: ...


@dataclass(frozen=True)
class QueueDepth:
    """What a transport can tell of one queue now (``idembus status``, the dashboard);
    ``None``: it cannot tell that."""

    #: Messages waiting to be delivered now (not delayed, not held by a consumer).
    ready: int | None = None
    #: Messages delivered to a consumer and not acknowledged yet (leased).
    unacked: int | None = None
    #: Messages held back until a later time (delayed retries, deferred messages).
    delayed: int | None = None
    #: Consumers attached to the queue.
    consumers: int | None = None
    #: Seconds the oldest ready message has been due: how far behind its consumers are.
    oldest_seconds: float | None = None


@dataclass(frozen=True)
class OrderedKeys:
    """What a transport that orders messages by key in the endpoint's own queue (the
    database queues) can tell of them now (``idembus status``)."""

    #: Keys with a message claimed by a consumer and not settled yet.
    in_flight: int
    #: Ordered messages in the queue that no consumer holds (due, delayed, or waiting for
    #: an older message of their key).
    waiting: int


OnDelivery = Callable[[Delivery], None]
OnBatch = Callable[[Sequence[Delivery]], None]


class Transport(ABC):
    """Base class of transports; see the module docstring for the contract."""

    #: The broker can hold a message back until a given time (``idembus.deliver_at``).
    native_delay: bool = False

    #: ``send`` and ``publish`` return only after the broker confirmed the message.
    publisher_confirms: bool = False

    #: The broker lives inside this process (several worker processes cannot share it).
    process_local: bool = False

    #: Ordered messages (``ordered_by=``) travel in partition queues that the endpoint
    #: declares (:meth:`declare_partitions`) and consumes (:meth:`consume_partitions`);
    #: ``False``: the transport orders them by key in the endpoint's own queue (the
    #: database queues) and sends to a partition queue go to the endpoint's queue.
    partition_queues: bool = False

    #: Reply queues (``bus.request``) carry a lease their process renews, and expired
    #: ones are swept (:mod:`.reply_leases`): the broker cannot tie a queue to the
    #: consumer's connection, as RabbitMQ does, nor does the process's end delete it.
    expiring_reply_queues: bool = False

    #: Seconds a reply queue outlives a requester that died without closing its endpoint
    #: (``expiring_reply_queues``); its lease is renewed every third of this.
    reply_lease: float = 30.0

    def ordered_keys(self, queue: str) -> OrderedKeys | None:
        """The ordered messages of ``queue`` by key (transports that order them in the
        endpoint's own queue); ``None``: this transport cannot tell (on RabbitMQ, the depths
        of the partition queues tell)."""
        return None

    def declare_partitions(self, queue: str, count: int) -> None:
        """Create the ``count`` partition queues of ``queue`` (``partition_queues``)."""
        raise NotImplementedError(f"{type(self).__name__} has no partition queues")

    def consume_partitions(self, queue: str, partitions: Sequence[int],
                           on_delivery: OnDelivery, *, stop: threading.Event) -> None:
        """Call ``on_delivery`` for each message of the partition queues ``partitions`` of
        ``queue``, one at a time, in each partition's order, until ``stop`` is set."""
        raise NotImplementedError(f"{type(self).__name__} has no partition queues")

    @abstractmethod
    def declare(self, queue: str, *, subscriptions: Collection[str] = ()) -> None:
        """Create ``queue`` and bind it to each event type name in ``subscriptions``."""

    @abstractmethod
    def send(self, envelope: Envelope) -> None:
        """Put ``envelope`` on the queue ``envelope.destination``."""

    @abstractmethod
    def publish(self, envelope: Envelope) -> bool | None:
        """Deliver the event ``envelope`` to every queue subscribed to its type or to a
        message type it derives from (``idembus.enclosed_types``), one copy each. Return
        False if the broker reports that no queue took it (the endpoint counts it as
        ``unrouted``); True or None otherwise (None: this transport cannot tell)."""

    @abstractmethod
    def consume(
        self, queue: str, on_delivery: OnDelivery, *, stop: threading.Event, prefetch: int = 1
    ) -> None:
        """Call ``on_delivery`` for each message of ``queue`` until ``stop`` is set."""

    @abstractmethod
    def get(self, queue: str) -> Delivery | None:
        """Take one message from ``queue`` without waiting, or return ``None``."""

    @abstractmethod
    def pending(self, queue: str) -> int:
        """Number of messages ready in ``queue`` (0 if it does not exist)."""

    def depth(self, queue: str) -> QueueDepth:
        """What can be told of ``queue`` now; this default knows only :meth:`pending`."""
        return QueueDepth(ready=self.pending(queue))

    def inspect(
        self, queue: str, *, limit: int | None = None
    ) -> AbstractContextManager[list[Delivery]]:
        """Look at the messages waiting in ``queue`` without losing any.

        ``with transport.inspect(queue, limit=100) as deliveries:`` — ``deliveries`` holds
        the messages waiting now (at most ``limit``; ``[]`` if the queue is empty or does
        not exist), taken from the queue unsettled so that nobody else receives them
        meanwhile. Settle them only inside the block: ``ack()`` removes one for good,
        ``requeue()`` gives it back at once. When the block ends, even by an exception,
        every delivery still unsettled goes back to ``queue`` (and only to it); the order
        of the queue may change.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot inspect queue {queue!r} without taking its "
            "messages; tools that look at queues need a transport that implements inspect()"
        )

    def limit_bodies(self, queue: str, *, max_bytes: int, error_queue: str) -> None:
        """The consumers of ``queue`` take no body over ``max_bytes`` into this process: a
        transport that can tell a message's size before reading its body (the database
        queues) moves such a message to ``error_queue`` itself, unread, with the failure
        headers; the others deliver it, and the endpoint refuses it. The endpoint calls
        this with its ``max_message_bytes`` and error queue; this default does nothing."""

    def migrate(self) -> bool:
        """Create what this transport keeps in a database (tables, indexes) if it does not
        exist yet; idempotent (``idembus migrate`` runs it). True if there was anything to
        create; a broker has nothing (:meth:`declare` makes its queues)."""
        return False

    def close(self) -> None:
        """Release connections. Idempotent."""

    def dispatch(self, envelope: Envelope) -> bool | None:
        """Send ``envelope`` to its destination queue, or publish it if it has none (an
        event; a retried event goes back to the one queue that failed it). What
        :meth:`publish` returns (None for a send)."""
        if envelope.destination is None:
            return self.publish(envelope)
        self.send(envelope)
        return None

    def consume_replies(self, queue: str, on_delivery: OnDelivery, *,
                        stop: threading.Event, ready: threading.Event) -> None:
        """Create ``queue`` as a reply queue private to this process, set ``ready`` once
        messages sent to it are consumed, and consume it as :meth:`consume` does until
        ``stop`` is set; then delete it. (``bus.request``'s replies come back there.)

        A broker that can tie a queue to the consumer's connection removes it itself
        when the connection ends, even if the process is killed (RabbitMQ: exclusive,
        auto-delete). This default declares an ordinary queue and deletes it, with what
        it holds, when ``stop`` ends the consumption. Where ``expiring_reply_queues``,
        the queue's lease is renewed while it is consumed, and the expired reply queues
        of other processes are swept (:mod:`.reply_leases`): a killed process's queue
        goes one ``reply_lease`` after it died."""
        self.declare(queue)
        keeper = None
        if self.expiring_reply_queues:
            self.renew_reply_queue(queue)
            self.sweep_reply_queues()
            keeper = LeaseKeeper(self, queue)
            keeper.start()
        ready.set()
        try:
            self.consume(queue, on_delivery, stop=stop, prefetch=64)
        finally:
            ready.clear()
            if keeper is not None:
                keeper.stop()
            delete = getattr(self, "delete_queue", None)
            if delete is not None:
                try:
                    delete(queue)
                except Exception as error:
                    log.warning("the reply queue %r could not be deleted: %s", queue, error)

    def renew_reply_queue(self, queue: str) -> None:
        """Renew the lease of the reply queue ``queue``, consumed by this process, for
        ``reply_lease`` seconds (declaring it again if it was swept meanwhile). This
        default does nothing (the queue has no lease)."""

    def sweep_reply_queues(self) -> list[str]:
        """Delete the reply queues whose requester is gone (their lease ran out), with the
        replies in them; return their names. This default has none to delete."""
        return []

    def consume_batches(
        self, queue: str, on_batch: OnBatch, *, stop: threading.Event, prefetch: int = 1,
        size: int = 1, linger: float = 0.0,
    ) -> None:
        """Call ``on_batch`` with the deliveries of ``queue`` that are ready, up to
        ``size`` at a time, waiting at most ``linger`` seconds for more once one is ready,
        until ``stop`` is set; ``on_batch`` settles them all. If it raises, the transport
        requeues those left unsettled. This default hands over one delivery at a time."""
        def one(delivery: Delivery) -> None:
            on_batch([delivery])

        self.consume(queue, one, stop=stop, prefetch=prefetch)

    def dispatch_many(self, envelopes: Sequence[Envelope]) -> list[bool | None | Exception]:
        """:meth:`dispatch` for each envelope, in order: what it returned, or the error it
        raised. Transports with publisher confirms publish them all and wait for their
        confirms once; this default dispatches one after another."""
        return [self._dispatch_or_error(envelope) for envelope in envelopes]

    def _dispatch_or_error(self, envelope: Envelope) -> bool | None | Exception:
        """:meth:`dispatch`'s answer for ``envelope``, or the error it raised."""
        try:
            return self.dispatch(envelope)
        except Exception as error:
            return error

    def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        """Acknowledge ``deliveries`` (received by one consumer, in order); this default
        acknowledges one after another."""
        for delivery in deliveries:
            delivery.ack()

    @staticmethod
    def deliver(delivery: Delivery, on_delivery: OnDelivery) -> None:
        """Run the callback; requeue the delivery if it escaped unsettled by raising."""
        _requeued_on_failure([delivery], lambda: on_delivery(delivery),
                             "processing a message from %r stopped abruptly; requeued")

    @staticmethod
    def deliver_batch(deliveries: Sequence[Delivery], on_batch: OnBatch) -> None:
        """Run the batch callback; requeue the deliveries it left unsettled by raising."""
        _requeued_on_failure(deliveries, lambda: on_batch(deliveries),
                             "processing a batch from %r stopped abruptly; the unsettled "
                             "messages are requeued")


def _requeued_on_failure(deliveries: Sequence[Delivery], run: Callable[[], None],
                         failure: str) -> None:
    """``run()``; if it raises, requeue what it left of ``deliveries`` unsettled (what the
    broker does when a consumer dies), except after an outage of their connection, where
    nothing can be settled and the broker redelivers them: that is raised."""
    try:
        run()
    except (KeyboardInterrupt, SystemExit):
        raise
    except TransportUnavailable as exc:
        log.warning("%s", exc)
        raise
    except BaseException as exc:
        # An Exception here is a bug worth a traceback; anything else (a simulated crash
        # in tests) is expected and only noted.
        log.log(logging.ERROR if isinstance(exc, Exception) else logging.DEBUG, failure,
                deliveries[0].queue if deliveries else "?", exc_info=isinstance(exc, Exception))
        for delivery in deliveries:
            if not delivery.settled:
                delivery.requeue()
