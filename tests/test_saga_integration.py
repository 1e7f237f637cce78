"""Sagas on RabbitMQ and PostgreSQL: the trap of rebus#1136 (the creating message
redelivered after completion), a late non-starter, a timeout arriving through RabbitMQ's
delay levels after its saga completed, what ``idembus status`` is told, and the
``completed`` column an older schema gains."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import psycopg
import pytest

from idembus import Command, Endpoint, OutboxPolicy
from idembus.handlers import Handler, handles
from idembus.storage.postgres import PostgresStorage
from tests.conftest import AMQP_URL, POSTGRES_URL, require_service
from tests.saga_orders import (
    CloseOrder,
    OrderAccepted,
    OrderPaid,
    OrderSaga,
    PayOrder,
    PlaceOrder,
)
from tests.support import SignalCounter

pytestmark = [pytest.mark.amqp, pytest.mark.postgres]

SAGA = "OrderProcess"
MakeEndpoint = Callable[..., Endpoint]


@pytest.fixture
def transport_url() -> str:
    """Overrides conftest's: this module runs on RabbitMQ only (make_endpoint uses it)."""
    require_service(AMQP_URL, "RabbitMQ")
    return AMQP_URL


@pytest.fixture
def prefixes(unique: str) -> Iterator[Callable[[], str]]:
    """Fresh table prefixes, whose tables are dropped afterwards."""
    require_service(POSTGRES_URL, "PostgreSQL")
    made: list[str] = []

    def make() -> str:
        made.append(f"sg{unique}_{len(made)}")
        return made[-1]

    yield make
    for prefix in made:
        cleaner = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
        cleaner.drop_tables()
        cleaner.close()


class Receipts(Handler):
    """Downstream: the order events it handled, by id (a duplicate is not handled again:
    its endpoint's ``duplicate`` signal counts it)."""

    def __init__(self) -> None:
        self.handled: dict[str, str] = {}
        self._lock = threading.Lock()

    @handles
    def record(self, message: OrderAccepted | OrderPaid) -> None:
        with self._lock:
            self.handled[self.context.message_type] = self.context.message_id


def send(endpoint: Endpoint, command: Command, message_id: str | None = None) -> None:
    endpoint.bus.send(command, to=endpoint.name, message_id=message_id)


def test_a_saga_on_rabbitmq_and_postgresql_is_never_resurrected_by_late_messages(
    make_endpoint: MakeEndpoint, prefixes: Callable[[], str],
) -> None:
    # Given a saga endpoint that keeps sent bodies (so that a re-send shows on the wire)
    # and a downstream endpoint receiving its events
    storage = PostgresStorage(POSTGRES_URL, table_prefix=prefixes())
    sales = make_endpoint("sales", handlers=[OrderSaga], storage=storage, status_interval=0.2,
                          outbox=OutboxPolicy(compact_after_dispatch=False))
    receipts = Receipts()
    downstream = make_endpoint("receipts", handlers=[receipts],
                               storage=PostgresStorage(POSTGRES_URL, table_prefix=prefixes()))
    counters = {name: SignalCounter(sales, name) for name in (
        "handled", "duplicate", "redispatched", "not_found", "timeout_dropped")}
    received = SignalCounter(downstream, "handled")
    repeated = SignalCounter(downstream, "duplicate")
    downstream.start()
    sales.start()

    # When an order is placed (m-place) and paid: the saga is completed
    send(sales, PlaceOrder(order_id="o-1"), message_id="m-place")
    assert counters["handled"].wait_for(1)
    send(sales, PayOrder(order_id="o-1"), message_id="m-pay")
    assert counters["handled"].wait_for(2) and received.wait_for(2)
    accepted = receipts.handled["sagas.OrderAccepted"]

    # And m-place is delivered again (the trap of rebus#1136), then a payment comes late
    send(sales, PlaceOrder(order_id="o-1"), message_id="m-place")
    assert counters["redispatched"].wait_for(1) and repeated.wait_for(1)
    send(sales, PayOrder(order_id="o-1"), message_id="m-pay-again")
    assert counters["not_found"].wait_for(1)

    # Then the saga was not created again: its tombstone is where the payment left it, and
    # m-place's OrderAccepted went out again with its first id, which downstream knew
    tombstone = storage.load(SAGA, "o-1")
    assert (tombstone.version, tombstone.completed, tombstone.state) == (2, True, None)
    assert counters["duplicate"].count == 1 and counters["handled"].count == 2
    assert repeated.details[0]["message_id"] == accepted
    assert received.count == 2

    # When another order is closed, asking in the same commit for a reminder in 1 s (it
    # waits in RabbitMQ's delay levels, and arrives after the completion by construction)
    send(sales, PlaceOrder(order_id="o-2"))
    assert counters["handled"].wait_for(3)
    send(sales, CloseOrder(order_id="o-2", remind_after=1))

    # Then the reminder is dropped and counted, and the saga stays completed
    assert counters["timeout_dropped"].wait_for(1)
    assert storage.load(SAGA, "o-2").completed
    assert counters["not_found"].count == 1

    # And the endpoint's report, read by `idembus status`, counts both
    sales.stop()
    (report,) = storage.status_reports(sales.name)
    assert (report.counters["not_found"], report.counters["timeout_dropped"]) == (1, 1)


def test_an_aggregates_table_from_before_completion_gains_the_column_and_keeps_its_rows(
    prefixes: Callable[[], str],
) -> None:
    # Given tables from before completion, with a live aggregate in them
    prefix = prefixes()
    older = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    older.migrate()
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f"ALTER TABLE {prefix}_aggregates DROP COLUMN completed")
        admin.execute(f"INSERT INTO {prefix}_aggregates (aggregate_type, aggregate_id, version,"
                      " state) VALUES ('OrderProcess', 'o-1', 1, '{\"reminders\": 1}')")
    older.close()

    # When an endpoint of this version starts on it
    storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    try:
        storage.verify()

        # Then the aggregate is there, live, and can be completed
        loaded = storage.load(SAGA, "o-1", "H/m2")
        assert (loaded.version, loaded.live, loaded.state) == (1, True, {"reminders": 1})
        storage.commit(loaded, key="H/m2", state=None, outgoing=(), completed=True)
        assert storage.load(SAGA, "o-1").completed
        storage.migrate()  # again: nothing changes
        assert storage.load(SAGA, "o-1").completed
    finally:
        storage.close()

