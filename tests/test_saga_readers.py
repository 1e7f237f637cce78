"""What reads the stored aggregates sees a completed saga (a tombstone) as deleted: the
gateway's replication and ``idembus spark reconcile``."""

from __future__ import annotations

import datetime
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from idembus import Endpoint
from idembus.envelope import format_utc
from idembus.gateway import Gateway
from idembus.spark.reconcile import Correction, reconcile
from idembus.storage.memory import MemoryStorage
from tests.saga_orders import OrderAccepted, OrderPaid, OrderProcess, OrderSaga
from tests.sse_client import events, take
from tests.test_gateway import stream
from tests.test_spark_reconcile import millis, next_millisecond, write_dump

UTC = datetime.timezone.utc
SAGA = "OrderProcess"


@pytest.fixture
def sales() -> Iterator[Endpoint]:
    endpoint = Endpoint(f"sales-{uuid.uuid4().hex[:8]}", storage=MemoryStorage(),
                        handlers=[OrderSaga], journal=True, status_interval=0)
    yield endpoint
    endpoint.close()


@pytest.fixture
def gateway_for() -> Iterator[Callable[[Endpoint], Gateway]]:
    started: list[Gateway] = []

    def start(endpoint: Endpoint) -> Gateway:
        started.append(Gateway(endpoint, port=0, poll_interval=0.02))
        started[-1].start()
        return started[-1]

    yield start
    for gateway in started:
        gateway.stop()


def open_saga(endpoint: Endpoint, order_id: str) -> datetime.datetime:
    """Start a saga (a unit of work publishing OrderAccepted); return when it committed."""
    with endpoint.unit_of_work(OrderProcess, order_id) as work:
        work.bus.publish(OrderAccepted(order_id=order_id))
    return changed_at(endpoint, order_id)


def complete_saga(endpoint: Endpoint, order_id: str) -> datetime.datetime:
    """Complete a saga (publishing OrderPaid); return when it committed."""
    with endpoint.unit_of_work(OrderProcess, order_id) as work:
        work.bus.publish(OrderPaid(order_id=order_id))
        work.complete()
    return changed_at(endpoint, order_id)


def changed_at(endpoint: Endpoint, order_id: str) -> datetime.datetime:
    (moment,) = [r.updated_at for r in endpoint.storage.records(SAGA)
                 if r.aggregate_id == order_id]
    assert moment is not None
    return moment


def wait_past(moment: datetime.datetime) -> None:
    """Return once the clock has passed ``moment`` (what comes next is later)."""
    while datetime.datetime.now(UTC) <= moment:
        threading.Event().wait(0.001)


# -- the gateway's replication --------------------------------------------------------------


def test_full_replication_leaves_a_completed_saga_out(
    sales: Endpoint, gateway_for: Callable[[Endpoint], Gateway],
) -> None:
    open_saga(sales, "o-live")  # journal position 1
    open_saga(sales, "o-done")  # 2
    complete_saga(sales, "o-done")  # 3
    gateway = gateway_for(sales)

    with httpx.Client() as client, stream(client, gateway, last="0") as response:
        reset, state, live = take(events(response), 3)

    assert reset.kind == "reset"
    assert (state.kind, state.data["aggregate_id"], state.data["state"]) == (
        SAGA, "o-live", {"express": False, "reminders": 0})
    assert "deleted" not in state.data
    assert (live.kind, live.id) == ("live", "3")


def test_replicating_what_changed_since_a_time_sends_a_completed_saga_as_deleted(
    sales: Endpoint, gateway_for: Callable[[Endpoint], Gateway],
) -> None:
    # Given a saga changed before a time, then two after it, one of which was completed,
    # and a journal trimmed so that it no longer reaches back to that time
    before = open_saga(sales, "o-before")  # journal position 1
    since = next_millisecond(before)
    wait_past(since)
    open_saga(sales, "o-live")  # 2
    open_saga(sales, "o-done")  # 3
    completed_at = complete_saga(sales, "o-done")  # 4
    sales.storage.trim_journal(datetime.datetime.now(UTC) + datetime.timedelta(hours=1),
                               batch=1)
    gateway = gateway_for(sales)

    # When a client resumes from that time
    with httpx.Client() as client, stream(client, gateway, last=str(millis(since))) as response:
        reset, *states, live = take(events(response), 4)

    # Then it gets the live saga's state and the completed one as deleted
    assert "no longer reaches back" in reset.data["reason"]
    found = {state.data["aggregate_id"]: state.data for state in states}
    assert sorted(found) == ["o-done", "o-live"]
    assert found["o-done"]["deleted"] is True
    assert found["o-done"]["state"] is None
    assert found["o-done"]["updated_at"] == format_utc(completed_at)
    assert "deleted" not in found["o-live"]
    assert (live.kind, live.id) == ("live", "4")


# -- spark reconcile --------------------------------------------------------------------------


def test_reconcile_counts_a_completed_saga_as_deleted(
    spark: Any, sales: Endpoint, tmp_path: Path,
) -> None:
    # Given two completed sagas and a live one changed before the dump's newest timestamp
    # (the live saga "live", changed last), and one completed after it
    for order_id in ("live-gone", "done-gone", "done-listed", "done-late"):
        open_saga(sales, order_id)
    complete_saga(sales, "done-gone")
    listed_at = complete_saga(sales, "done-listed")
    wait_past(next_millisecond(listed_at))
    newest = datetime.datetime.fromtimestamp(millis(open_saga(sales, "live")) / 1000, UTC)
    wait_past(next_millisecond(newest))
    complete_saga(sales, "done-late")
    dump = write_dump(tmp_path / "orders.jsonl", [
        {"type": SAGA, "id": "live", "timestamp": millis(newest), "parents": ["user/1"]},
        {"type": SAGA, "id": "done-listed", "timestamp": millis(listed_at) - 1000,
         "parents": ["user/2"]},
        {"type": SAGA, "id": "done-late", "timestamp": millis(listed_at) - 1000},
    ])

    # When the dump is reconciled
    summary = reconcile(spark, sales, [str(dump)], dry_run=True)

    # Then the saga completed before the dump but listed in it is missing, the live one
    # absent from the dump is deleted, and the other completed ones need nothing
    done_listed = datetime.datetime.fromtimestamp((millis(listed_at) - 1000) / 1000, UTC)
    assert summary.preview == (
        Correction(SAGA, "done-listed", "missing", done_listed, None, ("user/2",)),
        Correction(SAGA, "live-gone", "deleted", None, changed_at(sales, "live-gone"), ()),
    )
    assert (summary.dump, summary.stored, summary.corrections) == (3, 2, 2)
