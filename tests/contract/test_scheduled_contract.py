"""The delayed-message role of the storage contract (:mod:`idembus.testing.contract`), on
every backend.

The ``storage_factory`` fixture of tests/conftest.py runs it on the in-memory backend, on
mongomock, on PostgreSQL and, when IDEMBUS_MONGODB_URL is set, on a real MongoDB server.
PostgreSQL and MongoDB also open a second storage object on the same database, as another
process would, for the tests of what it sees.
"""

from __future__ import annotations

from typing import Any

import pytest

from idembus.storage.mongo import MongoStorage
from idembus.storage.postgres import PostgresStorage
from idembus.testing.contract import DelayedStoreContract
from tests.conftest import MONGODB_URL


class TestDelayedStore(DelayedStoreContract):
    """DelayedStoreContract on every backend of tests/conftest.py's ``storage_factory``."""

    def another_instance(self, storage: Any) -> Any:
        """A second storage on the same database as ``storage``, as another process would
        open."""
        if storage.process_local:
            pytest.skip("lives inside one storage object")
        if isinstance(storage, PostgresStorage):
            # PostgresStorage keeps no public table_prefix; its table names carry it.
            prefix = storage._scheduled.removesuffix("_scheduled")
            return PostgresStorage(storage.conninfo, table_prefix=prefix)
        if isinstance(storage, MongoStorage):
            assert MONGODB_URL is not None
            return MongoStorage(MONGODB_URL, database=storage.database.name)
        raise AssertionError(f"no second instance for {type(storage).__name__}")
