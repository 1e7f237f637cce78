"""The MongoDB change stream wakes the outbox only for commits, and the outbox's scan reads
and indexes idembus's aggregate collections only. The pipeline is run here by mongomock's
aggregation over change events shaped as the server writes them; the stream itself needs a
replica set, which is not available here: it has never been run against a server (README).
Views exist only on a server: that test runs with ``IDEMBUS_MONGODB_URL``."""

from __future__ import annotations

import datetime
from typing import Any

import mongomock
import pytest

from idembus import headers as h
from idembus.envelope import Envelope
from idembus.storage.base import AggregateRecord
from idembus.storage.mongo import AGGREGATES, UNDISPATCHED_INDEX, MongoStorage
from idembus.storage.mongo_changes import commit_pipeline
from tests.conftest import MONGODB_URL, require_service


def change(kind: str, collection: str, updated: dict[str, Any] | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"operationType": kind, "ns": {"db": "app", "coll": collection}}
    if updated is not None:
        event["updateDescription"] = {"updatedFields": updated, "removedFields": []}
    return event


EVENTS = {
    "aggregate created": (change("insert", "Account"), True),
    "aggregate committed": (change("update", "Account", {"version": 4, "state": {}}), True),
    "inbox record": (change("insert", "idembus_inbox"), True),
    "aggregate replaced": (change("replace", "Order"), True),
    "dispatch mark": (change("update", "Account", {"processed.2.dispatched": True}), False),
    "status report": (change("update", "idembus_status", {"counters": {}}), False),
    "lease renewed": (change("update", "idembus_leases", {"expires_at": 1}), False),
    "journal append": (change("insert", "idembus_journal"), False),
    "audit record": (change("insert", "idembus_audit"), False),
    "delayed message": (change("insert", "idembus_scheduled"), False),
    "parked message": (change("insert", "idembus_parked"), False),
    "aggregate collection noted": (change("insert", "idembus_aggregates"), False),
    "deletion": (change("delete", "Account"), False),
}


def test_the_pipeline_passes_commits_and_nothing_else() -> None:
    events = mongomock.MongoClient().db.events
    events.insert_many([{"_id": name, **event} for name, (event, _) in EVENTS.items()])

    passed = {document["_id"] for document in events.aggregate(commit_pipeline())}

    assert passed == {name for name, (_, wakes) in EVENTS.items() if wakes}


def soon() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)


def pending(storage: MongoStorage, account: str) -> None:
    """Commit an entry to ``account`` whose message is not dispatched yet."""
    outgoing = Envelope(headers={h.MESSAGE_ID: f"out-{account}", h.MESSAGE_TYPE: "test.Out"},
                        body="{}", destination="billing")
    storage.commit(AggregateRecord("Account", account), key=f"H/{account}", state={},
                   outgoing=[outgoing])


def test_the_outbox_scan_is_served_by_an_index_from_the_first_commit() -> None:
    storage = MongoStorage.embedded("changes")

    storage.commit(AggregateRecord("Account", "a"), key="H/m1", state={}, outgoing=())

    assert UNDISPATCHED_INDEX in storage.database["Account"].index_information()


def test_the_outbox_scan_neither_reads_nor_indexes_the_applications_own_collections() -> None:
    # Given an aggregate with an undispatched entry, and collections of the application's
    # own beside it, one with fields named like idembus's
    storage = MongoStorage.embedded("changes")
    pending(storage, "a")
    storage.database["customers"].insert_one({"_id": "c1", "name": "Ada"})
    storage.database["jobs"].insert_one(
        {"_id": "j1", "processed": [{"dispatched": False, "at": datetime.datetime(2020, 1, 1)}]})

    # When the outbox scans, and the schema is migrated
    found = storage.undispatched(committed_before=soon())
    storage.migrate()

    # Then it finds the aggregate's entry alone, and the other collections get no index
    assert [(entry.aggregate_type, entry.key) for entry in found] == [("Account", "H/a")]
    for name in ("customers", "jobs"):
        assert UNDISPATCHED_INDEX not in storage.database[name].index_information()


def test_migrate_indexes_and_notes_aggregate_collections_written_by_an_older_version() -> None:
    # Given an aggregate collection written before idembus noted its collections
    older = MongoStorage.embedded("changes")
    pending(older, "a")
    older.database[AGGREGATES].delete_many({})
    if UNDISPATCHED_INDEX in older.database["Account"].index_information():
        older.database["Account"].drop_index(UNDISPATCHED_INDEX)
    storage = MongoStorage(older.client, database="changes")
    assert storage.undispatched(committed_before=soon()) == []

    # When the schema is migrated (as verify does at every start)
    storage.migrate()

    # Then the collection has its index back and the outbox finds its entry
    assert UNDISPATCHED_INDEX in storage.database["Account"].index_information()
    assert [entry.key for entry in storage.undispatched(committed_before=soon())] == ["H/a"]


@pytest.mark.mongodb
def test_views_are_neither_indexed_nor_scanned_on_a_real_server(unique: str) -> None:
    if not MONGODB_URL:
        pytest.skip("set IDEMBUS_MONGODB_URL to run against a real MongoDB")
    require_service(MONGODB_URL, "MongoDB")
    storage = MongoStorage(MONGODB_URL, database=f"idembus-views-{unique}")
    try:
        pending(storage, "a")
        storage.database.command("create", "rich_accounts", viewOn="Account", pipeline=[])

        storage.verify()

        assert [entry.key for entry in storage.undispatched(committed_before=soon())] == ["H/a"]
        assert "rich_accounts" not in storage._aggregate_collections()
    finally:
        storage.client.drop_database(storage.database.name)
        storage.close()
