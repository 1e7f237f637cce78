"""What PostgreSQL storage adds to the contract: schema, start-up failures, the inbox."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from idembus import ConfigurationError, Endpoint
from idembus.envelope import Envelope
from idembus.headers import INTENT, MESSAGE_ID, MESSAGE_TYPE
from idembus.storage.base import INBOX, AggregateRecord
from idembus.storage.errors import AlreadyProcessed, StorageUnavailable
from idembus.storage.postgres import PostgresStorage
from tests.conftest import POSTGRES_URL, require_service
from tests.support import AccountHandler, Deposit, Ledger, SignalCounter

pytestmark = pytest.mark.postgres
ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def prefix() -> Iterator[str]:
    require_service(POSTGRES_URL, "PostgreSQL")
    name = f"pg{uuid.uuid4().hex[:12]}"
    yield name
    cleaner = PostgresStorage(POSTGRES_URL, table_prefix=name)
    cleaner.drop_tables()
    cleaner.close()


def expected_tables(prefix: str) -> set[str]:
    return {f"{prefix}_{name}"
            for name in ("aggregates", "processed", "scheduled", "status", "leases", "audit",
                         "journal", "parked", "rates", "slots", "payloads")}


def tables(prefix: str) -> set[str]:
    with psycopg.connect(POSTGRES_URL) as connection:
        rows = connection.execute(
            "SELECT tablename FROM pg_tables WHERE tablename LIKE %s", (f"{prefix}%",)
        ).fetchall()
    return {row[0] for row in rows}


def test_an_unreachable_database_fails_clearly_and_hides_the_password():
    storage = PostgresStorage("postgresql://app:s3cret@127.0.0.1:1/test", connect_timeout=0.5)
    try:
        with pytest.raises(StorageUnavailable, match="PostgreSQL at .* is unreachable") as error:
            storage.verify()
        assert "s3cret" not in str(error.value)
        assert "app:***@127.0.0.1:1" in str(error.value)
    finally:
        storage.close()


def test_an_endpoint_on_an_unreachable_database_fails_at_start():
    storage = PostgresStorage("postgresql://postgres@127.0.0.1:1/test", connect_timeout=0.5)
    endpoint = Endpoint("pg-down", storage=storage, handlers=[AccountHandler])
    try:
        with pytest.raises(StorageUnavailable, match="unreachable"):
            endpoint.start()
        assert not endpoint.running
    finally:
        endpoint.close()


def test_a_table_prefix_that_is_not_an_identifier_is_refused():
    with pytest.raises(ConfigurationError, match="table_prefix 'Drop Table'"):
        PostgresStorage(POSTGRES_URL, table_prefix="Drop Table")


def test_migrate_creates_the_tables_and_can_run_concurrently_and_again(prefix):
    # Given four processes' worth of storages starting at the same moment
    storages = [PostgresStorage(POSTGRES_URL, table_prefix=prefix) for _ in range(4)]
    barrier = threading.Barrier(len(storages))
    errors: list[BaseException] = []

    def start(storage: PostgresStorage) -> None:
        barrier.wait(timeout=10)
        try:
            storage.migrate()
        except BaseException as exc:  # collected for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in storages]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    # Then all succeed, and a second migration changes nothing
    assert errors == []
    storages[0].migrate()
    assert tables(prefix) == expected_tables(prefix)
    for storage in storages:
        storage.close()


def test_an_inbox_record_is_one_processed_row_that_deduplicates(prefix):
    storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    storage.verify()
    key = "Ledger/m1"
    sent = Envelope({MESSAGE_ID: "o1", MESSAGE_TYPE: "t", INTENT: "publish"}, "{}")
    try:
        storage.commit(storage.load(INBOX, key, key), key=key, state=None, outgoing=[sent])
        with pytest.raises(AlreadyProcessed) as duplicate:
            storage.commit(AggregateRecord(INBOX, key), key=key, state=None, outgoing=[])
        assert duplicate.value.outgoing == (sent,)
        (record,) = storage.records(INBOX)
        assert record.aggregate_id == key and record.version == 1
        with psycopg.connect(POSTGRES_URL) as connection:
            count = connection.execute(f"SELECT count(*) FROM {prefix}_aggregates").fetchone()
        assert count == (0,)
    finally:
        storage.close()


def test_an_endpoint_on_postgres_applies_duplicates_once(make_endpoint, prefix):
    # Given accounts and ledger endpoints whose storage is PostgreSQL
    storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    ledger_storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    ledger = Ledger()
    accounts = make_endpoint("accounts", handlers=[AccountHandler], storage=storage)
    downstream = make_endpoint("ledger", handlers=[ledger], storage=ledger_storage)
    recorded = SignalCounter(downstream, "handled")
    duplicates = SignalCounter(accounts, "duplicate")
    accounts.start()
    downstream.start()

    # When one deposit is sent three times with the same id
    message_id = str(uuid.uuid4())
    for _ in range(3):
        accounts.bus.send(Deposit(account="a", amount=5), message_id=message_id)

    # Then it is applied once and the ledger records one Deposited
    assert duplicates.wait_for(2)
    assert recorded.wait_for(1)
    record = storage.load("Account", "a")
    assert record.version == 1 and record.state == {"balance": 5, "deposits": 1}
    assert [entry[1:] for entry in ledger.entries] == [("a", 5)]


def test_idembus_migrate_creates_the_schema_from_the_command_line(prefix, tmp_path):
    (tmp_path / "pg_app.py").write_text(textwrap.dedent(f'''
        from idembus import Endpoint
        from idembus.storage.postgres import PostgresStorage
        from tests.support import AccountHandler

        endpoint = Endpoint("pg-app", handlers=[AccountHandler],
                            storage=PostgresStorage({POSTGRES_URL!r}, table_prefix={prefix!r}))
    '''))
    done = subprocess.run(
        [sys.executable, "-m", "idembus", "migrate", "pg_app:endpoint"], cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "PostgresStorage schema is in place" in done.stdout
    assert tables(prefix) == expected_tables(prefix)


def test_records_page_through_an_aggregate_type_reading_each_once(unique: str) -> None:
    require_service(POSTGRES_URL, "PostgreSQL")
    storage = PostgresStorage(POSTGRES_URL, table_prefix=f"rp{unique}")
    storage.verify()
    try:
        storage.records_page = 2
        for number in range(5):
            loaded = storage.load("Order", f"o{number}", "k")
            storage.commit(loaded, key="k", state={"n": number}, outgoing=[])
        storage.commit(storage.load("Other", "x", "k"), key="k", state={}, outgoing=[])
        records = list(storage.records("Order"))
        assert sorted(r.aggregate_id for r in records) == [f"o{n}" for n in range(5)]
        assert all(r.updated_at is not None for r in records)
    finally:
        storage.drop_tables()
        storage.close()


def test_a_storage_first_used_while_the_database_is_unreachable_works_once_it_is_back(
) -> None:
    # Given a storage whose first connection finds nothing listening (a failover, a
    # database still starting)
    require_service(POSTGRES_URL, "PostgreSQL")
    from urllib.parse import urlparse

    from tests.proxy import TcpProxy

    target = urlparse(POSTGRES_URL)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 5432)
    url = POSTGRES_URL.replace(f"{target.hostname}:{target.port or 5432}",
                               f"127.0.0.1:{proxy.port}", 1)
    storage = PostgresStorage(url, table_prefix=f"back{uuid.uuid4().hex[:8]}",
                              connect_timeout=1)
    try:
        with pytest.raises(StorageUnavailable) as first:
            storage.verify()
        assert "cannot be reused" not in str(first.value)
        # When the database answers again
        proxy.restore()
        # Then the same storage object works (its pool was not closed for good)
        storage.verify()
        assert not storage.load("Account", "a").exists
    finally:
        try:
            storage.drop_tables()
        finally:
            storage.close()
            proxy.cut()
