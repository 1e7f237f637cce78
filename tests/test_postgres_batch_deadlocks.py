"""Batched commits on PostgreSQL (``commit_many``) lock their aggregates in one order, so
that two workers committing overlapping batches never deadlock; and a deadlock that
PostgreSQL reports all the same is not a failure of the messages."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest

from idembus.storage.base import AggregateRecord, PendingCommit
from idembus.storage.errors import ConcurrencyConflict
from idembus.storage.postgres import PostgresStorage

pytestmark = pytest.mark.postgres

TYPE = "tests.Account"


def created(storage: PostgresStorage, aggregate_id: str) -> AggregateRecord:
    """An aggregate committed once, as loaded afterwards (version 1)."""
    storage.commit(AggregateRecord(TYPE, aggregate_id), key=f"create-{aggregate_id}",
                   state={"n": 0}, outgoing=())
    return storage.load(TYPE, aggregate_id, "nothing")


def change(loaded: AggregateRecord) -> PendingCommit:
    """A commit of ``loaded`` (an update if it exists, else a create) by a new message."""
    return PendingCommit(loaded, str(uuid.uuid4()), {"n": loaded.version + 1}, ())


def opposite_batches(storage: PostgresStorage, round_: int) -> tuple[list[PendingCommit],
                                                                     list[PendingCommit]]:
    """Two batches over the same aggregates, each with updates and creates, in opposite
    orders: ``first`` has one update (committed alone) and two creates (committed as a
    group); ``second`` one create and two updates. Before the fix, the one committed alone
    locked its row first, then the group waited for the other batch's."""
    old = [created(storage, f"old-{round_}-{index}") for index in range(2)]
    new = [AggregateRecord(TYPE, f"new-{round_}-{index}") for index in range(2)]
    first = [change(old[0]), change(new[0]), change(new[1])]
    second = [change(new[1]), change(old[1]), change(old[0])]
    return first, second[::-1]


@pytest.mark.timeout(240)
def test_two_workers_committing_overlapping_batches_in_opposite_orders_never_deadlock(
        postgres_storage: PostgresStorage, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="idembus.storage.postgres")
    storage = postgres_storage
    failures: list[BaseException] = []
    answers: list[Exception | None] = []
    for round_ in range(60):
        batches = opposite_batches(storage, round_)
        gate = threading.Barrier(2)

        def commit(batch: Sequence[PendingCommit], gate: threading.Barrier = gate) -> None:
            gate.wait(10)
            try:
                answers.extend(storage.commit_many(batch))
            except BaseException as error:  # asserted below
                failures.append(error)

        workers = [threading.Thread(target=commit, args=(batch,)) for batch in batches]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
        assert not any(worker.is_alive() for worker in workers)
    # No batch raised (a deadlock was an outage: the whole batch waited and went again),
    # and each commit either applied or lost its race as a conflict, as one alone would.
    assert not failures, [str(failure) for failure in failures[:3]]
    refused = [answer for answer in answers if answer is not None]
    assert all(isinstance(answer, ConcurrencyConflict) for answer in refused), refused[:3]
    assert "deadlock" not in " ".join(str(answer) for answer in refused)
    # Nor did PostgreSQL find a deadlock (which would have been committed one by one).
    assert "rolled back by PostgreSQL" not in caplog.text


class _DeadlockOnce(PostgresStorage):
    """A storage whose first group commit meets a deadlock, as PostgreSQL reports it."""

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self.deadlocks = 0

    def _commit_groups(self, commits: Sequence[PendingCommit], order: Sequence[int]
                       ) -> list[tuple[str, tuple[Any, ...], list[int]]]:
        groups = super()._commit_groups(commits, order)
        if self.deadlocks == 0:
            self.deadlocks += 1
            # A statement that fails the way a deadlock does (SQLSTATE 40P01).
            groups.append(("DO $$ BEGIN RAISE EXCEPTION 'deadlock detected' "
                           "USING ERRCODE = 'deadlock_detected'; END $$", (), []))
        return groups


@pytest.mark.timeout(60)
def test_a_batch_that_meets_a_deadlock_is_committed_one_by_one_not_failed(
        postgres_storage: PostgresStorage) -> None:
    storage = _DeadlockOnce(postgres_storage.conninfo,
                            table_prefix=postgres_storage.table_prefix)
    try:
        old = [created(storage, f"dl-{index}") for index in range(2)]
        batch = [change(old[0]), change(old[1]),
                 change(AggregateRecord(TYPE, "dl-new-0")),
                 change(AggregateRecord(TYPE, "dl-new-1"))]
        answers = storage.commit_many(batch)
        assert storage.deadlocks == 1
        assert answers == [None, None, None, None]
        for pending in batch:
            loaded = storage.load(TYPE, pending.loaded.aggregate_id, pending.key)
            assert pending.key in loaded.processed
    finally:
        storage.close()


def test_a_deadlock_is_transient_in_the_taxonomy() -> None:
    from idembus.storage.errors import StorageUnavailable
    from idembus.storage.postgres_errors import classified

    error = psycopg.errors.DeadlockDetected("deadlock detected")
    kind = classified(error, "postgresql://x")
    assert isinstance(kind, StorageUnavailable), kind
