"""The payload stores the claim-check tests run on: in memory (shared by every endpoint of
the process), mongomock and PostgreSQL, each fresh for one test."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from idembus import MongoStorage
from idembus.storage.base import PayloadStore
from idembus.storage.postgres import PostgresStorage
from tests.conftest import POSTGRES_URL, require_service
from tests.test_cli_errors import SharedMemoryStorage


@contextmanager
def payload_store(kind: str, database: str, table_prefix: str) -> Iterator[PayloadStore]:
    """A fresh payload store of ``kind`` ("memory", "mongomock" or "postgres"): a mongomock
    ``database`` or PostgreSQL tables under ``table_prefix`` of its own, closed and dropped
    afterwards."""
    if kind == "memory":
        yield SharedMemoryStorage()
        return
    if kind == "mongomock":
        mongo = MongoStorage.embedded(database)
        mongo.migrate()
        yield mongo
        mongo.close()
        return
    require_service(POSTGRES_URL, "PostgreSQL")
    postgres = PostgresStorage(POSTGRES_URL, table_prefix=table_prefix)
    postgres.verify()
    yield postgres
    postgres.drop_tables()
    postgres.close()
