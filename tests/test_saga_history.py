"""A finished saga's story is kept with its tombstone: each message it handled with its type
and time, the one that ended it, and the state it ended with (``keep_final_state``); an
older PostgreSQL schema gains the column the types need and keeps its rows."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import psycopg
import pytest
from pydantic import BaseModel

from idembus import Command, message_name
from idembus.handlers import AggregateHandler, handles
from idembus.storage.postgres import PostgresStorage
from tests.conftest import POSTGRES_URL, require_service
from tests.saga_orders import CloseOrder, PayOrder, PlaceOrder
from tests.support import SignalCounter
from tests.test_sagas import SAGA, MakeSales, make_sales, send, settle

__all__ = ["make_sales"]  # the fixture, shared with tests/test_sagas.py


def test_a_paid_and_a_cancelled_order_tell_apart_by_their_story(make_sales: MakeSales) -> None:
    # Given two orders placed, one paid and one closed (cancelled)
    sales = make_sales()
    handled = SignalCounter(sales, "handled")
    sales.start()
    send(sales, PlaceOrder(order_id="o-1"), message_id="m-place-1")
    send(sales, PlaceOrder(order_id="o-2"), message_id="m-place-2")
    settle(sales, handled, 2)
    send(sales, PayOrder(order_id="o-1"), message_id="m-pay")
    send(sales, CloseOrder(order_id="o-2"), message_id="m-close")
    settle(sales, handled, 4)

    # When their tombstones are read as the tools read them
    paid, cancelled = (sales.storage.history(SAGA, order) for order in ("o-1", "o-2"))

    # Then each keeps its messages with their types, in order, and which one ended it
    assert [e.message_type for e in paid.processed.values()] == [
        message_name(PlaceOrder), message_name(PayOrder)]
    assert [e.message_type for e in cancelled.processed.values()] == [
        message_name(PlaceOrder), message_name(CloseOrder)]
    assert paid.ended_by() is not None and paid.ended_by().key == "OrderSaga/m-pay"
    assert cancelled.ended_by() is not None
    assert cancelled.ended_by().message_type == message_name(CloseOrder)
    # And the state each ended with, while neither is live any more
    assert paid.completed and paid.state is None
    assert paid.final_state == {"express": False, "reminders": 0}


class Parcel(BaseModel):
    recipient: str = ""


class Deliver(Command, message_name="history.Deliver"):
    parcel_id: str
    recipient: str


class Delivered(Command, message_name="history.Delivered"):
    parcel_id: str


class ForgetfulDelivery(AggregateHandler[Parcel]):
    """Personal data that must not outlive the saga: no final state on its tombstone."""

    starts = (Deliver,)
    keep_final_state = False

    def aggregate_id(self, message: Deliver | Delivered) -> str:
        return message.parcel_id

    @handles
    def deliver(self, message: Deliver) -> None:
        self.state.recipient = message.recipient

    @handles
    def delivered(self, message: Delivered) -> None:
        self.complete()


def test_a_saga_that_keeps_no_final_state_leaves_its_story_without_it(
    make_sales: MakeSales,
) -> None:
    sales = make_sales(ForgetfulDelivery())
    handled = SignalCounter(sales, "handled")
    sales.start()

    send(sales, Deliver(parcel_id="p-1", recipient="Ada Lovelace"))
    settle(sales, handled, 1)
    send(sales, Delivered(parcel_id="p-1"))
    settle(sales, handled, 2)

    record = sales.storage.history("Parcel", "p-1")
    assert record.completed and record.final_state is None
    assert [e.message_type for e in record.processed.values()] == [
        "history.Deliver", "history.Delivered"]


def test_a_unit_of_work_that_completes_keeps_the_state_it_ended_with(
    make_sales: MakeSales,
) -> None:
    sales = make_sales()

    with sales.unit_of_work(Parcel, "p-9", operation_id="op-1") as work:
        work.state.recipient = "Grace Hopper"
        work.complete()

    record = sales.storage.history("Parcel", "p-9")
    assert record.completed and record.final_state == {"recipient": "Grace Hopper"}


@pytest.fixture
def prefixes(unique: str) -> Iterator[Callable[[], str]]:
    """Fresh table prefixes, whose tables are dropped afterwards."""
    require_service(POSTGRES_URL, "PostgreSQL")
    made: list[str] = []

    def make() -> str:
        made.append(f"sh{unique}_{len(made)}")
        return made[-1]

    yield make
    for prefix in made:
        cleaner = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
        cleaner.drop_tables()
        cleaner.close()


@pytest.mark.postgres
def test_a_processed_table_from_before_message_types_gains_the_column_and_keeps_its_rows(
    prefixes: Callable[[], str],
) -> None:
    # Given tables from before message types were recorded, with a saga and its entry
    prefix = prefixes()
    older = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    older.migrate()
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f"ALTER TABLE {prefix}_processed DROP COLUMN message_type")
        admin.execute(f"INSERT INTO {prefix}_aggregates (aggregate_type, aggregate_id, version,"
                      " state) VALUES ('OrderProcess', 'o-1', 1, '{\"reminders\": 0}')")
        admin.execute(f"INSERT INTO {prefix}_processed (aggregate_type, aggregate_id, key,"
                      " outgoing, outgoing_ids, dispatched) VALUES ('OrderProcess', 'o-1',"
                      " 'OrderSaga/m-old', '[]', '[]', true)")
    older.close()

    # When an endpoint of this version starts on it and completes the saga
    storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    try:
        storage.verify()
        storage.commit(storage.load(SAGA, "o-1", "OrderSaga/m-pay"), key="OrderSaga/m-pay",
                       state={"reminders": 0}, outgoing=(), completed=True,
                       message_type=message_name(PayOrder))

        # Then the old entry reads without a type, the new one with its type
        record = storage.history(SAGA, "o-1")
        assert {k: e.message_type for k, e in record.processed.items()} == {
            "OrderSaga/m-old": None, "OrderSaga/m-pay": message_name(PayOrder)}
        assert record.completed and record.final_state == {"reminders": 0}
        storage.migrate()  # again: nothing changes
        assert storage.history(SAGA, "o-1") == record
    finally:
        storage.close()


def test_of_entries_committed_in_the_same_millisecond_the_later_ended_the_saga() -> None:
    # MongoDB keeps times to the millisecond: two commits of one saga can read back equal
    import datetime

    from idembus.storage.base import AggregateRecord, ProcessedMessage

    at = datetime.datetime(2031, 5, 4, 12, 0, tzinfo=datetime.timezone.utc)
    record = AggregateRecord("Order", "o-1", version=2, completed=True, processed={
        "H/start": ProcessedMessage("H/start", (), (), True, at, message_type="PlaceOrder"),
        "H/paid": ProcessedMessage("H/paid", (), (), True, at, message_type="OrderPaid"),
    })
    ended = record.ended_by()
    assert ended is not None and ended.message_type == "OrderPaid"
