"""The storage contract and its backends (MongoDB/mongomock, in-memory)."""

from __future__ import annotations

from storage.base import AggregateRecord, ProcessedMessage, Storage
from storage.errors import (
    AlreadyProcessed,
    ConcurrencyConflict,
    ConflictRetriesExhausted,
    StorageError,
    StorageUnavailable,
)
from storage.memory import MemoryStorage
from storage.mongo import MongoStorage

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
