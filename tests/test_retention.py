"""Retention: dispatched processed records expire, undispatched ones never do."""

from __future__ import annotations

import datetime
import uuid

import mongomock
import pytest

from idembus import headers as h
from idembus.envelope import Envelope, utc_now
from idembus.storage.base import INBOX
from idembus.storage.memory import MemoryStorage
from idembus.storage.mongo import RETENTION_INDEX, MongoStorage
from idembus.storage.postgres import PostgresStorage
from idembus.transports.kombu import KombuTransport
from tests.conftest import POSTGRES_URL, require_service
from tests.support import outbox_relay

HOUR = datetime.timedelta(hours=1)


def event() -> Envelope:
    return Envelope({h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Deposited",
                     h.INTENT: "publish"}, "{}")


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.postgres)])
def expiring(request):  # type: ignore[no-untyped-def]
    """A storage keeping processed records for an hour."""
    if request.param == "memory":
        yield MemoryStorage(retention=HOUR)
        return
    require_service(POSTGRES_URL, "PostgreSQL")
    storage = PostgresStorage(POSTGRES_URL, table_prefix=f"ret{uuid.uuid4().hex[:10]}",
                              retention=HOUR)
    storage.verify()
    yield storage
    storage.drop_tables()
    storage.close()


def remembered(storage, aggregate_id: str, key: str) -> bool:  # type: ignore[no-untyped-def]
    return key in storage.load("Account", aggregate_id, key).processed


def test_dispatched_records_expire_and_undispatched_ones_do_not(expiring):
    # Given one record whose message was dispatched and one whose message never was
    for key, aggregate in (("H/sent", "a"), ("H/stuck", "b")):
        loaded = expiring.load("Account", aggregate, key)
        expiring.commit(loaded, key=key, state={"n": 1}, outgoing=[event()])
    expiring.mark_dispatched("Account", "a", "H/sent")
    expiring.flush()

    # When the clock is past the retention
    removed = expiring.expire(utc_now() + 2 * HOUR)

    # Then the dispatched record is forgotten and the undispatched one kept
    assert removed == 1
    assert not remembered(expiring, "a", "H/sent")
    assert remembered(expiring, "b", "H/stuck")
    assert expiring.load("Account", "a").exists  # the aggregate itself stays


def test_nothing_expires_before_the_retention(expiring):
    loaded = expiring.load("Account", "a", "H/m1")
    expiring.commit(loaded, key="H/m1", state={"n": 1}, outgoing=[])
    assert expiring.expire(utc_now() + HOUR / 2) == 0
    assert remembered(expiring, "a", "H/m1")


def test_expiry_goes_in_bounded_batches(expiring):
    for number in range(5):
        key = f"H/m{number}"
        expiring.commit(expiring.load("Account", f"a{number}", key), key=key, state={},
                        outgoing=[])
    later = utc_now() + 2 * HOUR
    assert [expiring.expire(later, batch=2) for _ in range(4)] == [2, 2, 1, 0]


def test_the_outbox_dispatcher_expires_records_on_its_rounds():
    storage = MemoryStorage(retention=datetime.timedelta(seconds=0.05))
    loaded = storage.load(INBOX, "H/m1", "H/m1")
    storage.commit(loaded, key="H/m1", state=None, outgoing=[])
    outbox = outbox_relay("any", KombuTransport("memory://"), storage, grace=0)
    deadline = utc_now() + datetime.timedelta(seconds=10)
    while outbox.expired == 0 and utc_now() < deadline:
        outbox.run_once()  # rounds are timed; the record must age past 50 ms first
    assert outbox.expired == 1
    assert "H/m1" not in storage.load(INBOX, "H/m1", "H/m1").processed


def test_mongodb_expires_dispatched_inbox_records_with_a_partial_ttl_index():
    # mongomock keeps the index but never deletes: this checks what the server is told.
    storage = MongoStorage(mongomock.MongoClient(), database="retention", retention=HOUR)
    storage.verify()
    index = storage.database[INBOX].index_information()[RETENTION_INDEX]
    assert index["key"] == [("processed.at", 1)]
    assert index["expireAfterSeconds"] == 3600
    assert index["partialFilterExpression"] == {"processed.dispatched": True}
