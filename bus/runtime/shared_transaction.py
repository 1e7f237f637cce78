"""Commit, send and acknowledge in one transaction, when the queues share the database.

An endpoint whose :class:`~idembus.storage.postgres.PostgresStorage` and
:class:`~idembus.transports.postgres.PostgresTransport` are in the same PostgreSQL
database (same host, port, database and role; ``PostgresTransport(shared_transactions=
False)`` turns it off) commits each handler's work in one transaction that also

* inserts its outgoing messages into their queues (native delays and subscriptions as
  ``send`` and ``publish`` apply them),
* records them as dispatched already (no outbox sends them, no dispatch mark follows),
  with the journal entries of the events it journals, and
* for the message's last handler, deletes the incoming message from its queue.

It is one statement (:mod:`idembus.storage.postgres_shared`), in one round trip, in a
transaction of its own only when the endpoint journals events (the entries are appended
first). So there is no window between commit and dispatch, nor between dispatch and
acknowledgement: either all of it happened or none of it. A crash before the commit leaves
the message to be delivered again; after it, nothing is delivered again. A copy of the
message that comes from outside (a publisher's retry) still finds it processed and is
acknowledged, sending nothing: what was stored went out with the commit.

This is NServiceBus's "combining persistence with the SQL transport" (the outbox is then
unnecessary), done per handler: a message several handlers handle commits each of them on
its own, as on every transport, and the last one takes the incoming message with it.

Outgoing messages whose queue nobody declared, or that the database refuses, cannot be
inserted, and a body the claim check (:mod:`idembus.storage.claims`) sends as a reference
is not: nothing is written, and the work is committed the way every transport does
(commit, then dispatch: the refused message is parked,
:mod:`idembus.runtime.recoverability.parking`).
The ``dispatch`` middleware hooks run for each message after the commit, around nothing
(source ``handler``): tracing records its send, which took place in the commit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ..envelope import Envelope
from ..logs import message_logger
from ..pipeline import Dispatch
from ..storage.base import AggregateRecord
from ..storage.errors import StorageRefused
from ..transports.base import Delivery
from .endpoint_context import EndpointContext
from .journal import Journal
from .requests import answers_request

log = message_logger(__name__)


class _Enqueued(Protocol):
    queues: tuple[str, ...]

    def refused(self, envelopes: Sequence[Envelope]) -> list[Envelope]: ...

    def unrouted(self, envelopes: Sequence[Envelope]) -> list[Envelope]: ...


class _Part(Protocol):
    """The transport's part of the commit statement
    (:class:`~idembus.transports.postgres.QueuePart`)."""

    def enqueued(self, result: Any) -> _Enqueued: ...


@runtime_checkable
class _Queues(Protocol):
    """What the transport lends the commit (:class:`PostgresTransport`)."""

    def part(self, envelopes: Sequence[Envelope], *,
             remove: Delivery | None = None) -> _Part: ...

    def removed(self, delivery: Delivery) -> None: ...


@runtime_checkable
class _Committer(Protocol):
    """What the storage lends the commit (:meth:`PostgresStorage.commit_with`)."""

    def commit_with(self, loaded: AggregateRecord, *, key: str,
                    state: Mapping[str, Any] | None, outgoing: Sequence[Envelope],
                    part: Any, keep_bodies: bool = False, journal: Sequence[Any] = (),
                    completed: bool = False, state_version: int | None = None,
                    message_type: str | None = None) -> Any: ...

    def commit(self, loaded: AggregateRecord, *, key: str, state: Mapping[str, Any] | None,
               outgoing: Sequence[Envelope], completed: bool = False,
               state_version: int | None = None, message_type: str | None = None) -> None: ...


class SharedTransaction:
    """Commits a handler's work, its outgoing messages and (for the last handler) the
    removal of the incoming message in one transaction; see the module docstring."""

    def __init__(self, context: EndpointContext, journal: Journal | None, *,
                 keep_bodies: bool, on_unrouted: Callable[[Envelope], None]) -> None:
        storage, transport = context.storage, context.transport
        if not isinstance(storage, _Committer) or not isinstance(transport, _Queues):
            raise TypeError(f"{type(storage).__name__} and {type(transport).__name__} share "
                            "no transaction")
        self._storage = storage
        self._transport = transport
        self._endpoint = context.name
        self._signals = context.signals
        self._pipeline = context.pipeline
        self._journal = journal
        self._keep_bodies = keep_bodies
        self._on_unrouted = on_unrouted
        #: Bodies over its threshold go out through the dispatcher, which claim-checks them.
        self._claims = context.claim_check

    def commit(self, loaded: AggregateRecord, *, key: str, state: Mapping[str, Any] | None,
               outgoing: Sequence[Envelope], settle: Delivery | None = None,
               **options: Any) -> bool:
        """Commit (``options``: ``completed``, ``state_version``, ``message_type``) with the
        outgoing messages and the removal of ``settle``. True if the messages went out with the
        commit; False if the work was committed alone (nothing to send and nothing to
        remove, or a message the queues refused), for the caller to dispatch as usual.
        Raises what :meth:`~idembus.storage.base.AggregateStore.commit` raises."""
        if not outgoing and settle is None:
            self._storage.commit(loaded, key=key, state=state, outgoing=outgoing, **options)
            return False
        if self._claims is not None and any(map(self._claims.sends_apart, outgoing)):
            return self._apart(loaded, key, state, outgoing, options,
                               "a body (or field) the claim check sends as a reference")
        part = self._transport.part(outgoing, remove=settle)
        journal = [] if self._journal is None else self._journal.entries(
            outgoing, aggregate_type=loaded.aggregate_type, aggregate_id=loaded.aggregate_id)
        try:
            result = self._storage.commit_with(loaded, key=key, state=state, outgoing=outgoing,
                                               part=part,
                                               keep_bodies=(self._keep_bodies
                                                            or answers_request(outgoing)),
                                               journal=journal, **options)
        except StorageRefused as refused:  # the database refused a row: nothing was written
            return self._apart(loaded, key, state, outgoing, options, refused)
        if result is None:  # a destination queue nobody declared: nothing was written
            return self._apart(loaded, key, state, outgoing, options,
                               "a destination queue nobody declared")
        enqueued = part.enqueued(result)
        if settle is not None:
            self._transport.removed(settle)
        for envelope in outgoing:
            self._pipeline.dispatch(Dispatch(envelope, self._endpoint, "handler"),
                                    lambda: None)
            self._signals.emit("dispatched", message_id=envelope.message_id,
                               message_type=envelope.message_type, envelope=envelope)
        for envelope in enqueued.unrouted(outgoing):
            self._on_unrouted(envelope)
        return True

    def _apart(self, loaded: AggregateRecord, key: str, state: Mapping[str, Any] | None,
               outgoing: Sequence[Envelope], options: Mapping[str, Any],
               reason: object) -> bool:
        """Commit as every transport does; the dispatcher then sends the messages and parks
        what the queues refuse (if the database refuses the work itself, this raises)."""
        log.info("%s commits %s apart from its messages: %s", self._endpoint, key, reason)
        self._storage.commit(loaded, key=key, state=state, outgoing=outgoing, **options)
        return False


def shared_transaction(context: EndpointContext, journal: Journal | None, *,
                       keep_bodies: bool, on_unrouted: Callable[[Envelope], None],
                       ) -> SharedTransaction | None:
    """The shared transaction of the context's storage and transport, or ``None`` when they
    do not share a database: then commits and sends go their separate ways, and the outbox
    repairs what a crash leaves between them."""
    shares = getattr(context.transport, "shares_database_with", None)
    if shares is None or not shares(context.storage):
        return None
    return SharedTransaction(context, journal, keep_bodies=keep_bodies, on_unrouted=on_unrouted)
