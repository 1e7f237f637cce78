"""The contract of :class:`~idembus.storage.base.LimitStore`: rate limits as a schedule of
slots and concurrency limits as leased slots, shared by every user of the storage."""

from __future__ import annotations

import datetime
import threading
from typing import ClassVar

from ...storage.base import LimitStore, StorageRole
from .base import RoleContract, StorageFactory

UTC = datetime.timezone.utc
START = datetime.datetime(2031, 5, 4, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime.datetime:
    return START + datetime.timedelta(seconds=seconds)


class LimitStoreContract(RoleContract):
    """Reservations spaced by the interval after a burst; slots taken, renewed, released
    and freed when their lease ends; both atomic under concurrent callers."""

    roles: ClassVar[tuple[type[StorageRole], ...]] = (LimitStore,)

    def test_a_burst_runs_at_once_and_later_reservations_are_spaced(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        waits = [storage.reserve_rate("r", interval=0.5, burst=2, now=at(0)) for _ in range(5)]
        assert waits == [0.0, 0.0, 0.5, 1.0, 1.5]

    def test_a_quiet_spell_refills_the_burst_and_no_more(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        for _ in range(4):
            storage.reserve_rate("r", interval=1.0, burst=2, now=at(0))
        # the slots reserved at 0 reach to 4 s; at 100 s the burst is whole again, not more
        waits = [storage.reserve_rate("r", interval=1.0, burst=2, now=at(100))
                 for _ in range(3)]
        assert waits == [0.0, 0.0, 1.0]

    def test_rate_limits_are_separate_by_name(self, storage_factory: StorageFactory) -> None:
        storage = storage_factory()
        assert storage.reserve_rate("a", interval=10, burst=1, now=at(0)) == 0.0
        assert storage.reserve_rate("b", interval=10, burst=1, now=at(0)) == 0.0
        assert storage.reserve_rate("a", interval=10, burst=1, now=at(0)) == 10.0

    def test_concurrent_reservations_get_distinct_slots(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        waits: list[float] = []
        lock = threading.Lock()

        def reserve() -> None:
            for _ in range(10):
                wait = storage.reserve_rate("r", interval=1.0, burst=1, now=at(0))
                with lock:
                    waits.append(wait)

        threads = [threading.Thread(target=reserve) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert sorted(waits) == [float(n) for n in range(40)]

    def test_slots_are_taken_up_to_the_limit_and_given_back(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()

        def take(holder: str, seconds: float = 0) -> bool:
            return bool(storage.acquire_slot("c", slots=2, holder=holder, lease=30,
                                             now=at(seconds)))

        assert take("a") and take("b")
        assert not take("c")
        assert take("a")  # a holder keeps its slot
        storage.release_slot("c", "a")
        assert take("c")
        assert not take("a")
        storage.release_slot("c", "nobody")  # releasing what one does not hold changes nothing
        assert not take("d")

    def test_a_slot_whose_lease_ran_out_is_free_again(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        assert storage.acquire_slot("c", slots=1, holder="dead", lease=30, now=at(0))
        assert not storage.acquire_slot("c", slots=1, holder="next", lease=30, now=at(29))
        assert storage.acquire_slot("c", slots=1, holder="next", lease=30, now=at(31))

    def test_concurrent_takers_never_exceed_the_slots(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        won: list[str] = []
        lock = threading.Lock()

        def take(holder: str) -> None:
            if storage.acquire_slot("c", slots=3, holder=holder, lease=30, now=at(0)):
                with lock:
                    won.append(holder)

        threads = [threading.Thread(target=take, args=(f"h{n}",)) for n in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len(won) == 3
