"""The outbox role of the storage contract (:mod:`idembus.testing.contract`): undispatched
entries, leases, fenced marks and overdue, on every backend.

The ``storage_factory`` fixture of tests/conftest.py runs it on the in-memory backend, on
mongomock, on PostgreSQL and, when IDEMBUS_MONGODB_URL is set, on a real MongoDB server.
"""

from __future__ import annotations

from idembus.testing.contract import OutboxStoreContract


class TestOutboxStore(OutboxStoreContract):
    """OutboxStoreContract on every backend of tests/conftest.py's ``storage_factory``."""
