"""Records the storage contract's tests build and read: an account aggregate, its
envelopes and commits (shared by the aggregate, completion and group-commit contracts)."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ... import headers as h
from ...envelope import Envelope
from ...storage.base import AggregateRecord, AggregateStore

ACCOUNT = "Account"
UTC = datetime.timezone.utc


def envelope(
    message_type: str = "test.Deposited",
    *,
    intent: h.Intent = h.Intent.PUBLISH,
    body: str | None = None,
    destination: str | None = None,
) -> Envelope:
    """An outgoing message as a handler would have recorded it, with a fresh id."""
    message_id = str(uuid.uuid4())
    return Envelope(
        headers={
            h.MESSAGE_ID: message_id,
            h.MESSAGE_TYPE: message_type,
            h.INTENT: intent.value,
        },
        body=body if body is not None else f'{{"id": "{message_id}"}}',
        destination=destination,
    )


def commit(
    storage: AggregateStore,
    loaded: AggregateRecord,
    key: str,
    state: Mapping[str, Any] | None = None,
    outgoing: Sequence[Envelope] = (),
) -> None:
    storage.commit(loaded, key=key, state=state if state is not None else {}, outgoing=outgoing)


def created(
    storage: AggregateStore, aggregate_id: str, key: str = "Seed/m0", **state: Any
) -> AggregateRecord:
    """Create an aggregate with one processed message and return it as loaded afterwards."""
    commit(storage, storage.load(ACCOUNT, aggregate_id), key, state or {"balance": 0})
    return storage.load(ACCOUNT, aggregate_id)


def remembered(storage: AggregateStore, aggregate_id: str, *keys: str) -> dict[str, Any]:
    """The processed entries of ``keys`` that the storage remembers for one account.

    Loads once per key: the contract promises only the entry of the key asked about
    (PostgreSQL keeps the history outside the record).
    """
    found: dict[str, Any] = {}
    for key in keys:
        entry = storage.load(ACCOUNT, aggregate_id, key).processed.get(key)
        if entry is not None:
            found[key] = entry
    return found
