"""The aggregate role of the storage contract (:mod:`idembus.testing.contract`): load,
commit, mark_dispatched, the processed window and races, on every backend.

The ``storage_factory`` fixture of tests/conftest.py runs it on the in-memory backend, on
mongomock, on PostgreSQL and, when IDEMBUS_MONGODB_URL is set, on a real MongoDB server.
:class:`TestBatchingStorage` runs it on the in-memory backend behind the decorator a
batching endpoint puts around its storage (:mod:`idembus.runtime.batching_ports`), called
outside a batch: it must be the storage's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from idembus.runtime.batching_ports import BatchingStorage
from idembus.storage.memory import MemoryStorage
from idembus.testing.contract import AggregateStoreContract, StorageFactory


class TestAggregateStore(AggregateStoreContract):
    """AggregateStoreContract on every backend of tests/conftest.py's ``storage_factory``."""


class TestBatchingStorage(AggregateStoreContract):
    """AggregateStoreContract on a MemoryStorage seen through a :class:`BatchingStorage`."""

    @pytest.fixture
    def storage_factory(self) -> Iterator[StorageFactory]:
        def make(**options: Any) -> BatchingStorage:
            return BatchingStorage(MemoryStorage(**options))

        yield make
