"""The outbox relay repairs crashes between commit and dispatch, one at a time."""

from __future__ import annotations

import datetime
import time
import uuid

from idembus import Endpoint
from idembus.envelope import utc_now
from idembus.policies import OutboxPolicy
from idembus.runtime.outbox import OutboxRelay
from idembus.storage.base import OUTBOX_LEASE
from idembus.storage.memory import MemoryStorage
from idembus.transports.errors import TransportUnavailable
from idembus.transports.kombu import KombuTransport
from tests.support import Account, AccountHandler, Deposited, Ledger, SignalCounter


class Away(KombuTransport):
    """A transport whose publishes fail while ``away`` (the broker went down)."""

    away = True

    def publish(self, envelope):  # type: ignore[no-untyped-def]
        if self.away:
            raise TransportUnavailable("the broker is away (simulated)")
        super().publish(envelope)


def crashed_operation(accounts: Endpoint, account: str) -> str:
    """A unit of work that committed but could not dispatch: what a crash leaves."""
    with accounts.unit_of_work(Account, account, operation_id=str(uuid.uuid4())) as work:
        work.state.balance = 5
        return work.bus.publish(Deposited(account=account, amount=5))


def test_a_crash_between_commit_and_dispatch_is_repaired_exactly_once(
    make_endpoint, make_transport, transport_url
):
    # Given an operation committed while the broker was away, and a running ledger
    transport = Away(transport_url, exchange=make_transport().exchange_name)
    storage = MemoryStorage()
    ledger = Ledger()
    accounts = make_endpoint("accounts", handlers=[AccountHandler], transport=transport,
                             storage=storage, outbox=False)
    downstream = make_endpoint("ledger", handlers=[ledger])
    recorded = SignalCounter(downstream, "handled")
    downstream.start()
    event_id = crashed_operation(accounts, "a")

    # When the broker is back and the outbox relay makes its rounds
    transport.away = False
    outbox = OutboxRelay(accounts.context, accounts.dispatcher, grace=0)
    assert outbox.run_once() == 1
    assert outbox.run_once() == 0

    # Then the event arrived once, with the id the operation gave it
    assert recorded.wait_for(1)
    assert ledger.entries == [(event_id, "a", 5)]
    outbox.stop()


def test_a_running_endpoint_repairs_by_itself(make_endpoint, make_transport, transport_url):
    transport = Away(transport_url, exchange=make_transport().exchange_name)
    ledger = Ledger()
    accounts = make_endpoint("accounts", handlers=[AccountHandler], transport=transport,
                             storage=MemoryStorage(), outbox=OutboxPolicy(grace=0))
    downstream = make_endpoint("ledger", handlers=[ledger])
    recorded = SignalCounter(downstream, "handled")
    accounts.start()
    downstream.start()

    event_id = crashed_operation(accounts, "a")
    transport.away = False
    accounts.outbox.wake()

    assert recorded.wait_for(1)
    assert ledger.entries == [(event_id, "a", 5)]


def test_of_two_dispatchers_one_works_and_the_other_takes_over_when_its_lease_ends(
    make_endpoint,
):
    # Given two dispatchers on one storage with short leases
    accounts = make_endpoint("accounts", handlers=[AccountHandler], storage=MemoryStorage(),
                             outbox=False)
    dispatcher = accounts.dispatcher
    first = OutboxRelay(accounts.context, dispatcher, lease_ttl=0.3, grace=0)
    second = OutboxRelay(accounts.context, dispatcher, lease_ttl=0.3, grace=0)

    # When the first takes the lease, the second stands by
    first.run_once()
    assert first.lease is not None
    second.run_once()
    assert second.lease is None

    # And once the first stops renewing (it died), the second takes over with a newer token
    deadline = time.monotonic() + 10
    while second.lease is None and time.monotonic() < deadline:
        time.sleep(0.05)  # a lease runs out by the clock: there is no event to wait on
        second.run_once()
    assert second.lease is not None and second.lease.token > first.lease.token


class TakenOverMidRound(MemoryStorage):
    """While a dispatcher works through a batch it pauses past its lease (simulated: the
    lease is taken by another owner, an hour later by the clock)."""

    def undispatched(self, **options):  # type: ignore[no-untyped-def]
        found = super().undispatched(**options)
        self.acquire_lease(f"{OUTBOX_LEASE}:{options.get('endpoint')}", "the-taker", ttl=30,
                           now=utc_now() + datetime.timedelta(hours=1))
        return found


def test_a_dispatcher_whose_lease_was_taken_mid_round_marks_nothing_and_steps_back(
    make_endpoint, make_transport, transport_url
):
    # Given an entry a crash left undispatched
    transport = Away(transport_url, exchange=make_transport().exchange_name)
    storage = TakenOverMidRound()
    accounts = make_endpoint("accounts", handlers=[AccountHandler], transport=transport,
                             storage=storage, outbox=False)
    crashed_operation(accounts, "a")
    transport.away = False

    # When a dispatcher takes it, and loses its lease before marking
    paused = OutboxRelay(accounts.context, accounts.dispatcher, grace=0)
    repaired = paused.run_once()

    # Then its mark is refused: it steps back, and the entry stays for the new owner
    assert repaired == 0
    assert paused.lease is None
    (pending,) = storage.undispatched(committed_before=utc_now() + datetime.timedelta(hours=2))
    assert pending.aggregate_id == "a"
