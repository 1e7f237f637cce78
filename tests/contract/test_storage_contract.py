"""The aggregate role of the storage contract (:mod:`idembus.testing.contract`): load,
commit, mark_dispatched, the processed window and races, on every backend.

The ``storage_factory`` fixture of tests/conftest.py runs it on the in-memory backend, on
mongomock, on PostgreSQL and, when IDEMBUS_MONGODB_URL is set, on a real MongoDB server.
"""

from __future__ import annotations

from idembus.testing.contract import AggregateStoreContract


class TestAggregateStore(AggregateStoreContract):
    """AggregateStoreContract on every backend of tests/conftest.py's ``storage_factory``."""
