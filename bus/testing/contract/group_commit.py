"""The contract of group commits and loads (``commit_many``, ``load_many``): what a batch of
messages sends to the storage in one call, each still its own conditional write with its
own answer. Part of :class:`~idembus.testing.contract.AggregateStoreContract`."""

from __future__ import annotations

from typing import ClassVar

from ...storage.base import AggregateStore, PendingCommit, StorageRole
from ...storage.errors import AlreadyProcessed, ConcurrencyConflict
from . import records as agg
from .base import RoleContract, StorageFactory


class GroupCommitContract(RoleContract):
    """``commit_many`` answers each commit as ``commit`` would have alone — written, a
    duplicate with its stored messages, a conflict — and one refusal never undoes or
    blocks the others; ``load_many`` answers each load in order."""

    roles: ClassVar[tuple[type[StorageRole], ...]] = (AggregateStore,)

    def test_a_group_commit_answers_each_commit_on_its_own(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given two existing accounts, one with a message already processed
        storage = storage_factory()
        live = agg.created(storage, "live", balance=1)
        stored = (agg.envelope(),)
        agg.commit(storage, storage.load(agg.ACCOUNT, "seen"), "H/seen", {"balance": 7},
                   stored)
        seen = storage.load(agg.ACCOUNT, "seen")
        stale = agg.created(storage, "stale", balance=2)
        agg.commit(storage, stale, "H/moved", {"balance": 3})  # a competing writer
        sent = (agg.envelope(),)

        # When a group updates one, creates one, repeats the processed message and
        # commits on a stale version
        results = storage.commit_many([
            PendingCommit(live, "H/a", {"balance": 10}, sent),
            PendingCommit(storage.load(agg.ACCOUNT, "new"), "H/b", {"balance": 20}, ()),
            PendingCommit(seen, "H/seen", {"balance": 99}, (agg.envelope(),)),
            PendingCommit(stale, "H/c", {"balance": 30}, ()),
        ])

        # Then the first two are written, the third is a duplicate handing back what was
        # stored, the fourth a conflict, and neither refusal wrote anything
        assert results[:2] == [None, None]
        assert isinstance(results[2], AlreadyProcessed)
        assert tuple(results[2].outgoing) == stored
        assert isinstance(results[3], ConcurrencyConflict)
        assert storage.load(agg.ACCOUNT, "live").state == {"balance": 10}
        assert storage.load(agg.ACCOUNT, "live", "H/a").processed["H/a"].outgoing == sent
        assert storage.load(agg.ACCOUNT, "new").state == {"balance": 20}
        assert storage.load(agg.ACCOUNT, "seen").state == {"balance": 7}
        after = storage.load(agg.ACCOUNT, "stale", "H/c")
        assert after.state == {"balance": 3} and "H/c" not in after.processed

    def test_a_group_load_answers_each_load_in_order(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        agg.created(storage, "a", key="H/1", balance=1)
        agg.created(storage, "b", key="H/2", balance=2)

        records = storage.load_many([(agg.ACCOUNT, "b", "H/2"), (agg.ACCOUNT, "missing", None),
                                     (agg.ACCOUNT, "a", "H/1")])

        assert [getattr(record, "aggregate_id", None) for record in records] == [
            "b", "missing", "a"]
        b, missing, a = records
        assert not isinstance(b, Exception) and b.state == {"balance": 2}
        assert "H/2" in b.processed
        assert not isinstance(missing, Exception) and not missing.exists
        assert not isinstance(a, Exception) and a.state == {"balance": 1}
