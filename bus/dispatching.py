"""Putting outgoing messages on the wire, now or later.

A message without ``idembus.deliver_at``, or whose time has come, goes straight to the
transport. A deferred one goes to the transport too when the broker can hold it back
(RabbitMQ's delay queues); otherwise it waits in the storage's delayed-message store, and
the :class:`DelayedDeliveries` poller of every running endpoint on that storage sends it
when it is due. Either way it survives a restart of the endpoint.

With a journal (:mod:`idembus.journal`), events that went out are also appended to the
storage's event journal before their senders mark them dispatched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from . import batch_runner
from .background import Periodic
from .clock import Clock, SystemClock
from .envelope import Envelope
from .errors import MessageRefused
from .health import Health
from .journal import Journal
from .loggable import loggable
from .parking import park_outgoing
from .pipeline import Dispatch, Pipeline
from .policies import Backoff
from .redaction import redact
from .storage.base import Lease, Storage
from .transports.base import Transport
from .transports.errors import DestinationRefused, TransportUnavailable

log = logging.getLogger(__name__)


@dataclass
class DispatchProgress:
    """How far sending one entry's messages got, across the attempts an outage forces: what
    went out (or was parked) is not sent again."""

    #: What went out, in order (what the mark journals).
    sent: list[Envelope] = field(default_factory=list)
    #: Ids of what went out or was parked.
    done: set[str] = field(default_factory=set)


class Dispatcher:
    """Sends or publishes envelopes, keeping deferred ones where they can wait.

    ``keep_bodies``: marks keep the bodies of what was sent
    (``OutboxPolicy(compact_after_dispatch=False)``). ``pipeline``: the endpoint's
    middleware, whose ``dispatch`` hooks run around each outgoing message sent. ``clock``:
    the endpoint's, which says whether a deferred message is due yet.
    """

    def __init__(self, transport: Transport, storage: Storage,
                 journal: Journal | None = None, *, endpoint: str | None = None,
                 pipeline: Pipeline | None = None, keep_bodies: bool = False,
                 clock: Clock | None = None,
                 on_unrouted: Callable[[Envelope], None] | None = None) -> None:
        self._transport = transport
        self._clock = clock or SystemClock()
        #: Called with each event the broker reported no queue took.
        self._on_unrouted = on_unrouted
        self._storage = storage
        self._journal = journal
        #: The endpoint's middleware (what :class:`~idembus.sending.Bus` objects record through).
        self.pipeline = pipeline or Pipeline()
        self.keep_bodies = keep_bodies
        #: The endpoint whose delayed-message pollers send what this dispatcher defers
        #: (``None``: any endpoint's on the storage).
        self.endpoint = endpoint

    def dispatch(self, envelope: Envelope) -> None:
        """Put ``envelope`` on the wire (or, deferred on a transport without delay, in the
        storage until it is due). No middleware: for error-queue copies and retries."""
        due = envelope.deliver_at
        if due is not None and not self._transport.native_delay and due > self._clock.now():
            self._storage.schedule(envelope, due, owner=self.endpoint)
        elif (batch_runner.dispatch(self._transport, envelope) is False
              and self._on_unrouted is not None):
            self._on_unrouted(envelope)

    def send_committed(self, aggregate_type: str, aggregate_id: str, key: str,
                       outgoing: Sequence[Envelope], *, source: str,
                       endpoint: str | None = None, progress: DispatchProgress | None = None,
                       lease: Lease | None = None) -> DispatchProgress:
        """Send what ``key`` committed, then mark it dispatched: the one way handlers,
        units of work and the outbox send what they stored.

        Each message not yet in ``progress`` goes out through the ``dispatch`` middleware
        (one the broker refuses for good is parked, :meth:`dispatch_committed`); then the
        entry is marked (fenced by ``lease``, journaling what went out). An outage raises,
        ``progress`` keeping what is done, so the caller's next attempt sends only the rest.
        Callers choose what to do about errors; nothing is marked unless all went out."""
        progress = progress if progress is not None else DispatchProgress()
        if not outgoing:
            return progress
        for envelope in outgoing:
            if envelope.message_id in progress.done:
                continue
            if self.dispatch_committed(envelope, endpoint=endpoint, source=source):
                progress.sent.append(envelope)
            progress.done.add(envelope.message_id)
        self.mark_dispatched(aggregate_type, aggregate_id, key, progress.sent, lease=lease)
        return progress

    def dispatch_committed(self, envelope: Envelope, *, endpoint: str | None = None,
                           source: str = "handler") -> bool:
        """Dispatch an outgoing message that is stored with its entry; if the broker
        refuses it for good (its queue refused, too large for it), park it in the storage
        for ``endpoint`` (default: this dispatcher's) instead (:mod:`idembus.parking`), so
        that the entry can be marked and nothing waits on it forever. True if it went out;
        raises on an outage, or if it cannot be parked."""
        owner = endpoint if endpoint is not None else (self.endpoint or "")
        try:
            self.pipeline.dispatch(Dispatch(envelope, owner, source),
                                    lambda: self.dispatch(envelope))
        except DestinationRefused as refused:
            park_outgoing(self._storage, envelope, refused, endpoint=owner)
            return False
        return True

    def mark_dispatched(self, aggregate_type: str, aggregate_id: str, key: str,
                        outgoing: Sequence[Envelope], *, lease: Lease | None = None) -> None:
        """Mark ``key``'s ``outgoing`` messages, just dispatched, in the storage; the
        journaled events among them ride with the mark
        (``Storage.mark_dispatched(..., journal=...)``)."""
        journal = [] if self._journal is None else self._journal.entries(
            outgoing, aggregate_type=aggregate_type, aggregate_id=aggregate_id)
        self._storage.mark_dispatched(aggregate_type, aggregate_id, key,
                                      keep_bodies=self.keep_bodies, lease=lease,
                                      journal=journal)

    def dispatch_now(self, envelope: Envelope) -> None:
        """Dispatch a message sent outside handlers (``endpoint.bus``), and journal it."""
        self.pipeline.dispatch(Dispatch(envelope, self.endpoint or "", "bus"),
                                lambda: self.dispatch(envelope))
        if self._journal is not None:
            self._journal.record([envelope])


class DelayedDeliveries(Periodic):
    """A thread that sends the storage's delayed messages when they are due.

    Claims are leases: a poller that dies mid-batch leaves its claims to expire, and
    another poller sends them again (with the same ids; receivers deduplicate). With
    ``owner``, it sends only what that endpoint deferred (with its transport), and what
    was deferred for any poller.

    Message by message: an outage ends the round (the claims expire and the next round
    takes them again) and counts as no attempt; a message the broker refuses for good, or
    that failed otherwise ``max_attempts`` times, is parked (:mod:`idembus.parking`) and
    forgotten here. Failures are counted with the message in the storage
    (``Storage.note_scheduled_failure``): every poller of every process, and a poller
    restarted, gives up after the same number.
    """

    def __init__(self, transport: Transport, storage: Storage, *, name: str,
                 interval: float = 0.5, batch: int = 100, lease: float = 30.0,
                 backoff: Backoff | None = None, owner: str | None = None,
                 max_attempts: int = 5, health: Health | None = None,
                 clock: Clock | None = None) -> None:
        super().__init__(name, backoff=backoff, health=health)
        self._transport = transport
        self._clock = clock or SystemClock()
        self._storage = storage
        self._interval = interval
        self._batch = batch
        self._lease = lease
        self.owner = owner
        #: How often one message may fail (other than by an outage) before it is parked.
        self.max_attempts = max_attempts

    def round(self) -> float:
        self.send_due()
        return self._interval

    def send_due(self) -> int:
        """Send what is due now; return how many were sent."""
        sent = 0
        while not self._stop.is_set():
            envelopes = self._storage.claim_due(self._clock.now(), limit=self._batch,
                                                lease=self._lease, owner=self.owner)
            done = [envelope for envelope in envelopes if self._send(envelope)]
            self._storage.forget_scheduled(done)
            sent += len(done)
            if len(envelopes) < self._batch:
                break
        return sent

    def _send(self, envelope: Envelope) -> bool:
        """Send one due message; True when it is done with (sent or parked). An outage
        raises: the round ends, and the claims left expire."""
        try:
            self._transport.dispatch(envelope)
        except TransportUnavailable:
            raise
        except Exception as error:
            attempts = self._storage.note_scheduled_failure(envelope)
            if attempts == 0:  # another poller sent it and forgot it meanwhile
                log.info("sending delayed message %s failed, but it is no longer scheduled: "
                         "%s", loggable(envelope.message_id), redact(str(error)))
                return False
            if not isinstance(error, MessageRefused) and attempts < self.max_attempts:
                log.warning("sending delayed message %s failed (attempt %d of %d): %s",
                            loggable(envelope.message_id), attempts, self.max_attempts,
                            redact(str(error)))
                return False
            park_outgoing(self._storage, envelope, error, endpoint=self.owner or "",
                          attempts=attempts)
            return True
        return True
