"""The MongoDB change stream wakes the outbox only for commits. The pipeline is run here by
mongomock's aggregation over change events shaped as the server writes them; the stream
itself needs a replica set and is verified only there (README)."""

from __future__ import annotations

import datetime
from typing import Any

import mongomock

from idembus.storage.base import AggregateRecord
from idembus.storage.mongo import UNDISPATCHED_INDEX, MongoStorage
from idembus.storage.mongo_changes import commit_pipeline


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
    "deletion": (change("delete", "Account"), False),
}


def test_the_pipeline_passes_commits_and_nothing_else() -> None:
    events = mongomock.MongoClient().db.events
    events.insert_many([{"_id": name, **event} for name, (event, _) in EVENTS.items()])

    passed = {document["_id"] for document in events.aggregate(commit_pipeline())}

    assert passed == {name for name, (_, wakes) in EVENTS.items() if wakes}


def test_the_outbox_scan_is_served_by_an_index() -> None:
    storage = MongoStorage.embedded("changes")
    storage.commit(AggregateRecord("Account", "a"), key="H/m1", state={}, outgoing=())

    storage.undispatched(committed_before=datetime.datetime.now(datetime.timezone.utc))

    assert UNDISPATCHED_INDEX in storage.database["Account"].index_information()
