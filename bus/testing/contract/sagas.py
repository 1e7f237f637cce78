"""The contract of a saga's story: each processed entry keeps its message's type and time,
a tombstone keeps the state it ended with and the entry that ended it, and the live
aggregates of a type (or its tombstones) are listed page by page (``aggregate_page``).
Part of :class:`~idembus.testing.contract.AggregateStoreContract`."""

from __future__ import annotations

import datetime
from typing import ClassVar

from ...storage.base import AggregateStore, PendingCommit, StorageRole
from . import records as agg
from .base import RoleContract, StorageFactory
from .completion import expiring

HOUR = datetime.timedelta(hours=1)
PLACED, PAID, CANCELLED = "shop.OrderPlaced", "shop.PaymentReceived", "shop.CancelOrder"


def story(storage: AggregateStore, aggregate_id: str, *, final: bool = True) -> None:
    """An account placed with one message, then completed by another (with its last state
    unless not ``final``)."""
    storage.commit(storage.load(agg.ACCOUNT, aggregate_id), key=f"H/{aggregate_id}-1",
                   state={"status": "placed"}, outgoing=(), message_type=PLACED)
    storage.commit(storage.load(agg.ACCOUNT, aggregate_id), key=f"H/{aggregate_id}-2",
                   state={"status": "paid"} if final else None, outgoing=(agg.envelope(),),
                   completed=True, message_type=PAID)


class SagaHistoryContract(RoleContract):
    """What tools read of a saga after it ended, and how they list the live ones."""

    roles: ClassVar[tuple[type[StorageRole], ...]] = (AggregateStore,)

    def test_each_entry_keeps_the_type_and_time_of_its_message_through_the_dispatch_mark(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        before = datetime.datetime.now(agg.UTC)
        story(storage, "a")
        storage.mark_dispatched(agg.ACCOUNT, "a", "H/a-2")
        storage.flush()

        record = storage.history(agg.ACCOUNT, "a")

        assert {key: entry.message_type for key, entry in record.processed.items()} == {
            "H/a-1": PLACED, "H/a-2": PAID}
        assert all(entry.at is not None and entry.at >= before - datetime.timedelta(seconds=5)
                   for entry in record.processed.values())
        assert storage.load(agg.ACCOUNT, "a", "H/a-1").processed["H/a-1"].message_type == PLACED

    def test_an_entry_committed_without_a_type_reads_as_none(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()

        agg.created(storage, "a", key="H/m1")

        assert storage.history(agg.ACCOUNT, "a").processed["H/m1"].message_type is None

    def test_a_tombstone_keeps_the_state_it_ended_with_and_the_entry_that_ended_it(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()

        story(storage, "a")

        loaded, history = storage.load(agg.ACCOUNT, "a"), storage.history(agg.ACCOUNT, "a")
        for record in (loaded, history):
            assert record.completed and not record.live and record.state is None
            assert dict(record.final_state or {}) == {"status": "paid"}
        ended = history.ended_by()
        assert ended is not None
        assert (ended.key, ended.message_type) == ("H/a-2", PAID)

    def test_a_tombstone_completed_without_a_state_has_no_final_state(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()

        story(storage, "a", final=False)

        record = storage.history(agg.ACCOUNT, "a")
        assert record.completed and record.final_state is None

    def test_a_tombstone_started_again_is_live_without_a_final_state(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        story(storage, "a")

        agg.commit(storage, storage.load(agg.ACCOUNT, "a"), "H/a-3", {"status": "again"})

        record = storage.history(agg.ACCOUNT, "a")
        assert record.live and record.final_state is None
        assert dict(record.state or {}) == {"status": "again"}
        assert record.ended_by() is None

    def test_a_group_commit_keeps_each_entry_type_and_each_final_state(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        for name in ("a", "b"):
            agg.created(storage, name, key=f"H/{name}-0")
        commits = [PendingCommit(storage.load(agg.ACCOUNT, name), f"H/{name}-1",
                                 {"status": name}, (), {"completed": name == "b",
                                                        "message_type": f"t.{name}"})
                   for name in ("a", "b")]

        assert storage.commit_many(commits) == [None, None]

        a, b = storage.history(agg.ACCOUNT, "a"), storage.history(agg.ACCOUNT, "b")
        assert a.processed["H/a-1"].message_type == "t.a" and a.live
        assert b.processed["H/b-1"].message_type == "t.b"
        assert b.completed and dict(b.final_state or {}) == {"status": "b"}

    def test_aggregate_page_lists_the_live_ones_by_id_a_page_at_a_time(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given three live accounts, two tombstones and another type's aggregate
        storage = storage_factory()
        for name in ("c", "a", "b"):
            agg.created(storage, name, key=f"H/{name}", balance=ord(name))
        story(storage, "d")
        story(storage, "e")
        storage.commit(storage.load("Other", "a0"), key="H/o", state={}, outgoing=())

        # When they are listed two at a time
        first = storage.aggregate_page(agg.ACCOUNT, limit=2)
        second = storage.aggregate_page(agg.ACCOUNT, limit=2, after=first[-1].aggregate_id)

        # Then the live ones come in the order of their ids, with their states
        assert [r.aggregate_id for r in first] == ["a", "b"]
        assert [r.aggregate_id for r in second] == ["c"]
        assert dict(first[0].state or {}) == {"balance": ord("a")}
        assert all(r.live and r.version == 1 and r.updated_at is not None
                   for r in first + second)

    def test_aggregate_page_lists_tombstones_with_their_final_state_and_filters_on_the_id(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        agg.created(storage, "order-9", key="H/live")
        for name in ("order-1", "order-2", "other-1"):
            story(storage, name)

        ended = storage.aggregate_page(agg.ACCOUNT, completed=True)
        orders = storage.aggregate_page(agg.ACCOUNT, completed=True, id_prefix="order-")
        live = storage.aggregate_page(agg.ACCOUNT, id_prefix="order-")

        assert [r.aggregate_id for r in ended] == ["order-1", "order-2", "other-1"]
        assert all(r.completed and r.state is None and dict(r.final_state or {}) == {
            "status": "paid"} for r in ended)
        assert [r.aggregate_id for r in orders] == ["order-1", "order-2"]
        assert [r.aggregate_id for r in live] == ["order-9"]
        assert storage.aggregate_page(agg.ACCOUNT, id_prefix="nobody") == []

    def test_a_tombstone_and_its_story_stay_until_retention_has_passed(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = expiring(storage_factory(retention=HOUR))
        story(storage, "a")
        storage.mark_dispatched(agg.ACCOUNT, "a", "H/a-2")
        storage.flush()

        storage.expire(datetime.datetime.now(agg.UTC))
        kept = storage.history(agg.ACCOUNT, "a")
        storage.expire(datetime.datetime.now(agg.UTC) + 2 * HOUR)

        assert dict(kept.final_state or {}) == {"status": "paid"}
        assert {e.message_type for e in kept.processed.values()} == {PLACED, PAID}
        assert not storage.history(agg.ACCOUNT, "a").exists
        assert storage.aggregate_page(agg.ACCOUNT, completed=True) == []
