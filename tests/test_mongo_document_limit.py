"""MongoDB's 16 MiB document limit cannot be reached by idembus's own bookkeeping (issue 24,
point 10): an aggregate document keeps its processed window and the messages each entry
sent; a 1,000-message window of 20 KB events, or one handler's fan-out of 30,000 messages,
made documents of 19.8 and 22.3 MiB — unwritable on a server, silently kept by mongomock.
Now large or late messages are spilled to ``idembus_outgoing`` (:mod:`idembus.storage.mongo_spill`),
written before the aggregate's own write, and read back on load.

Every write is observed (mongomock's collection methods wrapped) and the BSON size of every
document it leaves or inserts measured with ``bson.encode``.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import bson
import mongomock
import pytest

from idembus import headers as h
from idembus.envelope import Envelope
from idembus.storage.errors import AlreadyProcessed
from idembus.storage.mongo import MongoStorage
from idembus.storage.mongo_spill import SPILL, WINDOW_BYTES

LIMIT = 16 * 1024 * 1024
UTC = datetime.timezone.utc


class Sizes:
    """The largest document each observed write left or inserted."""

    def __init__(self) -> None:
        self.largest = 0
        self.writes = 0

    def measure(self, documents: Iterator[Any]) -> None:
        for document in documents:
            if document is not None:
                self.largest = max(self.largest, len(bson.encode(document)))
        self.writes += 1


@pytest.fixture
def sizes(monkeypatch: pytest.MonkeyPatch) -> Sizes:
    """Observe every write mongomock's collections make."""
    seen = Sizes()
    collection = mongomock.collection.Collection

    def after(name: str, documents: Callable[..., Iterator[Any]]) -> None:
        original = getattr(collection, name)

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            seen.measure(documents(self, *args, **kwargs))
            return result

        monkeypatch.setattr(collection, name, wrapper)

    def stored(self: Any, identifier: Any) -> Iterator[Any]:
        # mongomock's stored document as it is (a find would copy it, slowly)
        return iter([self._store._documents.get(identifier)])

    def by_filter(self: Any, where: Any, *_: Any, **__: Any) -> Iterator[Any]:
        return stored(self, where["_id"]) if "_id" in where else iter(())

    after("insert_one", lambda self, document, *_, **__: iter([document]))
    after("insert_many", lambda self, documents, *_, **__: iter(documents))
    after("update_one", by_filter)
    after("bulk_write", lambda self, operations, *_, **__: (
        d for o in operations for d in (
            [o._doc] if hasattr(o, "_doc") else stored(self, o._filter["_id"]))))
    return seen


def outgoing(count: int, body_bytes: int) -> list[Envelope]:
    """Messages as a handler's bus records them (the headers idembus writes)."""
    now = datetime.datetime.now(UTC).isoformat()
    envelopes = []
    for _ in range(count):
        message_id = str(uuid.uuid4())
        envelopes.append(Envelope(headers={
            h.MESSAGE_ID: message_id, h.MESSAGE_TYPE: "shop.OrderShipped",
            h.ENCLOSED_TYPES: "shop.OrderShipped,shop.OrderEvent", h.INTENT: "publish",
            h.CORRELATION_ID: str(uuid.uuid4()), h.CONVERSATION_ID: str(uuid.uuid4()),
            h.CAUSATION_ID: str(uuid.uuid4()), h.ORIGINATING_ENDPOINT: "shipping",
            h.TIME_SENT: now, h.MESSAGE_VERSION: "1"},
            body='{"order_id": "' + message_id + '", "note": "' + "x" * body_bytes + '"}'))
    return envelopes


@pytest.mark.timeout(300)  # a thousand rewrites of a growing document on mongomock: ~60 s
def test_a_window_of_a_thousand_messages_stays_under_the_limit(sizes: Sizes):
    # Given a window of 1,000 and handlers that each publish a 20 KB event the outbox has
    # not dispatched yet (so every entry must stay)
    storage = MongoStorage.embedded(f"limit-{uuid.uuid4().hex[:8]}", processed_window=1000)
    sent: dict[str, list[Envelope]] = {}
    for number in range(1000):
        key = f"Shipping/m{number}"
        sent[key] = outgoing(1, 20_000)
        storage.commit(storage.load("Order", "o-1", key), key=key, state={"n": number},
                       outgoing=sent[key])

    # Then no write left a document near the limit (before: 19.8 MiB)
    assert sizes.writes >= 1000
    assert sizes.largest < LIMIT, f"a write left {sizes.largest / 2**20:.1f} MiB"
    # and nothing was forgotten: every entry, with its messages, for the outbox and for a
    # duplicate
    late = datetime.datetime.now(UTC) + datetime.timedelta(seconds=1)
    pending = storage.undispatched(committed_before=late, limit=2000)
    assert {p.key: [e.to_record() for e in p.outgoing] for p in pending} == {
        key: [e.to_record() for e in envelopes] for key, envelopes in sent.items()}
    with pytest.raises(AlreadyProcessed) as duplicate:
        storage.commit(storage.load("Order", "o-1"), key="Shipping/m7", state={},
                       outgoing=[])
    assert [e.message_id for e in duplicate.value.outgoing] == [
        sent["Shipping/m7"][0].message_id]


def test_small_messages_stay_on_the_document_only_while_it_has_room(sizes: Sizes):
    # Given 200 handlers each publishing a 15 KB event (small enough to stay inline)
    storage = MongoStorage.embedded(f"limit-{uuid.uuid4().hex[:8]}")
    for number in range(200):
        key = f"Shipping/m{number}"
        storage.commit(storage.load("Order", "o-1", key), key=key, state={},
                       outgoing=outgoing(1, 15_000))

    # Then the first ones stayed on the document and the rest were spilled, so that the
    # document stays near WINDOW_BYTES (before: 3 MiB, and 16 MiB at ~1,000)
    document = storage.database["Order"].find_one({"_id": "o-1"})
    inline = [entry for entry in document["processed"] if entry["outgoing"]]
    assert 50 < len(inline) < 70
    assert all("spill" in entry for entry in document["processed"][len(inline):])
    assert sizes.largest < WINDOW_BYTES + 200 * 1024


def test_a_fan_out_of_thirty_thousand_messages_stays_under_the_limit(sizes: Sizes):
    # Given a handler that sends 30,000 messages in one commit
    storage = MongoStorage.embedded(f"limit-{uuid.uuid4().hex[:8]}")
    fan_out = outgoing(30_000, 100)
    storage.commit(storage.load("Campaign", "c-1"), key="Mailer/m1", state={},
                   outgoing=fan_out)

    # Then every document written stays under the limit (before: 22.3 MiB in one)
    assert sizes.largest < LIMIT, f"a write left {sizes.largest / 2**20:.1f} MiB"
    # and the outbox and a duplicate get all 30,000 back, in order
    entry = storage.load("Campaign", "c-1").processed["Mailer/m1"]
    assert [e.message_id for e in entry.outgoing] == [e.message_id for e in fan_out]
    assert entry.outgoing[-1].body == fan_out[-1].body
    late = datetime.datetime.now(UTC) + datetime.timedelta(seconds=1)
    (pending,) = storage.undispatched(committed_before=late)
    assert len(pending.outgoing) == 30_000

    # Once dispatched, the ids stay and the bodies are no longer read
    storage.mark_dispatched("Campaign", "c-1", "Mailer/m1")
    entry = storage.load("Campaign", "c-1").processed["Mailer/m1"]
    assert entry.dispatched and entry.outgoing == ()
    assert entry.outgoing_ids == tuple(e.message_id for e in fan_out)


def test_side_documents_of_a_commit_that_did_not_apply_are_collected():
    # Given a spilled commit that applied, and one that lost its race (its side documents
    # are deleted at once) and one whose process died between its side write and its
    # aggregate write (simulated: the side documents alone)
    storage = MongoStorage.embedded(f"limit-{uuid.uuid4().hex[:8]}")
    loaded = storage.load("Campaign", "c-1")
    storage.commit(loaded, key="Mailer/m1", state={}, outgoing=outgoing(3, 10_000))
    with pytest.raises(AlreadyProcessed):
        storage.commit(loaded, key="Mailer/m1", state={}, outgoing=outgoing(3, 10_000))
    side = storage.database[SPILL]
    assert side.count_documents({}) == 1
    survivor = side.find_one()["ref"]
    storage.database[SPILL].insert_one({
        "_id": "dead.0", "ref": "dead", "n": 0, "collection": "Campaign",
        "aggregate_id": "c-1", "key": "Mailer/m2", "outgoing": [], "ids": [],
        "at": datetime.datetime.now(UTC)})

    # When the retention sweep runs within the grace period, then after it
    storage.expire(datetime.datetime.now(UTC))
    assert side.count_documents({}) == 2
    storage.expire(datetime.datetime.now(UTC) + datetime.timedelta(hours=2))

    # Then only the orphan is gone, and the applied commit still reads its messages
    assert [d["ref"] for d in side.find()] == [survivor]
    assert len(storage.load("Campaign", "c-1").processed["Mailer/m1"].outgoing) == 3


def test_messages_dispatched_without_their_bodies_leave_room_for_the_next(sizes: Sizes):
    # Given 200 handlers each publishing a 15 KB event, each marked dispatched at once
    # (the outbox compacts after dispatch: the bodies go, the ids stay)
    storage = MongoStorage.embedded(f"limit-{uuid.uuid4().hex[:8]}")
    for number in range(200):
        key = f"Shipping/m{number}"
        storage.commit(storage.load("Order", "o-1", key), key=key, state={},
                       outgoing=outgoing(1, 15_000))
        storage.mark_dispatched("Order", "o-1", key)

    # Then the room their bodies took counts no more: nothing was spilled (a spill is one
    # more write per commit)
    assert storage.database[SPILL].count_documents({}) == 0
    assert len(storage.load("Order", "o-1").processed) == storage.processed_window
