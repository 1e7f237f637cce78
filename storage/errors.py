"""Errors raised by storage backends (the tree is drawn in :mod:`bus.errors`).

Backends translate their driver's exceptions into these, so the endpoint treats every
backend alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from bus.envelope import Envelope
from bus.errors import BusError


class StorageError(BusError):
    """Root of the storage errors."""


class ConcurrencyConflict(StorageError):
    """The aggregate changed after it was loaded; load it again and re-run the handler."""


class AlreadyProcessed(StorageError):
    """The message was handled before; carries the outgoing messages that were stored with it.

    ``outgoing`` is empty once their dispatch was confirmed: sending them again would only
    create duplicates downstream.
    """

    def __init__(self, key: str, outgoing: Sequence[Envelope]) -> None:
        super().__init__(f"{key} was already processed")
        self.key = key
        self.outgoing = tuple(outgoing)


class ConflictRetriesExhausted(StorageError):
    """Optimistic retries gave up; the message goes through the normal error path."""


class StorageUnavailable(StorageError):
    """The database cannot be reached or refused the operation."""


class StaleLease(StorageError):
    """A write carried a lease that another owner has taken since: the writer must stop."""
