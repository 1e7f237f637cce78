"""The storage contract, in roles.

A backend subclasses the roles it supports; :class:`Storage` combines them all (the memory,
MongoDB and PostgreSQL backends). An endpoint checks at construction that its storage has
the roles its options need (:func:`idembus.storage.roles.check_storage_roles`), and
:mod:`idembus.testing.contract` holds one abstract test class per role for any backend.

- :class:`AggregateStore` (every endpoint): ``load``, ``commit``, ``mark_dispatched``,
  ``records``; aggregates and deduplication, described below.
- :class:`ParkingStore` (every endpoint): ``park``, ``parked_messages``, ``unpark``; what
  neither the broker nor the error queue took.
- :class:`OutboxStore` (``outbox=True``): ``undispatched``, ``note_repair_failure``,
  ``overdue``, ``acquire_lease``, ``release_lease``, ``watch``.
- :class:`DelayedStore` (a transport without native delay): ``schedule``, ``claim_due``,
  ``forget_scheduled``, ``note_scheduled_failure``.
- :class:`JournalStore` (``journal=...``): ``append_journal``, ``read_journal``,
  ``journal_bounds``, ``journal_position_at``, ``trim_journal``.
- :class:`AuditStore` (the ``Audit`` middleware): ``write_audit``, ``read_audit``.
- :class:`StatusStore` (status reports, ``idembus status``): ``report_status``,
  ``status_reports``, ``forget_status``.
- :class:`LimitStore` (the ``Limits`` middleware): ``reserve_rate``, ``acquire_slot``,
  ``release_slot``; rate and concurrency limits shared by every process of a storage.
  Not part of :class:`Storage`: a backend adds it (the three of idembus do).
- :class:`PayloadStore` (``Endpoint(claim_check=...)``): ``put_payload``, ``get_payload``,
  ``collect_payloads``; the bodies of claim-checked messages. Not part of :class:`Storage`
  either (the three of idembus add it).

Each shares :class:`StorageRole`: ``process_local``, ``migrate``, ``verify``, ``close``.

A backend keeps one record per aggregate: its state, a version, and the messages it has
processed, each with the outgoing messages its handler produced. Its role,
:class:`AggregateStore`, is three calls:

``load(aggregate_type, aggregate_id, key)``
    Return the record, or an empty one at version 0 if the aggregate does not exist. Its
    ``processed`` holds the entry of ``key`` if that message was processed; backends that
    keep the history inside the record (MongoDB, memory) return every remembered entry.

``commit(loaded, key=..., state=..., outgoing=..., state_version=..., completed=False,
message_type=...)``
    In **one atomic conditional write**, store the new state (with its schema version),
    bump the version and record
    ``key`` (the handler-scoped incoming message id) with its outgoing messages. The write
    succeeds only if the aggregate is still at ``loaded.version`` and ``key`` is not yet
    recorded. Creating an aggregate (``loaded.version == 0``) is an insert, so two creators
    race like two updaters. When the write is refused the backend looks again and raises
    :class:`~idembus.storage.errors.AlreadyProcessed` (with the stored outgoing messages) if ``key``
    is now recorded, or :class:`~idembus.storage.errors.ConcurrencyConflict` otherwise. No lock,
    no pre-check query, no multi-document transaction.

    ``completed=True`` ends the aggregate (a saga's ``complete()``) in the same one write:
    it becomes a **tombstone** — no state, ``completed`` set, the version bumped, and every
    processed entry kept with its outgoing messages — so a late duplicate of a message it
    processed still raises ``AlreadyProcessed`` with what it stored. A later commit on the
    tombstone (``completed=False``, at its version) starts the aggregate again and keeps its
    entries. The tombstone keeps the ``state`` the completing commit was given as its
    ``final_state`` (what the saga looked like when it ended; ``state`` itself stays
    ``None``), and each entry keeps the ``message_type`` its commit was given, so a saga's
    story — which messages it handled, when, which one ended it, and its last state — is
    there until ``expire`` removes the tombstone, once it is older than ``retention`` and
    none of its entries waits for dispatch. ``aggregate_page`` lists the live aggregates of
    a type, or its tombstones, page by page.

``mark_dispatched(aggregate_type, aggregate_id, key)``
    The outgoing messages of ``key`` were confirmed by the broker: mark them dispatched, drop
    their bodies and keep their ids. (An entry without outgoing messages is born
    dispatched.) A later duplicate of ``key`` then redispatches nothing. Neither the
    version nor the state changes, so this never makes a concurrent commit conflict. A
    backend may apply marks later, in batches (``flush()`` waits for them): a mark that is
    lost only means a late duplicate sends its messages again, which downstream
    deduplicates.

A :class:`DelayedStore` keeps **delayed messages** for transports that cannot hold them
back themselves (memory://, Redis): ``schedule(envelope, due)`` stores one,
``claim_due(now)`` hands the due ones to one poller at a time (a claim is a lease: if that
poller dies, another claims them again once the lease ran out), ``forget_scheduled``
removes what was dispatched. Delivery is at least once, and a message dispatched twice
keeps its id. A send that fails (not by an outage) is counted with the message
(``note_scheduled_failure``), so that every poller, in any process and after any restart,
gives up on it after the same number.

For the **outbox dispatcher**, which repairs crashes between commit and dispatch, an
:class:`OutboxStore` lists entries never marked dispatched (``undispatched``) and keeps
**leases** (``acquire_lease``/``release_lease``) whose fencing token guards the
dispatcher's marks. ``overdue`` sums up, per endpoint, what has waited too long for either
(the entries and delayed messages of a renamed or retired endpoint, which no running
dispatcher sends).

A backend remembers processed messages for a bounded time or count: MongoDB and memory keep
the newest ``processed_window`` entries of each aggregate; PostgreSQL keeps a row per message
(``processed_window`` is ``None``). A duplicate that arrives after its entry was forgotten is
processed again; README says so.
Stateless handlers use the same records: one per (handler, message id) in the aggregate
type :data:`INBOX`.

An endpoint with a journal (``Endpoint(journal=...)``) also appends the events it publishes
to the storage's **event journal**, after the broker confirmed them and no later than they
are marked dispatched (``mark_dispatched(..., journal=...)``; ``append_journal`` for events
published outside handlers), so an event is journaled at least once and, being unique by
message id, kept once. Positions are dense — 1, 2, 3, … — and a position becomes visible
only after every smaller one is: a reader that remembers the last position it saw
(``read_journal(after=...)``) never misses an entry appended later. ``trim_journal`` drops
old entries but always keeps the newest, so positions never restart.
"""

from __future__ import annotations

import datetime
import heapq
import threading
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .. import headers as h
from ..envelope import Envelope
from .errors import AlreadyProcessed, ConcurrencyConflict

#: Aggregate type under which stateless handlers keep their inbox records.
INBOX = "idembus_inbox"

#: The lease the outbox dispatchers of one storage compete for.
OUTBOX_LEASE = "idembus-outbox-dispatcher"

#: How many processed entries an aggregate keeps unless told otherwise.
DEFAULT_PROCESSED_WINDOW = 100


@dataclass(frozen=True)
class ProcessedMessage:
    """One processed message of an aggregate, with what its handler sent."""

    key: str
    outgoing: tuple[Envelope, ...]
    outgoing_ids: tuple[str, ...]
    dispatched: bool = False
    #: When the handler's effects were committed (UTC).
    at: datetime.datetime | None = None
    #: Failed repairs by the outbox so far (undispatched entries only).
    attempts: int = 0
    #: Bytes the backend keeps for this entry in its aggregate's record, where it bounds
    #: records by size (MongoDB); 0: not known.
    stored_bytes: int = field(default=0, compare=False)
    #: The processed message's type (``commit(message_type=...)``); ``None``: not given, or
    #: committed before types were recorded.
    message_type: str | None = None


@dataclass(frozen=True)
class Undispatched:
    """Outgoing messages committed with ``key`` and never confirmed dispatched."""

    aggregate_type: str
    aggregate_id: str
    key: str
    outgoing: tuple[Envelope, ...]
    #: How often the outbox failed to repair it so far (:meth:`Storage.note_repair_failure`).
    attempts: int = 0


#: :attr:`Overdue.kind` of undispatched outbox entries.
OVERDUE_ENTRIES = "entries"
#: :attr:`Overdue.kind` of delayed messages whose due time has passed.
OVERDUE_DELAYED = "delayed messages"


@dataclass(frozen=True)
class Overdue:
    """How much of one kind has waited too long for one endpoint (:meth:`Storage.overdue`)."""

    #: The endpoint that committed the entries (``idembus.originating_endpoint`` of their
    #: first message) or deferred the messages; ``None``: not recorded (any endpoint's
    #: dispatcher or poller sends those).
    endpoint: str | None
    #: :data:`OVERDUE_ENTRIES` or :data:`OVERDUE_DELAYED`.
    kind: str
    count: int
    #: When the oldest of them was committed, or was due (UTC).
    since: datetime.datetime


@dataclass(frozen=True)
class Lease:
    """Exclusive right to a named job until ``expires_at``.

    ``token`` grows each time the lease changes owner (a fencing token): writes made under
    a lease carry it, and the storage refuses them once a newer owner exists.
    """

    name: str
    owner: str
    token: int
    expires_at: datetime.datetime


@dataclass(frozen=True)
class AuditRecord:
    """What happened to one message at one handler (an endpoint with ``audit=True``)."""

    endpoint: str
    handler: str
    message_id: str
    message_type: str
    #: ``handled``, ``duplicate``, ``redispatched``, ``failed`` or ``dead_lettered``.
    outcome: str
    #: The message's ``idembus.time_sent``, if it had one.
    time_sent: datetime.datetime | None
    recorded_at: datetime.datetime

    @property
    def bucket(self) -> int:
        """A stable number in [0, 1024) from the message id, to split readers by."""
        return zlib.crc32(self.message_id.encode("utf-8")) % AUDIT_BUCKETS


#: Audit records are spread over this many buckets; ``read_audit`` parts group them.
AUDIT_BUCKETS = 1024


@dataclass(frozen=True)
class StatusReport:
    """The counters one running endpoint process reported (``idembus status``)."""

    endpoint: str
    #: Which process: host, pid and a random part.
    instance: str
    counters: Mapping[str, int]
    started_at: datetime.datetime
    updated_at: datetime.datetime
    #: The process stopped cleanly after this report.
    stopped: bool = False
    #: What keeps the process from working at the time of the report, by source
    #: (``"transport"``, ``"storage"``): a refused login, a missing table. Empty when well.
    problems: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ParkedMessage:
    """A message idembus could neither deliver nor put in the error queue, kept in the
    storage with the reason instead of being lost or retried forever (``idembus errors``
    lists, retries and purges it with the error queue's messages).

    ``envelope`` carries the failure headers that say why, and is addressed where a retry
    sends it (without those headers): the queue that failed it, or the outgoing message's
    own destination. Its body may hold any bytes the broker delivered (as surrogate
    escapes): backends store it as bytes."""

    parked_id: str
    endpoint: str
    #: Why it was parked: :data:`PARKED_FROM_ERROR_QUEUE` or :data:`PARKED_OUTGOING`.
    source: str
    envelope: Envelope
    parked_at: datetime.datetime


#: Where a parked message is in the order of pages (:meth:`ParkingStore.parked_page`).
ParkedKey = tuple[datetime.datetime, str]


def parked_key(parked: ParkedMessage) -> ParkedKey:
    """The order parked messages are read in: when they were parked, then their id."""
    return (parked.parked_at, parked.parked_id)


#: The error queue refused the failed message's copy (too large, a broker policy).
PARKED_FROM_ERROR_QUEUE = "error-queue"
#: Moved from the error queue into the storage (``idembus.error_queue.ingest``): every
#: failed message is read, retried and purged from the storage, never from the broker.
MOVED_FROM_ERROR_QUEUE = "moved-from-error-queue"
#: What is left of a moved message once retried or purged: its id, without headers or
#: body, so that a copy the broker gives back (an acknowledgement it did not apply before
#: the connection closed) is recognised and not taken again.
SETTLED_FROM_ERROR_QUEUE = "settled-from-error-queue"
#: A committed outgoing message the broker refused for good (its queue refused, too large),
#: or that the outbox failed to send a bounded number of times.
PARKED_OUTGOING = "outgoing"


@dataclass(frozen=True)
class JournalEntry:
    """One published event in the event journal (an endpoint with ``journal=...``)."""

    message_id: str
    message_type: str
    #: The event's headers (``idembus.*`` included) and its JSON body, as on the wire.
    headers: Mapping[str, str]
    body: str
    #: The aggregate whose handler published it; ``None`` for stateless handlers and
    #: publishes outside handlers.
    aggregate_type: str | None = None
    aggregate_id: str | None = None
    #: References consumers filter on, such as ``user/42`` (``Event.journal_parents``).
    parents: tuple[str, ...] = ()
    #: When it was appended (UTC); set by the storage.
    recorded_at: datetime.datetime | None = None
    #: Its place in the journal, from 1; 0 until appended.
    position: int = 0


@dataclass(frozen=True)
class JournalBounds:
    """What the journal holds: positions ``oldest..newest`` (``oldest`` is ``None`` when it
    is empty; ``newest`` is 0 if nothing was ever appended)."""

    oldest: int | None
    newest: int
    size: int


@dataclass(frozen=True)
class AggregateRecord:
    """An aggregate as loaded: ``version == 0`` means it does not exist yet.

    ``processed`` is ordered from the oldest remembered message to the newest.
    """

    aggregate_type: str
    aggregate_id: str
    version: int = 0
    state: Mapping[str, Any] | None = None
    processed: Mapping[str, ProcessedMessage] = field(default_factory=dict)
    #: When the state was last committed (UTC), where the backend knows (``records``).
    updated_at: datetime.datetime | None = None
    #: A tombstone: the aggregate was ended (``commit(..., completed=True)``, a saga's
    #: ``complete()``); its state is gone, its processed entries are kept.
    completed: bool = False
    #: The schema version the state was committed with (``commit(state_version=...)``);
    #: ``None``: stored before versions existed, read as 1.
    state_version: int | None = None
    #: A tombstone's last state: the state the completing commit was given (what the saga
    #: looked like when it ended); ``None`` for live aggregates, and for tombstones
    #: completed without one (or before backends kept it).
    final_state: Mapping[str, Any] | None = None

    @property
    def exists(self) -> bool:
        """A record is stored: a live aggregate or a tombstone."""
        return self.version > 0

    @property
    def live(self) -> bool:
        """A record with a state: stored and not completed."""
        return self.version > 0 and not self.completed

    def window_start(self, window: int | None) -> datetime.datetime | None:
        """When the oldest remembered message was processed, if the window is full.

        A message sent before that time and not in ``processed`` may be a duplicate whose
        entry was already forgotten.
        """
        if window is None or len(self.processed) < window or not self.processed:
            return None
        return next(iter(self.processed.values())).at

    def ended_by(self) -> ProcessedMessage | None:
        """The entry of the message that completed this tombstone (its newest entry, when
        the record holds it); ``None`` for a live aggregate."""
        if not self.completed or not self.processed:
            return None
        # The newest; of entries with the same time (MongoDB keeps milliseconds), the later
        # in the record, which holds them in the order they were committed.
        _, _, newest = max((_entry_time(entry), position, entry)
                           for position, entry in enumerate(self.processed.values()))
        return newest


def _entry_time(entry: ProcessedMessage) -> datetime.datetime:
    return entry.at or datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)


@dataclass(frozen=True)
class PendingCommit:
    """One message's commit in a group (:meth:`AggregateStore.commit_many`): the arguments
    of :meth:`AggregateStore.commit`; ``options`` holds ``completed``, ``state_version``
    and ``message_type`` when the caller gives them."""

    loaded: AggregateRecord
    key: str
    state: Mapping[str, Any] | None
    outgoing: tuple[Envelope, ...]
    options: Mapping[str, Any] = field(default_factory=dict)


class StorageRole:
    """What every storage role shares: where the data lives, and the backend's lifecycle.

    A backend subclasses the roles it supports (:class:`AggregateStore` and
    :class:`ParkingStore` at least, which every endpoint needs); :class:`Storage` is all of
    them. :func:`idembus.storage.roles.check_storage_roles` tells an endpoint whether a
    storage has the roles its options need.
    """

    #: The data lives inside this process (several worker processes cannot share it).
    process_local: bool = False

    def migrate(self) -> None:
        """Create what the backend needs (tables, indexes). Idempotent; ``idembus migrate``."""

    def verify(self) -> None:
        """Check at start-up that the backend is reachable; raise ``StorageUnavailable``."""

    def close(self) -> None:
        """Release connections. Idempotent."""


class AggregateStore(StorageRole, ABC):
    """Aggregates and deduplication: ``load``, ``commit`` and ``mark_dispatched`` (see the
    module docstring), and the processed window. Every endpoint needs this role.

    ``mark_dispatched`` receives a ``lease`` only from the outbox dispatcher (backends with
    :class:`OutboxStore`) and ``journal`` entries only from an endpoint with a journal
    (backends with :class:`JournalStore`).
    """

    #: How long a processed message is remembered at least; ``None``: not limited by time
    #: (by count, or kept). The endpoint checks at start that it outlasts the retry path.
    retention: datetime.timedelta | None = None

    def __init__(self, *, processed_window: int | None = DEFAULT_PROCESSED_WINDOW) -> None:
        if processed_window is not None and processed_window < 1:
            raise ValueError(f"processed_window must be at least 1, got {processed_window}")
        #: How many processed entries each aggregate remembers; ``None``: not bounded by count.
        self.processed_window = processed_window

    @abstractmethod
    def load(
        self, aggregate_type: str, aggregate_id: str, key: str | None = None
    ) -> AggregateRecord:
        """Return the aggregate's record (version 0 if it does not exist), with the
        processed entry of ``key`` if there is one."""

    @abstractmethod
    def commit(
        self,
        loaded: AggregateRecord,
        *,
        key: str,
        state: Mapping[str, Any] | None,
        outgoing: Sequence[Envelope],
        completed: bool = False,
        state_version: int | None = None,
        message_type: str | None = None,
    ) -> None:
        """Store state and ``key -> outgoing`` in one conditional write; with
        ``completed``, leave a tombstone instead of the state (see the module docstring),
        keeping ``state`` (if given) as its :attr:`AggregateRecord.final_state`.

        ``state_version``: the schema version of ``state`` (the state model's
        ``state_version``), stored with it and returned by ``load`` and ``records`` as
        :attr:`AggregateRecord.state_version`. ``message_type``: the type of the message
        ``key`` records, kept with its entry (:attr:`ProcessedMessage.message_type`).

        Raises ``AlreadyProcessed`` or ``ConcurrencyConflict`` when the write is refused.
        """

    @abstractmethod
    def mark_dispatched(self, aggregate_type: str, aggregate_id: str, key: str, *,
                        keep_bodies: bool = False, lease: Lease | None = None,
                        journal: Sequence[JournalEntry] = ()) -> None:
        """Record that ``key``'s outgoing messages were dispatched and, unless
        ``keep_bodies``, forget their bodies (keeping their ids). With ``lease`` the write
        is fenced: it is applied at once and raises :class:`~idembus.storage.errors.StaleLease` if
        another owner has taken the lease since.

        ``journal``: entries of the dispatched events to append to the event journal no
        later than the mark (PostgreSQL writes them in the same transaction as a batch of
        marks; the others append them first). A mark that is lost takes its entries with it,
        and the events are dispatched and journaled again."""

    @abstractmethod
    def records(self, aggregate_type: str) -> Iterator[AggregateRecord]:
        """Every stored record of one aggregate type, for reports and tools (not per
        message), with ``updated_at``."""

    def history(self, aggregate_type: str, aggregate_id: str, *,
                entries: int = 200) -> AggregateRecord:
        """The aggregate's record with its ``entries`` newest processed entries (newest
        last, as ``load`` orders them), for tools that show one aggregate (the dashboard's
        lookup); a completed saga's tombstone too. The default serves backends whose
        ``load`` returns every remembered entry; those that keep entries apart (PostgreSQL)
        override it."""
        if entries < 0:
            raise ValueError(f"entries cannot be negative, got {entries}")
        record = self.load(aggregate_type, aggregate_id)
        kept = list(record.processed.items())[-entries:] if entries else []
        return replace(record, processed=dict(kept))

    def aggregate_page(self, aggregate_type: str, *, completed: bool = False,
                       after: str | None = None, limit: int = 50,
                       id_prefix: str = "") -> list[AggregateRecord]:
        """At most ``limit`` aggregates of ``aggregate_type`` in the order of their ids,
        those after ``after`` only (a page; the next starts after the last id): the live
        ones, or with ``completed`` the tombstones; with ``id_prefix`` only ids that start
        with it. Each record has its state (a tombstone: its ``final_state``), version,
        ``updated_at`` and no processed entries (:meth:`history` has those). For tools
        (``idembus sagas list``, the dashboard), not per message. This default reads
        :meth:`records` through (a backend should override it with an indexed query)."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        found = (replace(record, processed={}) for record in self.records(aggregate_type)
                 if record.exists and record.completed == completed
                 and record.aggregate_id.startswith(id_prefix)
                 and (after is None or record.aggregate_id > after))
        return heapq.nsmallest(limit, found, key=lambda record: record.aggregate_id)

    def load_many(
        self, requests: Sequence[tuple[str, str, str | None]]
    ) -> list[AggregateRecord | Exception]:
        """:meth:`load` for each ``(aggregate_type, aggregate_id, key)``, in order: each
        record, or the error its load raised. Backends that can, answer them all in one
        round trip (PostgreSQL's pipeline mode); this default loads one after another."""
        records: list[AggregateRecord | Exception] = []
        for aggregate_type, aggregate_id, key in requests:
            try:
                records.append(self.load(aggregate_type, aggregate_id, key))
            except Exception as error:
                records.append(error)
        return records

    def commit_many(self, commits: Sequence[PendingCommit]) -> list[Exception | None]:
        """:meth:`commit` for each of ``commits`` (a batch's, on different aggregates), in
        order: ``None`` for each written, or the error that commit raised
        (``AlreadyProcessed``, ``ConcurrencyConflict``, an outage). Each is still its own
        atomic conditional write, which succeeds or fails on its own; backends that can
        send them in one round trip (PostgreSQL's pipeline mode, MongoDB's unordered
        ``bulk_write``); this default, which third-party backends inherit, commits one
        after another."""
        results: list[Exception | None] = []
        for pending in commits:
            try:
                self.commit(pending.loaded, key=pending.key, state=pending.state,
                            outgoing=pending.outgoing, **pending.options)
            except Exception as error:
                results.append(error)
            else:
                results.append(None)
        return results

    def flush(self) -> None:
        """Apply every ``mark_dispatched`` made so far (backends that batch them)."""

    def expire(self, now: datetime.datetime, *, batch: int = 1000) -> int:
        """Forget up to ``batch`` processed entries older than ``retention`` whose messages
        were dispatched (never the undispatched), and tombstones completed longer than
        ``retention`` ago none of whose entries waits for dispatch; return how many
        entries and tombstones. Backends whose server expires entries itself (MongoDB's TTL
        index) count only what they removed here. The outbox dispatcher calls this on its
        rounds."""
        return 0

    def _refusal(self, aggregate_type: str, aggregate_id: str, key: str) -> Exception:
        """Explain a refused conditional write by looking at the record again."""
        current = self.load(aggregate_type, aggregate_id, key)
        entry = current.processed.get(key)
        if entry is not None:
            return AlreadyProcessed(key, entry.outgoing)
        return ConcurrencyConflict(
            f"{aggregate_type} {aggregate_id!r} moved past the loaded version while {key} ran"
        )

    def _refusal_in_group(self, pending: PendingCommit) -> Exception:
        """:meth:`_refusal` of one refused commit of a group, or the error met reading the
        record again: that commit's answer either way."""
        try:
            return self._refusal(pending.loaded.aggregate_type, pending.loaded.aggregate_id,
                                 pending.key)
        except Exception as error:
            return error


class OutboxStore(StorageRole, ABC):
    """The outbox dispatcher's part: entries never marked dispatched, leases with fencing
    tokens, and what waits too long (``Endpoint(outbox=True)``, ``idembus dispatcher``).
    Its backend also has :class:`AggregateStore`, where the entries are."""

    @abstractmethod
    def undispatched(self, *, committed_before: datetime.datetime, limit: int = 100,
                     endpoint: str | None = None) -> list[Undispatched]:
        """Up to ``limit`` processed entries committed before ``committed_before`` whose
        outgoing messages were never marked dispatched (a crash between commit and
        dispatch), oldest first. With ``endpoint``: only the entries that endpoint
        committed (its name in their messages' ``idembus.originating_endpoint``), and
        those whose messages name none."""

    @abstractmethod
    def note_repair_failure(self, aggregate_type: str, aggregate_id: str, key: str) -> None:
        """Count one failed attempt of the outbox to send ``key``'s messages (it shows in
        :attr:`Undispatched.attempts`), so that a bounded number of attempts holds whoever
        holds the lease."""

    def overdue(self, before: datetime.datetime) -> list[Overdue]:
        """What has waited since before ``before`` (an aware datetime), per endpoint and
        kind: undispatched entries committed before it, and (a backend that is also a
        :class:`DelayedStore`) scheduled messages due before it (claimed or not). Ordered by
        endpoint (``None`` first), entries before delayed messages. For operators
        (``idembus dispatcher --list-stranded``), not per message."""
        found = self._overdue(_aware(before, "before"))
        return sorted(found, key=lambda o: (o.endpoint is not None, o.endpoint or "",
                                            o.kind != OVERDUE_ENTRIES))

    @abstractmethod
    def _overdue(self, before: datetime.datetime) -> list[Overdue]:
        """:meth:`overdue` in any order, ``before`` known to be aware."""

    @abstractmethod
    def acquire_lease(self, name: str, owner: str, *, ttl: float,
                      now: datetime.datetime) -> Lease | None:
        """Take the lease ``name`` for ``owner`` (or renew it) until ``now + ttl``; ``None``
        while another owner holds it. A change of owner increases the token."""

    @abstractmethod
    def release_lease(self, lease: Lease) -> None:
        """Give the lease up at once (if ``lease`` still holds it)."""

    def watch(self, wake: Callable[[], None], stop: threading.Event,
              lease: Callable[[], Lease | None], *, lease_name: str = OUTBOX_LEASE) -> bool:
        """Block until ``stop``, calling ``wake`` whenever new commits may have left messages
        to dispatch; return False at once if the backend cannot watch (then the outbox
        dispatcher polls). ``lease()`` is the watcher's current lease (named ``lease_name``):
        progress it saves is fenced by it."""
        return False


class DelayedStore(StorageRole, ABC):
    """Delayed messages, for transports that cannot hold them back themselves (memory://,
    Redis): ``schedule``, ``claim_due`` under a lease, ``forget_scheduled`` and the failure
    count of ``note_scheduled_failure`` (see the module docstring)."""

    def schedule(self, envelope: Envelope, due: datetime.datetime, *,
                 owner: str | None = None) -> None:
        """Keep ``envelope`` until ``due`` (an aware datetime), for the pollers of ``owner``
        (the endpoint that scheduled it, whose transport sends it; ``None``: any poller).
        Idempotent per :func:`scheduled_key`: the same message deferred again for another
        time (the next delayed retry) is a new entry, even while the previous one is being
        forgotten."""
        self._schedule(envelope, _aware(due, "due"), owner)

    def claim_due(
        self, now: datetime.datetime, *, limit: int = 100, lease: float = 30.0,
        owner: str | None = None,
    ) -> list[Envelope]:
        """Up to ``limit`` scheduled envelopes due at ``now`` (oldest due first) that no
        live claim holds; each is held for ``lease`` seconds. With ``owner``: only those
        ``owner`` scheduled, and those scheduled for any poller."""
        return self._claim_due(_aware(now, "now"), limit=limit, lease=lease, owner=owner)

    @abstractmethod
    def _schedule(self, envelope: Envelope, due: datetime.datetime,
                  owner: str | None) -> None:
        """:meth:`schedule`, ``due`` known to be aware."""

    @abstractmethod
    def _claim_due(
        self, now: datetime.datetime, *, limit: int, lease: float, owner: str | None
    ) -> list[Envelope]:
        """:meth:`claim_due`, ``now`` known to be aware."""

    @abstractmethod
    def forget_scheduled(self, envelopes: Sequence[Envelope]) -> None:
        """Remove scheduled envelopes (after they were dispatched)."""

    @abstractmethod
    def note_scheduled_failure(self, envelope: Envelope) -> int:
        """Count one failed send of the scheduled ``envelope`` (by :func:`scheduled_key`)
        and return how many it has had, this one included: the count is kept with the
        message, so it holds for every poller and across restarts. Scheduling the same entry
        again keeps its count; a new entry (the next delayed round) starts at 0, and
        forgetting the entry forgets its count. Returns 0 if it is no longer scheduled
        (another poller sent and forgot it)."""


class JournalStore(StorageRole, ABC):
    """The event journal of endpoints with ``journal=...`` (see the module docstring),
    read by ``idembus gateway``."""

    @abstractmethod
    def append_journal(self, entries: Sequence[JournalEntry]) -> None:
        """Append the entries in order, skipping those whose ``message_id`` the journal
        already holds (an event dispatched again); each gets the next position and
        ``recorded_at`` now."""

    @abstractmethod
    def read_journal(self, *, after: int, limit: int = 500) -> list[JournalEntry]:
        """Up to ``limit`` entries with positions greater than ``after``, in order."""

    @abstractmethod
    def journal_bounds(self) -> JournalBounds:
        """The oldest and newest positions and the number of entries."""

    @abstractmethod
    def journal_position_at(self, moment: datetime.datetime) -> int | None:
        """Where to read from (``after=``) to get every entry recorded at or after
        ``moment``: one less than the first such entry's position, the newest position if
        there is none, 0 if the journal is empty; ``None`` if the oldest entry kept was
        recorded at or after ``moment`` but older ones were trimmed (what happened since
        ``moment`` is no longer all there)."""

    @abstractmethod
    def trim_journal(self, before: datetime.datetime, *, batch: int = 1000) -> int:
        """Remove up to ``batch`` entries recorded before ``before``, never the newest;
        return how many."""


class AuditStore(StorageRole, ABC):
    """The audit trail of endpoints with the :class:`~idembus.observability.audit.Audit`
    middleware, read
    by ``idembus spark report``."""

    @abstractmethod
    def write_audit(self, records: Sequence[AuditRecord]) -> None:
        """Keep audit records (appended; written in batches by the endpoint)."""

    @abstractmethod
    def read_audit(self, *, part: int = 0, parts: int = 1) -> Iterator[AuditRecord]:
        """The audit records whose ``bucket % parts == part``: ``parts`` readers (Spark
        partitions) together read each record once."""


class StatusStore(StorageRole, ABC):
    """What running endpoint processes report, read by ``idembus status``."""

    @abstractmethod
    def report_status(self, report: StatusReport) -> None:
        """Keep ``report``, replacing the earlier one of the same endpoint and instance."""

    @abstractmethod
    def status_reports(self, endpoint: str) -> list[StatusReport]:
        """Every kept report of ``endpoint``, newest first."""

    @abstractmethod
    def forget_status(self, endpoint: str, *, updated_before: datetime.datetime) -> int:
        """Remove the reports of ``endpoint`` last updated before ``updated_before``
        (processes long gone); return how many."""


class LimitStore(StorageRole, ABC):
    """Rate and concurrency limits shared by every process that uses the storage (the
    :class:`~idembus.runtime.recoverability.limits.Limits` middleware). Times come from the
    caller's clock (``now``, aware), as for :class:`DelayedStore`: processes on several
    machines need synchronised clocks.

    A rate limit is a virtual schedule (the generic cell rate algorithm): each name keeps
    the time its next unit of work is due (``tat``). A reservation takes the next slot
    whether or not it is free now, and says how long to wait for it; so a backlog is spread
    out evenly instead of every waiting message coming back at the same moment.
    """

    @abstractmethod
    def reserve_rate(self, name: str, *, interval: float, burst: int,
                     now: datetime.datetime) -> float:
        """Reserve the next slot of the rate limit ``name`` (one unit every ``interval``
        seconds, up to ``burst`` at once after a quiet spell) and return the seconds from
        ``now`` until it: 0 when it may run at once. Atomic: concurrent reservations from
        any process get distinct slots. In effect, with ``tat`` the name's due time (``now``
        if unknown), the new ``tat`` is ``max(tat, now) + interval`` and the wait is
        ``max(0, new tat - now - burst * interval)``."""

    @abstractmethod
    def acquire_slot(self, name: str, *, slots: int, holder: str, lease: float,
                     now: datetime.datetime) -> bool:
        """Take one of the ``slots`` of the concurrency limit ``name`` for ``holder`` until
        ``lease`` seconds from ``now``, if one is free (never taken, released, or its lease
        ran out); True if taken. A holder that has a slot of ``name`` already keeps it (its
        lease is renewed) and gets True."""

    @abstractmethod
    def release_slot(self, name: str, holder: str) -> None:
        """Give back the slot of ``name`` that ``holder`` holds, if it still does."""


class PayloadStore(StorageRole, ABC):
    """The bodies of claim-checked messages (:mod:`idembus.storage.claims`): each kept under
    an id derived from its message's id, until a time after which it may be collected.

    Writing is idempotent: the same id written again (a message dispatched again after a
    crash) keeps one body and only ever moves its time forward. Times come from the
    caller's clock (aware).

    A body may also be held (:meth:`hold_payload`): while any hold is on it, it is kept
    whatever its time; a message moved to the error queue holds its body until it is
    retried or purged."""

    @abstractmethod
    def put_payload(self, payload_id: str, body: bytes, *,
                    keep_until: datetime.datetime) -> None:
        """Keep ``body`` under ``payload_id`` at least until ``keep_until``: stored if new,
        otherwise replaced, its time becoming the later of the two."""

    @abstractmethod
    def get_payload(self, payload_id: str) -> bytes | None:
        """The body kept under ``payload_id``, or ``None`` if there is none (never stored,
        or collected)."""

    @abstractmethod
    def collect_payloads(self, now: datetime.datetime, *, batch: int = 100) -> int:
        """Remove up to ``batch`` bodies whose ``keep_until`` is before ``now`` and that
        no hold keeps (:meth:`hold_payload`); return how many."""

    @abstractmethod
    def hold_payload(self, payload_id: str, hold_id: str) -> bool:
        """Keep the body of ``payload_id`` whatever its time until :meth:`release_payload`
        of ``hold_id`` (an error-queue copy that refers to it). Idempotent; a body may
        have several holds. True if the body is there (else nothing is held). Atomic with
        :meth:`collect_payloads`: a body held is never collected, and a body collected is
        never reported held."""

    @abstractmethod
    def release_payload(self, hold_id: str, *, keep_until: datetime.datetime) -> bool:
        """Remove the hold ``hold_id`` (wherever it is); the body's time becomes the later
        of its own and ``keep_until``. True if the hold was there."""


def rate_wait(tat: float, *, now: float, interval: float, burst: int) -> tuple[float, float]:
    """The generic cell rate algorithm of :meth:`LimitStore.reserve_rate` on epoch seconds:
    ``(new tat, seconds to wait)`` for a reservation at ``now`` when the due time is
    ``tat``."""
    new_tat = max(tat, now) + interval
    return new_tat, max(0.0, new_tat - now - burst * interval)


class ParkingStore(StorageRole, ABC):
    """Where idembus keeps what neither the broker nor the error queue took, with the
    reason, so that nothing is lost (``idembus errors`` lists, retries and purges it).
    Every endpoint needs this role."""

    @abstractmethod
    def park(self, parked: ParkedMessage) -> None:
        """Keep ``parked`` (idempotent per ``parked_id``)."""

    @abstractmethod
    def parked_messages(self, endpoint: str) -> list[ParkedMessage]:
        """Every message parked by ``endpoint``, oldest first."""

    @abstractmethod
    def unpark(self, parked_ids: Sequence[str]) -> int:
        """Remove parked messages (retried or purged); return how many were there."""

    def parked_page(self, endpoint: str | None, *, after: ParkedKey | None = None,
                    limit: int = 100) -> list[ParkedMessage]:
        """At most ``limit`` messages parked by ``endpoint`` (every endpoint: ``None``), in
        the order of :func:`parked_key`, those after ``after`` only: a page, for tools
        that must not hold them all at once. This default reads them all (a backend
        should override it); it cannot list every endpoint's."""
        if endpoint is None:
            raise NotImplementedError(f"{type(self).__name__} cannot list the parked "
                                      "messages of every endpoint")
        found = sorted(self.parked_messages(endpoint), key=parked_key)
        return [parked for parked in found if after is None or parked_key(parked) > after
                ][:limit]

    def parked_by_ids(self, endpoint: str, parked_ids: Sequence[str]) -> list[ParkedMessage]:
        """The messages of ``parked_ids`` that ``endpoint`` parked and that are still
        there, in the order of :func:`parked_key`. This default pages through
        :meth:`parked_page` (a backend should override it)."""
        wanted: set[str] = set(parked_ids)
        found: list[ParkedMessage] = []
        after: ParkedKey | None = None
        while page := self.parked_page(endpoint, after=after):
            found.extend(parked for parked in page if parked.parked_id in wanted)
            after = parked_key(page[-1])
        return found


class Storage(AggregateStore, OutboxStore, DelayedStore, JournalStore, AuditStore,
              StatusStore, ParkingStore):
    """Base class of the backends that have every role (memory, MongoDB, PostgreSQL); see
    the module docstring for the contract. A backend with fewer roles subclasses those
    roles instead."""


#: Every role, in the order :class:`Storage` combines them.
ROLES: tuple[type[StorageRole], ...] = (AggregateStore, OutboxStore, DelayedStore,
                                         JournalStore, AuditStore, StatusStore, ParkingStore,
                                         LimitStore, PayloadStore)


def _aware(moment: datetime.datetime, name: str) -> datetime.datetime:
    """``moment`` if it carries a time zone; a naive time is ambiguous (local or UTC?)."""
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError(f"{name} must be an aware datetime (UTC), got naive {moment!r}")
    return moment


def committed_by(outgoing: Sequence[Envelope]) -> str | None:
    """The endpoint that committed an entry with these messages (``None``: unknown)."""
    return outgoing[0].headers.get(h.ORIGINATING_ENDPOINT) if outgoing else None


def scheduled_key(envelope: Envelope) -> tuple[str, str, str]:
    """What identifies a delayed message: its id, destination and ``idembus.deliver_at``."""
    return (envelope.message_id, envelope.destination or "",
            envelope.headers.get(h.DELIVER_AT, ""))
