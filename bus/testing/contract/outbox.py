"""The contract of :class:`~idembus.storage.base.OutboxStore`: entries never marked
dispatched, leases with fencing tokens, fenced marks, and what waits too long per
endpoint."""

from __future__ import annotations

import datetime
import uuid
from typing import Any, ClassVar

import pytest

from ... import headers as h
from ...envelope import Envelope, utc_now
from ...storage.base import (
    OVERDUE_DELAYED,
    OVERDUE_ENTRIES,
    AggregateRecord,
    AggregateStore,
    DelayedStore,
    OutboxStore,
    Overdue,
    StorageRole,
)
from ...storage.errors import StaleLease
from .base import RoleContract, StorageFactory, needs
from .delayed import delayed

UTC = datetime.timezone.utc
START = datetime.datetime(2031, 5, 4, 12, 0, tzinfo=UTC)
NAME = "outbox"


def at(seconds: float) -> datetime.datetime:
    return START + datetime.timedelta(seconds=seconds)


def event() -> Envelope:
    message_id = str(uuid.uuid4())
    return Envelope({h.MESSAGE_ID: message_id, h.MESSAGE_TYPE: "test.Deposited",
                     h.INTENT: "publish"}, f'{{"id": "{message_id}"}}')


def commit(storage: Any, aggregate_id: str, key: str, outgoing: list[Envelope]) -> None:
    loaded = storage.load("Account", aggregate_id, key)
    storage.commit(loaded, key=key, state={"n": loaded.version + 1}, outgoing=outgoing)


def soon() -> datetime.datetime:
    return utc_now() + datetime.timedelta(seconds=60)


def command_of(endpoint: str | None) -> Envelope:
    """An outgoing command committed by ``endpoint`` (``None``: from before endpoints were
    recorded: no ``idembus.originating_endpoint``)."""
    headers = {h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Deposit",
               h.INTENT: h.Intent.SEND.value}
    if endpoint is not None:
        headers[h.ORIGINATING_ENDPOINT] = endpoint
    return Envelope(headers, '{"account": "a", "amount": 1}', "billing")


def commit_entry(storage: AggregateStore, aggregate_id: str,
                 endpoint: str | None) -> datetime.datetime:
    """Commit an entry with one message of ``endpoint``'s, never dispatched; when it was
    committed, as the storage says."""
    key = f"H/{aggregate_id}"
    storage.commit(AggregateRecord("Account", aggregate_id), key=key, state={},
                   outgoing=[command_of(endpoint)])
    committed = storage.load("Account", aggregate_id, key).processed[key].at
    assert committed is not None
    return committed


class OutboxStoreContract(RoleContract):
    """Undispatched entries until marked (per endpoint, with their failed repairs), leases
    exclusive until they expire with a fencing token that refuses a paused owner's marks,
    and what waits too long (the storage's aggregate role commits the entries)."""

    roles: ClassVar[tuple[type[StorageRole], ...]] = (OutboxStore,)

    def test_entries_with_messages_are_undispatched_until_marked(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        sent = [event(), event()]
        commit(storage, "a", "H/m1", sent)
        commit(storage, "b", "H/m2", [])  # nothing to send: born dispatched

        (pending,) = storage.undispatched(committed_before=soon())
        assert (pending.aggregate_type, pending.aggregate_id, pending.key) == (
            "Account", "a", "H/m1")
        assert pending.outgoing == tuple(sent)

        storage.mark_dispatched("Account", "a", "H/m1")
        storage.flush()
        assert storage.undispatched(committed_before=soon()) == []

    def test_undispatched_lists_only_entries_committed_before_the_cutoff(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        commit(storage, "a", "H/m1", [event()])
        assert storage.undispatched(committed_before=utc_now() - datetime.timedelta(hours=1)) == []
        assert len(storage.undispatched(committed_before=soon())) == 1

    def test_undispatched_of_one_endpoint_lists_its_entries_and_those_without_an_endpoint(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()

        def sent_by(endpoint: str | None) -> Envelope:
            envelope = event()
            headers = dict(envelope.headers)
            if endpoint is not None:
                headers[h.ORIGINATING_ENDPOINT] = endpoint
            return Envelope(headers, envelope.body)

        commit(storage, "a", "H/m1", [sent_by("sales"), sent_by("sales")])
        commit(storage, "b", "H/m2", [sent_by("billing")])
        commit(storage, "c", "H/m3", [sent_by(None)])  # written before endpoints were recorded

        def keys(endpoint: str | None) -> set[str]:
            return {entry.key for entry in storage.undispatched(committed_before=soon(),
                                                                endpoint=endpoint)}

        assert keys("sales") == {"H/m1", "H/m3"}
        assert keys("billing") == {"H/m2", "H/m3"}
        assert keys(None) == {"H/m1", "H/m2", "H/m3"}

    def test_failed_repairs_are_counted_with_the_entry(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        commit(storage, "a", "H/m1", [event()])
        commit(storage, "b", "H/m2", [event()])

        storage.note_repair_failure("Account", "a", "H/m1")
        storage.note_repair_failure("Account", "a", "H/m1")

        attempts = {e.key: e.attempts for e in storage.undispatched(committed_before=soon())}
        assert attempts == {"H/m1": 2, "H/m2": 0}

    def test_keep_bodies_marks_dispatched_but_keeps_what_a_duplicate_sends_again(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        sent = [event()]
        commit(storage, "a", "H/m1", sent)
        storage.mark_dispatched("Account", "a", "H/m1", keep_bodies=True)
        storage.flush()
        assert storage.undispatched(committed_before=soon()) == []
        entry = storage.load("Account", "a", "H/m1").processed["H/m1"]
        assert entry.dispatched and entry.outgoing == tuple(sent)

    def test_a_lease_is_exclusive_until_it_expires_and_a_new_owner_gets_a_higher_token(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        first = storage.acquire_lease(NAME, "A", ttl=30, now=at(0))
        assert first is not None and first.owner == "A"

        assert storage.acquire_lease(NAME, "B", ttl=30, now=at(10)) is None
        renewed = storage.acquire_lease(NAME, "A", ttl=30, now=at(20))
        assert renewed is not None and renewed.token == first.token
        assert renewed.expires_at == at(50)

        assert storage.acquire_lease(NAME, "B", ttl=30, now=at(49)) is None
        taken = storage.acquire_lease(NAME, "B", ttl=30, now=at(51))
        assert taken is not None and taken.owner == "B" and taken.token > first.token

    def test_a_released_lease_can_be_taken_at_once(self, storage_factory: StorageFactory) -> None:
        storage = storage_factory()
        held = storage.acquire_lease(NAME, "A", ttl=30, now=at(0))
        storage.release_lease(held)
        taken = storage.acquire_lease(NAME, "B", ttl=30, now=at(1))
        assert taken is not None and taken.token > held.token
        storage.release_lease(held)  # a stale release changes nothing
        assert storage.acquire_lease(NAME, "C", ttl=30, now=at(2)) is None

    def test_leases_of_different_names_are_independent(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        assert storage.acquire_lease("one", "A", ttl=30, now=at(0)) is not None
        assert storage.acquire_lease("two", "B", ttl=30, now=at(0)) is not None

    def test_a_mark_under_the_current_lease_is_applied(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        commit(storage, "a", "H/m1", [event()])
        lease = storage.acquire_lease(NAME, "A", ttl=30, now=utc_now())
        storage.mark_dispatched("Account", "a", "H/m1", lease=lease)
        assert storage.undispatched(committed_before=soon()) == []

    def test_a_paused_owner_whose_lease_was_taken_cannot_mark_anything(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given owner A's lease, which expired while A was paused, and B took it
        storage = storage_factory()
        commit(storage, "a", "H/m1", [event()])
        commit(storage, "b", "H/m2", [event()])
        stale = storage.acquire_lease(NAME, "A", ttl=30, now=at(0))
        current = storage.acquire_lease(NAME, "B", ttl=30, now=at(31))
        assert current is not None

        # When A wakes up and marks with its old token, Then it is refused and nothing changes
        with pytest.raises(StaleLease):
            storage.mark_dispatched("Account", "a", "H/m1", lease=stale)
        assert {p.key for p in storage.undispatched(committed_before=soon())} == {"H/m1", "H/m2"}

        # And B's marks go through
        storage.mark_dispatched("Account", "b", "H/m2", lease=current)
        assert [p.key for p in storage.undispatched(committed_before=soon())] == ["H/m1"]

    # -- overdue: what waits too long, per endpoint -----------------------------------------------

    def test_overdue_counts_per_endpoint_the_entries_and_delayed_messages_waiting_since_before(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given undispatched entries of two endpoints and one from before endpoints were
        # recorded, one entry that was dispatched, and delayed messages past due (one claimed)
        storage = storage_factory()
        needs(storage, DelayedStore)
        sales_first = commit_entry(storage, "s1", "sales")
        commit_entry(storage, "s2", "sales")
        retired = commit_entry(storage, "o1", "old-sales")
        legacy = commit_entry(storage, "l1", None)
        commit_entry(storage, "o2", "old-sales")
        storage.mark_dispatched("Account", "o2", "H/o2")
        storage.flush()
        hour_ago = (utc_now() - datetime.timedelta(hours=1)).replace(microsecond=0)
        for seconds in (0, 30):
            storage.schedule(delayed(), hour_ago + datetime.timedelta(seconds=seconds),
                             owner="old-sales")
        storage.schedule(delayed(), hour_ago + datetime.timedelta(minutes=1))
        storage.schedule(delayed(), utc_now() + datetime.timedelta(hours=1), owner="old-sales")
        assert len(storage.claim_due(hour_ago + datetime.timedelta(seconds=1))) == 1

        # When an operator asks what waits since before a minute from now
        found = storage.overdue(utc_now() + datetime.timedelta(minutes=1))

        # Then each endpoint's count and oldest time is there, unrecorded endpoints first
        assert found == [
            Overdue(None, OVERDUE_ENTRIES, 1, legacy),
            Overdue(None, OVERDUE_DELAYED, 1, hour_ago + datetime.timedelta(minutes=1)),
            Overdue("old-sales", OVERDUE_ENTRIES, 1, retired),
            Overdue("old-sales", OVERDUE_DELAYED, 2, hour_ago),
            Overdue("sales", OVERDUE_ENTRIES, 2, sales_first),
        ]

        # And what has waited for less long is not overdue
        assert storage.overdue(hour_ago + datetime.timedelta(seconds=10)) == [
            Overdue("old-sales", OVERDUE_DELAYED, 1, hour_ago)]
        assert storage.overdue(hour_ago) == []
