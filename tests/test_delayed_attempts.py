"""Failed sends of delayed messages are counted in the storage; on PostgreSQL that count is
a column of the scheduled table, which a schema from before it gains at start or by
``idembus migrate``, keeping the messages waiting there."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from idembus import headers as h
from idembus.envelope import Envelope, utc_now
from idembus.storage.postgres import PostgresStorage
from tests.conftest import POSTGRES_URL, require_service

pytestmark = pytest.mark.postgres


@pytest.fixture
def prefix() -> Iterator[str]:
    """A table prefix of its own, whose tables are dropped afterwards."""
    require_service(POSTGRES_URL, "PostgreSQL")
    prefix = f"da{uuid.uuid4().hex[:10]}"
    yield prefix
    cleaner = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    cleaner.drop_tables()
    cleaner.close()


def waiting(message_id: str) -> Envelope:
    return Envelope({h.MESSAGE_ID: message_id, h.MESSAGE_TYPE: "test.ChargeCard",
                     h.INTENT: h.Intent.SEND.value,
                     h.DELIVER_AT: utc_now().isoformat()}, '{"id": 1}', "billing")


def schema_from_before_failure_counts(prefix: str) -> None:
    """The tables as a version without ``<prefix>_scheduled.attempts`` left them."""
    older = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    older.migrate()
    older.close()
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f"ALTER TABLE {prefix}_scheduled DROP COLUMN attempts")


def test_a_scheduled_table_from_before_counts_gains_the_column_at_start_and_keeps_its_rows(
    prefix: str,
) -> None:
    # Given a schema from before failure counts, with a delayed message waiting in it
    schema_from_before_failure_counts(prefix)
    message = waiting(str(uuid.uuid4()))
    older = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    older.schedule(message, utc_now() - datetime.timedelta(seconds=1), owner="sales")
    older.close()

    # When an endpoint of this version starts on it
    storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    try:
        storage.verify()

        # Then the column was added: the message's failures are counted from zero
        assert storage.note_scheduled_failure(message) == 1

        # And migrating again changes nothing, and the message is still there to send
        storage.migrate()
        assert storage.note_scheduled_failure(message) == 2
        assert storage.claim_due(utc_now(), owner="sales") == [message]
    finally:
        storage.close()
