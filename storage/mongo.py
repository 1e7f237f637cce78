"""MongoDB storage over pymongo: one document per aggregate, one conditional write per message.

Features
========
* Document per aggregate, in a collection named after the aggregate type::

      {_id: <aggregate id>, version: <int>, state: {...}, state_version: <int>,
       updated_at: <datetime>, completed: <bool>,
       processed: [{key, type: <message type>, outgoing: [...], ids: [...],
                    dispatched: bool, at: <datetime>, endpoint: <committing endpoint>,
                    bytes: <int>,
                    spill: <token>, count: <int>}, ...]}

* Commit of an existing aggregate: ``update_one`` matching ``_id``, the loaded ``version``
  and ``processed.key != key``; ``$set`` state and version, ``$push`` the entry with
  ``$slice`` keeping the newest ``processed_window`` entries — or more, back to the oldest
  entry whose messages were never dispatched: the window never forgets what the outbox
  still has to send.
* Creation: ``insert_one``; a duplicate-key error is a lost race like any other.
* Bounded in bytes, not only in count, so that idembus's bookkeeping never reaches MongoDB's
  16 MiB: an entry keeps its messages inline only up to 16 KiB and while the document's
  entries take under 1 MiB; otherwise they go to ``idembus_outgoing``
  (:mod:`idembus.storage.mongo_spill`), written before the aggregate's write, under ids new
  to the commit attempt, and referenced by the entry (``spill``, ``count``); the window
  also ends early past 8 MiB of entries (only windows of many thousands get there). A
  load with a key reads that entry's spilled messages only; ``expire`` deletes side
  documents nobody references after an hour (a crash between the two writes, an entry
  that left its window). Marked dispatched without ``keep_bodies``, a spilled entry keeps
  its ids; its bodies are no longer read.
* With ``retention=``, a TTL index (partial: dispatched records only) deletes inbox records
  of stateless handlers once older than it; aggregate documents keep their bounded window.
  TTL deletion is the server's: mongomock never deletes, so that path is verified only by
  the index it creates.
* A completed aggregate (a saga's ``complete()``) is a tombstone: ``completed: true``,
  ``state``: its last state (read as ``final_state``; ``null`` if none was given), its
  processed window kept, each entry with its message ``type``. Documents written before
  types were recorded read with ``message_type`` ``None``: nothing to migrate. With
  ``retention=``, ``expire`` (the outbox dispatcher's rounds) deletes tombstones completed
  longer ago than that whose entries were all dispatched, found through a partial index
  (``idembus_tombstones``); a TTL index could not tell dispatched entries from the others.
* Delayed messages wait in the collection ``idembus_scheduled``; pollers claim due ones with
  ``find_one_and_update`` (a lease), so only one dispatches each while it lives.
* The event journal is the collection ``idembus_journal``, one document per entry with its
  position as ``_id`` and a unique index on ``message_id``. An appender reads the newest
  position and inserts the next one; the ``_id`` index lets one of two racing appenders
  win, and the loser tries again with a fresh newest. So positions are dense and each is
  written only once the one before it is visible. ``trim_journal`` deletes old entries,
  never the newest; there is no TTL index, which could delete the newest and let
  positions start again from 1.
* No transactions, sessions or replica set needed; documents are the unit of atomicity,
  so sharding by ``_id`` needs nothing more.
* The aggregate collections idembus writes are noted in ``idembus_aggregates`` (before the
  first commit to each, by each process); the outbox scans those and no other collection,
  and only those get the index serving that scan (``idembus_undispatched``), made when a
  collection is noted and again by ``migrate``/``verify``. Collections written before this
  note existed are recognised at ``migrate`` by the shape of their first document; other
  collections of the database, and views, are never scanned or indexed.

mongomock
=========
mongomock is this backend's test double (no longer the endpoint's default). It is not
thread-safe: four threads doing guarded conditional updates were seen to apply one message
up to four times. Given a mongomock client, this backend serialises every operation behind
one lock. mongomock also scans whole collections on every query, so keep its data modest;
measure speed on a real server.

Connection String
=================
``MongoStorage("mongodb://host:27017/?replicaSet=rs0", database="sales")``, a
``pymongo.MongoClient``, or ``MongoStorage.embedded("sales")`` for mongomock.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import re
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import bson
import bson.errors
import pymongo
import pymongo.errors

from ..envelope import Envelope, utc_now
from ..errors import ConfigurationError
from ..redaction import redact
from . import mongo_changes, mongo_spill
from .base import (
    AUDIT_BUCKETS,
    DEFAULT_PROCESSED_WINDOW,
    INBOX,
    OUTBOX_LEASE,
    OVERDUE_DELAYED,
    OVERDUE_ENTRIES,
    AggregateRecord,
    AuditRecord,
    JournalBounds,
    JournalEntry,
    Lease,
    LimitStore,
    Overdue,
    ParkedKey,
    ParkedMessage,
    PayloadStore,
    PendingCommit,
    ProcessedMessage,
    StatusReport,
    Storage,
    Undispatched,
    committed_by,
    parked_key,
    rate_wait,
    scheduled_key,
)
from .errors import (
    StaleLease,
    StorageAccessDenied,
    StorageRefused,
    StorageUnavailable,
)
from .journal import journal_size, resume_position
from .parked import body_bytes, envelope_bytes, envelope_from

T = TypeVar("T")

#: Collection of delayed messages waiting for their time (transports without native delay).
SCHEDULED = "idembus_scheduled"
#: Collection of the counters endpoint processes report (``idembus status``).
STATUS = "idembus_status"
#: Collection of audit records (endpoints with ``audit=True``).
AUDIT = "idembus_audit"
#: Collection of leases (the outbox dispatcher's), with their fencing tokens.
LEASES = "idembus_leases"
#: Collection of the event journal (endpoints with ``journal=...``), ``_id`` = position.
JOURNAL = "idembus_journal"
#: Name of the TTL index expiring dispatched inbox records.
RETENTION_INDEX = "idembus_retention"
#: The index of each aggregate collection that serves the outbox's scan.
UNDISPATCHED_INDEX = "idembus_undispatched"
#: The index of each aggregate collection that serves ``expire``'s look for tombstones.
TOMBSTONES_INDEX = "idembus_tombstones"
#: Messages parked with their reason (``idembus errors``).
PARKED = "idembus_parked"
#: The aggregate collections idembus wrote, one document ``{_id: <collection name>}`` each.
AGGREGATES = "idembus_aggregates"
#: Rate and concurrency limits (the ``Limits`` middleware), one document per name.
LIMITS = "idembus_limits"
#: Claim-checked bodies (``Endpoint(claim_check=...)``), in chunks of
#: :data:`PAYLOAD_CHUNK_BYTES`: ``{_id: "<payload id>.<n>", payload, n, count, data,
#: keep_until}``.
PAYLOADS = "idembus_payloads"
#: The largest chunk of a claim-checked body (a document holds at most 16 MiB).
PAYLOAD_CHUNK_BYTES = 8 * 1024 * 1024
_INTERNAL_COLLECTIONS = frozenset({SCHEDULED, STATUS, LEASES, AUDIT, JOURNAL, PARKED,
                                   AGGREGATES, LIMITS, PAYLOADS, mongo_spill.SPILL})
#: How often one entry's append may lose the race for the next position before giving up.
_APPEND_TRIES = 1000


#: MongoDB's error code for a duplicate key (a lost creation race).
_DUPLICATE_KEY = 11000


def bulk_updates_work(client: Any) -> bool:
    """Whether ``client`` runs a ``bulk_write`` of ``UpdateOne``: a server does; mongomock
    only if its bulk builder takes the ``sort`` keyword pymongo 4.11 and later pass."""
    if not is_mongomock(client):
        return True
    from mongomock.collection import BulkOperationBuilder
    parameters = inspect.signature(BulkOperationBuilder.add_update).parameters.values()
    return any(parameter.name == "sort" or parameter.kind is inspect.Parameter.VAR_KEYWORD
               for parameter in parameters)


def is_mongomock(client: Any) -> bool:
    """True when ``client`` is a mongomock client (not safe for concurrent use)."""
    return type(client).__module__.split(".")[0] == "mongomock"


class MongoStorage(Storage, LimitStore, PayloadStore):
    """Storage backend for MongoDB (pymongo) and mongomock; see the module docstring.

    Parameters
    ----------
    client:
        A ``mongodb://`` URL (the storage makes and closes its own client) or a client
        (``pymongo.MongoClient``, ``mongomock.MongoClient``).
    database:
        The database of the aggregate collections and idembus's own.
    processed_window:
        How many processed messages each aggregate document remembers for deduplication.
    retention:
        Expire dispatched inbox records (a TTL index) and completed sagas' tombstones once
        older than this (``None``: keep them).
    """

    #: Documents must stay bounded, so the window always has a size here.
    processed_window: int

    def __init__(
        self,
        client: Any,
        *,
        database: str = "idembus",
        processed_window: int = DEFAULT_PROCESSED_WINDOW,
        retention: datetime.timedelta | None = None,
    ) -> None:
        super().__init__(processed_window=processed_window)
        #: Inbox records (stateless handlers) whose messages were dispatched are deleted by
        #: the server's TTL monitor this long after they were processed; tombstones whose
        #: entries were all dispatched, by ``expire`` this long after their completion.
        self.retention = retention
        #: Aggregate collections this process has noted in AGGREGATES and indexed.
        self._owned: set[str] = set()
        self._owns_client = isinstance(client, str)
        if isinstance(client, str):
            # Fail a start-up check in seconds, not pymongo's 30, unless the URL says otherwise.
            options: dict[str, Any] = {} if "serverselectiontimeoutms" in client.lower() else {
                "serverSelectionTimeoutMS": 5000}
            client = pymongo.MongoClient(client, tz_aware=True, **options)
        self.client = client
        self.database = client[database]
        # Re-entrant: a refused commit reloads the record while still holding the guard.
        self.process_local = is_mongomock(client)
        self._guard: AbstractContextManager[Any] = (
            threading.RLock() if self.process_local else contextlib.nullcontext()
        )
        #: Whether ``bulk_write`` takes updates here (group commits in one round trip).
        self._bulk_updates = bulk_updates_work(client)
        # Appends rely on the journal's unique index: made once, even without migrate().
        self._journal_indexed = False
        #: Whether this process made the indexes of the spilled messages' collection.
        self._spill_indexed = False

    @classmethod
    def embedded(
        cls, database: str = "idembus", *, processed_window: int = DEFAULT_PROCESSED_WINDOW,
        retention: datetime.timedelta | None = None,
    ) -> MongoStorage:
        """An in-process mongomock database: MongoStorage's test double, for tests of code
        written against MongoDB (an endpoint given no storage uses a MemoryStorage)."""
        import mongomock

        return cls(mongomock.MongoClient(), database=database, processed_window=processed_window,
                   retention=retention)

    def load(
        self, aggregate_type: str, aggregate_id: str, key: str | None = None
    ) -> AggregateRecord:
        with self._guard, _translated():
            document = self.database[aggregate_type].find_one({"_id": aggregate_id})
            if document is None:
                return AggregateRecord(aggregate_type, aggregate_id)
            return self._records_of(aggregate_type, [document], key)[0]

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
        token = uuid.uuid4().hex
        where, document, side = self._write_of(PendingCommit(
            loaded, key, state, tuple(outgoing),
            {"completed": completed, "state_version": state_version,
             "message_type": message_type}), token)
        collection = self.database[loaded.aggregate_type]
        with self._guard, _translated():
            self._own(loaded.aggregate_type)  # before the write: the outbox must find it
            self._spill(side)  # first: the entry references it only if its write applies
            if where is None:
                try:
                    collection.insert_one(document)
                    return
                except pymongo.errors.DuplicateKeyError:
                    pass
            else:
                if collection.update_one(where, document).matched_count == 1:
                    return
            self._unspill([token] if side else [])
            raise self._refusal(loaded.aggregate_type, loaded.aggregate_id, key)

    def _spill(self, side: Sequence[Mapping[str, Any]]) -> None:
        """Write the side documents of spilled entries (:mod:`idembus.storage.mongo_spill`),
        their collection indexed first (once per process)."""
        if side:
            if not self._spill_indexed:
                mongo_spill.index(self.database)
                self._spill_indexed = True
            self.database[mongo_spill.SPILL].insert_many(list(side), ordered=False)

    def _unspill(self, tokens: Sequence[str]) -> None:
        """Delete the side documents of commits that did not apply (a crash before this
        leaves them to :func:`~idembus.storage.mongo_spill.sweep`)."""
        if tokens:
            self.database[mongo_spill.SPILL].delete_many({"ref": {"$in": list(tokens)}})

    def _write_of(self, pending: PendingCommit, token: str, *, mark: bool = False
                  ) -> tuple[dict[str, Any] | None, dict[str, Any], list[dict[str, Any]]]:
        """The conditional write of one commit: ``(None, document, side)`` creating the
        aggregate, or ``(filter, update, side)`` updating it at the loaded version if the
        key is not among its processed messages; ``side``: the side documents its outgoing
        messages are spilled to, if they are (to be written first). ``token`` names the
        side documents; with ``mark`` it also marks the entry (``commit``), by which a group
        commit recognises the writes that applied."""
        loaded, outgoing = pending.loaded, pending.outgoing
        completed = bool(pending.options.get("completed", False))
        records = [envelope.to_record() for envelope in outgoing]
        ids = [envelope.message_id for envelope in outgoing]
        entry: dict[str, Any] = {
            "key": pending.key,
            "outgoing": records,
            "ids": ids,
            "dispatched": not outgoing,
            "at": utc_now(),
            "endpoint": committed_by(outgoing),
        }
        message_type = pending.options.get("message_type")
        if message_type is not None:
            entry["type"] = message_type
        if mark:
            entry["commit"] = token
        size = mongo_spill.size_of(records, ids) if outgoing else 0
        kept = self._kept_entries(loaded)
        side: list[dict[str, Any]] = []
        if size > mongo_spill.INLINE_BYTES or (
                size and _inline_bytes(kept) + size > mongo_spill.WINDOW_BYTES):
            where = {"collection": loaded.aggregate_type, "aggregate_id": loaded.aggregate_id,
                     "key": pending.key}
            side = mongo_spill.chunks(token, where, records, ids, entry["at"])
            entry.update(outgoing=[], ids=[], spill=token, count=len(records))
            size = 0
        bare = mongo_spill.bare_bytes(pending.key) + len((message_type or "").encode("utf-8"))
        entry["bytes"] = size + bare
        # What it takes once dispatched without keep_bodies: its ids stay inline.
        entry["lean"] = bare + (mongo_spill.size_of([], entry["ids"]) if size else 0)
        # A tombstone keeps the state it was given as its last (``final_state``).
        fields = {"state": dict(pending.state) if pending.state is not None else None,
                  "state_version": pending.options.get("state_version"),
                  "updated_at": entry["at"], "completed": completed}
        if not loaded.exists:
            return None, {"_id": loaded.aggregate_id, "version": 1, **fields,
                          "processed": [entry]}, side
        return ({"_id": loaded.aggregate_id, "version": loaded.version,
                 "processed.key": {"$ne": pending.key}},
                {"$set": {**fields, "version": loaded.version + 1},
                 "$push": {"processed": {"$each": [entry],
                                         "$slice": -(len(kept) + 1)}}}, side)

    def commit_many(self, commits: Sequence[PendingCommit]) -> list[Exception | None]:
        """On a MongoDB server, one unordered ``bulk_write`` per aggregate collection: each
        write keeps its own condition and succeeds or fails on its own. When not every
        update matched, which did is read back by their entries' tokens (a second round
        trip), and each refused commit is explained as :meth:`commit` explains it. On a
        mongomock whose ``bulk_write`` of updates fails (with pymongo 4.11 and later it
        does not take pymongo's ``sort``), and for a group naming one aggregate twice, one
        commit after another.

        The storage contract's group tests run it on a real server with
        ``IDEMBUS_MONGODB_URL``, and on mongomock given the missing keyword."""
        aggregates = {(p.loaded.aggregate_type, p.loaded.aggregate_id) for p in commits}
        if not self._bulk_updates or len(commits) < 2 or len(aggregates) < len(commits):
            return super().commit_many(commits)
        results: list[Exception | None] = [None] * len(commits)
        by_collection: dict[str, list[int]] = {}
        for index, pending in enumerate(commits):
            by_collection.setdefault(pending.loaded.aggregate_type, []).append(index)
        for aggregate_type, indexes in by_collection.items():
            try:
                refusals = self._bulk_commit(aggregate_type, [commits[i] for i in indexes])
            except Exception as error:  # the whole call failed: each of its commits meets it
                refusals = dict.fromkeys(range(len(indexes)), error)
            for position, refusal in refusals.items():
                results[indexes[position]] = refusal
        return results

    def _bulk_commit(self, aggregate_type: str,
                     group: Sequence[PendingCommit]) -> dict[int, Exception]:
        """One unordered ``bulk_write`` of ``group``'s writes; the refusals by position."""
        tokens = [uuid.uuid4().hex for _ in group]
        writes = [self._write_of(pending, token, mark=True)
                  for pending, token in zip(group, tokens, strict=True)]
        operations: list[Any] = [pymongo.InsertOne(document) if where is None
                                 else pymongo.UpdateOne(where, document)
                                 for where, document, _ in writes]
        updates = [index for index, (where, _, _) in enumerate(writes) if where is not None]
        collection = self.database[aggregate_type]
        failed: set[int] = set()
        with self._guard, _translated():
            self._own(aggregate_type)  # before the writes: the outbox must find them
            self._spill([document for _, _, side in writes for document in side])
            try:
                matched = collection.bulk_write(operations, ordered=False).matched_count
            except pymongo.errors.BulkWriteError as partial:
                errors = partial.details.get("writeErrors", [])
                if partial.details.get("writeConcernErrors") or any(
                        error.get("code") != _DUPLICATE_KEY for error in errors):
                    raise  # not only lost creation races: the group's error
                failed = {error["index"] for error in errors}
                matched = partial.details.get("nMatched", 0)
            if matched < len(updates):
                ids = [group[index].loaded.aggregate_id for index in updates]
                applied = {entry.get("commit")
                           for document in collection.find({"_id": {"$in": ids}},
                                                           {"processed.commit": 1})
                           for entry in document.get("processed", ())}
                failed |= {index for index in updates if tokens[index] not in applied}
            self._unspill([tokens[index] for index in sorted(failed) if writes[index][2]])
        return {index: self._refusal_in_group(group[index]) for index in sorted(failed)}

    def _kept_entries(self, loaded: AggregateRecord) -> list[ProcessedMessage]:
        """The loaded entries the commit after ``loaded`` keeps beside its own: the newest
        ``processed_window - 1`` as long as their bytes fit in
        :data:`~idembus.storage.mongo_spill.KEPT_BYTES`, stretched back to the oldest
        entry whose messages were not dispatched, which must stay for the outbox. Decided
        from the loaded record: the commit only applies at its version (no entry was added
        since), and an entry only ever changes from undispatched to dispatched, so nothing
        undispatched is cut."""
        entries = list(loaded.processed.values())  # in stored order, oldest first
        start, taken = len(entries), 0
        while start > 0 and len(entries) - start < self.processed_window - 1:
            taken += entries[start - 1].stored_bytes
            if taken > mongo_spill.KEPT_BYTES:
                break
            start -= 1
        oldest_pending = next((index for index, entry in enumerate(entries)
                               if not entry.dispatched), None)
        if oldest_pending is not None:
            start = min(start, oldest_pending)
        return entries[start:]

    def mark_dispatched(self, aggregate_type: str, aggregate_id: str, key: str, *,
                        keep_bodies: bool = False, lease: Lease | None = None,
                        journal: Sequence[JournalEntry] = ()) -> None:
        if journal:
            self.append_journal(journal)
        changes: dict[str, Any] = {"processed.$.dispatched": True}
        if not keep_bodies:
            # A spilled entry's side documents keep its ids; their bodies are no longer read.
            changes["processed.$.outgoing"] = []
            changes["processed.$.bodies"] = False
        where: dict[str, Any] = {"_id": aggregate_id, "processed.key": key}
        with self._guard, _translated():
            if lease is not None:
                # Without transactions the lease and the aggregate cannot be written together:
                # check the lease, then fence the aggregate itself with the highest token
                # that marked it, so an older owner can no longer mark it.
                self._check_fence(lease)
                changes["relay_fence"] = lease.token
                where["$or"] = [{"relay_fence": {"$exists": False}},
                                {"relay_fence": {"$lte": lease.token}}]
            result = self.database[aggregate_type].update_one(where, {"$set": changes})
            if lease is not None and result.matched_count == 0:
                fenced = self.database[aggregate_type].find_one(
                    {"_id": aggregate_id, "relay_fence": {"$gt": lease.token}}, {"_id": 1})
                if fenced is not None:
                    raise StaleLease(f"{aggregate_type} {aggregate_id!r} was marked under a "
                                     f"newer lease than token {lease.token}")

    def expire(self, now: datetime.datetime, *, batch: int = 1000) -> int:
        """Delete up to ``batch`` tombstones completed before ``now - retention`` whose
        entries were all dispatched (processed entries inside live aggregates stay in
        their window; the inbox's expire by the TTL index)."""
        with self._guard, _translated():
            mongo_spill.sweep(self.database, now, grace=max(
                mongo_spill.GRACE, self.retention or mongo_spill.GRACE), batch=batch)
        if self.retention is None:
            return 0
        doomed: dict[str, Any] = {
            "completed": True, "updated_at": {"$lt": now - self.retention},
            "processed.dispatched": {"$ne": False}}  # no entry waits for dispatch
        removed = 0
        with self._guard, _translated():
            for name in self._aggregate_collections():
                if removed >= batch:
                    break
                ids = [document["_id"] for document in self.database[name].find(
                    doomed, {"_id": 1}).limit(batch - removed)]
                if ids:
                    # The condition again: a commit since the look revived it, or added an
                    # entry to dispatch.
                    removed += int(self.database[name].delete_many(
                        {**doomed, "_id": {"$in": ids}}).deleted_count)
        return removed

    def undispatched(self, *, committed_before: datetime.datetime, limit: int = 100,
                     endpoint: str | None = None) -> list[Undispatched]:
        found: list[tuple[datetime.datetime, Undispatched]] = []
        pending: dict[str, Any] = {"dispatched": False, "at": {"$lt": committed_before}}
        if endpoint is not None:  # entries written before "endpoint" existed match too
            pending["endpoint"] = {"$in": [endpoint, None]}
        with self._guard, _translated():
            for name in self._aggregate_collections():
                for document in self.database[name].find(
                        {"processed": {"$elemMatch": pending}}).limit(limit):
                    entries = [(at, entry) for entry in document["processed"]
                               if not entry.get("dispatched", False)
                               and (at := _utc(entry.get("at"))) and at < committed_before
                               and (endpoint is None
                                    or entry.get("endpoint") in (endpoint, None))]
                    spilled = mongo_spill.fetch(self.database[mongo_spill.SPILL],
                                                mongo_spill.wanted_of(e for _, e in entries))
                    for at, entry in entries:
                        found.append((at, Undispatched(
                            name, document["_id"], entry["key"],
                            _entry_from(entry, spilled).outgoing,
                            int(entry.get("attempts", 0)))))
        return [item for _, item in sorted(found, key=lambda pair: pair[0])][:limit]

    def note_repair_failure(self, aggregate_type: str, aggregate_id: str, key: str) -> None:
        with self._guard, _translated():
            self.database[aggregate_type].update_one(
                {"_id": aggregate_id, "processed.key": key},
                {"$inc": {"processed.$.attempts": 1}})

    def _overdue(self, before: datetime.datetime) -> list[Overdue]:
        pending = {"dispatched": False, "at": {"$lt": before}}
        entries = [
            {"$match": {"processed": {"$elemMatch": pending}}},
            {"$unwind": "$processed"},
            {"$match": {"processed.dispatched": False, "processed.at": {"$lt": before}}},
            {"$group": {"_id": "$processed.endpoint", "count": {"$sum": 1},
                        "since": {"$min": "$processed.at"}}},
        ]
        delayed = [
            {"$match": {"due": {"$lt": before}}},
            {"$group": {"_id": "$owner", "count": {"$sum": 1}, "since": {"$min": "$due"}}},
        ]
        groups: dict[tuple[str | None, str], tuple[int, datetime.datetime]] = {}

        def add(kind: str, rows: Iterator[Mapping[str, Any]]) -> None:
            for row in rows:
                since: datetime.datetime = row["since"]
                if since.tzinfo is None:  # stored in UTC; mongomock returns it naive
                    since = since.replace(tzinfo=datetime.timezone.utc)
                count, oldest = groups.get((row["_id"], kind), (0, since))
                groups[row["_id"], kind] = (count + int(row["count"]), min(oldest, since))

        with self._guard, _translated():
            for name in self._aggregate_collections():
                add(OVERDUE_ENTRIES, self.database[name].aggregate(entries))
            add(OVERDUE_DELAYED, self._delayed_messages.aggregate(delayed))
        return [Overdue(endpoint, kind, count, since)
                for (endpoint, kind), (count, since) in groups.items()]

    def _records_of(self, aggregate_type: str, documents: Sequence[Mapping[str, Any]],
                    key: str | None = None) -> list[AggregateRecord]:
        """The records of ``documents``, with the messages of their spilled entries read
        from the side collection (one query); given ``key``, only that entry's (a load
        promises no more, and the others' can be many): the other spilled entries are
        loaded without their messages and ids."""
        wanted = mongo_spill.wanted_of((entry for document in documents
                                        for entry in document.get("processed", ())), key)
        spilled = (mongo_spill.fetch(self.database[mongo_spill.SPILL], wanted) if wanted
                   else {})
        return [_record_from(aggregate_type, document, spilled) for document in documents]

    def _own(self, name: str) -> None:
        """Note ``name`` as an aggregate collection of idembus's and give it the index that
        serves the outbox's scan (once per collection and process; both writes are no-ops
        when done before)."""
        if name in self._owned:
            return
        self.database[AGGREGATES].update_one(
            {"_id": name}, {"$setOnInsert": {"noted_at": utc_now()}}, upsert=True)
        self.database[name].create_index(
            [("processed.dispatched", pymongo.ASCENDING), ("processed.at", pymongo.ASCENDING)],
            name=UNDISPATCHED_INDEX)
        self.database[name].create_index(
            [("updated_at", pymongo.ASCENDING)], name=TOMBSTONES_INDEX,
            partialFilterExpression={"completed": True})
        self._owned.add(name)

    def _aggregate_collections(self) -> list[str]:
        """The aggregate collections idembus noted, in name order."""
        return sorted(str(d["_id"]) for d in self.database[AGGREGATES].find({}, {"_id": 1}))

    def _own_existing_collections(self) -> None:
        """Note and index the aggregate collections that exist: those noted before, and
        those written before the note existed (recognised by their first document). Views,
        system collections and idembus's own are left alone; so is any collection whose
        first document is not an aggregate's."""
        noted = set(self._aggregate_collections())
        for name in sorted(self._plain_collections() - _INTERNAL_COLLECTIONS):
            if name in noted or _is_aggregate(self.database[name].find_one()):
                self._own(name)

    def _plain_collections(self) -> set[str]:
        """The names of the database's collections, without views and system collections.
        mongomock has no views and cannot filter by type, so it lists every name."""
        if self.process_local:
            names = self.database.list_collection_names()
        else:
            names = self.database.list_collection_names(filter={"type": "collection"})
        return {name for name in names if not name.startswith("system.")}

    def acquire_lease(self, name: str, owner: str, *, ttl: float,
                      now: datetime.datetime) -> Lease | None:
        until = now + datetime.timedelta(seconds=ttl)
        leases = self.database[LEASES]
        after = pymongo.ReturnDocument.AFTER
        with self._guard, _translated():
            document = leases.find_one_and_update(  # renew
                {"_id": name, "owner": owner}, {"$set": {"expires_at": until}},
                return_document=after)
            if document is None:  # take over an expired lease
                document = leases.find_one_and_update(
                    {"_id": name, "expires_at": {"$lte": now}},
                    {"$set": {"owner": owner, "expires_at": until}, "$inc": {"token": 1}},
                    return_document=after)
            if document is None:  # nobody ever held it
                document = {"_id": name, "owner": owner, "expires_at": until, "token": 1}
                try:
                    leases.insert_one(document)
                except pymongo.errors.DuplicateKeyError:
                    return None  # held by another owner
        return Lease(name, owner, int(document["token"]), until)

    def watch(self, wake: Callable[[], None], stop: threading.Event,
              lease: Callable[[], Lease | None], *, lease_name: str = OUTBOX_LEASE) -> bool:
        if self.process_local or not mongo_changes.can_watch(self.client):
            return False  # mongomock or a standalone server: the dispatcher polls
        with _translated():
            mongo_changes.follow(self.database, self.database[LEASES], lease_name,
                                 wake, stop, lease)
        return True

    def release_lease(self, lease: Lease) -> None:
        with self._guard, _translated():
            self.database[LEASES].update_one(
                {"_id": lease.name, "owner": lease.owner, "token": lease.token},
                {"$set": {"expires_at": datetime.datetime(1970, 1, 1,
                                                          tzinfo=datetime.timezone.utc)}})

    def _check_fence(self, lease: Lease) -> None:
        held = self.database[LEASES].find_one({"_id": lease.name})
        if held is None or int(held["token"]) != lease.token:
            raise StaleLease(f"lease {lease.name!r} token {lease.token} was superseded")

    #: Documents ``records`` reads per query (it pages through a type).
    records_page = 1000

    def records(self, aggregate_type: str) -> Iterator[AggregateRecord]:
        """The records of one type in pages of ``records_page``, by ``_id`` (keyset): one
        page in memory at a time, and no cursor held between pages."""
        wanted: dict[str, Any] = {}
        while True:
            with self._guard, _translated():
                documents = list(self.database[aggregate_type].find(wanted)
                                 .sort("_id", 1).limit(self.records_page))
                records = self._records_of(aggregate_type, documents)
            yield from records
            if len(documents) < self.records_page:
                return
            wanted = {"_id": {"$gt": documents[-1]["_id"]}}

    def aggregate_page(self, aggregate_type: str, *, completed: bool = False,
                       after: str | None = None, limit: int = 50,
                       id_prefix: str = "") -> list[AggregateRecord]:
        """One query on ``_id`` (its index), without the processed entries."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        ids: dict[str, Any] = {}
        if after is not None:
            ids["$gt"] = after
        if id_prefix:
            ids["$regex"] = "^" + re.escape(id_prefix)
        wanted: dict[str, Any] = {"version": {"$gt": 0},
                                  "completed": True if completed else {"$ne": True}}
        if ids:
            wanted["_id"] = ids
        with self._guard, _translated():
            documents = list(self.database[aggregate_type].find(wanted, {"processed": 0})
                             .sort("_id", 1).limit(limit))
        return [_record_from(aggregate_type, document, {}) for document in documents]

    # -- delayed messages ---------------------------------------------------------------

    @property
    def _delayed_messages(self) -> Any:
        return self.database[SCHEDULED]

    def _schedule(self, envelope: Envelope, due: datetime.datetime,
                  owner: str | None) -> None:
        with self._guard, _translated():
            self._delayed_messages.update_one(
                {"_id": _scheduled_id(envelope)},
                {"$setOnInsert": {"envelope": envelope.to_record(), "due": due,
                                  "leased_until": None, "owner": owner}},
                upsert=True,
            )

    def _claim_due(
        self, now: datetime.datetime, *, limit: int, lease: float, owner: str | None
    ) -> list[Envelope]:
        until = now + datetime.timedelta(seconds=lease)
        claimed: list[Envelope] = []
        wanted: dict[str, Any] = {
            "due": {"$lte": now},
            "$or": [{"leased_until": None}, {"leased_until": {"$lte": now}}]}
        if owner is not None:  # "None" also matches documents written before owners
            wanted["owner"] = {"$in": [owner, None]}
        taken: list[Any] = []  # a lease too short to outlive this loop must not repeat one
        with self._guard, _translated():
            while len(claimed) < limit:
                document = self._delayed_messages.find_one_and_update(
                    {**wanted, "_id": {"$nin": taken}} if taken else wanted,
                    {"$set": {"leased_until": until}},
                    sort=[("due", pymongo.ASCENDING)],
                )
                if document is None:
                    break
                taken.append(document["_id"])
                claimed.append(Envelope.from_record(document["envelope"]))
        return claimed

    def forget_scheduled(self, envelopes: Sequence[Envelope]) -> None:
        if not envelopes:
            return
        with self._guard, _translated():
            self._delayed_messages.delete_many(
                {"_id": {"$in": [_scheduled_id(envelope) for envelope in envelopes]}})

    def note_scheduled_failure(self, envelope: Envelope) -> int:
        with self._guard, _translated():
            document = self._delayed_messages.find_one_and_update(
                {"_id": _scheduled_id(envelope)}, {"$inc": {"attempts": 1}},
                projection={"attempts": True}, return_document=pymongo.ReturnDocument.AFTER)
        return 0 if document is None else int(document["attempts"])

    def write_audit(self, records: Sequence[AuditRecord]) -> None:
        if not records:
            return
        documents = [{"endpoint": r.endpoint, "handler": r.handler, "message_id": r.message_id,
                      "message_type": r.message_type, "outcome": r.outcome,
                      "time_sent": r.time_sent, "recorded_at": r.recorded_at,
                      "bucket": r.bucket} for r in records]
        with self._guard, _translated():
            self.database[AUDIT].insert_many(documents)  # inserts only: no bulk updates

    def read_audit(self, *, part: int = 0, parts: int = 1) -> Iterator[AuditRecord]:
        with self._guard, _translated():
            # $in over the part's buckets rather than $mod: mongomock has no $mod, and an
            # index on bucket serves $in on a real server.
            buckets = [b for b in range(AUDIT_BUCKETS) if b % parts == part]
            documents = list(self.database[AUDIT].find(
                {"bucket": {"$in": buckets}}, {"_id": 0, "bucket": 0}))
        return iter([AuditRecord(**{**d, "time_sent": _utc(d.get("time_sent")),
                                    "recorded_at": _utc(d["recorded_at"])})
                     for d in documents])

    # -- event journal ------------------------------------------------------------------

    @property
    def _journal(self) -> Any:
        return self.database[JOURNAL]

    def append_journal(self, entries: Sequence[JournalEntry]) -> None:
        if not entries:
            return
        with self._guard, _translated():
            if not self._journal_indexed:
                self._index_journal()
            for entry in entries:
                self._append_one(entry)

    def _append_one(self, entry: JournalEntry) -> None:
        """Insert ``entry`` at the position after the newest, unless it is journaled."""
        for _ in range(_APPEND_TRIES):
            if self._journal.find_one({"message_id": entry.message_id}, {"_id": 1}):
                return  # journaled before (or just now, by the appender that beat us)
            try:
                self._journal.insert_one(
                    _journal_document(entry, self._newest_position() + 1, utc_now()))
                return
            except pymongo.errors.DuplicateKeyError:
                continue  # another appender took the position, or journaled this message
        raise StorageUnavailable(
            f"could not append {entry.message_id} to the journal: {_APPEND_TRIES} other "
            "appends took the next position first")

    def _newest_position(self) -> int:
        newest = self._journal.find_one({}, {"_id": 1}, sort=[("_id", pymongo.DESCENDING)])
        return int(newest["_id"]) if newest else 0

    def _oldest_position(self) -> int | None:
        oldest = self._journal.find_one({}, {"_id": 1}, sort=[("_id", pymongo.ASCENDING)])
        return int(oldest["_id"]) if oldest else None

    def _first_position_since(self, moment: datetime.datetime) -> int | None:
        """The position of the first entry recorded at or after ``moment``."""
        found = self._journal.find_one({"recorded_at": {"$gte": moment}}, {"_id": 1},
                                       sort=[("_id", pymongo.ASCENDING)])
        return int(found["_id"]) if found else None

    def read_journal(self, *, after: int, limit: int = 500) -> list[JournalEntry]:
        with self._guard, _translated():
            documents = list(self._journal.find({"_id": {"$gt": after}})
                             .sort("_id", pymongo.ASCENDING).limit(limit))
        return [_journal_entry(document) for document in documents]

    def journal_bounds(self) -> JournalBounds:
        with self._guard, _translated():
            newest = self._newest_position()
            oldest = self._oldest_position()
        return JournalBounds(oldest, newest, journal_size(oldest, newest))

    def journal_position_at(self, moment: datetime.datetime) -> int | None:
        with self._guard, _translated():
            newest = self._newest_position()  # first: see storage.journal.resume_position
            first_since = self._first_position_since(moment)
            oldest = self._oldest_position()
        return resume_position(newest=newest, oldest=oldest, first_since=first_since)

    def trim_journal(self, before: datetime.datetime, *, batch: int = 1000) -> int:
        with self._guard, _translated():
            # The oldest entries up to the first recorded since ``before``, never the newest.
            newest = self._newest_position()
            first_since = self._first_position_since(before)
            first_kept = newest if first_since is None else min(newest, first_since)
            doomed = [document["_id"] for document in self._journal.find(
                {"_id": {"$lt": first_kept}}, {"_id": 1}).sort(
                "_id", pymongo.ASCENDING).limit(batch)]
            if not doomed:
                return 0
            return int(self._journal.delete_many({"_id": {"$in": doomed}}).deleted_count)

    def _index_journal(self) -> None:
        # No TTL index on recorded_at: it could delete the newest entry, and positions
        # would start again from 1. trim_journal does the retention and keeps the newest.
        self._journal.create_index([("message_id", pymongo.ASCENDING)], unique=True)
        self._journal.create_index([("recorded_at", pymongo.ASCENDING)])
        self._journal_indexed = True

    def reserve_rate(self, name: str, *, interval: float, burst: int,
                     now: datetime.datetime) -> float:
        moment = now.timestamp()

        def change(document: dict[str, Any] | None) -> tuple[dict[str, Any], float]:
            tat, wait = rate_wait(moment if document is None else document["tat"],
                                  now=moment, interval=interval, burst=burst)
            return {"tat": tat}, wait

        return self._compare_and_set(f"rate:{name}", change)

    def acquire_slot(self, name: str, *, slots: int, holder: str, lease: float,
                     now: datetime.datetime) -> bool:
        moment = now.timestamp()

        def change(document: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
            held = [entry for entry in (document or {}).get("holders", [])
                    if entry["expires"] > moment and entry["holder"] != holder]
            mine = any(entry["holder"] == holder
                       for entry in (document or {}).get("holders", []))
            if not mine and len(held) >= slots:
                return {"holders": held}, False
            return {"holders": [*held, {"holder": holder, "expires": moment + lease}]}, True

        return self._compare_and_set(f"slots:{name}", change)

    def release_slot(self, name: str, holder: str) -> None:
        with self._guard, _translated():
            self.database[LIMITS].update_one({"_id": f"slots:{name}"},
                                             {"$pull": {"holders": {"holder": holder}}})

    def put_payload(self, payload_id: str, body: bytes, *,
                    keep_until: datetime.datetime) -> None:
        # No transaction: the chunks are written one by one under ids derived from the
        # payload's, each replacing its earlier self, so writing again completes a write
        # a crash interrupted; a collection running meanwhile deletes only chunks whose
        # time has not been moved yet, and this write puts them back.
        payloads = self.database[PAYLOADS]
        chunks = [body[start:start + PAYLOAD_CHUNK_BYTES]
                  for start in range(0, len(body), PAYLOAD_CHUNK_BYTES)] or [b""]
        with self._guard, _translated():
            first = payloads.find_one({"_id": f"{payload_id}.0"}, {"keep_until": 1})
            until = keep_until.timestamp()
            if first is not None:
                until = max(until, float(first["keep_until"]))
            for number, chunk in enumerate(chunks):
                # $set, not a replacement: the first chunk's holds stay
                payloads.update_one(
                    {"_id": f"{payload_id}.{number}"},
                    {"$set": {"payload": payload_id, "n": number, "count": len(chunks),
                              "data": bson.Binary(chunk), "keep_until": until}}, upsert=True)

    def get_payload(self, payload_id: str) -> bytes | None:
        with self._guard, _translated():
            chunks = list(self.database[PAYLOADS].find({"payload": payload_id}).sort(
                "n", pymongo.ASCENDING))
        if not chunks or [chunk["n"] for chunk in chunks] != list(range(chunks[0]["count"])):
            return None
        return b"".join(bytes(chunk["data"]) for chunk in chunks)

    def collect_payloads(self, now: datetime.datetime, *, batch: int = 100) -> int:
        # The first chunk carries the holds: it is removed first, in one conditional
        # delete (no hold, its time passed), so a hold and a collection never both win;
        # the other chunks go after it, those whose time a write has not moved meanwhile.
        moment = now.timestamp()
        unheld = {"keep_until": {"$lt": moment}, "holds.0": {"$exists": False}}
        payloads = self.database[PAYLOADS]
        collected = 0
        with self._guard, _translated():
            doomed = [document["payload"] for document in payloads.find(
                {"n": 0, **unheld}, {"payload": 1}).limit(batch)]
            for payload_id in doomed:
                if payloads.delete_one({"_id": f"{payload_id}.0", **unheld}).deleted_count:
                    collected += 1
                    payloads.delete_many({"payload": payload_id, "n": {"$gt": 0},
                                          "keep_until": {"$lt": moment}})
        return collected

    def hold_payload(self, payload_id: str, hold_id: str) -> bool:
        with self._guard, _translated():
            return bool(self.database[PAYLOADS].update_one(
                {"_id": f"{payload_id}.0"}, {"$addToSet": {"holds": hold_id}}).matched_count)

    def release_payload(self, hold_id: str, *, keep_until: datetime.datetime) -> bool:
        payloads = self.database[PAYLOADS]
        until = keep_until.timestamp()
        with self._guard, _translated():
            first = payloads.find_one_and_update(
                {"holds": hold_id}, {"$pull": {"holds": hold_id}, "$max": {"keep_until": until}},
                projection={"payload": 1})
            if first is None:
                return False
            payloads.update_many({"payload": first["payload"], "n": {"$gt": 0}},
                                 {"$max": {"keep_until": until}})
        return True

    def _compare_and_set(
        self, key: str,
        change: Callable[[dict[str, Any] | None], tuple[dict[str, Any], T]],
    ) -> T:
        """Apply ``change`` (the document of ``key`` or None -> its new fields and a result)
        atomically: read, then write only if nobody wrote in between (a ``version`` field),
        again after a lost race. No transaction: one document, conditional writes."""
        limits = self.database[LIMITS]
        while True:
            with self._guard, _translated():
                document = limits.find_one({"_id": key})
                fields, result = change(document)
                if document is None:
                    try:
                        limits.insert_one({"_id": key, "version": 1, **fields})
                    except pymongo.errors.DuplicateKeyError:
                        continue
                    return result
                written = limits.update_one(
                    {"_id": key, "version": document["version"]},
                    {"$set": {**fields, "version": document["version"] + 1}})
                if written.modified_count:
                    return result

    def report_status(self, report: StatusReport) -> None:
        document = {"endpoint": report.endpoint, "instance": report.instance,
                    "counters": dict(report.counters), "started_at": report.started_at,
                    "updated_at": report.updated_at, "stopped": report.stopped,
                    "problems": dict(report.problems)}
        with self._guard, _translated():
            self.database[STATUS].replace_one(
                {"_id": f"{report.endpoint}|{report.instance}"}, document, upsert=True)

    def forget_status(self, endpoint: str, *, updated_before: datetime.datetime) -> int:
        with self._guard, _translated():
            return int(self.database[STATUS].delete_many(
                {"endpoint": endpoint, "updated_at": {"$lt": updated_before}}).deleted_count)

    def status_reports(self, endpoint: str) -> list[StatusReport]:
        with self._guard, _translated():
            documents = list(self.database[STATUS].find({"endpoint": endpoint}))
        reports = [StatusReport(
            endpoint=d["endpoint"], instance=d["instance"], counters=d["counters"],
            started_at=_utc(d["started_at"]) or d["started_at"],
            updated_at=_utc(d["updated_at"]) or d["updated_at"], stopped=d["stopped"],
            problems=d.get("problems") or {},
        ) for d in documents]
        return sorted(reports, key=lambda report: report.updated_at, reverse=True)

    def park(self, parked: ParkedMessage) -> None:
        document = {"endpoint": parked.endpoint, "source": parked.source,
                    "parked_at": parked.parked_at,
                    "envelope": bson.Binary(envelope_bytes(parked.envelope)),
                    "body": bson.Binary(body_bytes(parked.envelope))}
        with self._guard, _translated():
            self.database[PARKED].update_one({"_id": parked.parked_id},
                                             {"$setOnInsert": document}, upsert=True)

    def parked_messages(self, endpoint: str) -> list[ParkedMessage]:
        with self._guard, _translated():
            documents = list(self.database[PARKED].find({"endpoint": endpoint})
                             .sort("parked_at", pymongo.ASCENDING))
        return [_parked_of(d) for d in documents]

    def unpark(self, parked_ids: Sequence[str]) -> int:
        with self._guard, _translated():
            return int(self.database[PARKED].delete_many(
                {"_id": {"$in": list(parked_ids)}}).deleted_count)

    def parked_page(self, endpoint: str | None, *, after: ParkedKey | None = None,
                    limit: int = 100) -> list[ParkedMessage]:
        query: dict[str, Any] = {} if endpoint is None else {"endpoint": endpoint}
        if after is not None:
            query["$or"] = [{"parked_at": {"$gt": after[0]}},
                            {"parked_at": after[0], "_id": {"$gt": after[1]}}]
        with self._guard, _translated():
            documents = list(self.database[PARKED].find(query).sort(
                [("parked_at", pymongo.ASCENDING), ("_id", pymongo.ASCENDING)]).limit(limit))
        return [_parked_of(d) for d in documents]

    def parked_by_ids(self, endpoint: str, parked_ids: Sequence[str]) -> list[ParkedMessage]:
        with self._guard, _translated():
            documents = list(self.database[PARKED].find(
                {"_id": {"$in": list(parked_ids)}, "endpoint": endpoint}))
        return sorted((_parked_of(d) for d in documents), key=parked_key)

    def migrate(self) -> None:
        """Create the indexes: delayed messages by due time, the journal's, each aggregate
        collection's undispatched index, and with ``retention`` the inbox's TTL index."""
        with self._guard, _translated():
            self._delayed_messages.create_index([("due", pymongo.ASCENDING)])
            self._index_journal()
            mongo_spill.index(self.database)
            self._spill_indexed = True
            self.database[PAYLOADS].create_index([("payload", pymongo.ASCENDING),
                                                  ("n", pymongo.ASCENDING)])
            self.database[PAYLOADS].create_index([("n", pymongo.ASCENDING),
                                                  ("keep_until", pymongo.ASCENDING)])
            self.database[PAYLOADS].create_index([("holds", pymongo.ASCENDING)], sparse=True)
            self._own_existing_collections()
            if self.retention is not None:
                # TTL on the inbox (one document per record), only once dispatched. Verified
                # with mongomock's index options only: mongomock never deletes by TTL.
                self.database[INBOX].create_index(
                    [("processed.at", pymongo.ASCENDING)], name=RETENTION_INDEX,
                    expireAfterSeconds=int(self.retention.total_seconds()),
                    partialFilterExpression={"processed.dispatched": True},
                )

    def verify(self) -> None:
        """Check at start that MongoDB answers, then :meth:`migrate`. A refused login or
        privilege fails the start with :class:`~idembus.errors.ConfigurationError` (exit status
        2, one line): no wait cures it."""
        try:
            with self._guard, _translated():
                self.client.admin.command("ping")
            self.migrate()
        except StorageAccessDenied as refused:
            raise ConfigurationError(
                f"{refused}; check the user, password and authSource of the connection "
                "string, and that the user's roles allow reading, writing and creating "
                "indexes in the database") from refused

    def close(self) -> None:
        if self._owns_client:
            self.client.close()


#: Server error codes that only an operator cures: Unauthorized, AuthenticationFailed.
_ACCESS_CODES = frozenset({13, 18})
#: Server error codes that pass: ExceededTimeLimit, interrupted at shutdown or by a
#: replica-set change, shutting down, stepped down, not primary, lock timeout.
_TRANSIENT_CODES = frozenset({50, 91, 189, 262, 10107, 11600, 11602, 13435, 13436, 24})


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    """pymongo's errors by the failure taxonomy: connection failures, timeouts and the
    server's retryable codes are outages; a refused login or privilege blocks the endpoint;
    everything else pymongo or the server refuses (a document too large, a key BSON cannot
    hold) is this message's own. A duplicate key passes through: callers read it as a lost
    race."""
    try:
        yield
    except pymongo.errors.DuplicateKeyError:
        raise
    except pymongo.errors.ConnectionFailure as exc:
        raise StorageUnavailable(f"MongoDB is unreachable: {redact(str(exc))}") from exc
    except pymongo.errors.OperationFailure as exc:
        text = f"MongoDB refused the operation (code {exc.code}): {redact(str(exc))}"
        if exc.code in _ACCESS_CODES:
            raise StorageAccessDenied(text) from exc
        if exc.code in _TRANSIENT_CODES or exc.has_error_label("RetryableWriteError"):
            raise StorageUnavailable(text) from exc
        raise StorageRefused(text) from exc
    except (pymongo.errors.PyMongoError, bson.errors.BSONError, OverflowError) as exc:
        # OverflowError: BSON's encoder on an integer beyond 64 bits.
        raise StorageRefused(f"MongoDB refused the data: {redact(str(exc))}") from exc


#: The taxonomy of pymongo's errors as storage errors, for others at the same seam (the
#: MongoDB transport).
translated = _translated


def _is_aggregate(document: Mapping[str, Any] | None) -> bool:
    """True if ``document`` has the shape of an aggregate idembus committed: an integer
    version and processed entries with a key and a dispatched flag."""
    if document is None or isinstance(document.get("version"), bool):
        return False
    processed = document.get("processed")
    return (isinstance(document.get("version"), int) and isinstance(processed, list)
            and bool(processed) and isinstance(processed[0], Mapping)
            and {"key", "dispatched"} <= processed[0].keys())


def _scheduled_id(envelope: Envelope) -> str:
    return "|".join(scheduled_key(envelope))


def _record_from(aggregate_type: str, document: Mapping[str, Any],
                 spilled: Mapping[str, tuple[list[Mapping[str, Any]], list[str]]]
                 ) -> AggregateRecord:
    processed = {entry["key"]: _entry_from(entry, spilled)
                 for entry in document.get("processed", ())}
    # Documents written before updated_at existed: the newest remembered commit.
    last_commit = max((entry.at for entry in processed.values() if entry.at is not None),
                      default=None)
    completed = bool(document.get("completed", False))
    return AggregateRecord(
        aggregate_type,
        document["_id"],
        version=document["version"],
        state=None if completed else document.get("state"),
        processed=processed,
        updated_at=_utc(document.get("updated_at")) or last_commit,
        completed=completed,
        state_version=document.get("state_version"),
        final_state=document.get("state") if completed else None,
    )


def _entry_from(entry: Mapping[str, Any],
                spilled: Mapping[str, tuple[list[Mapping[str, Any]], list[str]]]
                ) -> ProcessedMessage:
    """One processed entry, its messages inline or from its side documents."""
    spill = entry.get("spill")
    records, ids = (spilled.get(spill, ([], [])) if isinstance(spill, str)
                    else (entry.get("outgoing", ()), entry.get("ids", ())))
    size = entry.get("lean" if entry.get("bodies") is False else "bytes")
    return ProcessedMessage(
        key=entry["key"],
        outgoing=tuple(Envelope.from_record(o) for o in records),
        outgoing_ids=tuple(ids),
        dispatched=bool(entry.get("dispatched", False)),
        at=_utc(entry.get("at")),
        stored_bytes=size if isinstance(size, int) else len(bson.encode(entry)),
        message_type=entry.get("type"),
    )


def _inline_bytes(entries: Sequence[ProcessedMessage]) -> int:
    """The bytes ``entries`` take on their aggregate's document."""
    return sum(entry.stored_bytes for entry in entries)


def _journal_document(entry: JournalEntry, position: int,
                      now: datetime.datetime) -> dict[str, Any]:
    return {"_id": position, "message_id": entry.message_id,
            "message_type": entry.message_type, "aggregate_type": entry.aggregate_type,
            "aggregate_id": entry.aggregate_id, "parents": list(entry.parents),
            "headers": dict(entry.headers), "body": entry.body, "recorded_at": now}


def _journal_entry(document: Mapping[str, Any]) -> JournalEntry:
    return JournalEntry(
        message_id=document["message_id"],
        message_type=document["message_type"],
        headers=dict(document["headers"]),
        body=document["body"],
        aggregate_type=document.get("aggregate_type"),
        aggregate_id=document.get("aggregate_id"),
        parents=tuple(document.get("parents", ())),
        recorded_at=_utc(document["recorded_at"]),
        position=int(document["_id"]),
    )


def _utc(moment: datetime.datetime | None) -> datetime.datetime | None:
    """Stored times are UTC; some clients (mongomock, tz_aware=False) return them naive."""
    if moment is not None and moment.tzinfo is None:
        return moment.replace(tzinfo=datetime.timezone.utc)
    return moment


def _parked_of(document: Mapping[str, Any]) -> ParkedMessage:
    """A parked message as the collection holds it."""
    return ParkedMessage(document["_id"], document["endpoint"], document["source"],
                         envelope_from(bytes(document["envelope"]), bytes(document["body"])),
                         _utc(document["parked_at"]) or document["parked_at"])
