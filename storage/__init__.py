"""The storage contract and its backends (MongoDB/mongomock, in-memory)."""

from __future__ import annotations

from .base import AggregateRecord, ProcessedMessage, Storage
from .errors import (
    AlreadyProcessed,
    ConcurrencyConflict,
    ConflictRetriesExhausted,
    StorageError,
    StorageUnavailable,
)
from .memory import MemoryStorage
from .mongo import MongoStorage

__all__ = [
    "AggregateRecord",
    "AlreadyProcessed",
    "ConcurrencyConflict",
    "ConflictRetriesExhausted",
    "MemoryStorage",
    "MongoStorage",
    "ProcessedMessage",
    "Storage",
    "StorageError",
    "StorageUnavailable",
]
