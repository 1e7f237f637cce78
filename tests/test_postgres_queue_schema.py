"""Starting an endpoint on the PostgreSQL queues looks its tables up in the catalogue and
alters them only when something is missing: on a busy queue table an ``ALTER TABLE``
(even ``IF NOT EXISTS``) would wait for every open transaction and hold up everything
behind it."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from idembus import Endpoint
from idembus.transports.postgres import PostgresTransport
from tests.conftest import POSTGRES_URL, require_service

pytestmark = pytest.mark.postgres


@pytest.fixture
def prefix() -> Iterator[str]:
    """A table prefix of this test's own; its tables are dropped afterwards."""
    require_service(POSTGRES_URL, "PostgreSQL")
    name = f"s{uuid.uuid4().hex[:10]}"
    yield name
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f"DROP TABLE IF EXISTS {name}_messages, {name}_subscriptions, "
                      f"{name}_queues")


def started_within(endpoint: Endpoint, seconds: float) -> bool:
    """Whether ``endpoint.start()`` returned within ``seconds`` (it is left to finish)."""
    done = threading.Event()
    failures: list[BaseException] = []

    def start() -> None:
        try:
            endpoint.start()
        except BaseException as error:  # reported by the assertion below
            failures.append(error)
        finally:
            done.set()

    threading.Thread(target=start, daemon=True).start()
    finished = done.wait(seconds)
    assert not failures, failures
    return finished


@pytest.mark.timeout(90)
def test_a_second_endpoint_starts_while_a_transaction_holds_a_row_of_the_queue_table(
        prefix: str) -> None:
    # Given the queue tables, made by a first endpoint, and a message in them:
    first = Endpoint("schema-first", transport=PostgresTransport(POSTGRES_URL,
                                                                  table_prefix=prefix))
    first.start()
    first.close()
    with psycopg.connect(POSTGRES_URL, autocommit=True) as writer:
        writer.execute(f"INSERT INTO {prefix}_messages (queue, headers, body) "
                       "VALUES ('schema-first', '{}', '')")
    # And a transaction holding that row (FOR UPDATE) and left open:
    with psycopg.connect(POSTGRES_URL) as holder:
        holder.execute(f"SELECT id FROM {prefix}_messages FOR UPDATE").fetchall()
        # When a second endpoint starts on those tables, and runs `idembus migrate`'s step:
        second = Endpoint("schema-second", transport=PostgresTransport(
            POSTGRES_URL, table_prefix=prefix, connect_timeout=5))
        try:
            # Then neither waits for the open transaction (an ALTER TABLE would, forever).
            assert started_within(second, 30), "the start waited for the open transaction"
            migrated = threading.Thread(target=second.transport.migrate, daemon=True)
            migrated.start()
            migrated.join(30)
            assert not migrated.is_alive(), "migrate waited for the open transaction"
        finally:
            holder.rollback()
            second.close()


@pytest.mark.timeout(60)
def test_a_queue_table_of_an_earlier_version_gets_the_ordering_column_and_its_index(
        prefix: str) -> None:
    # Given a messages table as an idembus before ordered processing made it:
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        PostgresTransport(POSTGRES_URL, table_prefix=prefix).migrate()
        admin.execute(f"DROP INDEX {prefix}_messages_ordering")
        admin.execute(f"ALTER TABLE {prefix}_messages DROP COLUMN ordering_key")
    # When an endpoint starts on it:
    endpoint = Endpoint("schema-old", transport=PostgresTransport(POSTGRES_URL,
                                                                   table_prefix=prefix))
    endpoint.start()
    endpoint.close()
    # Then the table has the column and the index.
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        column = admin.execute(
            "SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(%s) "
            "AND attname = 'ordering_key' AND NOT attisdropped",
            (f"{prefix}_messages",)).fetchone()
        index = admin.execute("SELECT to_regclass(%s)",
                              (f"{prefix}_messages_ordering",)).fetchone()
    assert column is not None
    assert index is not None and index[0] is not None
