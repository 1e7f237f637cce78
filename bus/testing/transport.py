"""The in-process transport of :class:`~idembus.testing.Scenario`.

Queues are lists in this process; nothing is consumed by threads: the scenario takes one
message at a time (:meth:`ScenarioTransport.take`) and hands it to the endpoint that owns
the queue. Deferral is native and runs on the scenario's clock: a message whose
``idembus.deliver_at`` is still ahead waits aside until :meth:`ScenarioTransport.release_due`
finds the clock past it. Events go to the queues declared with their type, as on a broker.
Every message gets a sequence number when it enters a queue, so the order of delivery is
the order of arrival, across queues too: runs are deterministic (ordered commands, sent to
a partition queue, go to their endpoint's queue: they are in order already).
"""

from __future__ import annotations

import datetime
import heapq
import itertools
import threading
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from .. import headers as h
from ..clock import Clock
from ..envelope import Envelope
from ..hierarchy import parse_enclosed
from ..routing import base_queue
from ..transports.base import Delivery, OnDelivery, Transport


@dataclass(frozen=True)
class _Queued:
    order: int
    envelope: Envelope
    redelivered: bool = False


class ScenarioDelivery(Delivery):
    """A message taken from a scenario queue; a requeue puts it back at the head."""

    def __init__(self, transport: ScenarioTransport, queue: str, item: _Queued) -> None:
        envelope = item.envelope
        super().__init__(queue=queue, headers=dict(envelope.headers),
                         body=envelope.body.encode("utf-8", "surrogateescape"),
                         content_type=envelope.content_type, redelivered=item.redelivered,
                         content_encoding=envelope.content_encoding)
        self._transport = transport
        self._item = item

    def _ack(self) -> None:
        """Taken already: nothing to remove."""

    def _requeue(self) -> None:
        self._transport.put_back(self.queue, self._item)


class ScenarioTransport(Transport):
    """Queues in this process with deferral on ``clock``; see the module docstring."""

    native_delay = True
    publisher_confirms = True
    process_local = True

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._queues: dict[str, deque[_Queued]] = {}
        self._subscribers: dict[str, list[str]] = {}
        self._deferred: list[tuple[datetime.datetime, int, Envelope]] = []
        self._order = itertools.count()
        self._lock = threading.Lock()

    def declare(self, queue: str, *, subscriptions: Collection[str] = ()) -> None:
        with self._lock:
            self._queues.setdefault(queue, deque())
            for name in subscriptions:
                queues = self._subscribers.setdefault(name, [])
                if queue not in queues:
                    queues.append(queue)

    def send(self, envelope: Envelope) -> None:
        if envelope.destination is None:
            raise ValueError(f"send() needs a destination queue; {envelope.message_id} has "
                             "none (publish events)")
        self._enter(envelope)

    def publish(self, envelope: Envelope) -> bool:
        """Deliver the event to the queues subscribed to its type or to a type it derives
        from, one copy each; False if none is (``unrouted``). A deferred event is judged
        when it is due: True until then."""
        return self._enter(envelope)

    def _enter(self, envelope: Envelope) -> bool:
        due = envelope.deliver_at
        with self._lock:
            if due is not None and due > self.clock.now():
                heapq.heappush(self._deferred, (due, next(self._order), envelope))
                return True
            return self._route(envelope)

    def _route(self, envelope: Envelope) -> bool:
        """Into its queue, or the queues subscribed to its type or its enclosed types, one
        copy each (caller holds the lock); whether any queue took it."""
        if envelope.destination is not None:
            # An ordered command sent to a partition queue goes to its endpoint's queue
            # (no partition queues here: the scenario delivers in the order of arrival).
            targets = [base_queue(envelope.destination)]
        else:
            names = [envelope.message_type] + [
                name for name, _ in parse_enclosed(envelope.headers.get(h.ENCLOSED_TYPES))]
            targets = list(dict.fromkeys(
                queue for name in names for queue in self._subscribers.get(name, [])))
        for queue in targets:
            self._queues.setdefault(queue, deque()).append(
                _Queued(next(self._order), envelope))
        return bool(targets)

    def release_due(self) -> int:
        """Move the deferred messages the clock has reached into their queues, in the
        order they are due; return how many."""
        now = self.clock.now()
        released = 0
        with self._lock:
            while self._deferred and self._deferred[0][0] <= now:
                _, _, envelope = heapq.heappop(self._deferred)
                self._route(envelope)
                released += 1
        return released

    def next_due(self) -> datetime.datetime | None:
        """When the earliest deferred message is due, if one waits."""
        with self._lock:
            return self._deferred[0][0] if self._deferred else None

    def take(self, queues: Iterable[str]) -> Delivery | None:
        """The message that arrived first in any of ``queues``, taken; ``None`` if they are
        all empty."""
        with self._lock:
            heads = [(waiting[0].order, queue) for queue in queues
                     if (waiting := self._queues.get(queue))]
            if not heads:
                return None
            _, queue = min(heads)
            item = self._queues[queue].popleft()
        return ScenarioDelivery(self, queue, item)

    def put_back(self, queue: str, item: _Queued) -> None:
        """A requeued delivery goes back to the head of its queue, marked redelivered."""
        with self._lock:
            self._queues.setdefault(queue, deque()).appendleft(
                _Queued(item.order, item.envelope, redelivered=True))

    def messages(self, queue: str) -> list[Envelope]:
        """What waits in ``queue`` now, oldest first, left in place."""
        with self._lock:
            return [item.envelope for item in self._queues.get(queue, ())]

    def consume(self, queue: str, on_delivery: OnDelivery, *, stop: threading.Event,
                prefetch: int = 1) -> None:
        raise RuntimeError(
            f"a Scenario delivers the messages of {queue!r} itself: call scenario.run() or "
            "scenario.advance(...), do not start its endpoints")

    def get(self, queue: str) -> Delivery | None:
        return self.take([queue])

    def pending(self, queue: str) -> int:
        with self._lock:
            return len(self._queues.get(queue, ()))
