"""The event journal written by endpoints (``Endpoint(journal=...)``): which events, with
which aggregate and parents, exactly once whatever is dispatched again, trimmed by
retention."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from idembus import Endpoint, Event
from idembus import headers as h
from idembus.envelope import Envelope
from idembus.errors import ConfigurationError
from idembus.policies import OutboxPolicy
from idembus.runtime.journal import JournalPolicy
from idembus.sending import Bus
from idembus.storage.errors import StorageUnavailable
from idembus.storage.memory import MemoryStorage
from idembus.testing import wait_until_idle
from tests.support import Account, AccountHandler, Deposit, Deposited, Ledger, SignalCounter


class Tagged(Event, message_name="test.Tagged"):
    video: str
    tags: list[str]

    def journal_parents(self) -> list[str]:
        return [f"video/{self.video}"] + [f"tag/{tag}" for tag in self.tags]


class Untagged(Event, message_name="test.Untagged"):
    video: str


@pytest.fixture
def endpoints() -> Iterator[list[Endpoint]]:
    made: list[Endpoint] = []
    yield made
    for endpoint in made:
        endpoint.close()


def make(endpoints: list[Endpoint], name: str, **options: Any) -> Endpoint:
    options.setdefault("storage", MemoryStorage())
    endpoint = Endpoint(f"{name}-{uuid.uuid4().hex[:8]}", **options)
    endpoints.append(endpoint)
    return endpoint


def journaled(endpoint: Endpoint) -> list[tuple[str, str | None, str | None]]:
    return [(e.message_type, e.aggregate_type, e.aggregate_id)
            for e in endpoint.storage.read_journal(after=0, limit=10_000)]


def test_events_a_handler_publishes_are_journaled_with_its_aggregate_once(
    make_endpoint: Callable[..., Endpoint],
) -> None:
    # Given an accounts endpoint that journals, and a ledger downstream that does not, on
    # each broker
    storage = MemoryStorage()
    accounts = make_endpoint("accounts", handlers=[AccountHandler], storage=storage,
                             journal=True)
    ledger = make_endpoint("ledger", handlers=[Ledger()], storage=MemoryStorage())
    handled = SignalCounter(accounts, "handled")
    duplicates = SignalCounter(accounts, "duplicate")
    accounts.start()
    ledger.start()
    # When a deposit is sent twice with the same id
    command_id = accounts.bus.send(Deposit(account="a", amount=5), to=accounts.name)
    accounts.bus.send(Deposit(account="a", amount=5), to=accounts.name, message_id=command_id)
    assert handled.wait_for(1) and duplicates.wait_for(1)
    wait_until_idle([accounts, ledger])
    # Then its event is journaled once, with the account, and commands are not journaled
    assert journaled(accounts) == [("test.Deposited", "Account", "a")]
    (entry,) = storage.read_journal(after=0)
    assert entry.headers[h.CAUSATION_ID] == command_id
    assert journaled(ledger) == []


def test_only_the_listed_event_types_are_journaled(endpoints: list[Endpoint]) -> None:
    sales = make(endpoints, "sales", journal=[Tagged])
    sales.bus.publish(Untagged(video="v1"))
    tagged_id = sales.bus.publish(Tagged(video="v1", tags=["cats", "fun"]))
    entries = sales.storage.read_journal(after=0)
    assert [(e.message_id, e.parents) for e in entries] == [
        (tagged_id, ("video/v1", "tag/cats", "tag/fun"))]
    assert entries[0].aggregate_type is None


def test_parents_travel_in_a_header_and_bad_ones_are_refused(endpoints: list[Endpoint]) -> None:
    sales = make(endpoints, "sales", journal=True)
    sent: list[dict[str, str]] = []
    sales.signals.dispatched.connect(lambda _, **d: sent.append(d["envelope"].headers),
                                     weak=False)
    with sales.unit_of_work(Account, "a") as work:
        work.bus.publish(Tagged(video="v9", tags=["x"]))
        work.bus.publish(Untagged(video="v9"))
    (with_parents,) = [e for e in sales.storage.read_journal(after=0)
                       if e.message_type == "test.Tagged"]
    assert with_parents.headers[h.PARENTS] == "video/v9,tag/x"
    assert h.PARENTS not in next(e for e in sales.storage.read_journal(after=0)
                                 if e.message_type == "test.Untagged").headers
    assert journaled(sales) == [("test.Tagged", "Account", "a"),
                                ("test.Untagged", "Account", "a")]
    with pytest.raises(ValueError, match="without commas or whitespace"):
        sales.bus.publish(Tagged(video="v1", tags=["two words"]))


class JournalDownOnce(MemoryStorage):
    """The database goes away exactly when the first event is to be journaled."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 0

    def append_journal(self, entries: Any, **options: Any) -> None:
        if self.failures == 0:
            self.failures += 1
            raise StorageUnavailable("the database went away")
        super().append_journal(entries, **options)


def test_an_event_sent_but_not_journaled_is_journaled_when_the_mark_is_tried_again(
    endpoints: list[Endpoint],
) -> None:
    # Given the journal write fails after the event went out
    storage = JournalDownOnce()
    accounts = make(endpoints, "accounts", handlers=[AccountHandler], storage=storage,
                    journal=True)
    dispatched = SignalCounter(accounts, "dispatched")
    accounts.start()
    accounts.bus.send(Deposit(account="a", amount=1), to=accounts.name)
    # Then the mark (with the journal entry) is tried again after the outage, without
    # sending the event a second time; the journal holds it once; the deposit took effect once
    assert dispatched.wait_for(1)
    wait_until_idle([accounts])
    assert dispatched.count == 1 and storage.failures == 1
    assert journaled(accounts) == [("test.Deposited", "Account", "a")]
    assert Account.model_validate(storage.load("Account", "a").state).balance == 1


def test_the_outbox_dispatcher_journals_what_it_repairs_and_trims_by_retention(
    endpoints: list[Endpoint],
) -> None:
    storage = MemoryStorage()
    accounts = make(endpoints, "accounts", handlers=[AccountHandler], storage=storage,
                    journal=JournalPolicy(events=True, retention=datetime.timedelta(seconds=30)),
                    outbox=OutboxPolicy(grace=0))
    # A unit of work committed whose dispatch never happened (a crash after the commit)
    recorded: list[Envelope] = []
    Bus(accounts.name, accounts.router, recorded.append).publish(Deposited(account="b", amount=2))
    storage.commit(storage.load("Account", "b", "op-1"), key="op-1",
                   state={"balance": 2, "deposits": 1}, outgoing=recorded)
    assert journaled(accounts) == []
    assert accounts.outbox.run_once() == 1
    assert journaled(accounts) == [("test.Deposited", "Account", "b")]
    # Entries older than the retention are trimmed on the dispatcher's rounds, not the newest
    accounts.bus.publish(Untagged(video="v"))
    accounts.outbox.journal_retention = datetime.timedelta(seconds=-60)  # all are "old"
    accounts.outbox.run_once()
    assert storage.journal_bounds().size == 1 and accounts.outbox.trimmed == 1


@pytest.mark.parametrize(("option", "complaint"), [
    ("yes", "journal must be True, False or a list of Event types"),
    ([Deposit], "list the Event types to journal"),
    ([], "list the Event types to journal"),
])
def test_a_wrong_journal_option_fails_at_creation(
    endpoints: list[Endpoint], option: Any, complaint: str,
) -> None:
    with pytest.raises(ConfigurationError, match=complaint):
        make(endpoints, "sales", journal=option)


def test_a_retention_that_is_not_positive_fails_at_creation(endpoints: list[Endpoint]) -> None:
    with pytest.raises(ConfigurationError, match="retention must be positive"):
        make(endpoints, "sales",
             journal=JournalPolicy(events=True, retention=datetime.timedelta(0)))
