"""The outbox part of the storage contract, on every backend: entries never marked
dispatched, leases with fencing tokens, and fenced marks."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from idembus import headers as h
from idembus.envelope import Envelope, utc_now
from idembus.storage.errors import StaleLease

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


def test_entries_with_messages_are_undispatched_until_marked(
    storage_factory: Callable[..., Any],
) -> None:
    storage = storage_factory()
    sent = [event(), event()]
    commit(storage, "a", "H/m1", sent)
    commit(storage, "b", "H/m2", [])  # nothing to send: born dispatched

    (pending,) = storage.undispatched(committed_before=soon())
    assert (pending.aggregate_type, pending.aggregate_id, pending.key) == ("Account", "a", "H/m1")
    assert pending.outgoing == tuple(sent)

    storage.mark_dispatched("Account", "a", "H/m1")
    storage.flush()
    assert storage.undispatched(committed_before=soon()) == []


def test_undispatched_lists_only_entries_committed_before_the_cutoff(
    storage_factory: Callable[..., Any],
) -> None:
    storage = storage_factory()
    commit(storage, "a", "H/m1", [event()])
    assert storage.undispatched(committed_before=utc_now() - datetime.timedelta(hours=1)) == []
    assert len(storage.undispatched(committed_before=soon())) == 1


def test_undispatched_of_one_endpoint_lists_its_entries_and_those_without_an_endpoint(
    storage_factory: Callable[..., Any],
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


def test_failed_repairs_are_counted_with_the_entry(storage_factory: Callable[..., Any]) -> None:
    storage = storage_factory()
    commit(storage, "a", "H/m1", [event()])
    commit(storage, "b", "H/m2", [event()])

    storage.note_repair_failure("Account", "a", "H/m1")
    storage.note_repair_failure("Account", "a", "H/m1")

    attempts = {e.key: e.attempts for e in storage.undispatched(committed_before=soon())}
    assert attempts == {"H/m1": 2, "H/m2": 0}


def test_keep_bodies_marks_dispatched_but_keeps_what_a_duplicate_sends_again(
    storage_factory: Callable[..., Any],
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
    storage_factory: Callable[..., Any],
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


def test_a_released_lease_can_be_taken_at_once(storage_factory: Callable[..., Any]) -> None:
    storage = storage_factory()
    held = storage.acquire_lease(NAME, "A", ttl=30, now=at(0))
    storage.release_lease(held)
    taken = storage.acquire_lease(NAME, "B", ttl=30, now=at(1))
    assert taken is not None and taken.token > held.token
    storage.release_lease(held)  # a stale release changes nothing
    assert storage.acquire_lease(NAME, "C", ttl=30, now=at(2)) is None


def test_leases_of_different_names_are_independent(storage_factory: Callable[..., Any]) -> None:
    storage = storage_factory()
    assert storage.acquire_lease("one", "A", ttl=30, now=at(0)) is not None
    assert storage.acquire_lease("two", "B", ttl=30, now=at(0)) is not None


def test_a_mark_under_the_current_lease_is_applied(storage_factory: Callable[..., Any]) -> None:
    storage = storage_factory()
    commit(storage, "a", "H/m1", [event()])
    lease = storage.acquire_lease(NAME, "A", ttl=30, now=utc_now())
    storage.mark_dispatched("Account", "a", "H/m1", lease=lease)
    assert storage.undispatched(committed_before=soon()) == []


def test_a_paused_owner_whose_lease_was_taken_cannot_mark_anything(
    storage_factory: Callable[..., Any],
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
