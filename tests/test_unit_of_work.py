"""endpoint.unit_of_work: changing an aggregate outside handlers in one write."""

from __future__ import annotations

import uuid

import pytest
from pydantic import BaseModel

from idembus.context import MessageContext
from idembus.storage.errors import AlreadyProcessed, ConcurrencyConflict
from idembus.storage.memory import MemoryStorage
from idembus.transports.errors import TransportUnavailable
from idembus.transports.kombu import KombuTransport
from tests.support import Account, AccountHandler, Deposited, Ledger, SignalCounter


def accounts_and_ledger(make_endpoint, **options):  # type: ignore[no-untyped-def]
    ledger = Ledger()
    accounts = make_endpoint("accounts", handlers=[AccountHandler], **options)
    downstream = make_endpoint("ledger", handlers=[ledger])
    return accounts, downstream, ledger


def test_a_unit_of_work_commits_state_and_messages_then_dispatches_them(make_endpoint):
    # Given accounts (not even consuming) and a running ledger subscribed to Deposited
    accounts, downstream, ledger = accounts_and_ledger(make_endpoint)
    recorded = SignalCounter(downstream, "handled")
    downstream.start()

    # When a web request deposits through a unit of work
    with accounts.unit_of_work(Account, "a", operation_id="req-1") as work:
        work.state.balance += 5
        work.state.deposits += 1
        event_id = work.bus.publish(Deposited(account="a", amount=5))

    # Then the state is stored, and the event was sent with its derived id
    record = accounts.storage.load("Account", "a")
    assert record.version == 1
    assert Account.model_validate(record.state) == Account(balance=5, deposits=1)
    assert event_id == MessageContext("req-1", "unit-of-work", {}, "unit-of-work",
                                      accounts.name).outgoing_id(0)
    assert recorded.wait_for(1)
    assert ledger.entries == [(event_id, "a", 5)]


def test_an_exception_inside_the_block_writes_and_sends_nothing(make_endpoint):
    accounts, downstream, ledger = accounts_and_ledger(make_endpoint)
    with pytest.raises(LookupError):
        with accounts.unit_of_work(Account, "a") as work:
            work.state.balance = 100
            work.bus.publish(Deposited(account="a", amount=100))
            raise LookupError("the request was invalid")
    assert not accounts.storage.load("Account", "a").exists
    assert accounts.transport.pending(downstream.name) == 0


def test_the_same_operation_id_takes_effect_once(make_endpoint):
    # Given an operation that was committed
    accounts, downstream, _ = accounts_and_ledger(make_endpoint)
    downstream.transport.declare(downstream.name, subscriptions=downstream.subscriptions)
    with accounts.unit_of_work(Account, "a", operation_id="req-7") as work:
        work.state.balance += 5
        work.bus.publish(Deposited(account="a", amount=5))

    # When the request is retried with the same operation id
    with pytest.raises(AlreadyProcessed):
        with accounts.unit_of_work(Account, "a", operation_id="req-7") as work:
            work.state.balance += 5  # never runs

    # Then the balance counts it once and the event went out once
    assert Account.model_validate(accounts.storage.load("Account", "a").state).balance == 5
    assert accounts.transport.pending(downstream.name) == 1


def test_a_concurrent_change_makes_the_exit_raise_a_conflict_and_write_nothing(make_endpoint):
    accounts, _, _ = accounts_and_ledger(make_endpoint)
    with pytest.raises(ConcurrencyConflict):
        with accounts.unit_of_work(Account, "a") as first:
            with accounts.unit_of_work(Account, "a") as second:
                second.state.balance = 1
            first.state.balance = 2
    assert Account.model_validate(accounts.storage.load("Account", "a").state).balance == 1


def test_messages_the_broker_refused_are_sent_when_the_operation_is_retried(
    make_endpoint, make_transport, transport_url
):
    # Given a transport whose publishes fail (the broker is away)
    class Away(KombuTransport):
        away = True

        def publish(self, envelope):  # type: ignore[no-untyped-def]
            if self.away:
                raise TransportUnavailable("the broker is away (simulated)")
            super().publish(envelope)

    transport = Away(transport_url, exchange=make_transport().exchange_name)
    accounts, downstream, ledger = accounts_and_ledger(
        make_endpoint, transport=transport, storage=MemoryStorage())
    recorded = SignalCounter(downstream, "handled")
    downstream.start()

    # When an operation commits but cannot send its event
    operation = str(uuid.uuid4())
    with accounts.unit_of_work(Account, "a", operation_id=operation) as work:
        work.state.balance = 5
        event_id = work.bus.publish(Deposited(account="a", amount=5))
    assert accounts.transport.pending(downstream.name) == 0

    # Then retrying the operation sends the stored event, with its id, and changes nothing
    transport.away = False
    with pytest.raises(AlreadyProcessed):
        with accounts.unit_of_work(Account, "a", operation_id=operation):
            pass
    assert recorded.wait_for(1)
    assert ledger.entries == [(event_id, "a", 5)]
    assert accounts.storage.load("Account", "a").version == 1


class Profile(BaseModel):
    owner: str


def test_a_new_aggregate_state_can_come_from_a_factory(make_endpoint):
    accounts, _, _ = accounts_and_ledger(make_endpoint)
    with accounts.unit_of_work(Profile, "p1", new_state=lambda: Profile(owner="ann")) as work:
        work.state.owner = work.state.owner.upper()
    assert accounts.storage.load("Profile", "p1").state == {"owner": "ANN"}
