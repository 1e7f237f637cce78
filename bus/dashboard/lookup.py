"""One aggregate (or saga) as the storage holds it, with every processed entry it still
remembers: what the dashboard's lookup shows.

The storage's ``history`` gives the record with its newest processed entries (PostgreSQL
reads them apart; the other backends keep them in the record).
"""

from __future__ import annotations

import dataclasses
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
    record = storage.history(aggregate_type, aggregate_id, entries=limit + 1)
    entries = sorted(record.processed.values(), key=lambda entry: (entry.at is None, entry.at),
                     reverse=True)
    if record.updated_at is None and entries and entries[0].at is not None:
        record = dataclasses.replace(record, updated_at=entries[0].at)
    return Lookup(record, tuple(entries[:limit]), more=len(entries) > limit)
