"""PostgreSQL's refusals, classified from SQLSTATE on the real server: what waiting cures
(an outage), what only an operator cures (a refused login, a missing table or privilege),
and what no retry cures (the message's own data), which must reach the error queue."""

from __future__ import annotations

import contextlib
import datetime
import secrets
import sys
import threading
import types
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import psycopg
import pytest

from idembus import Endpoint, RetryPolicy
from idembus import headers as h
from idembus.cli import main
from idembus.envelope import Envelope, utc_now
from idembus.policies import OutboxPolicy
from idembus.runtime.recoverability.policy import Recoverability
from idembus.storage.base import AggregateRecord
from idembus.storage.errors import StorageAccessDenied, StorageRefused, StorageUnavailable
from idembus.storage.postgres import PostgresStorage
from idembus.transports.errors import TransportUnavailable
from idembus.transports.kombu import KombuTransport
from tests.conftest import POSTGRES_URL, require_service
from tests.support import (
    Account,
    AccountHandler,
    Deposit,
    Deposited,
    SignalCounter,
    eventually,
)

pytestmark = pytest.mark.postgres


@pytest.fixture
def storage(postgres_storage: PostgresStorage) -> PostgresStorage:
    return postgres_storage


@contextlib.contextmanager
def create_revoked_from_public(conninfo: str, schema: str = "public") -> Iterator[None]:
    """PUBLIC may not create in ``schema`` while inside; afterwards it may again if it could
    before (PostgreSQL before 15 grants it on ``public``): a shared database is left as it
    was found."""
    with psycopg.connect(conninfo, autocommit=True) as admin:
        row = admin.execute("SELECT has_schema_privilege('public', %s, 'CREATE')",
                            (schema,)).fetchone()
        granted = bool(row and row[0])
        if granted:
            admin.execute(f"REVOKE CREATE ON SCHEMA {schema} FROM PUBLIC")
    try:
        yield
    finally:
        if granted:
            with psycopg.connect(conninfo, autocommit=True) as admin:
                admin.execute(f"GRANT CREATE ON SCHEMA {schema} TO PUBLIC")


@pytest.fixture
def limited_role() -> Iterator[str]:
    """A login role with no rights beyond connecting (no CREATE on public, as from
    PostgreSQL 15 on)."""
    require_service(POSTGRES_URL, "PostgreSQL")
    role = f"idembus_lp_{uuid.uuid4().hex[:8]}"
    with create_revoked_from_public(POSTGRES_URL):
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f"CREATE ROLE {role} LOGIN")
        try:
            yield role
        finally:
            with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
                admin.execute(f"DROP OWNED BY {role}")
                admin.execute(f"DROP ROLE {role}")


def prefix_of(storage: PostgresStorage) -> str:
    return storage._aggregates.removesuffix("_aggregates")


def with_settings(conninfo: str, **settings: str) -> str:
    """``conninfo`` whose sessions start with these server settings."""
    options = " ".join(f"-c {name}={value}" for name, value in settings.items())
    return f"{conninfo}{'&' if '?' in conninfo else '?'}options={quote(options, safe='')}"


def test_public_create_is_granted_back_after_the_limited_role_is_done() -> None:
    # Given a schema where PUBLIC may create (as public before PostgreSQL 15)
    require_service(POSTGRES_URL, "PostgreSQL")
    schema = f"idembus_acl_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {schema}")
        admin.execute(f"GRANT CREATE ON SCHEMA {schema} TO PUBLIC")
    may_create = "SELECT has_schema_privilege('public', %s, 'CREATE')"
    try:
        # When PUBLIC's right is revoked for a test, and the test is done
        with create_revoked_from_public(POSTGRES_URL, schema):
            with psycopg.connect(POSTGRES_URL) as probe:
                assert probe.execute(may_create, (schema,)).fetchone() == (False,)

        # Then PUBLIC may create there again
        with psycopg.connect(POSTGRES_URL) as probe:
            assert probe.execute(may_create, (schema,)).fetchone() == (True,)
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA {schema}")


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


@contextlib.contextmanager
def row_locked(storage: PostgresStorage, aggregate_id: str) -> Iterator[None]:
    """Another session holds the lock of an aggregate's row (a long transaction, a
    migration) while inside."""
    with psycopg.connect(POSTGRES_URL) as holder:
        holder.execute(f"SELECT 1 FROM {storage._aggregates} WHERE aggregate_type = 'Account' "
                       "AND aggregate_id = %s FOR UPDATE", (aggregate_id,))
        yield
        holder.rollback()


@pytest.mark.parametrize("setting, sqlstate", [
    ({"lock_timeout": "100"}, "55P03"),
    ({"statement_timeout": "100"}, "57014"),
], ids=["lock_timeout", "statement_timeout"])
def test_a_lock_not_granted_in_time_is_waited_out_and_the_commit_then_applies(
    storage: PostgresStorage, setting: dict[str, str], sqlstate: str,
) -> None:
    # Given an aggregate whose row another session holds, and an endpoint that gives up
    # waiting for a lock after 100 ms
    storage.commit(AggregateRecord("Account", "a"), key="H/m1", state={"balance": 1},
                   outgoing=())
    impatient = PostgresStorage(with_settings(POSTGRES_URL, **setting),
                                table_prefix=prefix_of(storage))
    try:
        loaded = impatient.load("Account", "a")

        # When it commits while the row is held
        with row_locked(storage, "a"), pytest.raises(StorageUnavailable) as raised:
            impatient.commit(loaded, key="H/m2", state={"balance": 2}, outgoing=())

        # Then that is an outage (the message keeps its place), not the message's fault
        assert type(raised.value) is StorageUnavailable
        assert sqlstate in str(raised.value)

        # And once the row is free the same commit applies
        impatient.commit(loaded, key="H/m2", state={"balance": 2}, outgoing=())
        assert storage.load("Account", "a").state == {"balance": 2}
    finally:
        impatient.close()


def test_a_server_turned_read_only_is_an_outage_and_its_connection_is_not_used_again(
    storage: PostgresStorage,
) -> None:
    # Given an endpoint whose pooled connection is to a server that turned read-only, as
    # the old primary does when a failover makes it a standby
    with storage._connection() as connection:
        connection.execute("SET default_transaction_read_only = on")

    # When it commits
    with pytest.raises(StorageUnavailable) as raised:
        storage.commit(AggregateRecord("Account", "a"), key="H/m1", state={"balance": 1},
                       outgoing=())

    # Then that is an outage, not the message's fault
    assert type(raised.value) is StorageUnavailable and "25006" in str(raised.value)

    # And the next attempt connects afresh instead of asking the read-only server again
    storage.commit(AggregateRecord("Account", "a"), key="H/m1", state={"balance": 1},
                   outgoing=())
    assert storage.load("Account", "a").state == {"balance": 1}


def test_a_connection_the_administrator_ends_is_an_outage_and_the_next_attempt_reconnects(
    storage: PostgresStorage,
) -> None:
    # Given an endpoint connected under a name of its own
    name = f"idembus-terminated-{uuid.uuid4().hex[:8]}"
    named = PostgresStorage(f"{POSTGRES_URL}?application_name={name}",
                            table_prefix=prefix_of(storage))
    sessions = "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
    try:
        named.load("Account", "a")

        # When an administrator terminates its session
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f"SELECT pg_terminate_backend(pid) FROM ({sessions}) s", (name,))
            assert eventually(lambda: admin.execute(sessions, (name,)).fetchone() is None,
                              timeout=15.0, interval=0.02)

        # Then its next request meets an outage, and the one after reconnects
        with pytest.raises(StorageUnavailable) as raised:
            named.load("Account", "a")
        assert type(raised.value) is StorageUnavailable
        assert named.load("Account", "a").version == 0
    finally:
        named.close()


def test_a_message_postgres_refuses_reaches_the_error_queue_and_the_next_is_applied(
    storage: PostgresStorage,
) -> None:
    # Given an endpoint on PostgreSQL
    suffix = uuid.uuid4().hex[:8]
    transport = KombuTransport("memory://")
    endpoint = Endpoint(f"pg-accounts-{suffix}", transport=transport, storage=storage,
                        handlers=[AccountHandler], error_queue=f"pg-error-{suffix}",
                        recoverability=Recoverability(
                            retries=RetryPolicy(immediate_retries=1, delayed=())))
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
    """memory:// that fails while ``away`` (the broker went down) and notes the ids of the
    messages it put on the wire."""

    def __init__(self, url: str = "memory://", *, away: bool = True) -> None:
        super().__init__(url)
        self.away = away
        self.sent: list[str] = []

    def dispatch(self, envelope: Envelope) -> None:
        if self.away:
            raise TransportUnavailable("the broker is away (simulated)")
        super().dispatch(envelope)
        self.sent.append(envelope.message_id)


def test_two_endpoints_on_one_database_each_repair_their_own_entries_with_their_settings(
    storage: PostgresStorage,
) -> None:
    # Given two endpoints on one PostgreSQL database, each with a storage of its own as
    # in two processes: accounts journals its events and compacts what it dispatched;
    # audit journals nothing and keeps the bodies
    suffix = uuid.uuid4().hex[:8]
    accounts_broker, audit_broker = Away(), Away()
    accounts = Endpoint(f"pg-accounts-{suffix}", transport=accounts_broker, storage=storage,
                        journal=True,
                        outbox=OutboxPolicy(compact_after_dispatch=True, run=False, grace=0))
    audit = Endpoint(f"pg-audit-{suffix}", transport=audit_broker,
                     storage=PostgresStorage(POSTGRES_URL, table_prefix=prefix_of(storage)),
                     journal=False,
                     outbox=OutboxPolicy(compact_after_dispatch=False, run=False, grace=0))
    try:
        # And each committed an operation while its broker was away
        committed = {}
        for endpoint, account in ((accounts, "a"), (audit, "b")):
            with endpoint.unit_of_work(Account, account, operation_id=str(uuid.uuid4())) as work:
                work.state.balance = 5
                event_id = work.bus.publish(Deposited(account=account, amount=5))
            committed[account] = (work.key, event_id)
        accounts_broker.away = audit_broker.away = False

        def entry(account: str) -> Any:
            key = committed[account][0]
            return storage.load("Account", account, key).processed[key]

        # When audit's outbox makes its round
        assert audit.outbox.run_once() == 1

        # Then it sent its own event alone, journaled nothing and kept the body
        assert audit_broker.sent == [committed["b"][1]]
        assert storage.read_journal(after=0) == []
        assert entry("b").dispatched and len(entry("b").outgoing) == 1
        assert not entry("a").dispatched

        # When accounts' outbox makes its round
        assert accounts.outbox.run_once() == 1

        # Then it sent its own event, journaled it and dropped the body, keeping the id
        assert accounts_broker.sent == [committed["a"][1]]
        assert [e.message_id for e in storage.read_journal(after=0)] == [committed["a"][1]]
        assert entry("a").dispatched and entry("a").outgoing == ()
        assert entry("a").outgoing_ids == (committed["a"][1],)
        assert len(entry("b").outgoing) == 1
    finally:
        audit.close()
        accounts.close()


class ClaimsNoted(PostgresStorage):
    """A PostgreSQL storage that notes when its delayed-message poller claimed."""

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self.claims: list[datetime.datetime] = []
        self._claimed = threading.Condition()

    def _claim_due(self, now: datetime.datetime, *, limit: int, lease: float,
                   owner: str | None) -> list[Envelope]:
        found = super()._claim_due(now, limit=limit, lease=lease, owner=owner)
        with self._claimed:
            self.claims.append(now)
            self._claimed.notify_all()
        return found

    def wait_for_claim_after(self, moment: datetime.datetime, timeout: float = 15.0) -> bool:
        with self._claimed:
            return self._claimed.wait_for(
                lambda: any(now > moment for now in self.claims), timeout)


def test_two_endpoints_on_one_database_each_deliver_the_messages_they_deferred(
    storage: PostgresStorage,
) -> None:
    # Given two endpoints on one PostgreSQL database, with brokers that cannot hold
    # messages back (deferred messages wait in the storage)
    suffix = uuid.uuid4().hex[:8]
    sales_broker, billing_broker = Away(away=False), Away(away=False)
    billing_storage = ClaimsNoted(POSTGRES_URL, table_prefix=prefix_of(storage))
    sales = Endpoint(f"pg-sales-{suffix}", transport=sales_broker, storage=storage,
                     outbox=False, delayed_poll_interval=0.05)
    billing = Endpoint(f"pg-billing-{suffix}", transport=billing_broker,
                       storage=billing_storage, outbox=False, delayed_poll_interval=0.05)
    target = f"pg-target-{suffix}"
    sales_broker.declare(target)
    try:
        # When sales defers a command, and billing's poller looks after it is due
        billing.start()
        due = utc_now() + datetime.timedelta(milliseconds=300)
        deferred = sales.bus.send(Deposit(account="a", amount=1), to=target, deliver_at=due)
        assert billing_storage.wait_for_claim_after(due)

        # Then billing leaves it alone
        assert billing_broker.sent == [] and sales_broker.pending(target) == 0

        # When sales runs
        sales.start()

        # Then sales delivers it, with its own broker
        assert eventually(lambda: sales_broker.pending(target) == 1, timeout=15.0,
                          interval=0.02)
        assert sales_broker.sent == [deferred] and billing_broker.sent == []
    finally:
        billing.close()
        sales.close()


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
