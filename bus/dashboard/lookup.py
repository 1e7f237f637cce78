"""One aggregate (or saga) as the storage holds it, with every processed entry it still
remembers: what the dashboard's lookup shows.

The storage contract's ``load`` returns the whole record on the backends that keep the
processed entries inside it (memory, MongoDB), but on PostgreSQL only the entry of the
message being handled (the rows are not bounded by count). For PostgreSQL the lookup reads
the aggregate's row and its newest processed rows itself, with the backend's own
connections and tables, read-only. (A storage method would be the better home; it waits
until the storage seam is not being changed elsewhere.)
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from ..storage.base import AggregateRecord, AggregateStore

#: Processed entries shown at most (the newest).
ENTRIES = 200


@dataclasses.dataclass(frozen=True)
class Lookup:
    """What was found: the record (``version`` 0: nothing stored), its processed entries
    newest first, and whether more were left out."""

    record: AggregateRecord
    entries: tuple[Any, ...]
    more: bool = False


def look_up(storage: AggregateStore, aggregate_type: str, aggregate_id: str,
            *, limit: int = ENTRIES) -> Lookup:
    """The aggregate ``aggregate_type``/``aggregate_id`` in ``storage``."""
    postgres = sys.modules.get("idembus.storage.postgres")  # loaded if the storage is one
    if postgres is not None and isinstance(storage, postgres.PostgresStorage):
        return _postgres(storage, aggregate_type, aggregate_id, limit)
    record = storage.load(aggregate_type, aggregate_id)
    entries = sorted(record.processed.values(), key=lambda entry: (entry.at is None, entry.at),
                     reverse=True)
    if record.updated_at is None and entries and entries[0].at is not None:
        record = dataclasses.replace(record, updated_at=entries[0].at)
    return Lookup(record, tuple(entries[:limit]), more=len(entries) > limit)


def _postgres(storage: Any, aggregate_type: str, aggregate_id: str, limit: int) -> Lookup:
    from ..storage.postgres import _entry, _utc

    with storage._connection() as connection:
        row = connection.execute(
            f"SELECT version, state, state_version, completed, updated_at "
            f"FROM {storage._aggregates} WHERE aggregate_type = %s AND aggregate_id = %s",
            (aggregate_type, aggregate_id)).fetchone()
        rows = connection.execute(
            f"SELECT key, outgoing, outgoing_ids, dispatched, processed_at "
            f"FROM {storage._processed} WHERE aggregate_type = %s AND aggregate_id = %s "
            "ORDER BY processed_at DESC LIMIT %s",
            (aggregate_type, aggregate_id, limit + 1)).fetchall()
    entries = tuple(_entry(*found) for found in rows)
    if row is None:
        record = AggregateRecord(aggregate_type, aggregate_id)
    else:
        version, state, state_version, completed, updated_at = row
        newest = entries[0].at if entries else None
        record = AggregateRecord(aggregate_type, aggregate_id, version, state,
                                 updated_at=_utc(updated_at) or newest,
                                 completed=bool(completed), state_version=state_version)
    return Lookup(record, entries[:limit], more=len(entries) > limit)
