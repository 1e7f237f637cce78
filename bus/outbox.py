"""The outbox dispatcher: sends what was committed but never confirmed dispatched.

A process that dies between the commit and the dispatch of a handler's (or a unit of
work's) outgoing messages leaves them stored and unmarked. Usually the broker redelivers
the incoming message and the duplicate sends them; a unit of work has no incoming message,
and the operation may never be retried. The outbox dispatcher finds entries unmarked for
longer than ``grace`` seconds, dispatches their messages with their original ids and marks
them.

It looks every ``lease_ttl / 2`` seconds, and at once when the storage notifies it: on a
MongoDB replica set it follows a change stream (:mod:`storage.mongo_changes`, verified only
against a replica set); on mongomock and PostgreSQL it polls.

One dispatcher works at a time per storage: it holds a lease (taken with find-and-modify,
renewed every ``lease_ttl / 2`` seconds) whose fencing token grows each time the lease
changes hands. Its marks carry the token, so a dispatcher that was paused past its lease
(a long GC, a frozen VM) cannot mark anything once another has taken over. Messages sent
twice in such a handover keep their ids; receivers deduplicate them.

By default every endpoint runs one (they elect themselves through the lease); ``idembus
dispatcher package.module:endpoint`` runs one alone.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import uuid

from bus.background import Periodic
from bus.dispatching import Dispatcher
from bus.envelope import utc_now
from bus.policies import Backoff
from storage.base import OUTBOX_LEASE, Lease, Storage
from storage.errors import StaleLease

log = logging.getLogger(__name__)



class OutboxDispatcher(Periodic):
    """Repairs crashes between commit and dispatch; see the module docstring."""

    def __init__(
        self,
        storage: Storage,
        dispatcher: Dispatcher,
        *,
        name: str = "idembus-outbox",
        lease_ttl: float = 30.0,
        grace: float = 10.0,
        batch: int = 100,
        keep_bodies: bool = False,
        journal_retention: datetime.timedelta | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        if lease_ttl <= 0 or grace < 0:
            raise ValueError("lease_ttl must be positive and grace not negative")
        super().__init__(name, backoff=backoff)
        self._storage = storage
        self._dispatcher = dispatcher
        self.lease_ttl = lease_ttl
        self.grace = grace
        self._batch = batch
        self._keep_bodies = keep_bodies
        #: Who this dispatcher is, in the lease.
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.lease: Lease | None = None
        #: Processed entries forgotten past the storage's retention, by this dispatcher.
        self.expired = 0
        #: How long event-journal entries are kept (``None``: this endpoint keeps no
        #: journal and trims nothing).
        self.journal_retention = journal_retention
        #: Journal entries this dispatcher trimmed.
        self.trimmed = 0

    def run_once(self) -> int:
        """Take or renew the lease; if held, send one batch. Returns how many entries were
        repaired (0 when another dispatcher holds the lease)."""
        now = utc_now()
        self.lease = self._storage.acquire_lease(OUTBOX_LEASE, self.owner,
                                                 ttl=self.lease_ttl, now=now)
        if self.lease is None:
            return 0
        repaired = 0
        cutoff = now - datetime.timedelta(seconds=self.grace)
        for entry in self._storage.undispatched(committed_before=cutoff, limit=self._batch):
            for envelope in entry.outgoing:
                self._dispatcher.dispatch(envelope)
            try:
                self._dispatcher.mark_dispatched(
                    entry.aggregate_type, entry.aggregate_id, entry.key, entry.outgoing,
                    keep_bodies=self._keep_bodies, lease=self.lease)
            except StaleLease:
                log.warning("%s lost its lease to another dispatcher; stepping back", self.owner)
                self.lease = None
                break
            repaired += 1
            log.info("sent %d message(s) of %s %s (%s) that were committed but not dispatched",
                     len(entry.outgoing), entry.aggregate_type, entry.aggregate_id, entry.key)
        if self.lease is not None:
            self.expired += self._storage.expire(now)
            if self.journal_retention is not None:
                self.trimmed += self._storage.trim_journal(now - self.journal_retention)
        return repaired

    def round(self) -> float:
        # A full batch: more may wait. Otherwise renew the lease at half its time.
        return 0.0 if self.run_once() >= self._batch else self.lease_ttl / 2

    def start(self) -> None:
        super().start()
        threading.Thread(target=self._watch, name=f"{self.name}-watch", daemon=True).start()

    def _watch(self) -> None:
        """Wake on the storage's change notifications where it has them (MongoDB replica
        sets); elsewhere, or if watching fails, the rounds poll."""
        try:
            self._storage.watch(self.wake, self._stop, lambda: self.lease)
        except StaleLease:
            log.info("%s: another dispatcher owns the change stream now", self.owner)
        except Exception:
            log.warning("watching for changes failed; the outbox dispatcher polls",
                        exc_info=True)

    def stop(self, timeout: float | None = 30.0) -> bool:
        """Stop, and give the lease up so that another dispatcher takes over at once."""
        was_running = super().stop(timeout)
        if self.lease is not None:
            try:
                self._storage.release_lease(self.lease)
            except Exception:  # best effort: an unreleased lease expires by itself
                log.debug("releasing the outbox lease failed", exc_info=True)
            self.lease = None
        return was_running
