"""The outbox relay: sends what was committed but never confirmed dispatched.

A process that dies between the commit and the dispatch of a handler's (or a unit of
work's) outgoing messages leaves them stored and unmarked. Usually the broker redelivers
the incoming message and the duplicate sends them; a unit of work has no incoming message,
and the operation may never be retried. The outbox relay finds entries unmarked for
longer than ``grace`` seconds, dispatches their messages with their original ids and marks
them.

It looks every ``lease_ttl / 2`` seconds, and at once when the storage notifies it: on a
MongoDB replica set it follows a change stream (:mod:`idembus.storage.mongo_changes`, never yet
run against a server); on mongomock and PostgreSQL it polls.

One dispatcher works at a time per endpoint: it holds the endpoint's lease (taken with
find-and-modify, renewed every ``lease_ttl / 2`` seconds) whose fencing token grows each
time the lease changes hands. Its marks carry the token, so a dispatcher that was paused
past its lease (a long GC, a frozen VM) cannot mark anything once another has taken over.
Messages sent twice in such a handover keep their ids; receivers deduplicate them. It
repairs only the entries its endpoint committed (``idembus.originating_endpoint``), with
that endpoint's transport, journal and compaction: endpoints sharing a storage keep their
own choices.

It repairs entry by entry. An outage ends the round (the next waits with backoff); a
message the broker refuses for good is parked (:mod:`idembus.runtime.recoverability.parking`) and
its entry marked;
an entry that fails otherwise is tried again on the next rounds and, after
``max_attempts`` failures, its messages are parked with the reason and it is marked. No
entry blocks the others, and expiring processed entries and trimming the journal run
whatever happened to the entries.

By default every endpoint runs one (its processes elect one through the lease); ``idembus
outbox package.module:endpoint`` runs one alone.
"""

from __future__ import annotations

import datetime
import logging
import threading

from ..envelope import utc_now
from ..redaction import redact
from ..storage.base import (
    OUTBOX_LEASE,
    AggregateStore,
    JournalStore,
    OutboxStore,
    ParkingStore,
    Undispatched,
)
from ..storage.errors import StaleLease, StorageUnavailable
from ..transports.errors import TransportUnavailable
from .background import LeasedPeriodic
from .dispatching import Dispatcher, DispatchProgress
from .endpoint_context import EndpointContext
from .recoverability.parking import park_outgoing
from .unit_of_work import OutboxWork

log = logging.getLogger(__name__)



class OutboxRelay(LeasedPeriodic):
    """Repairs crashes between commit and dispatch; see the module docstring."""

    #: The storage roles a relay uses (and the journal's, to trim it, when it keeps one).
    storage_roles = (OutboxStore, AggregateStore, ParkingStore)
    #: How many entries one round takes at most.
    batch = 100

    def __init__(self, context: EndpointContext, dispatcher: Dispatcher, *,
                 grace: float = 10.0, lease_ttl: float = 30.0, max_attempts: int = 5,
                 journal_retention: datetime.timedelta | None = None) -> None:
        if lease_ttl <= 0 or grace < 0:
            raise ValueError("lease_ttl must be positive and grace not negative")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        storage = context.role(OutboxStore)
        super().__init__(
            f"idembus-{context.name}-outbox", leases=storage, lease_ttl=lease_ttl,
            backoff=context.recoverability.outage_backoff, health=context.health,
            lease_name=f"{OUTBOX_LEASE}:{context.name}")
        self._storage = storage
        self._aggregates = context.role(AggregateStore)
        self._parking = context.role(ParkingStore)
        self._journal = context.role(JournalStore) if journal_retention is not None else None
        self._dispatcher = dispatcher
        self._context = context
        #: Whose entries this relay repairs.
        self.endpoint = context.name
        self.grace = grace
        #: How often one entry may fail (other than by an outage) before its messages are
        #: parked and it is marked; the count is kept with the entry, in the storage.
        self.max_attempts = max_attempts
        #: Processed entries forgotten past the storage's retention, by this relay.
        self.expired = 0
        #: Claim-checked bodies collected past their retention, by this relay.
        self.collected = 0
        #: How long event-journal entries are kept (``None``: this endpoint keeps no
        #: journal and trims nothing).
        self.journal_retention = journal_retention
        #: Journal entries this relay trimmed.
        self.trimmed = 0

    def __call__(self, *, operation_id: str) -> OutboxWork:
        """Send through the outbox from outside handlers, with no aggregate: ``with
        endpoint.outbox(operation_id=key) as work: work.bus.send(...)`` (or ``async
        with``) commits what the block sends keyed by ``operation_id``, once, then sends
        it; this relay sends it if a crash came between (:class:`~.unit_of_work.OutboxWork`).
        """
        return OutboxWork(self._context, self._dispatcher, operation_id=operation_id)

    def run_once(self) -> int:
        """Take or renew the lease; if held, send one batch entry by entry, then expire and
        trim. Returns how many entries were repaired (0 when another dispatcher holds the
        lease). An outage ends the round (the next one waits with backoff); any other
        failure is the entry's own and the others go on."""
        now = utc_now()
        if self.take_lease(now) is None:
            return 0
        repaired = 0
        cutoff = now - datetime.timedelta(seconds=self.grace)
        try:
            for entry in self._storage.undispatched(committed_before=cutoff, limit=self.batch,
                                                    endpoint=self.endpoint):
                try:
                    repaired += self._repair(entry)
                except StaleLease:
                    log.warning("%s lost its lease to another dispatcher; stepping back",
                                self.owner)
                    self.lease = None
                    break
                except (StorageUnavailable, TransportUnavailable):
                    raise
                except Exception:
                    # Even parking or counting failed: this entry is tried again next round,
                    # and the others go on.
                    log.exception("repairing %s %s (%s) failed, and so did setting it aside; "
                                  "trying again next round", entry.aggregate_type,
                                  entry.aggregate_id, entry.key)
        finally:
            if self.lease is not None:
                self._housekeeping(now)
        return repaired

    def _repair(self, entry: Undispatched) -> int:
        """Send one entry's messages and mark it (1); on a failure that is not an outage,
        count it, and at ``max_attempts`` park what is left and mark it anyway (0)."""
        address = (entry.aggregate_type, entry.aggregate_id, entry.key)
        progress = DispatchProgress()  # sent, or parked because the broker refused it
        try:
            self._dispatcher.send_committed(*address, entry.outgoing, source="outbox",
                                            endpoint=self.endpoint, progress=progress,
                                            lease=self.lease)
        except (StaleLease, StorageUnavailable, TransportUnavailable):
            raise
        except Exception as error:
            attempts = entry.attempts + 1
            if attempts < self.max_attempts:
                log.warning("repairing %s %s (%s) failed (attempt %d of %d): %s",
                            *address, attempts, self.max_attempts, redact(str(error)))
                self._storage.note_repair_failure(*address)
                return 0
            for envelope in entry.outgoing:
                if envelope.message_id not in progress.done:
                    park_outgoing(self._parking, envelope, error,
                                  endpoint=self.endpoint, attempts=attempts)
            self._dispatcher.mark_dispatched(*address, progress.sent, lease=self.lease)
            return 0
        log.info("sent %d message(s) of %s %s (%s) that were committed but not dispatched",
                 len(progress.sent), *address)
        return 1

    def _housekeeping(self, now: datetime.datetime) -> None:
        """Expire processed entries, collect claim-checked bodies past their time and trim
        the journal, each whatever the others did."""
        try:
            self.expired += self._aggregates.expire(now)
        except Exception as error:
            log.warning("expiring processed messages failed: %s", redact(str(error)))
        payloads = self._context.payloads() if self._context.claim_check else None
        if payloads is not None:
            try:
                self.collected += payloads.collect_payloads(now)
            except Exception as error:
                log.warning("collecting claim-checked bodies failed: %s", redact(str(error)))
        if self._journal is None or self.journal_retention is None:
            return
        try:
            self.trimmed += self._journal.trim_journal(now - self.journal_retention)
        except Exception as error:
            log.warning("trimming the event journal failed: %s", redact(str(error)))

    def round(self) -> float:
        # A full batch: more may wait. Otherwise renew the lease at half its time.
        return 0.0 if self.run_once() >= self.batch else self.lease_ttl / 2

    def start(self) -> None:
        super().start()
        threading.Thread(target=self._watch, name=f"{self.name}-watch", daemon=True).start()

    def _watch(self) -> None:
        """Wake on the storage's change notifications where it has them (MongoDB replica
        sets); elsewhere, or if watching fails, the rounds poll."""
        try:
            self._storage.watch(self.wake, self._stop, lambda: self.lease,
                                lease_name=self.lease_name)
        except StaleLease:
            log.info("%s: another dispatcher owns the change stream now", self.owner)
        except Exception:
            log.warning("watching for changes failed; the outbox relay polls",
                        exc_info=True)
