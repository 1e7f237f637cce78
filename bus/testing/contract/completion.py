"""The contract of completion (``commit(..., completed=True)``, a saga's ``complete()``):
tombstones that keep what deduplication needs, new commits on them, and their expiry.
Part of :class:`~idembus.testing.contract.AggregateStoreContract`."""

from __future__ import annotations

import datetime
from typing import ClassVar

import pytest

from ...envelope import Envelope, utc_now
from ...storage.base import AggregateRecord, AggregateStore, StorageRole
from ...storage.errors import AlreadyProcessed, ConcurrencyConflict
from . import records as agg
from .base import RoleContract, StorageFactory

HOUR = datetime.timedelta(hours=1)


def completed(storage: AggregateStore, aggregate_id: str, key: str,
              outgoing: tuple[Envelope, ...] = ()) -> AggregateRecord:
    """Complete a live account with ``key`` and return the tombstone as loaded."""
    storage.commit(storage.load(agg.ACCOUNT, aggregate_id), key=key, state={"balance": -1},
                   outgoing=outgoing, completed=True)
    return storage.load(agg.ACCOUNT, aggregate_id)


def dispatched(storage: AggregateStore, aggregate_id: str, *keys: str) -> None:
    """Mark ``keys`` dispatched, applied at once."""
    for key in keys:
        storage.mark_dispatched(agg.ACCOUNT, aggregate_id, key)
    storage.flush()


def expiring(storage: AggregateStore) -> AggregateStore:
    """``storage``, unless it keeps tombstones for ever (it does not override ``expire``):
    then the test is skipped."""
    if type(storage).expire is AggregateStore.expire:
        pytest.skip(f"{type(storage).__name__} does not expire anything (no expire())")
    return storage


class CompletionContract(RoleContract):
    """Completing an aggregate leaves a tombstone: no state, the entries and their outgoing
    messages kept, so late duplicates stay duplicates; a commit on it starts the aggregate
    again; retention removes it once nothing of it waits for dispatch."""

    roles: ClassVar[tuple[type[StorageRole], ...]] = (AggregateStore,)

    def test_completing_leaves_a_tombstone_without_state_at_the_next_version_with_its_entries(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        agg.created(storage, "a", key="H/m1", balance=5)
        farewell = agg.envelope()

        tombstone = completed(storage, "a", "H/m2", (farewell,))

        assert tombstone.version == 2
        assert tombstone.exists and tombstone.completed and not tombstone.live
        assert tombstone.state is None
        entries = agg.remembered(storage, "a", "H/m1", "H/m2")
        assert set(entries) == {"H/m1", "H/m2"}
        assert entries["H/m2"].outgoing == (farewell,)
        assert entries["H/m2"].dispatched is False

    def test_an_aggregate_may_be_created_completed(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()

        storage.commit(storage.load(agg.ACCOUNT, "a"), key="H/m1", state={"balance": 1},
                       outgoing=[agg.envelope()], completed=True)

        tombstone = storage.load(agg.ACCOUNT, "a", "H/m1")
        assert (tombstone.version, tombstone.completed, tombstone.state) == (1, True, None)
        assert "H/m1" in tombstone.processed

    def test_a_live_aggregate_is_not_completed(self, storage_factory: StorageFactory) -> None:
        storage = storage_factory()

        record = agg.created(storage, "a")

        assert record.live and not record.completed
        assert not storage.load(agg.ACCOUNT, "nobody").live

    def test_a_duplicate_after_completion_raises_already_processed_with_what_it_stored(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given a message processed while the aggregate lived and the completing one, both
        # with messages not yet dispatched
        storage = storage_factory()
        stale = storage.load(agg.ACCOUNT, "a")
        first = agg.envelope()
        agg.commit(storage, stale, "H/m1", {"balance": 1}, [first])
        last = agg.envelope()
        completed(storage, "a", "H/m2", (last,))

        # When either comes again, from a fresh load of the tombstone or a stale record
        for loaded, key, stored in ((storage.load(agg.ACCOUNT, "a"), "H/m1", (first,)),
                                    (storage.load(agg.ACCOUNT, "a"), "H/m2", (last,)),
                                    (stale, "H/m1", (first,))):
            with pytest.raises(AlreadyProcessed) as refused:
                agg.commit(storage, loaded, key, {"balance": 100}, [agg.envelope()])

            # Then it is a duplicate with the stored messages, and the tombstone stays
            assert refused.value.outgoing == stored
        tombstone = storage.load(agg.ACCOUNT, "a")
        assert (tombstone.version, tombstone.completed, tombstone.state) == (2, True, None)

    def test_a_duplicate_after_completion_and_dispatch_carries_no_messages(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        agg.created(storage, "a", key="H/m1")
        completed(storage, "a", "H/m2", (agg.envelope(),))
        dispatched(storage, "a", "H/m2")

        with pytest.raises(AlreadyProcessed) as refused:
            agg.commit(storage, storage.load(agg.ACCOUNT, "a"), "H/m2", {"balance": 0},
                       [agg.envelope()])

        assert refused.value.outgoing == ()
        assert storage.load(agg.ACCOUNT, "a").completed  # the mark kept the tombstone

    def test_a_commit_on_a_tombstone_starts_the_aggregate_again_and_keeps_its_entries(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        agg.created(storage, "a", key="H/m1")
        tombstone = completed(storage, "a", "H/m2")

        agg.commit(storage, tombstone, "H/m3", {"balance": 7})

        record = storage.load(agg.ACCOUNT, "a")
        assert (record.version, record.live, dict(record.state or {})) == (3, True,
                                                                             {"balance": 7})
        assert set(agg.remembered(storage, "a", "H/m1", "H/m2", "H/m3")) == {
            "H/m1", "H/m2", "H/m3"}
        with pytest.raises(AlreadyProcessed):
            agg.commit(storage, record, "H/m1", {"balance": 0})

    def test_completing_from_a_stale_version_is_a_conflict_and_changes_nothing(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        stale = agg.created(storage, "a", key="H/m1")
        agg.commit(storage, stale, "H/m2", {"balance": 2})

        with pytest.raises(ConcurrencyConflict):
            storage.commit(stale, key="H/m3", state=None, outgoing=(), completed=True)

        record = storage.load(agg.ACCOUNT, "a")
        assert (record.version, record.live, dict(record.state or {})) == (2, True,
                                                                             {"balance": 2})

    def test_records_show_a_tombstone_as_completed_without_state(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        agg.created(storage, "a", key="H/a")
        agg.created(storage, "b", key="H/b")
        completed(storage, "b", "H/b2")
        storage.flush()

        found = {record.aggregate_id: record for record in storage.records(agg.ACCOUNT)}

        assert {i: (r.completed, r.state is None) for i, r in found.items()} == {
            "a": (False, False), "b": (True, True)}
        assert found["b"].updated_at is not None

    # -- retention ------------------------------------------------------------------------

    def test_expire_removes_a_dispatched_tombstone_once_retention_has_passed(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given a tombstone whose messages were dispatched, on a storage with retention
        storage = expiring(storage_factory(retention=HOUR))
        agg.created(storage, "a", key="H/m1")
        completed(storage, "a", "H/m2", (agg.envelope(),))
        dispatched(storage, "a", "H/m2")
        agg.created(storage, "b", key="H/b1")  # a live one, never removed by retention

        # When retention runs before it has passed, then after
        storage.expire(utc_now())
        kept = storage.load(agg.ACCOUNT, "a")
        removed = storage.expire(utc_now() + 2 * HOUR)

        # Then the tombstone stays until retention has passed, and then it is gone
        assert kept.completed and kept.version == 2
        assert removed >= 1
        assert storage.load(agg.ACCOUNT, "a").version == 0
        assert [r.aggregate_id for r in storage.records(agg.ACCOUNT)] == ["b"]
        assert storage.load(agg.ACCOUNT, "b").live

    def test_expire_never_removes_a_tombstone_whose_messages_were_not_dispatched(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given a tombstone whose completing message's messages were never dispatched
        storage = expiring(storage_factory(retention=HOUR))
        agg.created(storage, "a", key="H/m1")
        pending = agg.envelope()
        completed(storage, "a", "H/m2", (pending,))

        # When retention has long passed
        storage.expire(utc_now() + 2 * HOUR)

        # Then it is still there with its messages, so a duplicate re-sends them
        assert storage.load(agg.ACCOUNT, "a").completed
        assert agg.remembered(storage, "a", "H/m2")["H/m2"].outgoing == (pending,)

        # And once the outbox has sent them, retention removes it
        dispatched(storage, "a", "H/m2")
        storage.expire(utc_now() + 2 * HOUR)
        assert storage.load(agg.ACCOUNT, "a").version == 0
