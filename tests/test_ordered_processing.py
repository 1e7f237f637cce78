"""Ordered processing per key (``ordered_by=``): the sender's partition, the partition
queues on RabbitMQ, delayed retries held in place, and keys applied in order under
several workers and threads while a worker is killed."""

from __future__ import annotations

import os
import random
import signal
import uuid
from collections.abc import Callable

import psycopg
import pytest

from idembus import Command, Endpoint, Event, Recoverability, RetryPolicy
from idembus import headers as h
from idembus.errors import ConfigurationError
from idembus.handlers import Handler, handles
from idembus.messages import ordering_key, partition_of
from idembus.routing import Router, base_queue, partition_queue
from idembus.sending import Bus
from idembus.storage.memory import MemoryStorage
from idembus.storage.postgres import PostgresStorage
from idembus.testing import wait_until_idle
from idembus.transports.kombu import KombuTransport
from idembus.transports.postgres import PostgresTransport
from tests.conftest import AMQP_URL, POSTGRES_URL, require_service
from tests.ordered_app import Sequences, Step
from tests.test_workers import App, children, deployed, wait_until

ORDERED_APP = "from tests.ordered_app import make  # noqa: F401\n"


def test_the_partition_of_a_key_is_the_same_everywhere_and_spread():
    # The hash is blake2b, not Python's salted hash(): these values hold in every process.
    assert partition_of("account-1", 16) == partition_of("account-1", 16)
    assert [partition_of(f"k{n}", 16) for n in range(6)] == [
        partition_of(f"k{n}", 16) for n in range(6)]
    assert partition_of("a", 1) == 0
    spread = {partition_of(f"key-{n}", 16) for n in range(200)}
    assert spread == set(range(16))
    import hashlib
    digest = hashlib.blake2b(b"account-1", digest_size=8).digest()
    assert partition_of("account-1", 7) == int.from_bytes(digest, "big") % 7


def test_an_ordered_command_carries_its_key_and_goes_to_its_partition_queue():
    sent = []
    bus = Bus("sender", Router({Step: "steps"}), sent.append)
    bus.send(Step(key="k7", seq=3))
    (envelope,) = sent
    partition = partition_of("k7", 16)
    assert envelope.headers[h.ORDERING_KEY] == "k7"
    assert envelope.headers[h.PARTITION] == str(partition)
    assert envelope.headers[h.PARTITIONS] == "16"
    assert envelope.destination == f"steps.ordered.{partition}"
    assert base_queue(envelope.destination) == "steps"
    assert base_queue("steps.ordered.x") == "steps.ordered.x"
    assert partition_queue("steps", 2) == "steps.ordered.2"


def test_a_callable_orders_by_what_it_returns_and_an_unordered_type_has_no_key():
    class Transfer(Command, ordered_by=lambda message: message.source.upper()):
        source: str

    class Note(Command):
        text: str

    assert ordering_key(Transfer(source="ab")) == "AB"
    assert ordering_key(Note(text="x")) is None


@pytest.mark.parametrize("keywords, said", [
    ({"ordered_by": "missing"}, "not a field"),
    ({"ordered_by": 3}, "must name a field"),
    ({"ordered_by": "key", "partitions": 0}, "partitions must be"),
    ({"ordered_by": "key", "partitions": True}, "partitions must be"),
])
def test_a_wrong_declaration_fails_when_the_class_is_made(keywords, said):
    with pytest.raises(ConfigurationError, match=said):
        class Wrong(Command, **keywords):
            key: str


def test_an_event_cannot_be_ordered():
    with pytest.raises(ConfigurationError, match="for commands"):
        class Happened(Event, ordered_by="key"):
            key: str


def _sequences(storage: MemoryStorage) -> dict[str, list[int]]:
    return {record.aggregate_id: list((record.state or {})["seqs"])
            for record in storage.records("Seen")}


def test_keys_are_applied_in_order_by_four_threads_of_one_process():
    storage = MemoryStorage()
    queue = f"ordered-{uuid.uuid4().hex[:8]}"
    endpoint = Endpoint(queue, handlers=[Sequences], storage=storage, concurrency=4)
    with endpoint:
        assert endpoint.partitions == 16
        for seq in range(20):
            for key in range(20):
                endpoint.bus.send(Step(key=f"k{key}", seq=seq))
        wait_until_idle([endpoint], timeout=60)
    assert _sequences(storage) == {f"k{key}": list(range(20)) for key in range(20)}


class Flaky(Handler):
    """Fails the first two attempts of seq 0 of every key, then records the order."""

    def __init__(self, order: list[tuple[str, int]]) -> None:
        self.order = order
        self.failures: dict[str, int] = {}

    @handles
    def step(self, message: Step) -> None:
        if message.seq == 0 and self.failures.get(message.key, 0) < 2:
            self.failures[message.key] = self.failures.get(message.key, 0) + 1
            raise RuntimeError("not yet")
        self.order.append((message.key, message.seq))


def test_a_delayed_retry_of_an_ordered_message_holds_its_key():
    # Given a handler that fails the first message of a key twice, with delayed retries
    order: list[tuple[str, int]] = []
    queue = f"ordered-{uuid.uuid4().hex[:8]}"
    policy = RetryPolicy(immediate_retries=0, delayed=(0.2, 0.2))
    endpoint = Endpoint(queue, handlers=[Flaky(order)], concurrency=2,
                        recoverability=Recoverability(retries=policy))
    with endpoint:
        # When three messages of the key are sent
        for seq in range(3):
            endpoint.bus.send(Step(key="only", seq=seq))
        wait_until_idle([endpoint], timeout=30)
    # Then the later ones waited for the first one's retries
    assert order == [("only", 0), ("only", 1), ("only", 2)]
    assert endpoint.counters.snapshot()["retried"] == 2


# -- several processes, a worker killed -------------------------------------------------


def _ordered_app(tmp_path, queue_prefix: str):
    return deployed(tmp_path, ORDERED_APP, name=queue_prefix, prefix="ord")


def _seen(app: App) -> dict[str, list[int]]:
    with psycopg.connect(POSTGRES_URL) as connection:
        rows = connection.execute(
            f"SELECT aggregate_id, state FROM {app.prefix}_aggregates").fetchall()
    return {row[0]: row[1]["seqs"] for row in rows}


def _run_killed(app: App, keys: int, per_key: int, send: Callable[[Step], object], *,
                pending: Callable[[], int], **environment: str) -> None:
    """2 workers x 4 threads take ``keys`` x ``per_key`` steps while a worker is SIGKILLed
    at a third of the sends and the other original one at two thirds (so the worker
    active on the partitions dies with messages in flight, whichever it was); every key
    must see 0..per_key-1, each once, in order, and nothing goes to the error queue."""
    supervisor = app.start("--workers", "2", "--concurrency", "4", "--log-level", "INFO",
                           **environment)
    log = supervisor.err
    assert log.wait_for(", 4 consumer(s), ", count=2, timeout=60), log.lines[-20:]
    rng = random.Random(30)
    originals = children(supervisor.process.pid)
    kills = [keys * per_key // 3, 2 * keys * per_key // 3]
    sent = 0
    for seq in range(per_key):
        for key in range(keys):
            send(Step(key=f"key-{key}", seq=seq))
            sent += 1
            if kills and sent >= kills[0]:
                kills.pop(0)
                victim = rng.choice(originals)
                originals.remove(victim)
                os.kill(victim, signal.SIGKILL)
    assert log.wait_for("exited with status -9", count=2, timeout=60), log.lines[-20:]
    expected = {f"key-{key}": list(range(per_key)) for key in range(keys)}
    patience = max(90, keys * per_key // 10)
    assert wait_until(lambda: _seen(app) == expected, timeout=patience), {
        key: seqs for key, seqs in _seen(app).items() if seqs != expected[key]}
    assert wait_until(lambda: pending() == 0)
    assert app.transport.pending(app.error_queue) == 0


def _rabbitmq_case(tmp_path, keys: int, per_key: int) -> None:
    with _ordered_app(tmp_path, "ordered") as app:
        app.transport.declare_partitions(app.queue, 16)
        bus = Bus("test-sender", Router({Step: app.queue}), app.transport.dispatch)
        try:
            _run_killed(app, keys, per_key, bus.send, pending=lambda: sum(
                app.transport.pending(partition_queue(app.queue, index))
                for index in range(16)))
        finally:
            for index in range(16):
                app.transport.delete_queue(partition_queue(app.queue, index))


def _postgres_case(tmp_path, keys: int, per_key: int) -> None:
    require_service(POSTGRES_URL, "PostgreSQL")
    (tmp_path / "worker_app.py").write_text(ORDERED_APP)
    suffix = uuid.uuid4().hex[:10]
    prefix = f"ord{suffix}"
    transport = PostgresTransport(POSTGRES_URL, table_prefix=prefix + "q")
    storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    app = App(tmp_path, f"ordered-{suffix}", f"ordered-error-{suffix}", prefix,
              transport)  # type: ignore[arg-type]
    try:
        transport.migrate()
        storage.migrate()
        transport.declare(app.queue)
        transport.declare(app.error_queue)
        bus = Bus("test-sender", Router({Step: app.queue}), transport.dispatch)
        _run_killed(app, keys, per_key, bus.send, pending=lambda: transport.pending(app.queue),
                    APP_TRANSPORT=POSTGRES_URL)
    finally:
        for running in app.running:
            running.stop()
        transport.drop_tables()
        transport.close()
        storage.drop_tables()
        storage.close()


#: The reduced run (make test) and the full one (make soak), on each kind of queue.
SIZES = [pytest.param(20, 15, marks=pytest.mark.timeout(300), id="20x15"),
         pytest.param(100, 50, marks=[pytest.mark.slow, pytest.mark.timeout(900)],
                      id="100x50")]


@pytest.mark.amqp
@pytest.mark.postgres
@pytest.mark.parametrize("keys, per_key", SIZES)
def test_rabbitmq_applies_keys_in_order_under_2_workers_x_4_threads_with_kills(
        tmp_path, keys, per_key):
    _rabbitmq_case(tmp_path, keys=keys, per_key=per_key)


@pytest.mark.postgres
@pytest.mark.parametrize("keys, per_key", SIZES)
def test_postgres_queues_apply_keys_in_order_under_2_workers_x_4_threads_with_kills(
        tmp_path, keys, per_key):
    _postgres_case(tmp_path, keys=keys, per_key=per_key)


def test_the_database_queues_keep_ordered_messages_in_the_endpoints_own_queue():
    from idembus.transports.postgres_statements import _targets
    sent = []
    Bus("sender", Router({Step: "steps"}), sent.append).send(Step(key="k", seq=0))
    assert _targets(sent[0]) == ["steps"]


@pytest.mark.amqp
def test_rabbitmq_partition_queues_have_a_single_active_consumer():
    transport = KombuTransport(AMQP_URL)
    queue = f"ordered-sac-{uuid.uuid4().hex[:8]}"
    try:
        transport.declare(queue)
        transport.declare_partitions(queue, 2)
        # Declaring again with other arguments is refused: the broker holds the SAC flag.
        with transport._channel() as channel:
            with pytest.raises(Exception, match="single-active-consumer"):
                channel.queue_declare(queue=partition_queue(queue, 0), durable=True,
                                      auto_delete=False,
                                      arguments={"x-queue-type": "quorum"})
        transport.declare_partitions(queue, 2)  # idempotent
    finally:
        for name in (queue, partition_queue(queue, 0), partition_queue(queue, 1)):
            transport.delete_queue(name)
        transport.close()


@pytest.mark.postgres
def test_tables_of_an_earlier_idembus_get_the_ordering_key_column_at_start():
    require_service(POSTGRES_URL, "PostgreSQL")
    prefix = f"ordm{uuid.uuid4().hex[:10]}"
    transport = PostgresTransport(POSTGRES_URL, table_prefix=prefix)
    try:
        transport.migrate()
        with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
            connection.execute(f"DROP INDEX {prefix}_messages_ordering")
            connection.execute(f"ALTER TABLE {prefix}_messages DROP COLUMN ordering_key")
            assert transport.schema.missing(connection) == [
                f"{prefix}_messages.ordering_key", f"index {prefix}_messages_ordering"]
        later = PostgresTransport(POSTGRES_URL, table_prefix=prefix)
        later.verify()  # what an endpoint does at start
        later.declare("steps")
        Bus("sender", Router({Step: "steps"}), later.dispatch).send(Step(key="k", seq=0))
        with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
            assert transport.schema.missing(connection) == []
            assert connection.execute(
                f"SELECT queue, ordering_key FROM {prefix}_messages").fetchall() == [
                ("steps", "k")]
        later.close()
    finally:
        transport.drop_tables()
        transport.close()


@pytest.mark.postgres
@pytest.mark.timeout(60)
@pytest.mark.parametrize("shared", [False, True], ids=["acknowledged", "shared-transaction"])
def test_settling_an_ordered_message_wakes_the_consumers_for_the_next_of_its_key(shared):
    # Given an endpoint on the PostgreSQL queues whose idle consumers look only every 60 s
    require_service(POSTGRES_URL, "PostgreSQL")
    prefix = f"ordw{uuid.uuid4().hex[:10]}"
    transport = PostgresTransport(POSTGRES_URL, table_prefix=prefix + "q", max_idle_wait=60)
    storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix) if shared else MemoryStorage()
    endpoint = Endpoint(f"steps-{prefix}", transport=transport, storage=storage,
                        handlers=[Sequences], batching=None)
    try:
        # When five messages of one key wait before it starts (each free only once the one
        # before it is settled; no notification of their sends left to wake it)
        transport.declare(endpoint.name)
        sender = Bus("sender", Router({Step: endpoint.name}), transport.dispatch)
        for seq in range(5):
            sender.send(Step(key="k", seq=seq))
        with endpoint:
            assert (endpoint.shared_transaction is not None) is shared
            # Then each settlement wakes a consumer for the next: far sooner than 60 s
            wait_until_idle([endpoint], timeout=20)
            assert _sequences_of(storage) == {"k": [0, 1, 2, 3, 4]}
    finally:
        transport.drop_tables()
        if shared:
            leftover = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
            leftover.drop_tables()
            leftover.close()


def _sequences_of(storage: object) -> dict[str, list[int]]:
    return {record.aggregate_id: list((record.state or {})["seqs"])
            for record in storage.records("Seen")}  # type: ignore[attr-defined]


# -- idembus status ------------------------------------------------------------------------


def _status_json(viewer: Callable[[], Endpoint], monkeypatch: pytest.MonkeyPatch,
                 capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    """``idembus status --json`` and ``--wide`` of an endpoint ``viewer()`` makes for each
    (the command closes the endpoint it loads, as a process of its own would)."""
    import json
    import sys
    import types

    from idembus.cli import main

    module = types.ModuleType("ordered_status_app")
    module.make = viewer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ordered_status_app", module)
    assert main(["status", "ordered_status_app:make", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert main(["status", "ordered_status_app:make", "--wide"]) == 0
    summary["table"] = capsys.readouterr().out
    return summary  # type: ignore[no-any-return]


@pytest.mark.amqp
@pytest.mark.timeout(90)
def test_status_shows_the_partition_queues_depths_and_consumers_on_rabbitmq(
        monkeypatch, capsys):
    from tests.test_cli_errors import SharedMemoryStorage
    from tests.test_status import wait_until as eventually

    require_service(AMQP_URL, "RabbitMQ")
    queue = f"ordered-status-{uuid.uuid4().hex[:8]}"
    storage = SharedMemoryStorage()
    transport = KombuTransport(AMQP_URL)

    def viewer() -> Endpoint:
        return Endpoint(queue, transport=AMQP_URL, storage=storage, handlers=[Sequences])

    worker = Endpoint(queue, transport=KombuTransport(AMQP_URL), storage=storage,
                      handlers=[Sequences], concurrency=2, status_interval=0.05)
    try:
        # Given the partition queues, nobody consuming, and steps of two keys sent
        transport.declare(queue)
        transport.declare_partitions(queue, 16)
        sender = Bus("sender", Router({Step: queue}), transport.dispatch)
        for seq in range(3):
            sender.send(Step(key="k0", seq=seq))
        for seq in range(2):
            sender.send(Step(key="k1", seq=seq))
        expected = [0] * 16
        expected[partition_of("k0", 16)] += 3
        expected[partition_of("k1", 16)] += 2

        # When status runs, Then each partition queue shows its depth and no consumer
        def readies() -> list[int]:
            ordering = _status_json(viewer, monkeypatch, capsys)["ordering"]
            return [p["ready"] for p in ordering["partitions"]]

        assert eventually(lambda: readies() == expected), readies()
        summary = _status_json(viewer, monkeypatch, capsys)
        partitions = summary["ordering"]["partitions"]
        assert [p["queue"] for p in partitions] == [partition_queue(queue, i) for i in range(16)]
        assert {p["consumers"] for p in partitions} == {0}
        assert f"ordered: 16 partition queues {queue}.ordered.0 .. {queue}.ordered.15: ready 5"\
            in summary["table"]
        busiest = partition_queue(queue, expected.index(3))
        assert f"most ready in {busiest} (3)" in summary["table"]

        # When a worker consumes them, Then they empty and each has its consumer
        with worker:
            wait_until_idle([worker], timeout=30)
            assert eventually(lambda: {
                (p["ready"], p["consumers"])
                for p in _status_json(viewer, monkeypatch, capsys)["ordering"]["partitions"]
            } == {(0, 1)})
            table = _status_json(viewer, monkeypatch, capsys)["table"]
            assert "consumers 1 to 1 per partition (one active)" in table
            assert f"queue {queue}.ordered.15: ready 0" in table  # --wide: each partition
        assert _sequences_of(storage) == {"k0": [0, 1, 2], "k1": [0, 1]}
    finally:
        for index in range(16):
            transport.delete_queue(partition_queue(queue, index))
        transport.delete_queue(queue)
        transport.close()


@pytest.mark.postgres
@pytest.mark.timeout(60)
def test_status_shows_the_keys_in_flight_on_the_postgresql_queue(monkeypatch, capsys):
    from tests.test_cli_errors import SharedMemoryStorage

    require_service(POSTGRES_URL, "PostgreSQL")
    prefix = f"ords{uuid.uuid4().hex[:10]}"
    transport = PostgresTransport(POSTGRES_URL, table_prefix=prefix)
    queue, storage = f"steps-{prefix}", SharedMemoryStorage()

    def viewer() -> Endpoint:
        return Endpoint(queue, transport=PostgresTransport(POSTGRES_URL, table_prefix=prefix),
                        storage=storage, handlers=[Sequences])

    try:
        # Given three steps of k and two of j, and a tool holding k's first
        transport.declare(queue)
        sender = Bus("sender", Router({Step: queue}), transport.dispatch)
        for key, count in (("k", 3), ("j", 2)):
            for seq in range(count):
                sender.send(Step(key=key, seq=seq))
        with transport.inspect(queue, limit=1):
            # When status runs, Then one key is in flight and four ordered messages wait
            summary = _status_json(viewer, monkeypatch, capsys)
        assert summary["ordering"] == {"partitions": [], "keys_in_flight": 1, "waiting": 4,
                                       "unknown": None}
        assert "ordered: keys in flight 1, ordered messages waiting 4" in summary["table"]
    finally:
        transport.drop_tables()
        transport.close()


def test_status_says_nothing_of_ordering_for_an_endpoint_without_ordered_types():
    import datetime

    from idembus.cli.status import render
    from idembus.runtime.status import ordering_depth, summarise

    assert ordering_depth(KombuTransport("memory://"), "plain", partitions=0,
                          ordered=False) is None
    now = datetime.datetime.now(datetime.timezone.utc)
    summary = summarise("plain", [], now=now, stale_after=datetime.timedelta(seconds=15))
    summary.update(queue=None, ordering=None)
    assert "ordered" not in render(summary, now=now)
@pytest.mark.parametrize("lease", [0, -1.0, True, "10"])
def test_a_partition_lease_that_is_not_a_positive_number_of_seconds_is_refused(lease):
    with pytest.raises(ConfigurationError, match="partition_lease must be"):
        KombuTransport("memory://", partition_lease=lease)
