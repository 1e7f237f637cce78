"""Errors raised by storage backends (the tree is drawn in :mod:`idembus.errors`).

Backends translate their driver's exceptions into these, so the endpoint treats every
backend alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..envelope import Envelope
from ..errors import BusError, EndpointBlocked, MessageRefused


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
    """The database cannot be reached for now (transient): try again later."""


class CommitOutcomeUnknown(StorageUnavailable):
    """The database became unreachable during a commit: the write may have been applied
    (the reply was lost) or not. The next attempt finds out by loading the record again."""


class StorageAccessDenied(StorageUnavailable, EndpointBlocked):
    """The database refuses this endpoint (login or privilege refused, tables missing or of
    another shape, the database dropped): nothing works until an operator acts. Waited out
    like an outage, logged at ERROR; met by ``verify`` at start, a configuration error."""


class SchemaMissing(StorageAccessDenied):
    """A table of the storage does not exist (PostgreSQL: SQLSTATE ``42P01``): its schema
    was never created here. ``idembus migrate`` creates it (an endpoint's start does too
    when its role may); meanwhile it is treated as every refusal of the endpoint."""


class StorageRefused(StorageError, MessageRefused):
    """The database refused this operation for a reason of the data itself (a character
    it cannot store, a key too long, a document too large): permanent for this message."""


class StaleLease(StorageError):
    """A write carried a lease that another owner has taken since: the writer must stop."""
