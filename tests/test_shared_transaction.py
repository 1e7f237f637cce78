"""The PostgreSQL transport beside a PostgreSQL storage in the same database: a handler's
commit, its outgoing messages and the removal of the incoming message are one transaction
(README, "The guarantee, and its limits"; ``idembus.runtime.shared_transaction``).

The failure matrix's rows on this path: a crash before the commit leaves the message to its
redelivery; after the commit nothing is delivered again and nothing is sent twice; a
failure inside the transaction leaves nothing half done; a duplicate from outside is
deduplicated and sends nothing; a destination nobody declared falls back to commit-then-
dispatch, which parks it.
"""

from __future__ import annotations

import contextlib
import datetime
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg
import pytest

from idembus import Endpoint
from idembus import headers as h
from idembus.envelope import Envelope
from idembus.handlers import Handler, handles
from idembus.storage.memory import MemoryStorage
from idembus.storage.postgres import PostgresStorage
from idembus.testing import wait_until_idle
from idembus.testing.faults import CrashPoint
from idembus.transports.base import Delivery
from idembus.transports.postgres import PostgresTransport
from tests.conftest import POSTGRES_URL, require_service
from tests.hostile import Pinger
from tests.support import Account, AccountHandler, Deposit, Ledger, SignalCounter
from tests.test_failure_matrix import CrashAt, first_outgoing_id

pytestmark = pytest.mark.postgres


class Shop:
    """An accounts endpoint and a ledger endpoint on the PostgreSQL transport, each with
    a PostgreSQL storage in the same database (tables of their own)."""

    def __init__(self, unique: str) -> None:
        self.unique = unique
        self.transports: list[PostgresTransport] = []
        self.storages: list[PostgresStorage] = []
        self.endpoints: list[Endpoint] = []

    def transport(self, **options: Any) -> PostgresTransport:
        self.transports.append(PostgresTransport(POSTGRES_URL, table_prefix=f"q{self.unique}",
                                                 **options))
        return self.transports[-1]

    def storage(self, name: str) -> PostgresStorage:
        self.storages.append(PostgresStorage(POSTGRES_URL,
                                             table_prefix=f"{name}{self.unique}"))
        return self.storages[-1]

    def endpoint(self, name: str, **options: Any) -> Endpoint:
        options.setdefault("transport", self.transport())
        options.setdefault("storage", self.storage(name))
        options.setdefault("error_queue", f"error-{self.unique}")
        self.endpoints.append(Endpoint(f"{name}-{self.unique}", **options))
        return self.endpoints[-1]

    def close(self) -> None:
        for endpoint in self.endpoints:
            endpoint.close()  # closes their storages, whose tables go with fresh ones:
        for storage in self.storages:
            storage.close()
            dropper = PostgresStorage(storage.conninfo, table_prefix=storage.table_prefix)
            dropper.drop_tables()
            dropper.close()
        if self.transports:
            self.transports[0].drop_tables()
        for transport in self.transports:
            transport.close()


@pytest.fixture
def shop(unique: str) -> Iterator[Shop]:
    require_service(POSTGRES_URL, "PostgreSQL")
    made = Shop(unique)
    yield made
    made.close()


def accounts_and_ledger(shop: Shop, **options: Any) -> tuple[Endpoint, Endpoint, Ledger]:
    options.setdefault("handlers", [AccountHandler])
    accounts = shop.endpoint("accounts", **options)
    ledger = Ledger()
    downstream = shop.endpoint("ledger", handlers=[ledger])
    for endpoint in (accounts, downstream):
        endpoint.start()
    return accounts, downstream, ledger


def account(endpoint: Endpoint, name: str) -> Account:
    return Account.model_validate(endpoint.storage.load("Account", name).state)


class Seen(Handler):
    """Notes every Deposit (a stateless handler: its own inbox record, its own commit)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    @handles
    def deposit(self, message: Deposit) -> None:
        self.seen.append(self.context.message_id)


class _Dying:
    """A statement part whose result ends the database session running it."""

    def __init__(self, part: Any) -> None:
        self._part = part
        self.inputs, self.precondition, self.params = part.inputs, part.precondition, part.params
        self.result = (f"(SELECT CASE WHEN pg_terminate_backend(pg_backend_pid()) "
                       f"THEN {part.result} END)")

    def effects(self, guard: str) -> str:
        return str(self._part.effects(guard))

    def enqueued(self, result: Any) -> Any:
        return self._part.enqueued(result)


class Deletes:
    """Counts the acknowledgements a transport makes apart from a commit (its DELETEs)."""

    def __init__(self, transport: PostgresTransport, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = transport._delete

        def counted(delivery: Any) -> None:
            self.count += 1
            original(delivery)

        monkeypatch.setattr(transport, "_delete", counted)


def test_the_commit_sends_and_acknowledges_in_one_transaction_without_the_outbox(
    shop: Shop, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given accounts and ledger endpoints whose queues are in their storages' database
    accounts, downstream, ledger = accounts_and_ledger(shop)
    assert accounts.shared_transaction is not None
    acknowledgements = Deletes(accounts.transport, monkeypatch)  # type: ignore[arg-type]
    dispatched = SignalCounter(accounts, "dispatched")
    recorded = SignalCounter(downstream, "handled")

    # When a deposit is handled
    deposit_id = accounts.bus.send(Deposit(account="a", amount=5))
    assert recorded.wait_for(1)
    wait_until_idle([accounts, downstream])

    # Then its Deposited reached the ledger, and the processed entry was born dispatched:
    # no mark, nothing for the outbox
    expected = first_outgoing_id(accounts, deposit_id)
    assert ledger.entries == [(expected, "a", 5)]
    assert [d["message_id"] for d in dispatched.details] == [expected]
    key = f"AccountHandler/{deposit_id}"
    entry = accounts.storage.load("Account", "a", key).processed[key]
    assert entry.dispatched and entry.outgoing == () and entry.outgoing_ids == (expected,)
    later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
    assert accounts.storage.undispatched(committed_before=later) == []
    # And the deposit left its queue in that transaction: no acknowledgement of its own
    assert acknowledgements.count == 0
    assert accounts.transport.pending(accounts.name) == 0


@pytest.mark.parametrize(("point", "deliveries"), [
    (CrashPoint.BEFORE_COMMIT, 2), (CrashPoint.AFTER_COMMIT, 1), (CrashPoint.AFTER_DISPATCH, 1),
], ids=lambda value: value.value if isinstance(value, CrashPoint) else str(value))
def test_a_crash_before_the_commit_is_redelivered_and_after_it_nothing_comes_again(
    shop: Shop, point: CrashPoint, deliveries: int,
) -> None:
    # Given an endpoint that dies at one point (after the commit, other transports deliver
    # the message again, and its duplicate sends what was stored)
    deposit_id = str(uuid.uuid4())
    crash = CrashAt(point, deposit_id)
    accounts, downstream, ledger = accounts_and_ledger(shop, middleware=[crash])
    received = SignalCounter(accounts, "received")
    recorded = SignalCounter(downstream, "handled")

    # When a deposit arrives
    accounts.bus.send(Deposit(account="a", amount=5), message_id=deposit_id)

    # Then before the commit, the redelivery applies it; after it, the message left its
    # queue with the commit: no redelivery, no duplicate; either way the deposit is applied
    # once and the ledger gets its Deposited once
    assert recorded.wait_for(1)
    wait_until_idle([accounts, downstream])
    assert crash.crashes == 1
    assert received.count == deliveries
    assert accounts.counters["duplicate"] == 0 and accounts.counters["redispatched"] == 0
    assert account(accounts, "a") == Account(balance=5, deposits=1)
    assert ledger.entries == [(first_outgoing_id(accounts, deposit_id), "a", 5)]
    assert downstream.counters["received"] == 1


def test_a_connection_lost_inside_the_commit_leaves_nothing_half_done(
    shop: Shop, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a commit whose database session dies once in the middle of its statement, after
    # the write, the inserts and the deletion ran and before it could commit
    transport = shop.transport()
    deaths = [1]
    original = transport.part

    def dying_once(envelopes: Any, **options: Any) -> Any:
        part = original(envelopes, **options)
        if not deaths[0] or options.get("remove") is None:  # a send, not a commit
            return part
        deaths[0] -= 1
        return _Dying(part)

    monkeypatch.setattr(transport, "part", dying_once)
    accounts, downstream, ledger = accounts_and_ledger(shop, transport=transport)
    recorded = SignalCounter(downstream, "handled")

    # When a deposit is handled
    accounts.bus.send(Deposit(account="a", amount=5))

    # Then the lost statement left nothing (the attempt after the outage is no duplicate),
    # and that attempt applied the deposit and sent its event, once
    assert recorded.wait_for(1)
    wait_until_idle([accounts, downstream])
    assert deaths == [0]
    assert accounts.counters["duplicate"] == 0 and accounts.counters["handled"] == 1
    assert account(accounts, "a") == Account(balance=5, deposits=1)
    assert len(ledger.entries) == 1 and downstream.counters["received"] == 1
    assert transport.pending(accounts.name) == 0


def test_a_duplicate_from_outside_is_deduplicated_and_sends_nothing(shop: Shop) -> None:
    accounts, downstream, ledger = accounts_and_ledger(shop)
    duplicate = SignalCounter(accounts, "duplicate")
    recorded = SignalCounter(downstream, "handled")
    deposit_id = str(uuid.uuid4())

    # When a publisher sends one deposit twice, the second after the first was handled
    accounts.bus.send(Deposit(account="a", amount=5), message_id=deposit_id)
    assert recorded.wait_for(1)
    accounts.bus.send(Deposit(account="a", amount=5), message_id=deposit_id)

    # Then the second is a duplicate, which sends nothing again (the event went out with
    # the commit), and leaves the queue
    assert duplicate.wait_for(1)
    wait_until_idle([accounts, downstream])
    assert account(accounts, "a") == Account(balance=5, deposits=1)
    assert accounts.counters["redispatched"] == 0
    assert len(ledger.entries) == 1 and downstream.counters["received"] == 1
    assert accounts.transport.pending(accounts.name) == 0


def test_a_reply_to_a_queue_nobody_declared_falls_back_and_is_parked(shop: Shop) -> None:
    # Given an endpoint that replies to every Ping
    pinger = shop.endpoint("pinger", handlers=[Pinger])
    pinger.start()
    handled = SignalCounter(pinger, "handled")

    # When a Ping asks for the reply in a queue nobody declared
    ping_id = str(uuid.uuid4())
    pinger.transport.send(Envelope(
        {h.MESSAGE_ID: ping_id, h.MESSAGE_TYPE: "test.Ping", h.REPLY_TO: "nobody-declared"},
        '{"note": "hi"}', pinger.name))

    # Then the Ping is handled once and acknowledged, and the Pong is parked with the reason
    assert handled.wait_for(1)
    wait_until_idle([pinger])
    [parked] = pinger.storage.parked_messages(pinger.name)
    assert parked.envelope.message_type == "test.Pong"
    assert parked.envelope.destination == "nobody-declared"
    assert "no endpoint declared it" in parked.envelope.headers[h.EXCEPTION_MESSAGE]
    assert pinger.transport.pending(pinger.name) == 0


def test_the_last_of_several_handlers_takes_the_message_with_its_commit(
    shop: Shop, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given an endpoint with two handlers of Deposit, each committing on its own
    seen = Seen()
    accounts, downstream, _ = accounts_and_ledger(shop, handlers=[AccountHandler, seen])
    acknowledgements = Deletes(accounts.transport, monkeypatch)  # type: ignore[arg-type]
    recorded = SignalCounter(downstream, "handled")

    # When a deposit is handled by both
    deposit_id = accounts.bus.send(Deposit(account="a", amount=5))
    assert recorded.wait_for(1)
    wait_until_idle([accounts, downstream])

    # Then both committed, and the message left its queue with the last commit
    assert seen.seen == [deposit_id]
    assert account(accounts, "a") == Account(balance=5, deposits=1)
    assert acknowledgements.count == 0
    assert accounts.transport.pending(accounts.name) == 0


@pytest.mark.parametrize(("storage", "option", "shared"), [
    ("postgres", {}, True),
    ("postgres", {"shared_transactions": False}, False),
    ("memory", {}, False),
    ("other database", {}, False),
], ids=["same-database", "turned-off", "other-storage", "other-database"])
def test_only_a_storage_in_the_same_database_shares_the_transaction(
    shop: Shop, storage: str, option: dict[str, Any], shared: bool,
) -> None:
    makers: dict[str, Callable[[], Any]] = {
        "postgres": lambda: shop.storage("same"),
        "memory": MemoryStorage,
        "other database": lambda: PostgresStorage(
            POSTGRES_URL.rsplit("/", 1)[0] + "/elsewhere", table_prefix="never"),
    }
    endpoint = shop.endpoint("sharing", transport=shop.transport(**option),
                             storage=makers[storage](), handlers=[AccountHandler])
    assert (endpoint.shared_transaction is not None) is shared


class Replayed(Delivery):
    """A message a tool brings itself (``idembus spark replay`` does so)."""

    def __init__(self, message_id: str) -> None:
        super().__init__(queue="replay", headers={h.MESSAGE_ID: message_id,
                                                  h.MESSAGE_TYPE: "test.Deposit"},
                         body=b'{"account": "r", "amount": 3}', content_type=h.CONTENT_TYPE,
                         redelivered=False)
        self.acked = False

    def _ack(self) -> None:
        self.acked = True

    def _requeue(self) -> None:
        raise AssertionError("a replayed message is never requeued here")


def test_a_message_a_tool_brings_itself_is_committed_with_its_messages_and_acked_as_usual(
    shop: Shop,
) -> None:
    # Given an endpoint on the shared path, not consuming, and a ledger that is
    accounts = shop.endpoint("accounts", handlers=[AccountHandler])
    ledger = Ledger()
    downstream = shop.endpoint("ledger", handlers=[ledger])
    downstream.start()
    accounts.storage.verify()
    recorded = SignalCounter(downstream, "handled")

    # When a tool hands it a delivery of its own
    replayed = Replayed(str(uuid.uuid4()))
    accounts.process(replayed)

    # Then the deposit is applied, its event sent with the commit, and the tool's delivery
    # acknowledged its own way (no row of the queue table was touched for it)
    assert recorded.wait_for(1)
    assert replayed.acked
    assert account(accounts, "r") == Account(balance=3, deposits=1)
    assert len(ledger.entries) == 1


@contextlib.contextmanager
def commits_noted(tables: Sequence[str], unique: str) -> Iterator[Callable[[], list[Any]]]:
    """Note, at the commit of each transaction that inserts into one of ``tables``, the
    table and the ``synchronous_commit`` the commit runs with (a deferred trigger fires at
    commit, after every statement of the transaction)."""
    notes, note = f"commits_{unique}", f"note_commit_{unique}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {notes} (tbl text, synchronous_commit text)")
        admin.execute(f"CREATE FUNCTION {note}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                      f"INSERT INTO {notes} VALUES (TG_TABLE_NAME, "
                      "current_setting('synchronous_commit')); RETURN NULL; END $$")
        for table in tables:
            admin.execute(f"CREATE CONSTRAINT TRIGGER {note} AFTER INSERT ON {table} "
                          f"DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {note}()")

    def read() -> list[Any]:
        with psycopg.connect(POSTGRES_URL) as reader:
            return reader.execute(f"SELECT DISTINCT tbl, synchronous_commit FROM {notes} "
                                  "ORDER BY 1").fetchall()

    try:
        yield read
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            for table in tables:
                admin.execute(f"DROP TRIGGER IF EXISTS {note} ON {table}")
            admin.execute(f"DROP FUNCTION {note}()")
            admin.execute(f"DROP TABLE {notes}")


def test_sends_and_shared_commits_wait_for_the_disk_and_the_synchronous_standby(
    shop: Shop,
) -> None:
    # Given accounts and ledger endpoints sharing their transactions with the queues, and
    # a note of the synchronous_commit each insert's transaction commits with
    accounts, downstream, ledger = accounts_and_ledger(shop)
    assert accounts.shared_transaction is not None
    messages = accounts.transport.schema.messages  # type: ignore[attr-defined]
    processed = accounts.storage._processed  # type: ignore[attr-defined]
    recorded = SignalCounter(downstream, "handled")
    with commits_noted([messages, processed], shop.unique) as noted:
        # When a deposit is sent from outside and handled (its Deposited sent in the commit)
        accounts.bus.send(Deposit(account="a", amount=5))
        assert recorded.wait_for(1)
        wait_until_idle([accounts, downstream])

        # Then the send and the commit waited for the disk (and for a synchronous standby:
        # one that returned sooner would be forgotten by a crash or a failover); only the
        # wake-up that follows each, in a transaction of its own, does not
        assert sorted(noted()) == sorted([(messages, "on"), (processed, "on")])
