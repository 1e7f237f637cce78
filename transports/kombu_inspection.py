"""Tools' reads of the kombu transport: take one message, inspect the waiting ones and give
back those left unsettled, take them one at a time (each acknowledgement applied before the
next is asked for), count them."""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator
from typing import Any

import kombu
from kombu import Queue

from .base import Delivery, QueueDepth
from .errors import BrokerAccessDenied, DestinationRefused, TransportUnavailable
from .kombu_core import KombuCore
from .kombu_delivery import _give_back, _give_fresh, _KombuDelivery
from .kombu_errors import _broker_errors, _classified


class KombuInspection(KombuCore):
    """Taking, inspecting and counting messages (tools)."""

    def get(self, queue: str) -> Delivery | None:
        with self._channel() as channel:
            message = Queue(queue, durable=True, no_declare=True)(channel).get(no_ack=True)
        if message is None:
            return None
        return _KombuDelivery(queue, message, settled=True, events_exchange=self.exchange_name)

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
            self._settled_round_trip(channel, queue, scope.connection)

    @contextlib.contextmanager
    def take(self, queue: str, *, limit: int) -> Iterator[Iterator[Delivery]]:
        """Take up to ``limit`` messages of ``queue`` one at a time, unsettled, on one
        channel: ``with transport.take(queue, limit=100) as messages: for delivery in
        messages: ... delivery.ack()``. Each is taken only when the previous one was
        handled, so that its acknowledgement reaches the broker before the next is asked
        for (a quorum queue applies acknowledgements asynchronously: a burst of them may
        not be applied when the connection closes, and the messages come back). Settle
        each: one left unsettled goes back as a fresh copy
        (:meth:`_KombuDelivery.requeue_fresh`), never as a redelivery. Returns once the
        broker has the acknowledgements (a round trip on the channel)."""
        if limit < 0:
            raise ValueError(f"limit must be at least 0, got {limit}")
        scope = self._channel()
        with scope as channel:
            held: list[_KombuDelivery] = []

            def taken() -> Generator[Delivery, None, None]:
                for _ in range(limit):
                    _give_fresh(held)
                    held[:] = self._take(channel, queue, 1, scope.connection)
                    if not held:
                        return
                    yield held[0]

            messages = taken()
            try:
                yield messages
            except BaseException:
                messages.close()
                with contextlib.suppress(Exception):  # logged; the caller's error matters
                    _give_fresh(held)
                raise
            messages.close()
            _give_fresh(held)
            self._settled_round_trip(channel, queue, scope.connection)

    def _settled_round_trip(self, channel: Any, queue: str,
                            connection: kombu.Connection) -> None:
        """Return once the broker has applied every acknowledgement sent on ``channel``:
        a channel handles its methods in order, so the answer to a synchronous one (a
        passive declare) comes after the acks before it were passed to their queue. A
        channel closed at once after its acks may lose them (the messages come back)."""
        if not self._is_amqp:
            return
        try:
            channel.queue_declare(queue=queue, passive=True)
        except Exception as exc:
            classified = _classified(exc, connection, f"settling the messages of {queue!r}",
                                     refusal=TransportUnavailable, url=self.safe_url)
            if classified is None:
                raise
            raise classified from exc

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
        return self._declared(queue)[0]

    def depth(self, queue: str) -> QueueDepth:
        """Ready messages and, on RabbitMQ, consumers: what a passive declare answers. The
        broker does not say there how many are unacknowledged, nor how old they are."""
        ready, consumers = self._declared(queue)
        return QueueDepth(ready=ready, consumers=consumers if self._is_amqp else None)

    def _declared(self, queue: str) -> tuple[int, int]:
        """A passive declare's message and consumer counts (0, 0 for a missing queue)."""
        scope = self._channel()
        with scope as channel:
            try:
                _, count, consumers = channel.queue_declare(queue=queue, passive=True)
            except Exception as exc:
                if "NOT_FOUND" in str(exc) or "404" in str(exc):
                    return 0, 0  # no such queue: nothing waits in it
                classified = _classified(exc, scope.connection, f"counting {queue!r}",
                                         refusal=BrokerAccessDenied, url=self.safe_url)
                raise classified if classified is not None else exc from exc
        return int(count), int(consumers or 0)
