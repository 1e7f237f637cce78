"""Batched processing on the real services (issue 15, points 1-4): PostgreSQL's group
commit and load in one pipeline, RabbitMQ's pipelined publisher confirms and multiple
acknowledgements, and whole endpoints consuming in batches on memory:// and on RabbitMQ
with PostgreSQL."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import amqp
import psycopg
import pytest

from idembus import Batching, Endpoint
from idembus import headers as h
from idembus.envelope import Envelope
from idembus.handlers import Handler, handles
from idembus.messages import message_name
from idembus.storage.base import INBOX, AggregateRecord, PendingCommit
from idembus.storage.errors import AlreadyProcessed, ConcurrencyConflict
from idembus.storage.memory import MemoryStorage
from idembus.storage.postgres import PostgresStorage
from idembus.transports import confirms
from idembus.transports.errors import DestinationRefused, TransportUnavailable
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL, POSTGRES_URL
from tests.support import AccountHandler, Deposit, Ledger, SignalCounter, eventually

ACCOUNT = AccountHandler.storage_name()


class PipelineCount:
    """How many pipelines psycopg entered, how many explicit syncs (round trips inside a
    pipeline) and how many statements were executed meanwhile."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pipelines = 0
        self.syncs = 0
        self.statements = 0
        self.inside = 0
        enter, execute = psycopg.Connection.pipeline, psycopg.Connection.execute
        sync = psycopg.Pipeline.sync
        count = self

        def pipeline(connection: Any) -> Any:
            count.pipelines += 1
            return _Counted(enter(connection), count)

        def counted_execute(connection: Any, *args: Any, **kwargs: Any) -> Any:
            if count.inside:
                count.statements += 1
            return execute(connection, *args, **kwargs)

        def counted_sync(pipe: Any) -> None:
            count.syncs += 1
            sync(pipe)

        monkeypatch.setattr(psycopg.Connection, "pipeline", pipeline)
        monkeypatch.setattr(psycopg.Connection, "execute", counted_execute)
        monkeypatch.setattr(psycopg.Pipeline, "sync", counted_sync)


class _Counted:
    def __init__(self, context: Any, count: PipelineCount) -> None:
        self._context, self._count = context, count

    def __enter__(self) -> Any:
        self._count.inside += 1
        return self._context.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        self._count.inside -= 1
        return self._context.__exit__(*exc)


def pending(storage: PostgresStorage, account: str, key: str, balance: int) -> PendingCommit:
    return PendingCommit(storage.load(ACCOUNT, account, key), key, {"balance": balance}, ())


@pytest.mark.postgres
def test_postgres_commits_a_group_in_one_pipeline_each_write_on_its_own(
        postgres_storage: PostgresStorage, monkeypatch: pytest.MonkeyPatch):
    postgres_storage.commit(AggregateRecord(ACCOUNT, "moved"), key="k0", state={"balance": 1},
                    outgoing=())
    postgres_storage.commit(AggregateRecord(ACCOUNT, "seen"), key="k-seen", state={"balance": 1},
                    outgoing=())
    group = [pending(postgres_storage, f"fresh-{n}", f"k{n}", n) for n in range(4)]
    stale = PendingCommit(AggregateRecord(ACCOUNT, "moved", version=0), "k-late",
                          {"balance": 9}, ())
    duplicate = PendingCommit(AggregateRecord(ACCOUNT, "seen", version=0), "k-seen",
                              {"balance": 9}, ())
    count = PipelineCount(monkeypatch)

    results = postgres_storage.commit_many(
        [group[0], stale, group[1], duplicate, group[2], group[3]])

    # Six creations (two of aggregates that exist meanwhile): one statement, after the one
    # that locks the batch's aggregates in one order
    assert count.pipelines == 1 and count.syncs == 0 and count.statements == 2
    assert [type(result) for result in results] == [
        type(None), ConcurrencyConflict, type(None), AlreadyProcessed, type(None), type(None)]
    monkeypatch.undo()
    assert [postgres_storage.load(ACCOUNT, f"fresh-{n}").state for n in range(4)] == [
        {"balance": n} for n in range(4)]
    assert postgres_storage.load(ACCOUNT, "moved").state == {"balance": 1}


@pytest.mark.postgres
def test_postgres_updates_a_group_of_aggregates_in_one_statement_each_on_its_own(
        postgres_storage: PostgresStorage, monkeypatch: pytest.MonkeyPatch):
    for name in ("a", "b", "c", "moved", "seen"):
        postgres_storage.commit(AggregateRecord(ACCOUNT, name), key=f"first-{name}",
                                state={"balance": 1}, outgoing=())
    postgres_storage.commit(postgres_storage.load(ACCOUNT, "moved"), key="moved-on",
                            state={"balance": 2}, outgoing=())
    sent = event()
    updates = [PendingCommit(postgres_storage.load(ACCOUNT, name), f"k-{name}",
                             {"balance": 10 + n}, (sent,) if name == "b" else ())
               for n, name in enumerate(("a", "b", "c"))]
    stale = PendingCommit(AggregateRecord(ACCOUNT, "moved", version=1), "k-late",
                          {"balance": 9}, ())
    # Loaded before its own first commit: refused, and found processed.
    seen = PendingCommit(AggregateRecord(ACCOUNT, "seen", version=0, state=None),
                         "first-seen", {"balance": 9}, ())
    created = pending(postgres_storage, "new", "k-new", 7)
    count = PipelineCount(monkeypatch)

    results = postgres_storage.commit_many([updates[2], stale, created, updates[0], seen,
                                            updates[1]])

    # The four updates (three that apply, one stale) are one statement; the creation and
    # the commit of an aggregate loaded as absent are another (after the locks).
    assert count.pipelines == 1 and count.syncs == 0 and count.statements == 3
    assert [type(result) for result in results] == [
        type(None), ConcurrencyConflict, type(None), type(None), AlreadyProcessed, type(None)]
    monkeypatch.undo()
    for n, name in enumerate(("a", "b", "c")):
        record = postgres_storage.load(ACCOUNT, name, f"k-{name}")
        assert record.state == {"balance": 10 + n} and record.version == 2
        entry = record.processed[f"k-{name}"]
        assert entry.outgoing == ((sent,) if name == "b" else ())
        assert entry.outgoing_ids == ((sent.message_id,) if name == "b" else ())
        assert entry.dispatched is (name != "b")
    moved = postgres_storage.load(ACCOUNT, "moved", "k-late")
    assert moved.state == {"balance": 2} and moved.version == 2 and not moved.processed
    assert postgres_storage.load(ACCOUNT, "new").state == {"balance": 7}


@pytest.mark.postgres
def test_postgres_records_a_group_of_inbox_entries_in_one_statement_each_on_its_own(
        postgres_storage: PostgresStorage, monkeypatch: pytest.MonkeyPatch):
    sent = event()
    postgres_storage.commit(AggregateRecord(INBOX, "m-seen"), key="m-seen", state=None,
                            outgoing=(sent,))
    entries = [PendingCommit(AggregateRecord(INBOX, f"m-{n}"), f"m-{n}", None,
                             (event(),) if n == 1 else ()) for n in range(3)]
    seen = PendingCommit(AggregateRecord(INBOX, "m-seen"), "m-seen", None, ())
    # The same new aggregate twice in one group: the first is created, the second refused
    twice = [pending(postgres_storage, "twice", f"k-twice-{n}", n) for n in range(2)]
    count = PipelineCount(monkeypatch)

    results = postgres_storage.commit_many([entries[2], seen, twice[0], entries[0], twice[1],
                                            entries[1], entries[1]])

    # The inbox entries are one statement, the first creation of "twice" another, its
    # second creation its own (after the locks)
    assert count.pipelines == 1 and count.syncs == 0 and count.statements == 4
    assert [type(result) for result in results] == [
        type(None), AlreadyProcessed, type(None), type(None), ConcurrencyConflict,
        type(None), AlreadyProcessed]
    assert tuple(results[1].outgoing) == (sent,)  # type: ignore[union-attr]
    monkeypatch.undo()
    for n in range(3):
        entry = postgres_storage.load(INBOX, f"m-{n}", f"m-{n}").processed[f"m-{n}"]
        assert entry.outgoing == entries[n].outgoing
        assert entry.dispatched is (n != 1)
    record = postgres_storage.load(ACCOUNT, "twice", "k-twice-0")
    assert record.state == {"balance": 0} and record.version == 1
    assert "k-twice-0" in record.processed
    assert not postgres_storage.load(ACCOUNT, "twice", "k-twice-1").processed


@pytest.mark.postgres
def test_a_postgres_statement_that_fails_lets_the_rest_of_its_group_commit(
        postgres_storage: PostgresStorage):
    good = pending(postgres_storage, "good", "k-good", 1)
    # PostgreSQL's jsonb cannot hold \u0000: this one statement fails.
    bad = PendingCommit(postgres_storage.load(ACCOUNT, "bad", "k-bad"), "k-bad",
                        {"balance": 2, "note": "nul \u0000 here"}, ())
    last = pending(postgres_storage, "last", "k-last", 3)

    results = postgres_storage.commit_many([good, bad, last])

    assert results[0] is None and results[2] is None and isinstance(results[1], Exception)
    assert postgres_storage.load(ACCOUNT, "good").state == {"balance": 1}
    assert postgres_storage.load(ACCOUNT, "last").state == {"balance": 3}
    assert not postgres_storage.load(ACCOUNT, "bad").exists


@pytest.mark.postgres
def test_postgres_loads_a_group_in_one_round_trip_and_one_statement(
        postgres_storage: PostgresStorage, monkeypatch: pytest.MonkeyPatch):
    postgres_storage.commit(AggregateRecord(ACCOUNT, "a"), key="k1", state={"balance": 5},
                            outgoing=())
    postgres_storage.commit(AggregateRecord(INBOX, "m1"), key="m1", state=None, outgoing=())
    count = PipelineCount(monkeypatch)

    records = postgres_storage.load_many([
        (ACCOUNT, "a", "k1"), (INBOX, "m1", "m1"), (ACCOUNT, "b", "k2"), (INBOX, "m2", "m2"),
        (ACCOUNT, "a", "k3"), (ACCOUNT, "a", None)])

    # The aggregates' four loads are one statement, the inbox loads another.
    assert count.pipelines == 1 and count.syncs == 0 and count.statements == 2
    assert [type(record) for record in records] == [AggregateRecord] * 6
    assert records == [postgres_storage.load(*request) for request in [
        (ACCOUNT, "a", "k1"), (INBOX, "m1", "m1"), (ACCOUNT, "b", "k2"), (INBOX, "m2", "m2"),
        (ACCOUNT, "a", "k3"), (ACCOUNT, "a", None)]]
    first, inbox, missing, new_inbox, again, keyless = records
    assert isinstance(first, AggregateRecord) and "k1" in first.processed
    assert first.state == {"balance": 5} and first.version == 1
    assert isinstance(inbox, AggregateRecord) and "m1" in inbox.processed
    assert isinstance(missing, AggregateRecord) and not missing.exists
    assert isinstance(new_inbox, AggregateRecord) and not new_inbox.processed
    assert isinstance(again, AggregateRecord) and again.version == 1 and not again.processed
    assert isinstance(keyless, AggregateRecord) and keyless.version == 1
    assert not keyless.processed


def event(type_name: str = "test.Deposited") -> Envelope:
    return Envelope(headers={h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: type_name},
                    body="{}", destination=None)


def command(queue: str) -> Envelope:
    return Envelope(headers={h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Deposit"},
                    body="{}", destination=queue)


class WaitCount:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.waits = 0
        wait = confirms.ConfirmingChannel.wait
        count = self

        def counted(channel: Any, timeout: float) -> Any:
            count.waits += 1
            return wait(channel, timeout)

        monkeypatch.setattr(confirms.ConfirmingChannel, "wait", counted)


@pytest.mark.amqp
def test_rabbitmq_publishes_a_group_with_one_confirm_wait(rabbitmq, monkeypatch):
    transport, name = rabbitmq
    queue, idle = name("sink"), name("nobody")
    transport.declare(queue, subscriptions=["test.Deposited"])
    transport.publish(event())  # the first publish declares the exchange, alone
    assert transport.get(queue) is not None
    waits = WaitCount(monkeypatch)
    envelopes = [event(), command(queue), event("test.Nobody"), command(idle), event()]

    results = transport.dispatch_many(envelopes)

    assert waits.waits == 1
    assert results[0] is True and results[1] is None and results[2] is False
    assert isinstance(results[3], DestinationRefused) and results[4] is True
    received = []
    while (delivery := transport.get(queue)) is not None:
        received.append(delivery.headers[h.MESSAGE_ID])
    assert received == [envelopes[0].message_id, envelopes[1].message_id,
                        envelopes[4].message_id]


@pytest.mark.amqp
def test_a_group_is_published_without_reading_the_socket_between_messages(rabbitmq,
                                                                            monkeypatch):
    transport, name = rabbitmq
    queue = name("sink")
    transport.declare(queue, subscriptions=["test.Deposited"])
    transport.publish(event())  # declares the exchange
    assert transport.dispatch_many([event()]) == [True]  # opens the confirming channel
    reads: list[str] = []
    drain = amqp.Connection.drain_events

    def counted(connection: Any, *args: Any, **kwargs: Any) -> Any:
        reads.append("during wait" if waiting else "between publishes")
        return drain(connection, *args, **kwargs)

    waiting = False
    wait = confirms.ConfirmingChannel.wait

    def waited(channel: Any, timeout: float) -> Any:
        nonlocal waiting
        waiting = True
        try:
            return wait(channel, timeout)
        finally:
            waiting = False

    monkeypatch.setattr(amqp.Connection, "drain_events", counted)
    monkeypatch.setattr(confirms.ConfirmingChannel, "wait", waited)

    results = transport.dispatch_many([event() for _ in range(20)])

    assert "between publishes" not in reads and "during wait" in reads
    assert results == [True] * 20 and transport.pending(queue) == 22
    # Only that connection's properties changed: a new connection still announces it.
    assert amqp.Connection.negotiate_capabilities["connection.blocked"] is True
    with transport._channel() as channel:
        capabilities = channel.connection.client_properties["capabilities"]
        assert capabilities["connection.blocked"] is True


@pytest.mark.amqp
def test_a_group_larger_than_one_write_goes_out_whole_and_in_order(rabbitmq):
    # Given six sends of 100 kB each: more than the frames kept for one write
    transport, name = rabbitmq
    queue = name("sink")
    transport.declare(queue)
    envelopes = [Envelope(headers={h.MESSAGE_ID: str(uuid.uuid4()),
                                   h.MESSAGE_TYPE: "test.Deposit"},
                          body=f'{{"n": {n}, "pad": "{"x" * 100_000}"}}', destination=queue)
                 for n in range(6)]

    # When they are dispatched as one group
    results = transport.dispatch_many(envelopes)

    # Then each is confirmed, and the queue holds them in the order given, whole
    assert results == [None] * 6
    received = []
    while (delivery := transport.get(queue)) is not None:
        received.append((delivery.headers[h.MESSAGE_ID], len(delivery.body)))
    assert received == [(envelope.message_id, len(envelope.body)) for envelope in envelopes]


@pytest.mark.amqp
def test_a_message_the_broker_nacks_is_an_outage_for_its_sender_only(rabbitmq):
    transport, name = rabbitmq
    full = name("full")
    # A queue that refuses publishes once it holds one message: RabbitMQ nacks them.
    limited = KombuTransport(AMQP_URL, exchange=transport.exchange_name, queue_type="classic",
                             queue_arguments={"x-max-length": 1,
                                              "x-overflow": "reject-publish"})
    try:
        limited.declare(full)
        first, second = command(full), command(full)

        results = transport.dispatch_many([first, second])

        assert results[0] is None
        assert isinstance(results[1], TransportUnavailable) and "nack" in str(results[1])
    finally:
        limited.close()


@pytest.mark.amqp
def test_rabbitmq_acknowledges_consecutive_deliveries_with_one_multiple_ack(rabbitmq):
    transport, name = rabbitmq
    queue = name("acks")
    transport.declare(queue)
    for _ in range(4):
        transport.send(command(queue))
    batches: list[list[bool]] = []
    stop = threading.Event()

    def on_batch(deliveries: Any) -> None:
        transport.ack_many(deliveries)
        assert all(delivery.settled for delivery in deliveries)
        # What kombu marked acknowledged: with one basic.ack (multiple), only the last.
        batches.append([delivery._message.acknowledged for delivery in deliveries])
        if sum(map(len, batches)) >= 4:
            stop.set()

    transport.consume_batches(queue, on_batch, stop=stop, prefetch=8, size=8, linger=0.5)

    assert sum(map(len, batches)) == 4 and max(map(len, batches)) > 1
    assert all(marks == [False] * (len(marks) - 1) + [True] for marks in batches)
    assert transport.pending(queue) == 0


@pytest.mark.amqp
def test_a_delivery_that_comes_alone_is_handed_over_without_waiting_the_linger(rabbitmq):
    """Light load: batching must not add its linger to a lone message's latency."""
    transport, name = rabbitmq
    queue = name("alone")
    transport.declare(queue)
    batches: list[int] = []
    arrived = threading.Event()
    stop = threading.Event()

    def on_batch(deliveries: Any) -> None:
        transport.ack_many(deliveries)
        batches.append(len(deliveries))
        arrived.set()

    consumer = threading.Thread(target=transport.consume_batches, args=(queue, on_batch),
                                kwargs={"stop": stop, "prefetch": 8, "size": 8, "linger": 60})
    consumer.start()
    try:
        transport.send(command(queue))
        # Held for the linger, it would come after 60 s.
        assert arrived.wait(20), "the lone delivery waited for the linger"
        assert batches == [1]
    finally:
        stop.set()
        consumer.join(30)
    assert transport.pending(queue) == 0


@pytest.mark.amqp
def test_deliveries_the_broker_has_sent_join_the_batch_past_the_linger(rabbitmq):
    """Under load (messages waiting), a batch takes what is in the socket already, even with
    no linger: without it a batch held one or two deliveries and paid its load, commit,
    acknowledgement and confirm wait for them alone."""
    transport, name = rabbitmq
    queue = name("sent")
    transport.declare(queue)
    for _ in range(8):
        transport.send(command(queue))
    batches: list[int] = []
    stop = threading.Event()

    def on_batch(deliveries: Any) -> None:
        transport.ack_many(deliveries)
        batches.append(len(deliveries))
        if sum(batches) >= 8:
            stop.set()

    transport.consume_batches(queue, on_batch, stop=stop, prefetch=8, size=8, linger=0)

    assert sum(batches) == 8 and max(batches) > 2, batches
    assert transport.pending(queue) == 0


def deposits(queue: str, plan: list[tuple[str, str, int]]) -> list[Envelope]:
    return [Envelope(headers={h.MESSAGE_ID: message_id, h.MESSAGE_TYPE: message_name(Deposit),
                              h.INTENT: h.Intent.SEND.value},
                     body=Deposit(account=account, amount=amount).model_dump_json(),
                     destination=queue)
            for message_id, account, amount in plan]


def batch_plan() -> list[tuple[str, str, int]]:
    """60 deposits on 6 accounts, then 15 of them again (duplicates in later batches)."""
    fresh = [(str(uuid.uuid4()), f"acc-{n % 6}", n + 1) for n in range(60)]
    return fresh + fresh[::4]


def run_batched(transport: Any, name: Callable[[str], str], storage: Any) -> None:
    plan = batch_plan()
    sales = Endpoint(name("sales"), transport=transport, storage=storage,
                     handlers=[AccountHandler], error_queue=name("error"),
                     batching=Batching(size=16, linger=0.05), status_interval=0)
    ledger = Ledger()
    billing = Endpoint(name("billing"), transport=transport, storage=storage,
                       handlers=[ledger], error_queue=name("error"), status_interval=0,
                       batching=Batching(size=8))
    handled = SignalCounter(sales, "handled")
    duplicates = SignalCounter(sales, "duplicate")
    conflicts = SignalCounter(sales, "conflict")
    recorded = SignalCounter(billing, "handled")
    try:
        sales.transport.declare(sales.name, subscriptions=sales.subscriptions)
        for envelope in deposits(sales.name, plan):
            transport.send(envelope)
        billing.start()
        sales.start()
        assert handled.wait_for(60, timeout=60) and duplicates.wait_for(15, timeout=60)
        assert recorded.wait_for(60, timeout=60)
        for n in range(6):
            state = storage.load(ACCOUNT, f"acc-{n}").state
            amounts = [amount for _, account, amount in plan[:60] if account == f"acc-{n}"]
            assert state == {"balance": sum(amounts), "deposits": len(amounts)}
        assert conflicts.count == 0
        assert len({entry[0] for entry in ledger.entries}) == len(ledger.entries) == 60
    finally:
        sales.close()
        billing.close()


class HeldDeposits(Handler):
    """Handles deposits; the first one waits in its handler until ``release`` is set."""

    def __init__(self) -> None:
        self.holding = threading.Event()
        self.release = threading.Event()

    @handles
    def deposit(self, message: Deposit) -> None:
        if not self.holding.is_set():
            self.holding.set()
            self.release.wait(30)


@pytest.mark.amqp
def test_with_a_prefetch_of_two_batches_the_next_is_on_its_way_while_one_is_handled(rabbitmq):
    transport, name = rabbitmq
    held = HeldDeposits()
    endpoint = Endpoint(name("held"), transport=transport, storage=MemoryStorage(),
                        handlers=[held], error_queue=name("error"), prefetch=8,
                        batching=Batching(size=4, linger=0), status_interval=0)
    handled = SignalCounter(endpoint, "handled")
    transport.declare(endpoint.name, subscriptions=endpoint.subscriptions)
    for n in range(20):
        transport.send(Envelope(
            headers={h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Deposit"},
            body=f'{{"account": "acc-{n}", "amount": 1}}', destination=endpoint.name))
    endpoint.start()
    try:
        assert held.holding.wait(30)
        # While the first batch is held in its handler, the broker has sent the next batch
        # too: 8 of the 20 have left the queue, not the batch's 4.
        assert eventually(lambda: transport.pending(endpoint.name) == 12, timeout=10), \
            transport.pending(endpoint.name)
        held.release.set()
        assert handled.wait_for(20, timeout=60)
    finally:
        held.release.set()
        endpoint.close()


@pytest.mark.amqp
@pytest.mark.postgres
def test_an_endpoint_consumes_in_batches_on_rabbitmq_with_postgresql(rabbitmq, postgres_storage,
                                                                    monkeypatch):
    transport, name = rabbitmq
    waits = WaitCount(monkeypatch)
    commits: list[int] = []
    commit_many = PostgresStorage.commit_many

    def counted(storage: PostgresStorage, group: Any) -> Any:
        commits.append(len(group))
        return commit_many(storage, group)

    monkeypatch.setattr(PostgresStorage, "commit_many", counted)

    run_batched(transport, name, postgres_storage)

    assert max(commits) > 1 and len(commits) < 60  # groups, not one commit a message
    assert waits.waits < 60 + 15 + 60


def test_an_endpoint_consumes_in_batches_on_memory(unique: str):
    from idembus.storage.memory import MemoryStorage

    transport = KombuTransport("memory://", exchange=f"test-events-{unique}")

    def name(prefix: str) -> str:
        return f"{prefix}-{unique}"

    try:
        run_batched(transport, name, MemoryStorage())
    finally:
        transport.close()



@pytest.mark.postgres
def test_batching_on_the_postgresql_transport_keeps_its_one_transaction_a_message(
        postgres_storage: PostgresStorage):
    from idembus.testing import wait_until_idle
    from idembus.transports.postgres import PostgresTransport

    unique = uuid.uuid4().hex[:10]
    transport = PostgresTransport(POSTGRES_URL, table_prefix=f"bq{unique}")
    endpoint = Endpoint(f"accounts-{unique}", transport=transport, storage=postgres_storage,
                        handlers=[AccountHandler], batching=Batching(size=8),
                        status_interval=0)
    handled = SignalCounter(endpoint, "handled")
    try:
        assert endpoint.shared_transaction is not None
        endpoint.start()
        for amount in range(1, 6):
            endpoint.bus.send(Deposit(account="a", amount=amount))
        assert handled.wait_for(5)
        wait_until_idle([endpoint])
        assert postgres_storage.load(ACCOUNT, "a").state == {"balance": 15, "deposits": 5}
        assert transport.pending(endpoint.name) == 0
    finally:
        endpoint.close()
        transport.drop_tables()
        transport.close()
