"""The storage and the transport as the messages of a batch see them: decorators that the
assembly (:func:`~.assembly.assemble`) puts around the ports only when the endpoint batches.

:class:`BatchingStorage` is an :class:`~idembus.storage.base.AggregateStore` whose ``load``
and ``commit``, called by a message running in a batch (:mod:`.batch_runner`), park the
message until the batch does them in one ``load_many`` / ``commit_many`` of the storage
inside; :class:`BatchingTransport` is a :class:`~idembus.transports.base.Transport` whose
``dispatch`` does the same with ``dispatch_many``. Called outside a batch (the outbox relay,
``Endpoint.process``, a tool), they are the wrapped port's own. Everything else goes
straight to the wrapped port.

An endpoint that does not batch (``batching=None``, or a shared transaction) gets its ports
unwrapped: its per-message path calls ``storage.load`` / ``storage.commit`` /
``transport.dispatch`` and never looks for a batch.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from ..envelope import Envelope
from ..storage.base import AggregateRecord, AggregateStore, JournalEntry, Lease, PendingCommit
from ..transports.base import Delivery, OnBatch, OnDelivery, Transport
from .batch_runner import COMMIT, DISPATCH, LOAD, running_member


class BatchingStorage(AggregateStore):
    """``storage``'s aggregates with a batch's loads and commits grouped (see the module
    docstring)."""

    def __init__(self, storage: AggregateStore) -> None:
        super().__init__(processed_window=storage.processed_window)
        self.retention = storage.retention
        self.process_local = storage.process_local
        #: The storage this one groups the calls of.
        self.storage = storage

    def load(self, aggregate_type: str, aggregate_id: str,
             key: str | None = None) -> AggregateRecord:
        """The storage's ``load``; in a batch, in one ``load_many`` with the batch's others."""
        member = running_member()
        if member is None:
            return self.storage.load(aggregate_type, aggregate_id, key)
        record: AggregateRecord = member.park(LOAD, self.storage,
                                              (aggregate_type, aggregate_id, key),
                                              (aggregate_type, aggregate_id))
        return record

    def commit(self, loaded: AggregateRecord, *, key: str, state: Mapping[str, Any] | None,
               outgoing: Sequence[Envelope], completed: bool = False,
               state_version: int | None = None, message_type: str | None = None) -> None:
        """The storage's ``commit``; in a batch, in one ``commit_many`` with the batch's
        others (each still its own conditional write, with its own answer)."""
        member = running_member()
        if member is None:
            self.storage.commit(loaded, key=key, state=state, outgoing=outgoing,
                                completed=completed, state_version=state_version,
                                message_type=message_type)
            return
        member.park(COMMIT, self.storage, PendingCommit(
            loaded, key, state, tuple(outgoing),
            {"completed": completed, "state_version": state_version,
             "message_type": message_type}))

    def load_many(self, requests: Sequence[tuple[str, str, str | None]]
                  ) -> list[AggregateRecord | Exception]:
        return self.storage.load_many(requests)

    def commit_many(self, commits: Sequence[PendingCommit]) -> list[Exception | None]:
        return self.storage.commit_many(commits)

    def mark_dispatched(self, aggregate_type: str, aggregate_id: str, key: str, *,
                        keep_bodies: bool = False, lease: Lease | None = None,
                        journal: Sequence[JournalEntry] = ()) -> None:
        self.storage.mark_dispatched(aggregate_type, aggregate_id, key,
                                     keep_bodies=keep_bodies, lease=lease, journal=journal)

    def records(self, aggregate_type: str) -> Iterator[AggregateRecord]:
        return self.storage.records(aggregate_type)

    def history(self, aggregate_type: str, aggregate_id: str, *,
                entries: int = 200) -> AggregateRecord:
        return self.storage.history(aggregate_type, aggregate_id, entries=entries)

    def aggregate_page(self, aggregate_type: str, *, completed: bool = False,
                       after: str | None = None, limit: int = 50,
                       id_prefix: str = "") -> list[AggregateRecord]:
        return self.storage.aggregate_page(aggregate_type, completed=completed, after=after,
                                           limit=limit, id_prefix=id_prefix)

    def flush(self) -> None:
        self.storage.flush()

    def expire(self, now: datetime.datetime, *, batch: int = 1000) -> int:
        return self.storage.expire(now, batch=batch)

    def migrate(self) -> None:
        self.storage.migrate()

    def verify(self) -> None:
        self.storage.verify()

    def close(self) -> None:
        self.storage.close()


class BatchingTransport(Transport):
    """``transport`` with a batch's dispatches grouped (see the module docstring)."""

    def __init__(self, transport: Transport) -> None:
        self.native_delay = transport.native_delay
        self.publisher_confirms = transport.publisher_confirms
        self.process_local = transport.process_local
        #: The transport this one groups the dispatches of.
        self.transport = transport

    def dispatch(self, envelope: Envelope) -> bool | None:
        """The transport's ``dispatch``; in a batch, in one ``dispatch_many`` with the
        batch's others (one wait for the publisher confirms)."""
        member = running_member()
        if member is None:
            return self.transport.dispatch(envelope)
        sent: bool | None = member.park(DISPATCH, self.transport, envelope)
        return sent

    def dispatch_many(self, envelopes: Sequence[Envelope]) -> list[bool | None | Exception]:
        return self.transport.dispatch_many(envelopes)

    def declare(self, queue: str, *, subscriptions: Collection[str] = ()) -> None:
        self.transport.declare(queue, subscriptions=subscriptions)

    def send(self, envelope: Envelope) -> None:
        self.transport.send(envelope)

    def publish(self, envelope: Envelope) -> bool | None:
        return self.transport.publish(envelope)

    def consume(self, queue: str, on_delivery: OnDelivery, *, stop: threading.Event,
                prefetch: int = 1) -> None:
        self.transport.consume(queue, on_delivery, stop=stop, prefetch=prefetch)

    def consume_batches(self, queue: str, on_batch: OnBatch, *, stop: threading.Event,
                        prefetch: int = 1, size: int = 1, linger: float = 0.0) -> None:
        self.transport.consume_batches(queue, on_batch, stop=stop, prefetch=prefetch,
                                       size=size, linger=linger)

    def get(self, queue: str) -> Delivery | None:
        return self.transport.get(queue)

    def pending(self, queue: str) -> int:
        return self.transport.pending(queue)

    def inspect(self, queue: str, *,
                limit: int | None = None) -> AbstractContextManager[list[Delivery]]:
        return self.transport.inspect(queue, limit=limit)

    def limit_bodies(self, queue: str, *, max_bytes: int, error_queue: str) -> None:
        self.transport.limit_bodies(queue, max_bytes=max_bytes, error_queue=error_queue)

    def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        self.transport.ack_many(deliveries)

    def migrate(self) -> bool:
        return self.transport.migrate()

    def close(self) -> None:
        self.transport.close()
