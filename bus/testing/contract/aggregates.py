"""The contract of :class:`~idembus.storage.base.AggregateStore`: aggregates and
deduplication (``load``, ``commit``, ``mark_dispatched``), the processed window and
retention, and races between committers."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
from pydantic import BaseModel, ConfigDict

from ... import headers as h
from ...envelope import Envelope, utc_now
from ...errors import IncompatibleState
from ...evolution import load_state, upcaster
from ...storage.base import AggregateRecord, AggregateStore, OutboxStore, StorageRole
from ...storage.errors import AlreadyProcessed, ConcurrencyConflict
from .base import StorageFactory
from .completion import CompletionContract
from .group_commit import GroupCommitContract
from .records import ACCOUNT, UTC, commit, created, envelope, remembered
from .sagas import SagaHistoryContract

THREADS = 8
ROUNDS = 20


@dataclass
class Race:
    """What each racing thread got: "ok", "duplicate", "conflict" or an unexpected error."""

    outcomes: list[str]
    #: The outgoing messages each thread committed (winner) or was handed back (duplicates).
    outgoing: list[tuple[Envelope, ...]]

    @property
    def winner(self) -> int:
        return self.outcomes.index("ok")


def race(storage: AggregateStore, loaded: AggregateRecord, keys: Sequence[str]) -> Race:
    """Commit ``keys[i]`` from thread ``i``, every thread against ``loaded``, started together."""
    barrier = threading.Barrier(len(keys))
    result = Race([""] * len(keys), [()] * len(keys))

    def attempt(index: int) -> None:
        try:
            barrier.wait(timeout=30)
            outgoing = (envelope(),)
            commit(storage, loaded, keys[index], {"balance": index}, outgoing)
            result.outcomes[index], result.outgoing[index] = "ok", outgoing
        except AlreadyProcessed as duplicate:
            result.outcomes[index], result.outgoing[index] = "duplicate", duplicate.outgoing
        except ConcurrencyConflict:
            result.outcomes[index] = "conflict"
        except BaseException as error:  # reported through the outcome, not lost in a thread
            result.outcomes[index] = f"unexpected {error!r}"

    threads = [threading.Thread(target=attempt, args=(i,), daemon=True) for i in range(len(keys))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a committing thread hung"
    return result


class AggregateStoreContract(CompletionContract, GroupCommitContract, SagaHistoryContract):
    """Loads and conditional commits, duplicates refused with their stored messages,
    dispatch marks, the processed window and retention, racing committers, the state's
    schema version (``commit(state_version=...)``, read back by ``load`` and ``records``)
    and completion (:class:`~idembus.testing.contract.completion.CompletionContract`), group
    commits and loads (:class:`~idembus.testing.contract.group_commit.GroupCommitContract`),
    a saga's story and the listing of aggregates
    (:class:`~idembus.testing.contract.sagas.SagaHistoryContract`)."""

    roles: ClassVar[tuple[type[StorageRole], ...]] = (AggregateStore,)

    # -- load and commit --------------------------------------------------------------------------

    def test_loading_a_missing_aggregate_returns_an_empty_record_at_version_0(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()

        record = storage.load(ACCOUNT, "nobody")

        assert record.aggregate_type == ACCOUNT
        assert record.aggregate_id == "nobody"
        assert record.version == 0
        assert not record.exists
        assert record.state is None
        assert dict(record.processed) == {}

    def test_committing_a_new_aggregate_creates_it_at_version_1_with_its_processed_entry(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        event = envelope()
        command = envelope("test.Notify", intent=h.Intent.SEND, destination="mailer")

        commit(storage, storage.load(ACCOUNT, "a"), "AccountHandler/m1",
               {"balance": 5, "owner": {"name": "Ann"}}, [event, command])
        record = storage.load(ACCOUNT, "a")

        assert record.version == 1
        assert record.exists
        assert dict(record.state or {}) == {"balance": 5, "owner": {"name": "Ann"}}
        assert list(remembered(storage, "a", "AccountHandler/m1")) == ["AccountHandler/m1"]
        entry = remembered(storage, "a", "AccountHandler/m1")["AccountHandler/m1"]
        assert entry.key == "AccountHandler/m1"
        assert entry.outgoing == (event, command)
        assert entry.outgoing[1].destination == "mailer"
        assert entry.outgoing[1].intent is h.Intent.SEND
        assert entry.outgoing_ids == (event.message_id, command.message_id)
        assert entry.dispatched is False
        assert entry.at is not None and entry.at.utcoffset() is not None

    def test_committing_an_existing_aggregate_bumps_its_version_and_replaces_its_state(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        loaded = created(storage, "a", balance=5)

        commit(storage, loaded, "AccountHandler/m2", {"balance": 12})
        record = storage.load(ACCOUNT, "a")

        assert record.version == 2
        assert dict(record.state or {}) == {"balance": 12}
        assert set(remembered(storage, "a", "Seed/m0", "AccountHandler/m2")) == {
            "Seed/m0", "AccountHandler/m2"}

    def test_history_gives_the_record_with_its_newest_processed_entries_newest_last(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        loaded = created(storage, "a", balance=1)
        for index in range(1, 4):
            commit(storage, loaded, f"AccountHandler/m{index}", {"balance": index + 1},
                   [envelope()])
            loaded = storage.load(ACCOUNT, "a")

        record = storage.history(ACCOUNT, "a", entries=2)
        everything = storage.history(ACCOUNT, "a", entries=10)

        assert (record.version, dict(record.state or {})) == (4, {"balance": 4})
        assert list(record.processed) == ["AccountHandler/m2", "AccountHandler/m3"]
        assert record.processed["AccountHandler/m3"].outgoing_ids
        assert list(everything.processed) == [
            "Seed/m0", "AccountHandler/m1", "AccountHandler/m2", "AccountHandler/m3"]
        assert storage.history(ACCOUNT, "nobody").version == 0

    # -- duplicates -------------------------------------------------------------------------------

    def test_committing_a_key_again_from_the_stale_loaded_record_raises_already_processed(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        stored = [envelope(), envelope()]
        empty = storage.load(ACCOUNT, "a")
        commit(storage, empty, "AccountHandler/m1", {"balance": 5}, stored)

        with pytest.raises(AlreadyProcessed) as refused:
            commit(storage, empty, "AccountHandler/m1", {"balance": 10}, [envelope()])

        assert refused.value.key == "AccountHandler/m1"
        assert refused.value.outgoing == tuple(stored)
        record = storage.load(ACCOUNT, "a")
        assert record.version == 1
        assert dict(record.state or {}) == {"balance": 5}

    def test_committing_a_key_again_from_a_fresh_load_raises_already_processed(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        stored = [envelope()]
        loaded = created(storage, "a", balance=1)
        commit(storage, loaded, "AccountHandler/m1", {"balance": 5}, stored)
        fresh = storage.load(ACCOUNT, "a")

        with pytest.raises(AlreadyProcessed) as refused:
            commit(storage, fresh, "AccountHandler/m1", {"balance": 10}, [envelope()])

        assert refused.value.outgoing == tuple(stored)
        record = storage.load(ACCOUNT, "a")
        assert record.version == 2
        assert dict(record.state or {}) == {"balance": 5}

    def test_two_creators_with_different_keys_race_and_the_second_gets_a_concurrency_conflict(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        first = storage.load(ACCOUNT, "a")
        second = storage.load(ACCOUNT, "a")
        commit(storage, first, "AccountHandler/m1", {"balance": 1})

        with pytest.raises(ConcurrencyConflict):
            commit(storage, second, "AccountHandler/m2", {"balance": 2})

        record = storage.load(ACCOUNT, "a")
        assert record.version == 1
        assert dict(record.state or {}) == {"balance": 1}
        assert list(remembered(storage, "a", "AccountHandler/m1", "AccountHandler/m2")) == [
            "AccountHandler/m1"]

    def test_two_creators_with_the_same_key_race_and_the_second_gets_already_processed(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        first = storage.load(ACCOUNT, "a")
        second = storage.load(ACCOUNT, "a")
        winner = [envelope()]
        commit(storage, first, "AccountHandler/m1", {"balance": 1}, winner)

        with pytest.raises(AlreadyProcessed) as refused:
            commit(storage, second, "AccountHandler/m1", {"balance": 2}, [envelope()])

        assert refused.value.outgoing == tuple(winner)
        assert storage.load(ACCOUNT, "a").version == 1

    def test_a_stale_version_on_update_raises_concurrency_conflict_and_changes_nothing(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        stale = created(storage, "a", balance=1)
        commit(storage, stale, "AccountHandler/m2", {"balance": 2}, [envelope()])
        before = storage.load(ACCOUNT, "a")

        with pytest.raises(ConcurrencyConflict):
            commit(storage, stale, "AccountHandler/m3", {"balance": 3}, [envelope()])

        after = storage.load(ACCOUNT, "a")
        assert after.version == before.version == 2
        assert after.state == before.state
        assert after.processed == before.processed
        assert remembered(storage, "a", "AccountHandler/m3") == {}

    def test_deduplication_is_scoped_per_key_so_two_handlers_may_record_one_message_id(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        commit(storage, storage.load(ACCOUNT, "a"), "HandlerA/m1", {"balance": 1}, [envelope()])

        commit(storage, storage.load(ACCOUNT, "a"), "HandlerB/m1", {"balance": 2}, [envelope()])

        record = storage.load(ACCOUNT, "a")
        assert record.version == 2
        assert set(remembered(storage, "a", "HandlerA/m1", "HandlerB/m1")) == {
            "HandlerA/m1", "HandlerB/m1"}

    # -- the processed window ---------------------------------------------------------------------

    def test_the_processed_list_keeps_only_the_newest_window_entries(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory(processed_window=3)
        for number in range(1, 6):
            commit(storage, storage.load(ACCOUNT, "a"), f"H/m{number}", {"balance": number})

        record = storage.load(ACCOUNT, "a")

        assert record.version == 5
        assert list(record.processed) == ["H/m3", "H/m4", "H/m5"]  # oldest first

    def test_the_window_starts_when_the_oldest_remembered_message_was_processed(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory(processed_window=3)
        for number in range(1, 3):
            commit(storage, storage.load(ACCOUNT, "a"), f"H/m{number}", {"balance": number})
        assert storage.load(ACCOUNT, "a").window_start(3) is None  # not full: nothing forgotten

        for number in range(3, 6):
            commit(storage, storage.load(ACCOUNT, "a"), f"H/m{number}", {"balance": number})
        record = storage.load(ACCOUNT, "a")

        times = [entry.at for entry in record.processed.values()]
        assert all(t is not None and t.tzinfo is not None for t in times)
        assert times == sorted(times)
        assert record.window_start(3) == times[0] == record.processed["H/m3"].at

    def test_a_key_that_left_the_processed_window_can_be_committed_again(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory(processed_window=3)
        for number in range(1, 5):
            commit(storage, storage.load(ACCOUNT, "a"), f"H/m{number}", {"balance": number})
        loaded = storage.load(ACCOUNT, "a")
        assert "H/m1" not in loaded.processed

        commit(storage, loaded, "H/m1", {"balance": 100})

        record = storage.load(ACCOUNT, "a")
        assert record.version == 5
        assert dict(record.state or {}) == {"balance": 100}
        assert set(record.processed) == {"H/m3", "H/m4", "H/m1"}
        with pytest.raises(AlreadyProcessed):
            commit(storage, record, "H/m4", {"balance": 0})

    def test_the_window_never_forgets_an_entry_whose_messages_were_not_dispatched(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given an entry whose messages were never dispatched (the process died after commit)
        storage = storage_factory(processed_window=2)
        pending = envelope()
        commit(storage, storage.load(ACCOUNT, "a"), "H/m1", {"balance": 1}, [pending])

        # When more messages than the window holds are committed and dispatched after it
        for number in range(2, 6):
            commit(storage, storage.load(ACCOUNT, "a"), f"H/m{number}", {"balance": number},
                   [envelope()])
            storage.mark_dispatched(ACCOUNT, "a", f"H/m{number}")
            storage.flush()

        # Then the newest window stays, and the undispatched one with its message (a backend
        # may keep the entries between them: MongoDB slices), and the outbox still finds it
        # (a backend with the outbox role)
        record = storage.load(ACCOUNT, "a")
        assert list(record.processed)[0] == "H/m1"
        assert list(record.processed)[-2:] == ["H/m4", "H/m5"]
        assert record.processed["H/m1"].outgoing == (pending,)
        if isinstance(storage, OutboxStore):
            found = storage.undispatched(
                committed_before=utc_now() + datetime.timedelta(minutes=1))
            assert [(entry.key, entry.outgoing) for entry in found] == [("H/m1", (pending,))]

        # When the outbox has dispatched it, and another message is committed
        storage.mark_dispatched(ACCOUNT, "a", "H/m1")
        storage.flush()
        commit(storage, storage.load(ACCOUNT, "a"), "H/m6", {"balance": 6})

        # Then the window is back to its size
        assert list(storage.load(ACCOUNT, "a").processed) == ["H/m5", "H/m6"]

    def test_retention_never_forgets_an_entry_whose_messages_were_not_dispatched(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given a storage that forgets processed messages at once, an undispatched entry and a
        # dispatched one
        storage = storage_factory(retention=datetime.timedelta(0))
        pending = envelope()
        commit(storage, storage.load(ACCOUNT, "a"), "H/m1", {"balance": 1}, [pending])
        commit(storage, storage.load(ACCOUNT, "a"), "H/m2", {"balance": 2}, [envelope()])
        storage.mark_dispatched(ACCOUNT, "a", "H/m2")
        storage.flush()

        # When retention runs (on the next commit, and on the outbox dispatcher's rounds)
        commit(storage, storage.load(ACCOUNT, "a"), "H/m3", {"balance": 3})
        storage.expire(utc_now() + datetime.timedelta(days=1))

        # Then the undispatched entry is still there with its message, and the outbox still
        # finds it (a backend with the outbox role)
        assert remembered(storage, "a", "H/m1")["H/m1"].outgoing == (pending,)
        if isinstance(storage, OutboxStore):
            found = storage.undispatched(
                committed_before=utc_now() + datetime.timedelta(minutes=1))
            assert [(entry.key, entry.outgoing) for entry in found] == [("H/m1", (pending,))]

    def test_a_processed_window_below_1_is_refused(self, storage_factory: StorageFactory) -> None:
        with pytest.raises(ValueError, match="processed_window"):
            storage_factory(processed_window=0)
        with pytest.raises(ValueError, match="processed_window"):
            storage_factory(processed_window=-3)

    # -- mark_dispatched --------------------------------------------------------------------------

    def test_mark_dispatched_drops_the_bodies_keeps_the_ids_and_sets_dispatched(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        sent = [envelope(), envelope()]
        other = [envelope()]
        commit(storage, storage.load(ACCOUNT, "a"), "H/m1", {"balance": 1}, sent)
        commit(storage, storage.load(ACCOUNT, "a"), "H/m2", {"balance": 2}, other)

        storage.mark_dispatched(ACCOUNT, "a", "H/m1")
        storage.flush()

        record = storage.load(ACCOUNT, "a")
        entries = remembered(storage, "a", "H/m1", "H/m2")
        entry = entries["H/m1"]
        assert entry.outgoing == ()
        assert entry.outgoing_ids == tuple(e.message_id for e in sent)
        assert entry.dispatched is True
        # Only that key changed: no version bump to race with, the other entry untouched.
        assert record.version == 2
        assert dict(record.state or {}) == {"balance": 2}
        assert entries["H/m2"].outgoing == tuple(other)
        assert entries["H/m2"].dispatched is False

    def test_a_duplicate_after_mark_dispatched_carries_no_outgoing_messages(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        commit(storage, storage.load(ACCOUNT, "a"), "H/m1", {"balance": 1}, [envelope()])
        storage.mark_dispatched(ACCOUNT, "a", "H/m1")
        storage.flush()

        with pytest.raises(AlreadyProcessed) as refused:
            commit(storage, storage.load(ACCOUNT, "a"), "H/m1", {"balance": 2}, [envelope()])

        assert refused.value.outgoing == ()

    def test_mark_dispatched_of_an_unknown_aggregate_or_key_changes_nothing(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        stored = [envelope()]
        commit(storage, storage.load(ACCOUNT, "a"), "H/m1", {"balance": 1}, stored)
        before = storage.load(ACCOUNT, "a")

        storage.mark_dispatched(ACCOUNT, "nobody", "H/m1")
        storage.mark_dispatched(ACCOUNT, "a", "H/unknown")
        storage.mark_dispatched("Order", "a", "H/m1")
        storage.flush()

        assert storage.load(ACCOUNT, "nobody").version == 0
        assert storage.load("Order", "a").version == 0
        after = storage.load(ACCOUNT, "a")
        assert after == before
        assert remembered(storage, "a", "H/m1")["H/m1"].outgoing == tuple(stored)
        assert list(storage.records("Order")) == []

    # -- records ----------------------------------------------------------------------------------

    def test_records_yields_every_stored_record_of_one_aggregate_type_only(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        for aggregate_id, balance in (("a", 1), ("b", 2), ("c", 3)):
            loaded = storage.load(ACCOUNT, aggregate_id)
            commit(storage, loaded, f"H/{aggregate_id}", {"balance": balance})
        commit(storage, storage.load(ACCOUNT, "b"), "H/b2", {"balance": 20})
        commit(storage, storage.load("Order", "a"), "H/o1", {"total": 9})

        accounts = {record.aggregate_id: record for record in storage.records(ACCOUNT)}
        orders = list(storage.records("Order"))

        assert sorted(accounts) == ["a", "b", "c"]
        assert {i: dict(r.state or {}) for i, r in accounts.items()} == {
            "a": {"balance": 1}, "b": {"balance": 20}, "c": {"balance": 3}}
        assert {i: r.version for i, r in accounts.items()} == {"a": 1, "b": 2, "c": 1}
        assert all(r.aggregate_type == ACCOUNT for r in accounts.values())
        assert [(r.aggregate_type, r.aggregate_id, dict(r.state or {})) for r in orders] == [
            ("Order", "a", {"total": 9})]
        assert list(storage.records("Nothing")) == []

    # -- concurrency ------------------------------------------------------------------------------

    @pytest.mark.usefixtures("eager_thread_switching")
    @pytest.mark.parametrize("existing", [False, True], ids=["creating", "updating"])
    def test_threads_committing_the_same_key_against_one_loaded_record_succeed_exactly_once(
        self, storage_factory: StorageFactory, existing: bool
    ) -> None:
        storage = storage_factory()
        for round_number in range(ROUNDS):
            aggregate_id = f"same-key-{round_number}"
            loaded = (created(storage, aggregate_id) if existing
                      else storage.load(ACCOUNT, aggregate_id))

            result = race(storage, loaded, ["H/m1"] * THREADS)

            assert sorted(result.outcomes) == ["duplicate"] * (THREADS - 1) + ["ok"], (
                round_number, result.outcomes)
            stored = result.outgoing[result.winner]
            assert all(outgoing == stored for outgoing in result.outgoing), round_number
            record = storage.load(ACCOUNT, aggregate_id)
            assert record.version == loaded.version + 1
            assert dict(record.state or {}) == {"balance": result.winner}
            assert remembered(storage, aggregate_id, "H/m1")["H/m1"].outgoing == stored

    @pytest.mark.usefixtures("eager_thread_switching")
    @pytest.mark.parametrize("existing", [False, True], ids=["creating", "updating"])
    def test_threads_committing_different_keys_against_one_loaded_version_succeed_exactly_once(
        self, storage_factory: StorageFactory, existing: bool
    ) -> None:
        storage = storage_factory()
        keys = [f"H/m{index}" for index in range(THREADS)]
        for round_number in range(ROUNDS):
            aggregate_id = f"different-keys-{round_number}"
            loaded = (created(storage, aggregate_id) if existing
                      else storage.load(ACCOUNT, aggregate_id))

            result = race(storage, loaded, keys)

            assert sorted(result.outcomes) == ["conflict"] * (THREADS - 1) + ["ok"], (
                round_number, result.outcomes)
            record = storage.load(ACCOUNT, aggregate_id)
            assert record.version == loaded.version + 1
            assert dict(record.state or {}) == {"balance": result.winner}
            seeded = {"Seed/m0"} if existing else set()
            assert set(remembered(storage, aggregate_id, "Seed/m0", *keys)) == seeded | {
                keys[result.winner]}

    # -- when each aggregate was last committed ---------------------------------------------------

    def test_records_tell_when_each_aggregate_was_last_committed(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        before = datetime.datetime.now(UTC) - datetime.timedelta(seconds=1)
        loaded = storage.load("Order", "o1", "k1")
        storage.commit(loaded, key="k1", state={"n": 1}, outgoing=[])
        storage.flush()
        (record,) = list(storage.records("Order"))
        assert record.updated_at is not None and record.updated_at >= before
        assert record.state == {"n": 1}

    # -- the state's schema version (idembus.evolution) -------------------------------------------

    def test_a_state_committed_with_its_schema_version_is_loaded_and_listed_with_it(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        storage.commit(storage.load("Order", "o1", "k1"), key="k1", state={"n": 1},
                       outgoing=[], state_version=2)
        assert storage.load("Order", "o1", "k2").state_version == 2

        storage.commit(storage.load("Order", "o1", "k2"), key="k2", state={"n": 2},
                       outgoing=[], state_version=3)
        storage.flush()

        loaded = storage.load("Order", "o1", "k3")
        assert (loaded.version, loaded.state, loaded.state_version) == (2, {"n": 2}, 3)
        (record,) = list(storage.records("Order"))
        assert record.state_version == 3

    def test_a_state_committed_without_a_schema_version_is_loaded_with_none_read_as_1(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        storage.commit(storage.load("Order", "o1", "k1"), key="k1", state={"n": 1},
                       outgoing=[], state_version=2)
        storage.commit(storage.load("Order", "o1", "k2"), key="k2", state={"n": 2},
                       outgoing=[])  # a writer that does not know versions

        assert storage.load("Order", "o1").state_version is None
        assert storage.load("Order", "o2").state_version is None  # nothing stored yet

    def test_a_stored_state_is_upcast_from_its_version_when_loaded_into_its_model(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        storage.commit(storage.load("Order", "o1", "k1"), key="k1",
                       state={"total": 1.5}, outgoing=[])  # version 1: euros, unversioned

        record = storage.load("Order", "o1")
        state = load_state(_OrderV2, record.state or {}, record.state_version)

        assert state == _OrderV2(total_cents=150)

    def test_a_stored_field_the_model_no_longer_declares_is_refused_unless_it_opts_in(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        storage.commit(storage.load("Order", "o1", "k1"), key="k1",
                       state={"total_cents": 5, "coupon": "X1"}, outgoing=[], state_version=2)
        record = storage.load("Order", "o1")

        with pytest.raises(IncompatibleState, match="'coupon'"):
            load_state(_OrderV2, record.state or {}, record.state_version)
        kept = load_state(_OrderKeepingExtras, record.state or {}, record.state_version)
        assert kept.model_dump() == {"total_cents": 5, "coupon": "X1"}
        dropped = load_state(_OrderDroppingExtras, record.state or {}, record.state_version)
        assert dropped.model_dump() == {"total_cents": 5}


class _OrderV2(BaseModel):
    """Version 2 of a state: cents instead of version 1's euros."""

    state_version: ClassVar[int] = 2
    total_cents: int = 0


@upcaster(_OrderV2, from_version=1)
def _euros_to_cents(state: dict[str, Any]) -> dict[str, Any]:
    return {"total_cents": round(state.pop("total") * 100)}


class _OrderKeepingExtras(_OrderV2):
    model_config = ConfigDict(extra="allow")


class _OrderDroppingExtras(_OrderV2):
    model_config = ConfigDict(extra="ignore")
