"""The outbox at its edges: it repairs entry by entry (one entry's failure never stops the
others), moves a message aside after a bounded number of failures, keeps expiring and
trimming whatever the entries do, and repairs only its own endpoint's entries."""

from __future__ import annotations

import datetime
import logging
import threading
import uuid
from typing import Any

import pytest

from idembus import Backoff
from idembus import headers as h
from idembus.envelope import Envelope, utc_now
from idembus.runtime.health import Health
from idembus.runtime.outbox import OutboxRelay
from idembus.storage.base import PARKED_OUTGOING, AggregateRecord
from idembus.storage.errors import StorageAccessDenied
from idembus.storage.memory import MemoryStorage
from idembus.transports.errors import DestinationRefused, TransportUnavailable
from idembus.transports.kombu import KombuTransport
from tests.support import delayed_poller, eventually, outbox_relay

LATER = datetime.timedelta(seconds=1)


class Troubled(KombuTransport):
    """memory:// that fails the sends to queues named in ``refused`` (for good: the queue
    refuses them), ``broken`` (an error no one foresaw) or ``down`` (an outage)."""

    def __init__(self) -> None:
        super().__init__("memory://")
        self.refused: set[str] = set()
        self.broken: set[str] = set()
        self.down = False
        self.sent: list[str] = []

    def send(self, envelope: Envelope) -> None:
        if self.down:
            raise TransportUnavailable("the broker is away (simulated)")
        if envelope.destination in self.refused:
            raise DestinationRefused(f"NOT_FOUND - no queue {envelope.destination!r}")
        if envelope.destination in self.broken:
            raise RuntimeError(f"unforeseen trouble with {envelope.destination}")
        self.sent.append(envelope.message_id)


def command(destination: str, endpoint: str = "sales") -> Envelope:
    return Envelope({h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Deposit",
                     h.ORIGINATING_ENDPOINT: endpoint}, '{"account": "a", "amount": 1}',
                    destination=destination)


def crashed(storage: Any, aggregate_id: str, *outgoing: Envelope) -> None:
    """An entry committed and never dispatched: what a crash leaves."""
    storage.commit(AggregateRecord("Account", aggregate_id), key=f"H/{aggregate_id}",
                   state={}, outgoing=list(outgoing))


def outbox(storage: Any, transport: KombuTransport, **options: Any) -> OutboxRelay:
    return outbox_relay(options.pop("endpoint", "sales"), transport, storage, grace=0,
                        **options)


def pending(storage: Any) -> list[str]:
    return [entry.aggregate_id for entry in
            storage.undispatched(committed_before=utc_now() + LATER)]


def test_a_refused_message_is_parked_and_the_other_entries_are_repaired_in_the_same_round():
    # Given three crashed entries, the oldest with a message its queue refuses
    storage, transport = MemoryStorage(), Troubled()
    transport.refused = {"gone"}
    refused, fine = command("gone"), command("billing")
    crashed(storage, "a", refused, fine)
    crashed(storage, "b", command("billing"))
    crashed(storage, "c", command("shipping"))

    # When the outbox makes one round
    repaired = outbox(storage, transport).run_once()

    # Then every entry is done: the refused message parked with the reason, the rest sent
    assert repaired == 3 and pending(storage) == []
    [parked] = storage.parked_messages("sales")
    assert parked.source == PARKED_OUTGOING
    assert parked.envelope.message_id == refused.message_id
    assert parked.envelope.destination == "gone"
    assert "no queue 'gone'" in parked.envelope.headers[h.EXCEPTION_MESSAGE]
    assert fine.message_id in transport.sent and len(transport.sent) == 3


def test_an_entry_failing_otherwise_is_retried_then_parked_after_max_attempts():
    # Given a crashed entry whose send fails with an unforeseen error, and a good one
    storage, transport = MemoryStorage(), Troubled()
    transport.broken = {"flaky"}
    doomed = command("flaky")
    crashed(storage, "a", doomed)
    crashed(storage, "b", command("billing"))

    def round_by_a_new_holder() -> int:
        """One round by a dispatcher of another process, which then gives the lease up."""
        dispatcher = outbox(storage, transport, max_attempts=3)
        try:
            return dispatcher.run_once()
        finally:
            dispatcher.stop()

    # When the outbox makes its rounds, each in another process
    # Then the good entry is repaired at once; the failing one is tried on each round, and
    # the count stays with the entry across holders of the lease
    assert round_by_a_new_holder() == 1
    assert pending(storage) == ["a"]
    assert round_by_a_new_holder() == 0
    assert pending(storage) == ["a"] and storage.parked_messages("sales") == []
    [entry] = storage.undispatched(committed_before=utc_now() + LATER)
    assert entry.attempts == 2

    # And at the third failure its message is parked with the reason and the entry marked
    assert round_by_a_new_holder() == 0
    assert pending(storage) == []
    [parked] = storage.parked_messages("sales")
    assert parked.envelope.message_id == doomed.message_id
    assert "unforeseen trouble with flaky" in parked.envelope.headers[h.EXCEPTION_MESSAGE]
    assert parked.envelope.headers[h.IMMEDIATE_ATTEMPTS] == "3"


class CannotPark(MemoryStorage):
    """A storage whose parking fails with an error nobody foresaw."""

    def park(self, parked: Any) -> None:
        raise RuntimeError("parking broke (simulated)")


def test_an_entry_that_cannot_even_be_set_aside_does_not_hold_up_the_entries_after_it():
    # Given an old entry whose message is refused and cannot be parked, and newer ones
    storage, transport = CannotPark(), Troubled()
    transport.refused = {"gone"}
    crashed(storage, "a", command("gone"))
    crashed(storage, "b", command("billing"))
    crashed(storage, "c", command("shipping"))
    dispatcher = outbox(storage, transport, max_attempts=1)

    # When the outbox makes its rounds (giving up on an entry at its first failure)
    # Then the newer entries are repaired in the first, and the old one waits, every round
    assert dispatcher.run_once() == 2
    assert pending(storage) == ["a"]
    assert dispatcher.run_once() == 0
    assert pending(storage) == ["a"] and len(transport.sent) == 2


def test_a_refused_message_is_parked_once_however_many_rounds_its_entry_takes():
    # Given an entry with a message its queue refuses and one that fails otherwise
    storage, transport = MemoryStorage(), Troubled()
    transport.refused, transport.broken = {"gone"}, {"flaky"}
    refused, doomed = command("gone"), command("flaky")
    crashed(storage, "a", refused, doomed)
    dispatcher = outbox(storage, transport, max_attempts=3)

    # When the outbox makes rounds until it gives up on the entry
    for _ in range(3):
        assert dispatcher.run_once() == 0

    # Then each message is parked exactly once and the entry is done
    assert pending(storage) == []
    assert sorted(p.envelope.message_id for p in storage.parked_messages("sales")) == sorted(
        [refused.message_id, doomed.message_id])


class Expiring(MemoryStorage):
    """Counts the outbox's housekeeping calls."""

    def __init__(self) -> None:
        super().__init__(retention=datetime.timedelta(days=1))
        self.expire_calls = 0
        self.trim_calls = 0

    def expire(self, now: datetime.datetime, *, batch: int = 1000) -> int:
        self.expire_calls += 1
        raise RuntimeError("expiring failed (simulated)")

    def trim_journal(self, before: datetime.datetime, *, batch: int = 1000) -> int:
        self.trim_calls += 1
        return super().trim_journal(before, batch=batch)


def test_expire_and_trim_run_whatever_happened_to_the_entries():
    # Given a crashed entry while the broker is down, and an expiry that fails
    storage, transport = Expiring(), Troubled()
    transport.down = True
    crashed(storage, "a", command("billing"))
    dispatcher = outbox(storage, transport, journal_retention=datetime.timedelta(days=7))

    # When the outbox makes a round: the outage ends it
    with pytest.raises(TransportUnavailable):
        dispatcher.run_once()

    # Then expiring and trimming were still attempted, each whatever the other did
    assert (storage.expire_calls, storage.trim_calls) == (1, 1)
    assert pending(storage) == ["a"]  # and the entry waits for the broker

    # When the broker is back, the entry is repaired
    transport.down = False
    assert dispatcher.run_once() == 1


def test_each_endpoint_repairs_only_what_it_committed():
    # Given one storage with crashed entries of two endpoints, and one from before
    # endpoints were recorded (no originating endpoint)
    storage, transport = MemoryStorage(), Troubled()
    crashed(storage, "s", command("billing", endpoint="sales"))
    crashed(storage, "b", command("shipping", endpoint="billing"))
    legacy = command("billing")
    legacy = Envelope({k: v for k, v in legacy.headers.items()
                       if k != h.ORIGINATING_ENDPOINT}, legacy.body, legacy.destination)
    crashed(storage, "old", legacy)

    # When the sales endpoint's outbox makes a round
    outbox(storage, transport, endpoint="sales").run_once()

    # Then it repaired its own entry and the unattributed one, not billing's
    assert pending(storage) == ["b"]

    # And billing's own outbox (its own lease) repairs billing's
    assert outbox(storage, transport, endpoint="billing").run_once() == 1
    assert pending(storage) == []


def deferred(destination: str, endpoint: str = "sales") -> Envelope:
    envelope = command(destination, endpoint)
    return envelope.with_headers({h.DELIVER_AT: utc_now().isoformat()})


def test_a_delayed_message_the_broker_refuses_is_parked_and_the_others_are_sent():
    # Given three due delayed messages, the first to a queue that refuses it
    storage, transport = MemoryStorage(), Troubled()
    transport.refused = {"gone"}
    refused, fine, later = deferred("gone"), deferred("billing"), deferred("shipping")
    for envelope in (refused, fine, later):
        storage.schedule(envelope, utc_now() - LATER, owner="sales")
    poller = delayed_poller("sales", transport, storage)

    # When the poller makes a round
    sent = poller.send_due()

    # Then the two others are sent, the refused one parked, and none is left waiting
    assert sent == 3
    assert transport.sent == [fine.message_id, later.message_id]
    [parked] = storage.parked_messages("sales")
    assert parked.envelope.message_id == refused.message_id
    assert storage.claim_due(utc_now() + datetime.timedelta(minutes=5)) == []


def test_a_delayed_message_failing_otherwise_is_parked_after_max_attempts():
    storage, transport = MemoryStorage(), Troubled()
    transport.broken = {"flaky"}
    doomed = deferred("flaky")
    storage.schedule(doomed, utc_now() - LATER, owner="sales")
    poller = delayed_poller("sales", transport, storage, max_attempts=2, lease=0.0)

    assert poller.send_due() == 0
    assert storage.parked_messages("sales") == []
    assert poller.send_due() == 1

    [parked] = storage.parked_messages("sales")
    assert parked.envelope.message_id == doomed.message_id
    assert storage.claim_due(utc_now() + datetime.timedelta(minutes=5)) == []


class LoginRefusedUntilAllowed(MemoryStorage):
    """Refuses the outbox's lease until ``allow`` is set, as a database refuses a login."""

    def __init__(self) -> None:
        super().__init__()
        self.allow = threading.Event()
        self.refusals = 0

    def acquire_lease(self, *args: Any, **kwargs: Any) -> Any:
        if not self.allow.is_set():
            self.refusals += 1
            raise StorageAccessDenied("password authentication failed for user app")
        return super().acquire_lease(*args, **kwargs)


def test_an_outbox_the_database_refuses_logs_at_error_and_shows_it_until_it_works(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given an outbox dispatcher whose database refuses its login
    storage, transport = LoginRefusedUntilAllowed(), Troubled()
    health = Health()
    crashed(storage, "a", command("billing"))
    dispatcher = outbox(storage, transport, health=health, backoff=Backoff((0.01,)))
    dispatcher.start()
    try:
        # Then it says so at ERROR and in its health, under its own name, and keeps trying
        assert eventually(lambda: storage.refusals >= 2, timeout=10.0, interval=0.005)
        assert "password authentication failed" in health.problems()[dispatcher.name]
        assert any(record.levelno == logging.ERROR and "password authentication" in
                   record.getMessage() for record in caplog.records)

        # When the database takes it again, the entry is repaired and the problem is gone
        storage.allow.set()
        dispatcher.wake()
        assert eventually(lambda: pending(storage) == [] and not health.problems(), timeout=10.0,
                          interval=0.005)
    finally:
        dispatcher.stop()


