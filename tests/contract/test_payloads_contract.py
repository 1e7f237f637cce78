"""The payload role of the storage contract (:mod:`idembus.testing.contract`), on every
backend of tests/conftest.py's ``storage_factory``: memory, mongomock, PostgreSQL and, when
IDEMBUS_MONGODB_URL is set, a real MongoDB server."""

from __future__ import annotations

from idembus.testing.contract import PayloadStoreContract


class TestPayloadStore(PayloadStoreContract):
    """PayloadStoreContract on every backend of tests/conftest.py's ``storage_factory``."""
