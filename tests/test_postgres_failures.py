"""PostgreSQL's refusals, classified from SQLSTATE on the real server: what waiting cures
(an outage), what only an operator cures (a refused login, a missing table or privilege),
and what no retry cures (the message's own data), which must reach the error queue."""

from __future__ import annotations

import secrets
import sys
import types
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from idembus import Endpoint, RetryPolicy
from idembus import headers as h
from idembus.cli import main
from idembus.storage.base import AggregateRecord
from idembus.storage.errors import StorageAccessDenied, StorageRefused, StorageUnavailable
from idembus.storage.postgres import PostgresStorage
from idembus.transports.errors import TransportUnavailable
from idembus.transports.kombu import KombuTransport
from tests.conftest import POSTGRES_URL, require_service
from tests.support import Account, AccountHandler, Deposit, Deposited, SignalCounter

pytestmark = pytest.mark.postgres


@pytest.fixture
def storage() -> Iterator[PostgresStorage]:
    require_service(POSTGRES_URL, "PostgreSQL")
    prefix = f"pf{uuid.uuid4().hex[:10]}"
    storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    storage.verify()
    yield storage
    storage.close()  # an endpoint may have closed it already
    cleaner = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    cleaner.drop_tables()
    cleaner.close()


@pytest.fixture
def limited_role() -> Iterator[str]:
    """A login role with no rights beyond connecting (PostgreSQL 15: no CREATE on public)."""
    require_service(POSTGRES_URL, "PostgreSQL")
    role = f"idembus_lp_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    yield role
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f"DROP OWNED BY {role}")
        admin.execute(f"DROP ROLE {role}")


def test_a_nul_character_is_refused_for_this_message(storage: PostgresStorage) -> None:
    loaded = storage.load("Account", "a")
    with pytest.raises(StorageRefused):
        storage.commit(loaded, key="k1", state={"name": "nul\x00here"}, outgoing=())
    with pytest.raises(StorageRefused):
        storage.load("Account", "nul\x00here")


def test_a_key_too_long_for_the_index_is_refused_for_this_message(
    storage: PostgresStorage,
) -> None:
    # Random text does not compress: the index entry is larger than a btree page allows
    key = secrets.token_hex(6000)
    with pytest.raises(StorageRefused, match="54000"):
        storage.commit(AggregateRecord("Account", "a"), key=key, state={}, outgoing=())


def test_missing_tables_block_the_endpoint_until_migrated() -> None:
    require_service(POSTGRES_URL, "PostgreSQL")
    unmigrated = PostgresStorage(POSTGRES_URL, table_prefix=f"pm{uuid.uuid4().hex[:10]}")
    try:
        with pytest.raises(StorageAccessDenied, match="42P01"):
            unmigrated.load("Account", "a")
    finally:
        unmigrated.close()


@pytest.mark.parametrize("conninfo, reason", [
    ("postgresql://no_such_role_idembus@127.0.0.1:5432/test", "does not exist"),
    ("postgresql://postgres@127.0.0.1:5432/no_such_database_idembus", "does not exist"),
], ids=["role", "database"])
def test_a_refused_login_blocks_the_endpoint(conninfo: str, reason: str) -> None:
    require_service(POSTGRES_URL, "PostgreSQL")
    refused = PostgresStorage(conninfo, connect_timeout=1)
    try:
        with pytest.raises(StorageAccessDenied, match=reason):
            refused.load("Account", "a")
    finally:
        refused.close()


def test_a_missing_privilege_blocks_the_endpoint(
    storage: PostgresStorage, limited_role: str,
) -> None:
    limited = PostgresStorage(POSTGRES_URL.replace("postgres@", f"{limited_role}@"),
                              table_prefix=storage._aggregates.removesuffix("_aggregates"))
    try:
        with pytest.raises(StorageAccessDenied, match="42501"):
            limited.load("Account", "a")
    finally:
        limited.close()


def test_an_unreachable_server_is_an_outage() -> None:
    down = PostgresStorage("postgresql://postgres@127.0.0.1:1/test", connect_timeout=1)
    try:
        with pytest.raises(StorageUnavailable) as raised:
            down.load("Account", "a")
        assert not isinstance(raised.value, StorageAccessDenied)
    finally:
        down.close()


def test_a_message_postgres_refuses_reaches_the_error_queue_and_the_next_is_applied(
    storage: PostgresStorage,
) -> None:
    # Given an endpoint on PostgreSQL
    suffix = uuid.uuid4().hex[:8]
    transport = KombuTransport("memory://")
    endpoint = Endpoint(f"pg-accounts-{suffix}", transport=transport, storage=storage,
                        handlers=[AccountHandler], error_queue=f"pg-error-{suffix}",
                        retry_policy=RetryPolicy(immediate_retries=1, delayed=()))
    handled = SignalCounter(endpoint, "handled")
    dead = SignalCounter(endpoint, "dead_lettered")
    endpoint.start()
    try:
        # When a deposit the database cannot store arrives, and then a good one
        endpoint.bus.send(Deposit(account="nul\x00here", amount=5))
        endpoint.bus.send(Deposit(account="b", amount=7))

        # Then the first is in the error queue with the database's reason, the second applied
        assert dead.wait_for(1) and handled.wait_for(1)
        copy = transport.get(f"pg-error-{suffix}")
        assert copy is not None
        assert "idembus.storage.errors.StorageRefused" == copy.headers[h.EXCEPTION_TYPE]
        assert storage.load("Account", "b").state == {"balance": 7, "deposits": 1}
    finally:
        endpoint.close()


class Away(KombuTransport):
    """memory:// whose publishes fail while ``away`` (the broker went down)."""

    away = True

    def publish(self, envelope: Any) -> None:
        if self.away:
            raise TransportUnavailable("the broker is away (simulated)")
        super().publish(envelope)


def test_two_endpoints_on_one_database_each_repair_their_own_entries_with_their_settings(
    storage: PostgresStorage,
) -> None:
    # Given two endpoints on one PostgreSQL database: accounts journals its events, audit
    # does not; and an operation of accounts committed while its broker was away
    suffix = uuid.uuid4().hex[:8]
    journaling = Away("memory://")
    accounts = Endpoint(f"pg-accounts-{suffix}", transport=journaling, storage=storage,
                        journal=True, outbox=False, outbox_grace=0)
    other_storage = PostgresStorage(POSTGRES_URL, table_prefix=storage._aggregates
                                    .removesuffix("_aggregates"))
    audit = Endpoint(f"pg-audit-{suffix}", transport=KombuTransport("memory://"),
                     storage=other_storage, outbox=False, outbox_grace=0)
    try:
        with accounts.unit_of_work(Account, "a", operation_id=str(uuid.uuid4())) as work:
            work.state.balance = 5
            event_id = work.bus.publish(Deposited(account="a", amount=5))
        journaling.away = False

        # When the other endpoint's outbox makes its round
        # Then it leaves the entry alone: it would send it without journaling it
        assert audit.outbox.run_once() == 0
        assert storage.read_journal(after=0) == []

        # When the committing endpoint's outbox makes its round
        # Then the event is sent and journaled, as that endpoint does
        assert accounts.outbox.run_once() == 1
        assert [entry.message_id for entry in storage.read_journal(after=0)] == [event_id]
    finally:
        audit.close()
        accounts.close()


def test_a_role_without_ddl_rights_runs_on_a_migrated_schema_and_is_told_to_migrate_otherwise(
    limited_role: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    # Given an endpoint whose role may not create tables, on a schema nobody migrated
    prefix = f"lp{uuid.uuid4().hex[:10]}"
    conninfo = POSTGRES_URL.replace("postgres@", f"{limited_role}@")
    module_name = f"least_privilege_{uuid.uuid4().hex[:8]}"
    module = types.ModuleType(module_name)
    module.endpoint = lambda: Endpoint(  # type: ignore[attr-defined]
        f"lp-{prefix}", transport="memory://", handlers=[AccountHandler],
        storage=PostgresStorage(conninfo, table_prefix=prefix))
    monkeypatch.setitem(sys.modules, module_name, module)

    # When it is run
    status = main(["run", f"{module_name}:endpoint"])

    # Then it exits with status 2 and one line saying to run idembus migrate, no traceback
    err = capsys.readouterr().err
    assert status == 2
    assert "idembus migrate" in err and "Traceback" not in err

    # When an operator migrates with a role that may, and grants the endpoint's role its
    # rights on the tables
    owner = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    owner.migrate()
    try:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            for table in ("aggregates", "processed", "scheduled", "leases", "audit", "status",
                          "journal", "parked"):
                admin.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {prefix}_{table} "
                              f"TO {limited_role}")

        # Then the limited role starts and processes (verify only reads the schema)
        limited = PostgresStorage(conninfo, table_prefix=prefix)
        limited.verify()
        limited.commit(limited.load("Account", "a"), key="H/m1", state={"balance": 1},
                       outgoing=())
        assert limited.load("Account", "a").state == {"balance": 1}
        limited.close()
    finally:
        owner.drop_tables()
        owner.close()
