"""Server-Sent Events, as the WHATWG HTML standard defines the stream format."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from typing import Any

from ..envelope import format_utc
from ..storage.base import AggregateRecord, JournalEntry


def event(kind: str, data: Mapping[str, Any], *, event_id: int | None = None) -> bytes:
    """One event: ``id:`` (if given), ``event:``, one ``data:`` line of compact JSON."""
    lines = [] if event_id is None else [f"id: {event_id}"]
    lines.append(f"event: {kind}")
    lines.append("data: " + json.dumps(data, separators=(",", ":"), default=_plain))
    return ("\n".join(lines) + "\n\n").encode("utf-8")


def comment(text: str) -> bytes:
    """A comment line: ignored by clients, keeps proxies and idle connections alive."""
    return f": {text}\n\n".encode()


def retry(milliseconds: int) -> bytes:
    """Tell the client how long to wait before reconnecting."""
    return f"retry: {milliseconds}\n\n".encode()


def journal_event(entry: JournalEntry) -> bytes:
    """A journal entry: ``id`` its position, ``event`` its type, ``data`` body and headers."""
    return event(entry.message_type, {
        "body": _json_or_text(entry.body),
        "headers": dict(entry.headers),
        "aggregate_type": entry.aggregate_type,
        "aggregate_id": entry.aggregate_id,
        "parents": list(entry.parents),
        "recorded_at": entry.recorded_at,
    }, event_id=entry.position)


def state_event(record: AggregateRecord) -> bytes:
    """An aggregate's current state during full replication (no ``id``: a client cut off
    in the middle starts the replication again); a completed one (a tombstone) is said
    deleted: ``"deleted": true``, ``state`` null."""
    data = {
        "aggregate_type": record.aggregate_type,
        "aggregate_id": record.aggregate_id,
        "version": record.version,
        "state": record.state,
        "updated_at": record.updated_at,
    }
    if record.completed:
        data["deleted"] = True
    return event(record.aggregate_type, data)


def _json_or_text(body: str) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return body


def _plain(value: object) -> str:
    if isinstance(value, datetime.datetime):
        return format_utc(value)
    raise TypeError(f"cannot put {type(value).__name__} in an event")
