"""Putting outgoing messages on the wire, now or later.

A message without ``idembus.deliver_at``, or whose time has come, goes straight to the
transport. A deferred one goes to the transport too when the broker can hold it back
(RabbitMQ's delay queues); otherwise it waits in the storage's delayed-message store, and
the :class:`~.delayed.DelayedDeliveries` poller of every running endpoint on that storage
sends it when it is due. Either way it survives a restart of the endpoint.

With a journal (:mod:`idembus.runtime.journal`), events that went out are also appended to the
storage's event journal before their senders mark them dispatched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .. import headers as h
from ..envelope import Envelope, parse_utc, utc_now
from ..pipeline import Dispatch
from ..storage.base import AggregateStore, DelayedStore, Lease, ParkingStore
from ..storage.claims import claimed
from ..transports.errors import DestinationRefused
from .endpoint_context import EndpointContext
from .journal import Journal
from .recoverability.parking import park_outgoing
from .requests import answers_request, awaited_reply

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
    (``OutboxPolicy(compact_after_dispatch=False)``). The context's pipeline is the
    endpoint's middleware, whose ``dispatch`` hooks run around each outgoing message sent;
    its clock says whether a deferred message is due yet.
    """

    #: The storage roles a dispatcher uses: marks, parking, and (on a transport without
    #: native delay) delayed messages.
    storage_roles = (AggregateStore, ParkingStore, DelayedStore)

    def __init__(self, context: EndpointContext, journal: Journal | None = None, *,
                 keep_bodies: bool = False,
                 on_unrouted: Callable[[Envelope], None] | None = None) -> None:
        self._context = context
        self._transport = context.transport
        self._clock = context.clock
        #: Called with each event the broker reported no queue took.
        self._on_unrouted = on_unrouted
        self._marks = context.role(AggregateStore)
        self._parking = context.role(ParkingStore)
        self._journal = journal
        #: The endpoint's middleware (what :class:`~idembus.sending.Bus` objects record through).
        self.pipeline = context.pipeline
        self.keep_bodies = keep_bodies
        #: The endpoint whose delayed-message pollers send what this dispatcher defers.
        self.endpoint = context.name

    @property
    def journal(self) -> Journal | None:
        """Where published events are journaled (``Endpoint(journal=...)``), or ``None``."""
        return self._journal

    def dispatch(self, envelope: Envelope) -> None:
        """Put ``envelope`` on the wire (or, deferred on a transport without delay, in the
        storage until it is due). No middleware: for error-queue copies and retries."""
        deliver_at = envelope.headers.get(h.DELIVER_AT)  # most messages have none
        due = parse_utc(deliver_at) if deliver_at else None
        if due is not None and not self._transport.native_delay and due > self._clock.now():
            self._context.role(DelayedStore).schedule(envelope, due, owner=self.endpoint)
        elif (self._transport.dispatch(envelope) is False
              and self._on_unrouted is not None):
            self._on_unrouted(envelope)

    def claimed(self, envelope: Envelope) -> Envelope:
        """``envelope`` as it goes on the wire: with ``Endpoint(claim_check=...)``, a body
        over its threshold is written to the payload store first and replaced by its
        reference (:mod:`idembus.storage.claims`); the stored envelope keeps its body, so
        sending it again writes the same body under the same id."""
        claim_check = self._context.claim_check
        if claim_check is None:
            return envelope
        store = self._context.payloads()
        if store is None:
            return envelope
        return claimed(envelope, claim_check, store, now=utc_now())

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
        done = progress.done
        for envelope in outgoing:
            message_id = envelope.headers[h.MESSAGE_ID]
            if message_id in done:
                continue
            if self.dispatch_committed(envelope, endpoint=endpoint, source=source):
                progress.sent.append(envelope)
            done.add(message_id)
        self.mark_dispatched(aggregate_type, aggregate_id, key, progress.sent, lease=lease)
        return progress

    def dispatch_committed(self, envelope: Envelope, *, endpoint: str | None = None,
                           source: str = "handler") -> bool:
        """Dispatch an outgoing message that is stored with its entry; if the broker
        refuses it for good (its queue refused, too large for it), park it in the storage
        for ``endpoint`` (default: this dispatcher's) instead — but drop a reply to an
        awaited request whose reply queue is gone: nobody can receive it any more
        (:mod:`idembus.runtime.recoverability.parking`), so
        that the entry can be marked and nothing waits on it forever. True if it went out;
        raises on an outage, or if it cannot be parked."""
        owner = endpoint if endpoint is not None else self.endpoint
        try:
            if self.pipeline.hooks_dispatch:
                self.pipeline.dispatch(Dispatch(envelope, owner, source),
                                       lambda: self.dispatch(self.claimed(envelope)))
            else:  # no middleware around it: no Dispatch to make
                self.dispatch(self.claimed(envelope))
        except DestinationRefused as refused:
            if awaited_reply(envelope):  # its requester is gone, and its queue with it
                log.info("reply %s dropped: its requester's reply queue %r is gone",
                         envelope.message_id, envelope.destination,
                         extra={"endpoint": owner, "message_id": envelope.message_id})
                return False
            park_outgoing(self._parking, envelope, refused, endpoint=owner)
            return False
        return True

    def mark_dispatched(self, aggregate_type: str, aggregate_id: str, key: str,
                        outgoing: Sequence[Envelope], *, lease: Lease | None = None) -> None:
        """Mark ``key``'s ``outgoing`` messages, just dispatched, in the storage; the
        journaled events among them ride with the mark
        (``Storage.mark_dispatched(..., journal=...)``). An entry that replied to an
        awaited request keeps its bodies: the request sent again gets the same reply."""
        journal = [] if self._journal is None else self._journal.entries(
            outgoing, aggregate_type=aggregate_type, aggregate_id=aggregate_id)
        self._marks.mark_dispatched(aggregate_type, aggregate_id, key,
                                    keep_bodies=self.keep_bodies or answers_request(outgoing),
                                    lease=lease,
                                    journal=journal)

    def dispatch_now(self, envelope: Envelope) -> None:
        """Dispatch a message sent outside handlers (``endpoint.bus``), and journal it."""
        if self.pipeline.hooks_dispatch:
            self.pipeline.dispatch(Dispatch(envelope, self.endpoint, "bus"),
                                   lambda: self.dispatch(self.claimed(envelope)))
        else:
            self.dispatch(self.claimed(envelope))
        if self._journal is not None:
            self._journal.record([envelope])
