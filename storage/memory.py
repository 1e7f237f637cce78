"""In-memory storage: the contract without a database, for unit tests and the handler
test helper. Thread-safe; raises exactly the errors the real backends raise."""

from __future__ import annotations

import bisect
import copy
import dataclasses
import datetime
import heapq
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..envelope import Envelope, utc_now
from .base import (
    DEFAULT_PROCESSED_WINDOW,
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
    ProcessedMessage,
    StatusReport,
    Storage,
    Undispatched,
    committed_by,
    parked_key,
    rate_wait,
    scheduled_key,
)
from .errors import StaleLease
from .journal import resume_position


class MemoryStorage(Storage, LimitStore, PayloadStore):
    """Storage in this process's memory: dicts guarded by one lock (the default storage).

    Nothing survives the process and no other process sees it: for trials and tests.

    Parameters
    ----------
    processed_window:
        How many processed messages each aggregate remembers for deduplication (the
        newest; entries whose messages were not dispatched are always kept).
    retention:
        Delete dispatched processed records and completed sagas' tombstones once older
        than this (``None``: keep them).
    """

    process_local = True

    def __init__(
        self,
        *,
        processed_window: int = DEFAULT_PROCESSED_WINDOW,
        retention: datetime.timedelta | None = None,
    ) -> None:
        super().__init__(processed_window=processed_window)
        #: Processed entries older than this are forgotten (at the aggregate's next commit).
        self.retention = retention
        self._records: dict[tuple[str, str], AggregateRecord] = {}
        self._scheduled: dict[tuple[str, str, str], _Scheduled] = {}
        self._status: dict[tuple[str, str], StatusReport] = {}
        self._leases: dict[str, Lease] = {}
        self._audit: list[AuditRecord] = []
        self._journal: list[JournalEntry] = []
        self._journaled: set[str] = set()
        self._parked: dict[str, ParkedMessage] = {}
        self._rates: dict[str, float] = {}
        self._slots: dict[str, dict[str, float]] = {}  # name -> holder -> lease ends
        self._payloads: dict[str, tuple[bytes, datetime.datetime]] = {}  # id -> body, until
        self._payload_holds: dict[str, str] = {}  # hold id -> payload id
        self._lock = threading.Lock()

    def load(
        self, aggregate_type: str, aggregate_id: str, key: str | None = None
    ) -> AggregateRecord:
        lock = self._lock  # acquired and released, not a with block: the hot path's
        lock.acquire()     # three per message look no __enter__ and __exit__ up
        try:
            record = self._records.get((aggregate_type, aggregate_id))
        finally:
            lock.release()
        if record is None:
            return _record(aggregate_type, aggregate_id, 0, None, {}, None, False, None, None)
        # The states are the mutable parts a caller could change; entries are immutable.
        return _with_processed(record, dict(record.processed), state=_copied(record.state),
                               final_state=_copied(record.final_state))

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
        address = (loaded.aggregate_type, loaded.aggregate_id)
        outgoing = tuple(outgoing)
        entry = _entry(key, outgoing, tuple([envelope.message_id for envelope in outgoing]),
                       not outgoing, utc_now(), 0, message_type)
        kept = _copied(dict(state)) if state is not None else None
        lock = self._lock
        lock.acquire()
        try:
            current = self._records.get(address)
            current_version = current.version if current else 0
            accepted = current_version == loaded.version and (
                current is None or key not in current.processed
            )
            if accepted:
                processed = dict(current.processed) if current else {}
                processed[key] = entry
                processed = self._remembered(processed)
                self._records[address] = _record(
                    loaded.aggregate_type, loaded.aggregate_id, current_version + 1,
                    None if completed else kept, processed, entry.at, completed,
                    state_version, kept if completed else None)
                return
        finally:
            lock.release()
        raise self._refusal(loaded.aggregate_type, loaded.aggregate_id, key)

    def _remembered(self, processed: dict[str, ProcessedMessage]) -> dict[str, ProcessedMessage]:
        """``processed`` (the newest entry last) within the window and the retention: the
        newest ``processed_window`` entries, and every entry whose messages were never
        dispatched whatever its age, for the outbox to send."""
        if len(processed) == 1:  # the newest entry, always kept (an aggregate's first)
            return processed
        keys = list(processed)
        recent = set(keys[-(self.processed_window or len(keys)):])
        horizon = utc_now() - self.retention if self.retention is not None else None
        return {
            key: entry for key, entry in processed.items()
            if not entry.dispatched or key == keys[-1] or (
                key in recent and (horizon is None or entry.at is None or entry.at >= horizon))
        }

    def mark_dispatched(self, aggregate_type: str, aggregate_id: str, key: str, *,
                        keep_bodies: bool = False, lease: Lease | None = None,
                        journal: Sequence[JournalEntry] = ()) -> None:
        if journal:
            self.append_journal(journal)
        address = (aggregate_type, aggregate_id)
        lock = self._lock
        lock.acquire()
        try:
            if lease is not None:
                self._check_fence(lease)
            record = self._records.get(address)
            if record is None or key not in record.processed:
                return
            entry = record.processed[key]
            processed = dict(record.processed)
            processed[key] = _entry(key, entry.outgoing if keep_bodies else (),
                                    entry.outgoing_ids, True, entry.at, 0,
                                    entry.message_type)
            self._records[address] = _with_processed(record, processed)
        finally:
            lock.release()

    def note_repair_failure(self, aggregate_type: str, aggregate_id: str, key: str) -> None:
        address = (aggregate_type, aggregate_id)
        with self._lock:
            record = self._records.get(address)
            if record is None or key not in record.processed:
                return
            processed = dict(record.processed)
            processed[key] = dataclasses.replace(processed[key],
                                                 attempts=processed[key].attempts + 1)
            self._records[address] = dataclasses.replace(record, processed=processed)

    def expire(self, now: datetime.datetime, *, batch: int = 1000) -> int:
        if self.retention is None:
            return 0
        horizon = now - self.retention
        removed = 0
        with self._lock:
            for address, record in list(self._records.items()):
                if removed >= batch:
                    break
                if _expired_tombstone(record, horizon):
                    del self._records[address]
                    removed += 1
                    continue
                old = [key for key, entry in record.processed.items()
                       if entry.dispatched and entry.at is not None and entry.at < horizon]
                old = old[:batch - removed]
                if not old:
                    continue
                kept = {k: e for k, e in record.processed.items() if k not in old}
                self._records[address] = dataclasses.replace(record, processed=kept)
                removed += len(old)
        return removed

    def undispatched(self, *, committed_before: datetime.datetime, limit: int = 100,
                     endpoint: str | None = None) -> list[Undispatched]:
        with self._lock:
            found = [
                (entry.at, Undispatched(agg_type, agg_id, entry.key, entry.outgoing,
                                        entry.attempts))
                for (agg_type, agg_id), record in self._records.items()
                for entry in record.processed.values()
                if not entry.dispatched and entry.at is not None and entry.at < committed_before
                and (endpoint is None or committed_by(entry.outgoing) in (endpoint, None))
            ]
        return [item for _, item in sorted(found, key=lambda pair: pair[0])][:limit]

    def acquire_lease(self, name: str, owner: str, *, ttl: float,
                      now: datetime.datetime) -> Lease | None:
        with self._lock:
            held = self._leases.get(name)
            if held is not None and held.owner != owner and held.expires_at > now:
                return None
            token = held.token if held is not None and held.owner == owner else (
                (held.token if held else 0) + 1)
            lease = Lease(name, owner, token, now + datetime.timedelta(seconds=ttl))
            self._leases[name] = lease
            return lease

    def release_lease(self, lease: Lease) -> None:
        with self._lock:
            held = self._leases.get(lease.name)
            if held is not None and held.token == lease.token and held.owner == lease.owner:
                self._leases[lease.name] = Lease(lease.name, lease.owner, lease.token,
                                                 datetime.datetime.min.replace(
                                                     tzinfo=datetime.timezone.utc))

    def _check_fence(self, lease: Lease) -> None:
        held = self._leases.get(lease.name)
        if held is None or held.token != lease.token:
            raise StaleLease(f"lease {lease.name!r} token {lease.token} was superseded"
                             f" by {held.token if held else 'nobody'}")

    #: Records ``records`` copies per look under the lock (it pages through a type).
    records_page = 1000

    def records(self, aggregate_type: str) -> Iterator[AggregateRecord]:
        """The records of one type in pages of ``records_page``, by id (keyset): one page
        is copied at a time, and the lock is not held between pages."""
        after: str | None = None
        while True:
            with self._lock:
                ids = heapq.nsmallest(self.records_page, (
                    aggregate_id for (kind, aggregate_id) in self._records
                    if kind == aggregate_type and (after is None or aggregate_id > after)))
                page = copy.deepcopy([self._records[aggregate_type, i] for i in ids])
            for record in page:
                yield dataclasses.replace(record,
                                          updated_at=record.updated_at or _last_commit(record))
            if len(ids) < self.records_page:
                return
            after = ids[-1]

    def _schedule(self, envelope: Envelope, due: datetime.datetime,
                  owner: str | None) -> None:
        with self._lock:
            self._scheduled.setdefault(
                scheduled_key(envelope), _Scheduled(envelope, due, owner))

    def _claim_due(
        self, now: datetime.datetime, *, limit: int, lease: float, owner: str | None
    ) -> list[Envelope]:
        with self._lock:
            due = sorted(
                (entry for entry in self._scheduled.values()
                 if entry.due <= now and (entry.leased_until is None or entry.leased_until <= now)
                 and (owner is None or entry.owner in (owner, None))),
                key=lambda entry: entry.due,
            )[:limit]
            for entry in due:
                entry.leased_until = now + datetime.timedelta(seconds=lease)
            return [entry.envelope for entry in due]

    def forget_scheduled(self, envelopes: Sequence[Envelope]) -> None:
        with self._lock:
            for envelope in envelopes:
                self._scheduled.pop(scheduled_key(envelope), None)

    def note_scheduled_failure(self, envelope: Envelope) -> int:
        with self._lock:
            entry = self._scheduled.get(scheduled_key(envelope))
            if entry is None:
                return 0
            entry.attempts += 1
            return entry.attempts

    def _overdue(self, before: datetime.datetime) -> list[Overdue]:
        waiting: list[tuple[str | None, str, datetime.datetime]] = []
        with self._lock:
            waiting.extend(
                (committed_by(entry.outgoing), OVERDUE_ENTRIES, entry.at)
                for record in self._records.values() for entry in record.processed.values()
                if not entry.dispatched and entry.at is not None and entry.at < before)
            waiting.extend((entry.owner, OVERDUE_DELAYED, entry.due)
                           for entry in self._scheduled.values() if entry.due < before)
        groups: dict[tuple[str | None, str], list[datetime.datetime]] = {}
        for endpoint, kind, since in waiting:
            groups.setdefault((endpoint, kind), []).append(since)
        return [Overdue(endpoint, kind, len(times), min(times))
                for (endpoint, kind), times in groups.items()]

    def write_audit(self, records: Sequence[AuditRecord]) -> None:
        with self._lock:
            self._audit.extend(records)

    def read_audit(self, *, part: int = 0, parts: int = 1) -> Iterator[AuditRecord]:
        with self._lock:
            chosen = [r for r in self._audit if r.bucket % parts == part]
        return iter(chosen)

    def append_journal(self, entries: Sequence[JournalEntry]) -> None:
        with self._lock:
            for entry in entries:
                if entry.message_id in self._journaled:
                    continue
                newest = self._journal[-1].position if self._journal else 0
                self._journal.append(dataclasses.replace(
                    entry, position=newest + 1, recorded_at=utc_now()))
                self._journaled.add(entry.message_id)

    def read_journal(self, *, after: int, limit: int = 500) -> list[JournalEntry]:
        with self._lock:
            start = bisect.bisect_right(self._journal, after, key=lambda e: e.position)
            return self._journal[start:start + limit]

    def journal_bounds(self) -> JournalBounds:
        with self._lock:
            if not self._journal:
                return JournalBounds(None, 0, 0)
            return JournalBounds(self._journal[0].position, self._journal[-1].position,
                                 len(self._journal))

    def journal_position_at(self, moment: datetime.datetime) -> int | None:
        with self._lock:
            first_since = next((e.position for e in self._journal if e.recorded_at is not None
                                and e.recorded_at >= moment), None)
            return resume_position(
                newest=self._journal[-1].position if self._journal else 0,
                oldest=self._journal[0].position if self._journal else None,
                first_since=first_since)

    def trim_journal(self, before: datetime.datetime, *, batch: int = 1000) -> int:
        with self._lock:
            removable = self._journal[:-1][:batch]
            count = 0
            for entry in removable:
                if entry.recorded_at is None or entry.recorded_at >= before:
                    break
                count += 1
            for entry in self._journal[:count]:
                self._journaled.discard(entry.message_id)
            del self._journal[:count]
            return count

    def park(self, parked: ParkedMessage) -> None:
        with self._lock:
            self._parked.setdefault(parked.parked_id, parked)

    def parked_messages(self, endpoint: str) -> list[ParkedMessage]:
        with self._lock:
            found = [p for p in self._parked.values() if p.endpoint == endpoint]
        return sorted(found, key=lambda parked: parked.parked_at)

    def unpark(self, parked_ids: Sequence[str]) -> int:
        with self._lock:
            return sum(self._parked.pop(parked_id, None) is not None for parked_id in parked_ids)

    def parked_page(self, endpoint: str | None, *, after: ParkedKey | None = None,
                    limit: int = 100) -> list[ParkedMessage]:
        with self._lock:
            found = [p for p in self._parked.values()
                     if (endpoint is None or p.endpoint == endpoint)
                     and (after is None or parked_key(p) > after)]
        return heapq.nsmallest(limit, found, key=parked_key)

    def parked_by_ids(self, endpoint: str, parked_ids: Sequence[str]) -> list[ParkedMessage]:
        with self._lock:
            found = [self._parked[i] for i in dict.fromkeys(parked_ids)
                     if i in self._parked and self._parked[i].endpoint == endpoint]
        return sorted(found, key=parked_key)

    def reserve_rate(self, name: str, *, interval: float, burst: int,
                     now: datetime.datetime) -> float:
        moment = now.timestamp()
        with self._lock:
            self._rates[name], wait = rate_wait(self._rates.get(name, moment), now=moment,
                                                interval=interval, burst=burst)
        return wait

    def acquire_slot(self, name: str, *, slots: int, holder: str, lease: float,
                     now: datetime.datetime) -> bool:
        moment = now.timestamp()
        with self._lock:
            held = self._slots.setdefault(name, {})
            for other, ends in list(held.items()):
                if ends <= moment:
                    del held[other]
            if holder not in held and len(held) >= slots:
                return False
            held[holder] = moment + lease
            return True

    def release_slot(self, name: str, holder: str) -> None:
        with self._lock:
            self._slots.get(name, {}).pop(holder, None)

    def put_payload(self, payload_id: str, body: bytes, *,
                    keep_until: datetime.datetime) -> None:
        with self._lock:
            kept = self._payloads.get(payload_id)
            self._payloads[payload_id] = (
                bytes(body), keep_until if kept is None else max(kept[1], keep_until))

    def get_payload(self, payload_id: str) -> bytes | None:
        with self._lock:
            kept = self._payloads.get(payload_id)
        return None if kept is None else kept[0]

    def collect_payloads(self, now: datetime.datetime, *, batch: int = 100) -> int:
        with self._lock:
            held = set(self._payload_holds.values())
            doomed = [key for key, (_, until) in self._payloads.items()
                      if until < now and key not in held][:batch]
            for key in doomed:
                del self._payloads[key]
        return len(doomed)

    def hold_payload(self, payload_id: str, hold_id: str) -> bool:
        with self._lock:
            if payload_id not in self._payloads:
                return False
            self._payload_holds[hold_id] = payload_id
            return True

    def release_payload(self, hold_id: str, *, keep_until: datetime.datetime) -> bool:
        with self._lock:
            payload_id = self._payload_holds.pop(hold_id, None)
            kept = None if payload_id is None else self._payloads.get(payload_id)
            if payload_id is not None and kept is not None:
                self._payloads[payload_id] = (kept[0], max(kept[1], keep_until))
            return payload_id is not None

    def report_status(self, report: StatusReport) -> None:
        with self._lock:
            self._status[report.endpoint, report.instance] = report

    def status_reports(self, endpoint: str) -> list[StatusReport]:
        with self._lock:
            found = [r for (name, _), r in self._status.items() if name == endpoint]
        return sorted(found, key=lambda report: report.updated_at, reverse=True)

    def forget_status(self, endpoint: str, *, updated_before: datetime.datetime) -> int:
        with self._lock:
            old = [key for key, report in self._status.items()
                   if key[0] == endpoint and report.updated_at < updated_before]
            for key in old:
                del self._status[key]
        return len(old)


def _expired_tombstone(record: AggregateRecord, horizon: datetime.datetime) -> bool:
    """Whether ``record`` is a tombstone completed before ``horizon`` none of whose entries
    waits for dispatch: what retention removes."""
    return (record.completed and record.updated_at is not None and record.updated_at < horizon
            and all(entry.dispatched for entry in record.processed.values()))


def _last_commit(record: AggregateRecord) -> datetime.datetime | None:
    """When the newest remembered message of ``record`` was committed."""
    times = [entry.at for entry in record.processed.values() if entry.at is not None]
    return max(times, default=None)


@dataclass
class _Scheduled:
    envelope: Envelope
    due: datetime.datetime
    owner: str | None = None
    leased_until: datetime.datetime | None = None
    #: Failed sends so far (``note_scheduled_failure``).
    attempts: int = 0


def _copied(value: Any) -> Any:
    """A deep copy of a state (JSON: dicts, lists and scalars) without ``copy.deepcopy``'s
    memo and dispatch; anything else is deep-copied."""
    kind = type(value)
    if kind is dict:
        return {key: _copied(item) for key, item in value.items()}
    if kind is list:
        return [_copied(item) for item in value]
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return value
    return copy.deepcopy(value)


def _with_processed(record: AggregateRecord, processed: dict[str, ProcessedMessage], *,
                    state: Mapping[str, Any] | None = None,
                    final_state: Mapping[str, Any] | None = None) -> AggregateRecord:
    """``record`` with ``processed`` (and ``state`` and ``final_state``, if given): what
    ``dataclasses.replace`` does, for the fields a load and a mark change."""
    return _record(record.aggregate_type, record.aggregate_id, record.version,
                   record.state if state is None else state, processed, record.updated_at,
                   record.completed, record.state_version,
                   record.final_state if final_state is None else final_state)


# The two records below are built for every message (a load, a commit, a mark). As frozen
# dataclasses, their generated ``__init__`` sets each field with ``object.__setattr__``;
# their fields are their instance ``__dict__`` (no slots, no ``__post_init__``:
# tests/test_hot_path.py checks that), so these fill it in one update, every field given.


def _record(aggregate_type: str, aggregate_id: str, version: int,
            state: Mapping[str, Any] | None, processed: Mapping[str, ProcessedMessage],
            updated_at: datetime.datetime | None, completed: bool, state_version: int | None,
            final_state: Mapping[str, Any] | None) -> AggregateRecord:
    """``AggregateRecord(...)`` of these fields, without the frozen dataclass's
    ``__init__``."""
    record = object.__new__(AggregateRecord)
    record.__dict__.update(aggregate_type=aggregate_type, aggregate_id=aggregate_id,
                           version=version, state=state, processed=processed,
                           updated_at=updated_at, completed=completed,
                           state_version=state_version, final_state=final_state)
    return record


def _entry(key: str, outgoing: tuple[Envelope, ...], outgoing_ids: tuple[str, ...],
           dispatched: bool, at: datetime.datetime | None, attempts: int,
           message_type: str | None) -> ProcessedMessage:
    """``ProcessedMessage(...)`` of these fields (``stored_bytes`` 0: memory does not bound
    records by size), without the frozen dataclass's ``__init__``."""
    entry = object.__new__(ProcessedMessage)
    entry.__dict__.update(key=key, outgoing=outgoing, outgoing_ids=outgoing_ids,
                          dispatched=dispatched, at=at, attempts=attempts, stored_bytes=0,
                          message_type=message_type)
    return entry
