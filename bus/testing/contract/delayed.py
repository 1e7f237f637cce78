"""The contract of :class:`~idembus.storage.base.DelayedStore`: delayed messages.

``schedule(envelope, due)`` keeps an envelope until its time, ``claim_due(now)`` hands the
due ones to one poller at a time under a lease, ``forget_scheduled`` removes what was
dispatched, ``note_scheduled_failure`` counts failed sends with the message. Time is driven
through the ``now`` argument from a fixed clock, never by sleeping, so a lease of 30
seconds runs out in no time. The pollers' part
(:class:`idembus.runtime.delayed.DelayedDeliveries`
giving up after a bounded number of failures, whoever made them, and parking the message)
runs on the real clock. Tests of what a second storage object on the same data sees need
:meth:`~idembus.testing.contract.base.RoleContract.another_instance`.
"""

from __future__ import annotations

import datetime
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from ... import headers as h
from ...envelope import Envelope, utc_now
from ...runtime.delayed import DelayedDeliveries
from ...runtime.endpoint_context import EndpointContext
from ...storage.base import DelayedStore, ParkingStore, StorageRole
from ...transports.errors import TransportUnavailable
from ...transports.kombu import KombuTransport
from .base import RoleContract, StorageFactory, needs

UTC = datetime.timezone.utc
#: The fixed clock of these tests: ``at(seconds)`` is that many seconds after it.
START = datetime.datetime(2031, 5, 4, 12, 0, tzinfo=UTC)
LEASE = 30.0


def at(seconds: float) -> datetime.datetime:
    return START + datetime.timedelta(seconds=seconds)


def delayed(
    destination: str | None = "billing",
    *,
    message_id: str | None = None,
    content_type: str = h.CONTENT_TYPE,
) -> Envelope:
    """A message held back for later, as an endpoint would schedule it, with a fresh id."""
    message_id = message_id or str(uuid.uuid4())
    return Envelope(
        headers={
            h.MESSAGE_ID: message_id,
            h.MESSAGE_TYPE: "test.ChargeCard",
            h.INTENT: (h.Intent.SEND if destination else h.Intent.PUBLISH).value,
            h.CORRELATION_ID: f"correlation-{message_id}",
            h.DELIVER_AT: at(0).isoformat(),
        },
        body=f'{{"id": "{message_id}", "amount": "12.50 €"}}',
        destination=destination,
        content_type=content_type,
    )


def ids(envelopes: list[Envelope]) -> list[str]:
    return [envelope.message_id for envelope in envelopes]


POLLERS = 6
DUE = 20
ROUNDS = 5


def claim_together(storage: DelayedStore, now: datetime.datetime) -> list[list[Envelope] | str]:
    """``claim_due(now, limit=5)`` from POLLERS threads started together; what each got."""
    barrier = threading.Barrier(POLLERS)
    results: list[list[Envelope] | str] = ["did not finish"] * POLLERS

    def poll(index: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[index] = storage.claim_due(now, limit=5, lease=LEASE)
        except BaseException as error:  # reported through the result, not lost in a thread
            results[index] = f"unexpected {error!r}"

    threads = [threading.Thread(target=poll, args=(i,), daemon=True) for i in range(POLLERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a polling thread hung"
    return results


class Failing(KombuTransport):
    """memory:// whose sends raise ``failure`` (when set), and that notes what it sent."""

    def __init__(self) -> None:
        super().__init__("memory://")
        self.failure: Exception | None = None
        self.sent: list[str] = []

    def send(self, envelope: Envelope) -> None:
        if self.failure is not None:
            raise self.failure
        self.sent.append(envelope.message_id)


def a_poller(transport: Failing, storage: Any, *, max_attempts: int) -> DelayedDeliveries:
    """The delayed-message poller of the endpoint ``sales``, whose claims end at once (so
    that each round takes the failed message again)."""
    return DelayedDeliveries(EndpointContext.standalone("sales", transport, storage),
                             max_attempts=max_attempts, lease=0.0)


def due_now() -> datetime.datetime:
    return utc_now() - datetime.timedelta(seconds=1)


class DelayedStoreContract(RoleContract):
    """Due or not, idempotent scheduling, order and limit, claims as leases, forgetting,
    time zones, racing pollers, owners, failure counts kept with the message; and, with
    :meth:`another_instance`, what another storage object on the same data sees."""

    roles: ClassVar[tuple[type[StorageRole], ...]] = (DelayedStore,)

    @pytest.fixture
    def two_instances(self, storage_factory: StorageFactory) -> Iterator[tuple[Any, Any]]:
        """Two storage objects on one database; the factory drops the data afterwards."""
        first = storage_factory()
        second = self.another_instance(first)
        try:
            yield first, second
        finally:
            second.close()

    def after_a_restart(self, storage: Any) -> Any:
        """The storage a restarted process opens: a new object where the data outlives one."""
        return storage if storage.process_local else self.another_instance(storage)

    # -- due or not -------------------------------------------------------------------------------

    def test_nothing_is_claimed_before_its_due_time(self, storage_factory: StorageFactory) -> None:
        storage = storage_factory()
        storage.schedule(delayed(), at(60))

        assert storage.claim_due(at(0)) == []
        assert storage.claim_due(at(59.5)) == []

    def test_an_envelope_is_claimed_once_its_due_time_has_come(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        on_time, overdue, later = delayed(), delayed(), delayed()
        storage.schedule(on_time, at(60))
        storage.schedule(overdue, at(-3600))
        storage.schedule(later, at(61))

        claimed = storage.claim_due(at(60))

        assert sorted(ids(claimed)) == sorted(ids([on_time, overdue]))  # due <= now, not later

    def test_a_claimed_envelope_keeps_its_headers_body_and_destination(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        sent = delayed("billing")
        published = delayed(None)
        storage.schedule(sent, at(0))
        storage.schedule(published, at(1))

        claimed = storage.claim_due(at(1))

        assert claimed == [sent, published]
        assert claimed[0].destination == "billing"
        assert claimed[0].intent is h.Intent.SEND
        assert claimed[1].destination is None
        assert claimed[1].intent is h.Intent.PUBLISH
        assert dict(claimed[0].headers) == dict(sent.headers)
        assert claimed[0].body == sent.body

    def test_a_claimed_envelope_keeps_its_content_type(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given a message that is not JSON (a dead-lettered copy of a foreign message)
        storage = storage_factory()
        foreign = delayed("error", content_type="text/plain; charset=utf-8")
        storage.schedule(foreign, at(0))

        # When it is claimed
        [claimed] = storage.claim_due(at(0))

        # Then the transport would dispatch it with the content type it came with
        assert claimed.content_type == "text/plain; charset=utf-8"
        assert claimed == foreign

    # -- idempotent scheduling --------------------------------------------------------------------

    def test_scheduling_the_same_message_to_the_same_destination_twice_keeps_one(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        message = delayed("billing")

        storage.schedule(message, at(0))
        storage.schedule(message, at(0))  # a redelivered handler schedules it again

        assert storage.claim_due(at(0)) == [message]
        assert storage.claim_due(at(LEASE + 1)) == [message]  # no second copy behind the lease

    def test_scheduling_one_message_id_to_two_destinations_keeps_both(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        to_billing = delayed("billing", message_id="m-1")
        to_shipping = delayed("shipping", message_id="m-1")

        storage.schedule(to_billing, at(0))
        storage.schedule(to_shipping, at(0))

        claimed = storage.claim_due(at(0))
        assert sorted(e.destination or "" for e in claimed) == ["billing", "shipping"]
        assert ids(claimed) == ["m-1", "m-1"]

    # -- order and limit --------------------------------------------------------------------------

    def test_claim_due_hands_out_the_oldest_due_first_and_at_most_limit(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        by_due = {seconds: delayed() for seconds in (-50, -40, -30, -20, -10)}
        for seconds in (-20, -50, -10, -30, -40):  # scheduled out of order
            storage.schedule(by_due[seconds], at(seconds))

        first = storage.claim_due(at(0), limit=3)
        rest = storage.claim_due(at(0), limit=3)

        assert first == [by_due[-50], by_due[-40], by_due[-30]]
        assert rest == [by_due[-20], by_due[-10]]
        assert storage.claim_due(at(0), limit=3) == []

    # -- leases -----------------------------------------------------------------------------------

    def test_a_claimed_envelope_is_not_claimed_again_while_its_lease_lives(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given one poller claimed the envelope
        storage = storage_factory()
        message = delayed()
        storage.schedule(message, at(0))
        assert storage.claim_due(at(0), lease=LEASE) == [message]

        # When other pollers look before the lease runs out
        # Then they get nothing
        assert storage.claim_due(at(1), lease=LEASE) == []
        assert storage.claim_due(at(LEASE - 1), lease=LEASE) == []

    def test_an_envelope_whose_lease_ran_out_is_claimed_again(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given a poller claimed the envelope and died before dispatching and forgetting it
        storage = storage_factory()
        message = delayed()
        storage.schedule(message, at(0))
        assert storage.claim_due(at(0), lease=LEASE) == [message]

        # When another poller looks after the lease ran out
        reclaimed = storage.claim_due(at(LEASE + 1), lease=LEASE)

        # Then it gets the envelope, under a lease of its own
        assert reclaimed == [message]
        assert storage.claim_due(at(LEASE + 2), lease=LEASE) == []
        assert storage.claim_due(at(2 * LEASE + 2), lease=LEASE) == [message]

    def test_a_claim_whose_lease_ends_at_once_still_hands_out_each_envelope_once(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given two due envelopes
        storage = storage_factory()
        first, second = delayed(), delayed()
        storage.schedule(first, at(-1))
        storage.schedule(second, at(0))

        # When a poller claims them with a lease of no length (it wants them again next round)
        # Then each is in its claim once, and the next claim takes them again
        assert storage.claim_due(at(0), lease=0.0) == [first, second]
        assert storage.claim_due(at(0), lease=0.0) == [first, second]

    # -- forget_scheduled -------------------------------------------------------------------------

    def test_forget_scheduled_removes_exactly_the_given_envelopes(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given three claimed envelopes, two of them dispatched
        storage = storage_factory()
        first, second, third = delayed(), delayed(), delayed()
        for message in (first, second, third):
            storage.schedule(message, at(0))
        assert len(storage.claim_due(at(0))) == 3

        # When the dispatched two are forgotten
        storage.forget_scheduled([first, third])

        # Then only the undispatched one comes back once the leases ran out
        assert storage.claim_due(at(LEASE + 1)) == [second]

    def test_forgetting_unknown_envelopes_or_none_is_harmless(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        kept = delayed("billing", message_id="m-1")
        storage.schedule(kept, at(0))

        storage.forget_scheduled([])
        storage.forget_scheduled([delayed(), delayed("shipping", message_id="m-1"), delayed(None)])

        assert storage.claim_due(at(0)) == [kept]

    # -- time zones -------------------------------------------------------------------------------

    def test_a_due_time_in_another_time_zone_means_the_same_instant(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        message = delayed()
        paris_summer = datetime.timezone(datetime.timedelta(hours=2))
        storage.schedule(message, at(60).astimezone(paris_summer))  # 14:01 +02:00 is 12:01 UTC

        assert storage.claim_due(at(59)) == []
        assert storage.claim_due(at(60)) == [message]

    def test_scheduling_with_a_naive_due_time_is_refused_as_a_programming_error(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given a due time without a time zone: local time or UTC? The store cannot know.
        storage = storage_factory()
        naive = START.replace(tzinfo=None)

        # When it is scheduled, Then the caller hears of it at once
        with pytest.raises((TypeError, ValueError)):
            storage.schedule(delayed(), naive)

    def test_claiming_with_a_naive_now_is_refused_as_a_programming_error(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given an empty store, so that no comparison with a stored time can raise by accident
        storage = storage_factory()

        with pytest.raises((TypeError, ValueError)):
            storage.claim_due(START.replace(tzinfo=None))

    def test_a_naive_due_time_does_not_stop_the_other_envelopes_from_being_claimed(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given one bad call to schedule, refused or not
        storage = storage_factory()
        good = delayed()
        storage.schedule(good, at(0))
        try:
            storage.schedule(delayed(), START.replace(tzinfo=None) + datetime.timedelta(days=1))
        except (TypeError, ValueError):
            pass

        # When a poller claims, Then every other due envelope is still delivered
        assert storage.claim_due(at(0)) == [good]

    # -- concurrency ------------------------------------------------------------------------------

    @pytest.mark.usefixtures("eager_thread_switching")
    def test_pollers_claiming_together_claim_every_due_envelope_exactly_once(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        for round_number in range(ROUNDS):
            # Given 20 due envelopes (the previous round's were forgotten after dispatch)
            scheduled = [delayed() for _ in range(DUE)]
            for offset, message in enumerate(scheduled):
                storage.schedule(message, at(-offset))

            # When 6 pollers claim up to 5 each at the same moment
            results = claim_together(storage, at(0))

            # Then each envelope went to exactly one of them
            errors = [result for result in results if isinstance(result, str)]
            assert errors == [], (round_number, errors)
            claims = [result for result in results if not isinstance(result, str)]
            counts = Counter(e.message_id for claimed in claims for e in claimed)
            assert counts == Counter(ids(scheduled)), (round_number, counts)
            assert all(len(claimed) <= 5 for claimed in claims), round_number
            assert storage.claim_due(at(1)) == [], round_number  # every lease still lives
            storage.forget_scheduled(scheduled)

    # -- durability -------------------------------------------------------------------------------

    def test_what_one_storage_instance_scheduled_another_claims(
        self, two_instances: tuple[Any, Any],
    ) -> None:
        scheduler, poller = two_instances
        message = delayed()

        scheduler.schedule(message, at(60))

        assert poller.claim_due(at(0)) == []
        assert poller.claim_due(at(60)) == [message]

    def test_a_lease_taken_through_one_instance_holds_for_another(
        self, two_instances: tuple[Any, Any],
    ) -> None:
        # Given two pollers in two processes, and the first claimed the envelope
        first, second = two_instances
        message = delayed()
        first.schedule(message, at(0))
        assert first.claim_due(at(0), lease=LEASE) == [message]

        # Then the second gets it only once the first one's lease ran out, and not after a forget
        assert second.claim_due(at(1), lease=LEASE) == []
        assert second.claim_due(at(LEASE + 1), lease=LEASE) == [message]
        second.forget_scheduled([message])
        assert first.claim_due(at(3 * LEASE)) == []

    # -- the next delayed round -------------------------------------------------------------------

    def test_a_message_deferred_again_while_its_last_entry_is_claimed_survives_the_forget(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given a delayed retry claimed by a poller, dispatched, failed again at once and
        # deferred for its next round before that poller forgot the first entry
        storage = storage_factory()
        first_round = delayed()
        storage.schedule(first_round, at(0))
        (claimed,) = storage.claim_due(at(0), lease=LEASE)
        next_round = first_round.with_headers({h.DELIVER_AT: at(20).isoformat()})
        storage.schedule(next_round, at(20))

        # When the poller forgets what it dispatched
        storage.forget_scheduled([claimed])

        # Then the next round is still there, due at its own time
        assert storage.claim_due(at(19)) == []
        assert storage.claim_due(at(20)) == [next_round]

    # -- owners -----------------------------------------------------------------------------------

    def test_a_poller_claims_what_its_endpoint_scheduled_and_what_any_poller_may_send(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given messages deferred by two endpoints, and one for any poller
        storage = storage_factory()
        sales, billing, anyone = delayed(), delayed(), delayed()
        storage.schedule(sales, at(0), owner="sales")
        storage.schedule(billing, at(0), owner="billing")
        storage.schedule(anyone, at(0))

        # When the sales endpoint's poller claims what is due
        claimed = storage.claim_due(at(1), lease=LEASE, owner="sales")

        # Then it gets its own and the unowned one, never billing's, which billing's gets
        assert sorted(ids(claimed)) == sorted(ids([sales, anyone]))
        assert ids(storage.claim_due(at(1), lease=LEASE, owner="billing")) == ids([billing])

    # -- failure counts ---------------------------------------------------------------------------

    def test_each_failed_send_is_counted_with_its_scheduled_message(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given two scheduled messages, and one message id deferred to two destinations
        storage = storage_factory()
        first, second = delayed("billing", message_id="m-1"), delayed("shipping", message_id="m-1")
        other = delayed()
        for message in (first, second, other):
            storage.schedule(message, at(0))

        # When sends of them fail, Then each failure returns the message's own count so far
        assert storage.note_scheduled_failure(first) == 1
        assert storage.note_scheduled_failure(first) == 2
        assert storage.note_scheduled_failure(second) == 1
        assert storage.note_scheduled_failure(other) == 1
        assert storage.note_scheduled_failure(first) == 3

        # And counting changes nothing else: the messages are still claimed as scheduled
        assert sorted(ids(storage.claim_due(at(0)))) == sorted(ids([first, second, other]))

    def test_a_failure_count_is_kept_in_the_database_for_every_storage_instance(
        self, two_instances: tuple[Any, Any],
    ) -> None:
        # Given a message whose sends failed twice through one process's storage
        first, second = two_instances
        message = delayed()
        first.schedule(message, at(0))
        first.note_scheduled_failure(message)
        first.note_scheduled_failure(message)

        # When another process's storage counts the next failure, Then it is the third
        assert second.note_scheduled_failure(message) == 3

    def test_scheduling_a_message_again_keeps_its_count_and_its_next_round_starts_afresh(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given a delayed message whose send failed once
        storage = storage_factory()
        message = delayed()
        storage.schedule(message, at(0))
        assert storage.note_scheduled_failure(message) == 1

        # When a redelivered handler schedules it again, Then the count goes on
        storage.schedule(message, at(0))
        assert storage.note_scheduled_failure(message) == 2

        # And the message deferred for its next delayed round is a new entry, counted afresh
        next_round = message.with_headers({h.DELIVER_AT: at(20).isoformat()})
        storage.schedule(next_round, at(20))
        assert storage.note_scheduled_failure(next_round) == 1
        assert storage.note_scheduled_failure(message) == 3

    def test_a_forgotten_message_has_no_count_and_scheduling_it_anew_starts_from_zero(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given a message whose send failed, and that another poller then sent and forgot
        storage = storage_factory()
        message = delayed()
        storage.schedule(message, at(0))
        storage.note_scheduled_failure(message)
        storage.forget_scheduled([message])

        # When this poller counts its failure, Then there is nothing left to count
        assert storage.note_scheduled_failure(message) == 0

        # And scheduled anew, it starts from nothing
        storage.schedule(message, at(0))
        assert storage.note_scheduled_failure(message) == 1

    # -- pollers: a bounded number of failures, then parked ---------------------------------------

    def test_a_poller_restarted_after_two_failures_parks_the_message_at_its_third(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given a due message whose sends fail with an error nobody foresaw
        storage = storage_factory()
        needs(storage, ParkingStore)
        transport = Failing()
        transport.failure = RuntimeError("unforeseen trouble (simulated)")
        message = delayed()
        storage.schedule(message, due_now(), owner="sales")

        # When a poller fails it twice, and then its process ends
        crashed = a_poller(transport, storage, max_attempts=3)
        assert crashed.send_due() == 0
        assert crashed.send_due() == 0
        assert storage.parked_messages("sales") == []

        # When the restarted process's new poller, on a storage of its own, fails it once
        restarted = self.after_a_restart(storage)
        try:
            assert a_poller(transport, restarted, max_attempts=3).send_due() == 1

            # Then that was the third failure: the message is parked with the reason, and gone
            [parked] = restarted.parked_messages("sales")
            assert parked.envelope.message_id == message.message_id
            assert parked.envelope.headers[h.IMMEDIATE_ATTEMPTS] == "3"
            assert "unforeseen trouble" in parked.envelope.headers[h.EXCEPTION_MESSAGE]
            assert restarted.claim_due(utc_now() + datetime.timedelta(minutes=5)) == []
        finally:
            if restarted is not storage:
                restarted.close()

    def test_outages_use_up_no_attempts_whichever_poller_meets_them(
        self, storage_factory: StorageFactory,
    ) -> None:
        # Given a due message, and a poller allowed three failures
        storage = storage_factory()
        needs(storage, ParkingStore)
        transport = Failing()
        message = delayed()
        storage.schedule(message, due_now(), owner="sales")
        first = a_poller(transport, storage, max_attempts=3)

        # When its send fails once, then the broker is away for three rounds
        transport.failure = RuntimeError("unforeseen trouble (simulated)")
        assert first.send_due() == 0
        transport.failure = TransportUnavailable("the broker is away (simulated)")
        for _ in range(3):
            with pytest.raises(TransportUnavailable):
                first.send_due()

        # And after a restart, away for two more, then failing once more
        restarted = self.after_a_restart(storage)
        try:
            second = a_poller(transport, restarted, max_attempts=3)
            for _ in range(2):
                with pytest.raises(TransportUnavailable):
                    second.send_due()
            transport.failure = RuntimeError("unforeseen trouble (simulated)")
            assert second.send_due() == 0

            # Then only the two real failures counted: nothing is parked yet
            assert restarted.parked_messages("sales") == []

            # And the third real failure parks it
            assert second.send_due() == 1
            [parked] = restarted.parked_messages("sales")
            assert parked.envelope.headers[h.IMMEDIATE_ATTEMPTS] == "3"
        finally:
            if restarted is not storage:
                restarted.close()
