"""The contract of :class:`~idembus.storage.base.JournalStore`: the event journal, with
dense positions, and the dispatch marks that carry its entries."""

from __future__ import annotations

import datetime
import threading
from typing import ClassVar

from ...storage.base import (
    JournalBounds,
    JournalEntry,
    JournalStore,
    OutboxStore,
    StorageRole,
)
from .base import RoleContract, StorageFactory, needs

UTC = datetime.timezone.utc


def entry(number: int, *, parents: tuple[str, ...] = ()) -> JournalEntry:
    return JournalEntry(
        message_id=f"m{number}", message_type="sales.OrderPlaced",
        headers={"idembus.message_id": f"m{number}", "idembus.message_type": "sales.OrderPlaced"},
        body=f'{{"order_id": "o{number}"}}', aggregate_type="Order",
        aggregate_id=f"o{number}", parents=parents)


class JournalStoreContract(RoleContract):
    """Entries get dense positions once each, are read back in pages, trimmed but never the
    newest; dispatch marks carry them (the storage's aggregate role commits)."""

    roles: ClassVar[tuple[type[StorageRole], ...]] = (JournalStore,)

    def test_entries_get_dense_positions_and_are_read_back_as_appended(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        assert storage.journal_bounds() == JournalBounds(None, 0, 0)
        storage.append_journal([entry(1, parents=("user/7", "video/3")), entry(2)])
        storage.append_journal([entry(3)])
        read = storage.read_journal(after=0)
        assert [e.position for e in read] == [1, 2, 3]
        assert [e.message_id for e in read] == ["m1", "m2", "m3"]
        first = read[0]
        assert first.parents == ("user/7", "video/3")
        assert (first.aggregate_type, first.aggregate_id) == ("Order", "o1")
        assert first.body == '{"order_id": "o1"}'
        assert first.headers["idembus.message_id"] == "m1"
        assert first.recorded_at is not None and first.recorded_at.tzinfo is not None
        assert storage.journal_bounds() == JournalBounds(1, 3, 3)

    def test_an_event_appended_again_keeps_its_first_position(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        storage.append_journal([entry(1), entry(2)])
        storage.append_journal([entry(2), entry(3), entry(1)])
        assert [(e.message_id, e.position) for e in storage.read_journal(after=0)] == [
            ("m1", 1), ("m2", 2), ("m3", 3)]

    def test_reading_after_a_position_pages_through_the_rest(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        storage.append_journal([entry(n) for n in range(1, 8)])
        assert [e.position for e in storage.read_journal(after=2, limit=3)] == [3, 4, 5]
        assert [e.position for e in storage.read_journal(after=5, limit=3)] == [6, 7]
        assert storage.read_journal(after=7) == []

    def test_concurrent_appenders_leave_no_gap_and_no_repeat(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        start = threading.Barrier(4)

        def append(worker: int) -> None:
            start.wait()
            for n in range(15):
                storage.append_journal([entry(worker * 100 + n), entry(n)])  # m0..m14 contended

        threads = [threading.Thread(target=append, args=(w,)) for w in range(1, 5)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        read = storage.read_journal(after=0, limit=1000)
        assert [e.position for e in read] == list(range(1, len(read) + 1))
        ids = [e.message_id for e in read]
        assert len(ids) == len(set(ids)) == 4 * 15 + 15

    def test_trimming_removes_old_entries_but_never_the_newest(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        storage.append_journal([entry(1), entry(2), entry(3)])
        future = datetime.datetime.now(UTC) + datetime.timedelta(hours=1)
        assert storage.trim_journal(future, batch=1) == 1
        assert storage.journal_bounds() == JournalBounds(2, 3, 2)
        assert storage.trim_journal(future) == 1
        assert storage.journal_bounds() == JournalBounds(3, 3, 1)
        assert storage.trim_journal(future) == 0
        storage.append_journal([entry(4), entry(1)])  # positions go on; m1 was forgotten
        assert [(e.message_id, e.position) for e in storage.read_journal(after=0)] == [
            ("m3", 3), ("m4", 4), ("m1", 5)]

    def test_trimming_keeps_what_is_recent(self, storage_factory: StorageFactory) -> None:
        storage = storage_factory()
        storage.append_journal([entry(1), entry(2)])
        past = datetime.datetime.now(UTC) - datetime.timedelta(hours=1)
        assert storage.trim_journal(past) == 0
        assert storage.journal_bounds().size == 2

    def test_the_position_at_a_moment_resumes_from_the_first_entry_since(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        before_all = datetime.datetime.now(UTC) - datetime.timedelta(seconds=1)
        assert storage.journal_position_at(before_all) == 0
        storage.append_journal([entry(1), entry(2)])
        first, second = storage.read_journal(after=0)
        assert storage.journal_position_at(before_all) == 0
        assert storage.journal_position_at(second.recorded_at) in (0, 1)
        later = datetime.datetime.now(UTC) + datetime.timedelta(hours=1)
        assert storage.journal_position_at(later) == 2

    def test_the_position_at_a_moment_before_trimmed_entries_is_unknown(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        long_ago = datetime.datetime.now(UTC) - datetime.timedelta(days=1)
        storage.append_journal([entry(1), entry(2), entry(3)])
        storage.trim_journal(datetime.datetime.now(UTC) + datetime.timedelta(hours=1), batch=1)
        assert storage.journal_position_at(long_ago) is None
        later = datetime.datetime.now(UTC) + datetime.timedelta(hours=1)
        assert storage.journal_position_at(later) == 3

    def test_a_dispatch_mark_carries_its_journal_entries(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        for number, key in ((1, "k1"), (2, "k2")):
            loaded = storage.load("Order", f"o{number}", key)
            storage.commit(loaded, key=key, state={"n": number}, outgoing=[])
            storage.mark_dispatched("Order", f"o{number}", key, journal=[entry(number)])
        storage.mark_dispatched("Order", "o1", "k1", journal=[entry(1)])  # a mark made again
        storage.flush()
        assert [(e.message_id, e.position) for e in storage.read_journal(after=0)] == [
            ("m1", 1), ("m2", 2)]

    def test_a_fenced_mark_carries_its_journal_entries(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        needs(storage, OutboxStore)  # the outbox dispatcher's leases fence its marks
        now = datetime.datetime.now(UTC)
        lease = storage.acquire_lease("idembus-outbox-dispatcher", "me", ttl=30, now=now)
        loaded = storage.load("Order", "o1", "k1")
        storage.commit(loaded, key="k1", state={"n": 1}, outgoing=[])
        storage.mark_dispatched("Order", "o1", "k1", lease=lease, journal=[entry(1)])
        assert [e.message_id for e in storage.read_journal(after=0)] == ["m1"]
