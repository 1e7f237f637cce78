"""In-memory storage: the contract without a database, for unit tests and the handler
test helper. Thread-safe; raises exactly the errors the real backends raise."""

from __future__ import annotations

import copy
import datetime
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bus.envelope import Envelope, utc_now
from storage.base import (
    DEFAULT_PROCESSED_WINDOW,
    AggregateRecord,
    ProcessedMessage,
    StatusReport,
    Storage,
    scheduled_key,
)


class MemoryStorage(Storage):
    """Keeps every aggregate record in a dict guarded by one lock."""

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
        self._lock = threading.Lock()

    def load(
        self, aggregate_type: str, aggregate_id: str, key: str | None = None
    ) -> AggregateRecord:
        with self._lock:
            record = self._records.get((aggregate_type, aggregate_id))
        if record is None:
            return AggregateRecord(aggregate_type, aggregate_id)
        # The state is the one mutable part a caller could change; entries are immutable.
        return AggregateRecord(
            aggregate_type, aggregate_id, record.version,
            copy.deepcopy(record.state), dict(record.processed),
        )

    def commit(
        self,
        loaded: AggregateRecord,
        *,
        key: str,
        state: Mapping[str, Any] | None,
        outgoing: Sequence[Envelope],
    ) -> None:
        address = (loaded.aggregate_type, loaded.aggregate_id)
        entry = ProcessedMessage(
            key=key,
            outgoing=tuple(outgoing),
            outgoing_ids=tuple(envelope.message_id for envelope in outgoing),
            at=utc_now(),
        )
        with self._lock:
            current = self._records.get(address)
            current_version = current.version if current else 0
            accepted = current_version == loaded.version and (
                current is None or key not in current.processed
            )
            if accepted:
                processed = dict(current.processed) if current else {}
                processed[key] = entry
                window = self.processed_window or len(processed)
                for stale in list(processed)[: max(0, len(processed) - window)]:
                    del processed[stale]
                if self.retention is not None:
                    horizon = utc_now() - self.retention
                    processed = {k: e for k, e in processed.items()
                                 if e.at is None or e.at >= horizon}
                self._records[address] = AggregateRecord(
                    loaded.aggregate_type,
                    loaded.aggregate_id,
                    version=current_version + 1,
                    state=copy.deepcopy(dict(state)) if state is not None else None,
                    processed=processed,
                )
                return
        raise self._refusal(loaded.aggregate_type, loaded.aggregate_id, key)

    def mark_dispatched(self, aggregate_type: str, aggregate_id: str, key: str) -> None:
        address = (aggregate_type, aggregate_id)
        with self._lock:
            record = self._records.get(address)
            if record is None or key not in record.processed:
                return
            entry = record.processed[key]
            processed = dict(record.processed)
            processed[key] = ProcessedMessage(key, (), entry.outgoing_ids, True, entry.at)
            self._records[address] = AggregateRecord(
                aggregate_type, aggregate_id, record.version, record.state, processed
            )

    def records(self, aggregate_type: str) -> Iterator[AggregateRecord]:
        with self._lock:
            chosen = [r for (t, _), r in self._records.items() if t == aggregate_type]
        return iter(copy.deepcopy(chosen))

    def _schedule(self, envelope: Envelope, due: datetime.datetime) -> None:
        with self._lock:
            self._scheduled.setdefault(
                scheduled_key(envelope), _Scheduled(envelope, due))

    def _claim_due(
        self, now: datetime.datetime, *, limit: int, lease: float
    ) -> list[Envelope]:
        with self._lock:
            due = sorted(
                (entry for entry in self._scheduled.values()
                 if entry.due <= now and (entry.leased_until is None or entry.leased_until <= now)),
                key=lambda entry: entry.due,
            )[:limit]
            for entry in due:
                entry.leased_until = now + datetime.timedelta(seconds=lease)
            return [entry.envelope for entry in due]

    def forget_scheduled(self, envelopes: Sequence[Envelope]) -> None:
        with self._lock:
            for envelope in envelopes:
                self._scheduled.pop(scheduled_key(envelope), None)


    def report_status(self, report: StatusReport) -> None:
        with self._lock:
            self._status[report.endpoint, report.instance] = report

    def status_reports(self, endpoint: str) -> list[StatusReport]:
        with self._lock:
            found = [r for (name, _), r in self._status.items() if name == endpoint]
        return sorted(found, key=lambda report: report.updated_at, reverse=True)

@dataclass
class _Scheduled:
    envelope: Envelope
    due: datetime.datetime
    leased_until: datetime.datetime | None = None
