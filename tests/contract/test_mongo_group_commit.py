"""MongoStorage's group commit (``commit_many``: one unordered ``bulk_write`` per aggregate
collection) under the group-commit contract, on mongomock.

mongomock 4.3 runs a ``bulk_write`` of updates except for one thing: its bulk builder does
not take the ``sort`` keyword that pymongo 4.11 and later pass, so MongoStorage falls back
to one write per commit there. These tests give the builder that keyword (``sort`` unset,
as idembus leaves it) and so run the bulk path — its per-write conditions, the duplicate
keys of lost creation races in a partial ``BulkWriteError``, and the read-back of which
updates applied — against mongomock's own bulk semantics. A real server runs it through
tests/contract/test_storage_contract.py with IDEMBUS_MONGODB_URL.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import mongomock
import pytest
from mongomock.collection import BulkOperationBuilder

from idembus.storage.base import PendingCommit
from idembus.storage.errors import AlreadyProcessed
from idembus.storage.mongo import MongoStorage, bulk_updates_work
from idembus.testing.contract.aggregates import ACCOUNT
from idembus.testing.contract.group_commit import GroupCommitContract


@pytest.fixture
def bulk_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """mongomock's bulk builder given pymongo's ``sort`` keyword; the sizes of the
    ``bulk_write`` calls made."""
    add_update = BulkOperationBuilder.add_update

    def taking_sort(self: Any, *args: Any, sort: Any = None, **kwargs: Any) -> Any:
        assert sort is None, "idembus never sorts an update"
        return add_update(self, *args, **kwargs)

    calls: list[int] = []
    bulk_write = mongomock.Collection.bulk_write

    def counted(self: Any, requests: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(requests))
        return bulk_write(self, requests, *args, **kwargs)

    monkeypatch.setattr(BulkOperationBuilder, "add_update", taking_sort)
    monkeypatch.setattr(mongomock.Collection, "bulk_write", counted)
    return calls


class TestMongoBulkGroupCommit(GroupCommitContract):
    @pytest.fixture
    def storage_factory(self, bulk_calls: list[int]) -> Iterator[Callable[..., Any]]:
        def make(**options: Any) -> MongoStorage:
            return MongoStorage.embedded(f"group-{uuid.uuid4().hex[:8]}", **options)

        yield make

    def test_a_group_commit_answers_each_commit_on_its_own(
        self, storage_factory: Callable[..., Any], bulk_calls: list[int],
    ) -> None:
        super().test_a_group_commit_answers_each_commit_on_its_own(storage_factory)
        assert bulk_calls == [4]  # the group's four commits in one bulk_write


def test_without_the_keyword_mongomock_commits_a_group_one_by_one() -> None:
    storage = MongoStorage.embedded(f"group-{uuid.uuid4().hex[:8]}")
    assert not bulk_updates_work(storage.client)
    loaded = [storage.load(ACCOUNT, name) for name in ("a", "b")]

    results = storage.commit_many([PendingCommit(record, f"H/{record.aggregate_id}",
                                                 {"balance": 1}, ()) for record in loaded])

    assert results == [None, None]


def test_a_lost_creation_race_in_a_bulk_is_a_duplicate_for_that_commit_only(
    bulk_calls: list[int],
) -> None:
    # Given two commits creating accounts, one of which another writer created first with
    # the same message
    storage = MongoStorage.embedded(f"group-{uuid.uuid4().hex[:8]}")
    a, b = storage.load(ACCOUNT, "a"), storage.load(ACCOUNT, "b")
    storage.commit(storage.load(ACCOUNT, "b"), key="H/b", state={"balance": 5}, outgoing=())

    # When both go in one group
    results = storage.commit_many([PendingCommit(a, "H/a", {"balance": 1}, ()),
                                   PendingCommit(b, "H/b", {"balance": 9}, ())])

    # Then one bulk_write carried both; the creation applied, the other is a duplicate
    assert bulk_calls == [2]
    assert results[0] is None and isinstance(results[1], AlreadyProcessed)
    assert storage.load(ACCOUNT, "a").state == {"balance": 1}
    assert storage.load(ACCOUNT, "b").state == {"balance": 5}
