"""DESIGN §2, the failure matrix: one test per row, on memory://, RabbitMQ, Redis and the
database transports (PostgreSQL, MongoDB on mongomock); the PostgreSQL transport beside a
PostgreSQL storage in the same database, where commit, send and acknowledgement are one
transaction, has its own rows in ``tests/test_shared_transaction.py``.

Crashes are injected with ``Endpoint(fault_injector=...)``: a :class:`SimulatedCrash` at a
crash point escapes the endpoint like a dying process, the transport requeues the delivery
(the broker's redelivery) and the endpoint recovers by itself, as a restarted one would.
Races are forced with a barrier at ``BEFORE_COMMIT``: every racer has loaded the aggregate
and run its handler before any of them commits.

Row g (malformed body, unknown type, schema-invalid) has one representative here; every
kind of bad input is covered in ``tests/test_bad_input.py``.
"""

from __future__ import annotations

import datetime
import threading
import uuid
from collections.abc import Callable

import pytest

from idembus import Bus, Endpoint, MessageContext, RetryPolicy
from idembus import headers as h
from idembus.envelope import Envelope
from idembus.handlers import AggregateHandler, handles
from idembus.policies import OutboxPolicy
from idembus.runtime.recoverability.policy import Recoverability
from idembus.storage.mongo import MongoStorage
from idembus.testing import wait_until_idle
from idembus.testing.faults import CrashPoint, FaultInjector, SimulatedCrash
from idembus.transports.mongo import MongoTransport
from tests.conftest import ALL_TRANSPORT_URLS, required_transport
from tests.support import (
    Account,
    AccountHandler,
    Deposit,
    Deposited,
    Ledger,
    SignalCounter,
)

MakeEndpoint = Callable[..., Endpoint]

#: Long enough for the slowest broker, short enough that a broken test does not hang.
BARRIER_TIMEOUT = 10.0


@pytest.fixture(params=ALL_TRANSPORT_URLS)
def transport_url(request: pytest.FixtureRequest) -> str:
    """Every transport: brokers and the database transports."""
    return required_transport(request.param)


# -- fault injectors -----------------------------------------------------------------------


class CrashAt(FaultInjector):
    """Crash at ``point`` while processing ``message_id``, the first ``times`` times."""

    def __init__(self, point: CrashPoint, message_id: str, *, times: int = 1) -> None:
        self.point = point
        self.message_id = message_id
        self.times = times
        self.crashes = 0
        self._lock = threading.Lock()

    def reached(self, point: CrashPoint, message_id: str) -> None:
        with self._lock:
            if point is not self.point or message_id != self.message_id:
                return
            if self.crashes >= self.times:
                return
            self.crashes += 1
        raise SimulatedCrash(f"simulated crash {point.value} of {message_id}")


class MeetAt(FaultInjector):
    """Hold the first ``parties`` arrivals at ``point`` (for the given message ids) until all
    of them are there: each has loaded the aggregate and run its handler, none has committed.

    A barrier that times out is recorded (``met`` stays short), never raised, so that a
    test asserts on it instead of hanging or retrying behind its back.
    """

    def __init__(self, point: CrashPoint, message_ids: set[str], *, parties: int = 2) -> None:
        self.point = point
        self.message_ids = message_ids
        self.parties = parties
        self.arrivals = 0
        self.met = 0
        self._barrier = threading.Barrier(parties, timeout=BARRIER_TIMEOUT)
        self._lock = threading.Lock()

    def reached(self, point: CrashPoint, message_id: str) -> None:
        if point is not self.point or message_id not in self.message_ids:
            return
        with self._lock:
            self.arrivals += 1
            if self.arrivals > self.parties:
                return
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            return
        with self._lock:
            self.met += 1


# -- helpers -------------------------------------------------------------------------------


class CardDeclined(Exception):
    """The failure the failing handlers below raise."""


class FlakyAccounts(AggregateHandler[Account]):
    """Applies the deposit and publishes, then fails the first ``failures`` attempts."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.attempts = [0]  # shared by the per-message copies the endpoint makes
        self._lock = threading.Lock()

    def aggregate_id(self, message: Deposit) -> str:
        return message.account

    @handles
    def deposit(self, message: Deposit) -> None:
        self.state.balance += message.amount
        self.state.deposits += 1
        self.bus.publish(Deposited(account=message.account, amount=message.amount))
        with self._lock:
            self.attempts[0] += 1
            attempt = self.attempts[0]
        if attempt <= self.failures:
            raise CardDeclined(f"card declined on attempt {attempt}")


def new_id() -> str:
    return str(uuid.uuid4())


def account(endpoint: Endpoint, name: str) -> Account | None:
    record = endpoint.storage.load("Account", name)
    return Account.model_validate(record.state) if record.exists else None


def first_outgoing_id(endpoint: Endpoint, message_id: str, handler: str = "AccountHandler") -> str:
    """The id a handler's first outgoing message must have: uuid5 of (handler, incoming id)."""
    context = MessageContext(message_id=message_id, message_type="test.Deposit", headers={},
                             handler_name=handler, endpoint=endpoint.name)
    return context.outgoing_id(0)


def accounts_and_ledger(
    make_endpoint: MakeEndpoint, **accounts_options: object
) -> tuple[Endpoint, Endpoint, Ledger]:
    accounts_options.setdefault("handlers", [AccountHandler])
    accounts = make_endpoint("accounts", **accounts_options)
    ledger = Ledger()
    downstream = make_endpoint("ledger", handlers=[ledger])
    return accounts, downstream, ledger


def start(*endpoints: Endpoint) -> None:
    for endpoint in endpoints:
        endpoint.start()


# -- a. crash before commit ----------------------------------------------------------------


def test_a_crash_before_commit_stores_nothing_and_the_redelivery_processes_it_once(
    make_endpoint: MakeEndpoint,
) -> None:
    # Given an accounts endpoint that dies after running the handler, before committing
    deposit_id = new_id()
    crash = CrashAt(CrashPoint.BEFORE_COMMIT, deposit_id)
    accounts, downstream, ledger = accounts_and_ledger(make_endpoint, middleware=[crash])
    received = SignalCounter(accounts, "received")
    handled = SignalCounter(accounts, "handled")
    recorded = SignalCounter(downstream, "handled")
    start(accounts, downstream)

    # When a deposit arrives
    accounts.bus.send(Deposit(account="a", amount=5), message_id=deposit_id)

    # Then the redelivery applies it once and the ledger gets one Deposited
    assert recorded.wait_for(1)
    wait_until_idle([accounts, downstream])
    assert crash.crashes == 1
    assert received.count == 2, "the crashed delivery must have been delivered again"
    assert handled.count == 1
    assert account(accounts, "a") == Account(balance=5, deposits=1)
    assert ledger.entries == [(first_outgoing_id(accounts, deposit_id), "a", 5)]
    assert accounts.counters["duplicate"] == 0


# -- b. crash after commit, before dispatch ------------------------------------------------


def test_b_crash_after_commit_redelivery_is_a_duplicate_that_dispatches_the_stored_outgoing(
    make_endpoint: MakeEndpoint,
) -> None:
    # Given an accounts endpoint that dies after committing, before dispatching
    deposit_id = new_id()
    crash = CrashAt(CrashPoint.AFTER_COMMIT, deposit_id)
    accounts, downstream, ledger = accounts_and_ledger(make_endpoint, middleware=[crash])
    duplicate = SignalCounter(accounts, "duplicate")
    redispatched = SignalCounter(accounts, "redispatched")
    dispatched = SignalCounter(accounts, "dispatched")
    recorded = SignalCounter(downstream, "handled")
    start(accounts, downstream)

    # When a deposit arrives
    accounts.bus.send(Deposit(account="a", amount=5), message_id=deposit_id)

    # Then the redelivery finds it processed and sends the stored Deposited, exactly once
    assert recorded.wait_for(1)
    wait_until_idle([accounts, downstream])
    assert crash.crashes == 1
    assert duplicate.count == 1
    assert redispatched.count == 1
    assert redispatched.details[0]["count"] == 1
    expected_id = first_outgoing_id(accounts, deposit_id)
    assert [d["message_id"] for d in dispatched.details] == [expected_id]
    assert account(accounts, "a") == Account(balance=5, deposits=1)
    assert ledger.entries == [(expected_id, "a", 5)]
    assert accounts.counters["handled"] == 1


# -- c. crash after dispatch, before ack ---------------------------------------------------


def test_c_crash_after_dispatch_resends_the_same_id_and_the_downstream_deduplicates(
    make_endpoint: MakeEndpoint,
) -> None:
    # Given an accounts endpoint that keeps dispatched bodies and dies before acking
    deposit_id = new_id()
    crash = CrashAt(CrashPoint.AFTER_DISPATCH, deposit_id)
    accounts, downstream, ledger = accounts_and_ledger(
        make_endpoint, middleware=[crash], outbox=OutboxPolicy(compact_after_dispatch=False)
    )
    dispatched = SignalCounter(accounts, "dispatched")
    redispatched = SignalCounter(accounts, "redispatched")
    recorded = SignalCounter(downstream, "handled")
    ledger_duplicate = SignalCounter(downstream, "duplicate")
    start(accounts, downstream)

    # When a deposit arrives
    accounts.bus.send(Deposit(account="a", amount=5), message_id=deposit_id)

    # Then Deposited goes out twice with one id, and the ledger records it once
    assert redispatched.wait_for(1) and recorded.wait_for(1)
    wait_until_idle([accounts, downstream])
    expected_id = first_outgoing_id(accounts, deposit_id)
    assert crash.crashes == 1
    assert [d["message_id"] for d in dispatched.details] == [expected_id, expected_id]
    assert accounts.counters["duplicate"] == 1
    assert account(accounts, "a") == Account(balance=5, deposits=1)
    assert ledger.entries == [(expected_id, "a", 5)]
    assert downstream.counters["handled"] == 1
    # The ledger deduplicated the second copy; on MongoDB, a copy re-sent while the first
    # was still queued is the same document, which the insert deduplicated instead
    copies = downstream.counters["received"]
    assert ledger_duplicate.count == copies - 1
    assert copies == 2 or isinstance(downstream.transport, MongoTransport)


def test_c_crash_after_a_confirmed_dispatch_with_compaction_resends_nothing(
    make_endpoint: MakeEndpoint,
) -> None:
    # Given an accounts endpoint with the default compaction, dying before acking
    deposit_id = new_id()
    crash = CrashAt(CrashPoint.AFTER_DISPATCH, deposit_id)
    accounts, downstream, ledger = accounts_and_ledger(make_endpoint, middleware=[crash])
    duplicate = SignalCounter(accounts, "duplicate")
    dispatched = SignalCounter(accounts, "dispatched")
    recorded = SignalCounter(downstream, "handled")
    start(accounts, downstream)

    # When a deposit arrives
    accounts.bus.send(Deposit(account="a", amount=5), message_id=deposit_id)

    # Then the redelivery is a duplicate whose dropped bodies are not sent again
    assert duplicate.wait_for(1)
    assert recorded.wait_for(1)
    wait_until_idle([accounts, downstream])
    expected_id = first_outgoing_id(accounts, deposit_id)
    assert crash.crashes == 1
    assert [d["message_id"] for d in dispatched.details] == [expected_id]
    assert accounts.counters["redispatched"] == 0
    entry = accounts.storage.load("Account", "a").processed[f"AccountHandler/{deposit_id}"]
    assert entry.dispatched and entry.outgoing == () and entry.outgoing_ids == (expected_id,)
    assert ledger.entries == [(expected_id, "a", 5)]
    assert downstream.counters["received"] == 1
    assert downstream.counters["duplicate"] == 0


# -- d. one message, two consumers at once -------------------------------------------------


def test_d_the_same_message_on_two_consumers_at_once_is_applied_once(
    make_endpoint: MakeEndpoint,
) -> None:
    # Given two consumers that both load the account before either commits; bodies are
    # kept after dispatch so that the loser always has something to redispatch
    deposit_id = new_id()
    race = MeetAt(CrashPoint.BEFORE_COMMIT, {deposit_id})
    accounts, downstream, ledger = accounts_and_ledger(
        make_endpoint, middleware=[race], concurrency=2, prefetch=1,
        outbox=OutboxPolicy(compact_after_dispatch=False),
    )
    duplicate = SignalCounter(accounts, "duplicate")
    redispatched = SignalCounter(accounts, "redispatched")
    recorded = SignalCounter(downstream, "handled")
    ledger_duplicate = SignalCounter(downstream, "duplicate")
    start(accounts, downstream)

    # When the same deposit is delivered twice, one copy to each consumer
    for _ in range(2):
        accounts.bus.send(Deposit(account="a", amount=5), message_id=deposit_id)

    # Then one commit wins, the other is a duplicate that redispatches; the ledger dedups
    # (on MongoDB the insert does, when the first copy is still queued: see row c)
    assert redispatched.wait_for(1) and recorded.wait_for(1)
    wait_until_idle([accounts, downstream])
    assert race.met == 2, "both consumers must have loaded before either committed"
    assert accounts.counters["handled"] == 1
    assert duplicate.count == 1
    assert redispatched.count == 1
    assert account(accounts, "a") == Account(balance=5, deposits=1)
    assert ledger.entries == [(first_outgoing_id(accounts, deposit_id), "a", 5)]
    assert downstream.counters["handled"] == 1
    copies = downstream.counters["received"]
    assert ledger_duplicate.count == copies - 1
    assert copies == 2 or isinstance(downstream.transport, MongoTransport)


# -- e. two messages for one aggregate at once ---------------------------------------------


def test_e_two_deposits_to_one_account_at_once_are_both_applied(
    make_endpoint: MakeEndpoint,
) -> None:
    # Given an existing account and two consumers that both load it before either commits
    seed_id, first_id, second_id = new_id(), new_id(), new_id()
    race = MeetAt(CrashPoint.BEFORE_COMMIT, {first_id, second_id})
    accounts, downstream, ledger = accounts_and_ledger(
        make_endpoint, middleware=[race], concurrency=2, prefetch=1
    )
    handled = SignalCounter(accounts, "handled")
    conflict = SignalCounter(accounts, "conflict")
    recorded = SignalCounter(downstream, "handled")
    start(accounts, downstream)
    accounts.bus.send(Deposit(account="a", amount=1), message_id=seed_id)
    assert handled.wait_for(1)

    # When two different deposits to that account arrive together
    accounts.bus.send(Deposit(account="a", amount=10), message_id=first_id)
    accounts.bus.send(Deposit(account="a", amount=100), message_id=second_id)

    # Then one commit wins, the loser re-runs on fresh state: both are applied
    assert recorded.wait_for(3)
    wait_until_idle([accounts, downstream])
    assert race.met == 2, "both consumers must have loaded before either committed"
    assert conflict.count >= 1
    assert handled.count == 3
    assert accounts.counters["duplicate"] == 0
    assert account(accounts, "a") == Account(balance=111, deposits=3)
    assert sorted(entry[2] for entry in ledger.entries) == [1, 10, 100]


def test_e_two_deposits_creating_one_account_at_once_are_both_applied(
    make_endpoint: MakeEndpoint,
) -> None:
    # Given no account yet and two consumers that both see it missing before either commits
    first_id, second_id = new_id(), new_id()
    race = MeetAt(CrashPoint.BEFORE_COMMIT, {first_id, second_id})
    accounts, downstream, ledger = accounts_and_ledger(
        make_endpoint, middleware=[race], concurrency=2, prefetch=1
    )
    conflict = SignalCounter(accounts, "conflict")
    recorded = SignalCounter(downstream, "handled")
    start(accounts, downstream)

    # When two deposits that both create the account arrive together
    accounts.bus.send(Deposit(account="new", amount=10), message_id=first_id)
    accounts.bus.send(Deposit(account="new", amount=100), message_id=second_id)

    # Then the losing insert is a conflict like any other, and both are applied
    assert recorded.wait_for(2)
    wait_until_idle([accounts, downstream])
    assert race.met == 2, "both consumers must have loaded before either committed"
    assert conflict.count >= 1
    assert accounts.counters["handled"] == 2
    assert account(accounts, "new") == Account(balance=110, deposits=2)
    assert sorted(entry[2] for entry in ledger.entries) == [10, 100]


# -- f. handler raises ---------------------------------------------------------------------


def test_f_a_handler_failing_twice_then_succeeding_commits_exactly_once(
    make_endpoint: MakeEndpoint,
) -> None:
    # Given a handler that changes state and publishes, then fails twice
    flaky = FlakyAccounts(failures=2)
    accounts, downstream, ledger = accounts_and_ledger(make_endpoint, handlers=[flaky])
    failed = SignalCounter(accounts, "failed")
    retried = SignalCounter(accounts, "retried")
    recorded = SignalCounter(downstream, "handled")
    start(accounts, downstream)

    # When a deposit arrives (default retry policy: 5 immediate retries)
    deposit_id = accounts.bus.send(Deposit(account="a", amount=5))

    # Then the third attempt commits, and nothing of the failed attempts remains
    assert recorded.wait_for(1)
    wait_until_idle([accounts, downstream])
    assert flaky.attempts == [3]
    assert [d["attempt"] for d in failed.details] == [1, 2]
    assert all(isinstance(d["error"], CardDeclined) for d in failed.details)
    assert retried.count == 2
    assert accounts.counters["handled"] == 1
    assert accounts.counters["dead_lettered"] == 0
    assert account(accounts, "a") == Account(balance=5, deposits=1)
    assert ledger.entries == [(first_outgoing_id(accounts, deposit_id, "FlakyAccounts"), "a", 5)]


def test_f_a_handler_that_always_fails_sends_the_message_to_the_error_queue_untouched(
    make_endpoint: MakeEndpoint,
) -> None:
    # Given a handler that changes state and publishes, then always fails
    flaky = FlakyAccounts(failures=1_000)
    accounts, downstream, ledger = accounts_and_ledger(make_endpoint, handlers=[flaky],
                                                    recoverability=Recoverability(
                                                        retries=RetryPolicy(delayed=())))
    dead_lettered = SignalCounter(accounts, "dead_lettered")
    start(accounts, downstream)
    deposit = Deposit(account="zoë-€", amount=5)

    # When a deposit arrives (default retry policy)
    before = datetime.datetime.now(datetime.timezone.utc)
    deposit_id = accounts.bus.send(deposit)

    # Then after 1 + 5 attempts it is in the error queue with the story of the failure
    assert dead_lettered.wait_for(1)
    wait_until_idle([accounts, downstream])
    after = datetime.datetime.now(datetime.timezone.utc)
    failed = accounts.transport.get(accounts.error_queue)
    assert failed is not None
    assert accounts.transport.get(accounts.error_queue) is None
    assert failed.body == deposit.model_dump_json().encode("utf-8")
    headers = failed.headers
    assert headers[h.MESSAGE_ID] == deposit_id
    assert headers[h.MESSAGE_TYPE] == "test.Deposit"
    assert headers[h.EXCEPTION_TYPE] == f"{__name__}.CardDeclined"
    assert headers[h.EXCEPTION_MESSAGE] == "card declined on attempt 6"
    assert "CardDeclined" in headers[h.STACK_TRACE]
    assert "in deposit" in headers[h.STACK_TRACE]
    assert headers[h.FAILED_QUEUE] == accounts.name
    assert before <= datetime.datetime.fromisoformat(headers[h.TIME_OF_FAILURE]) <= after
    assert headers[h.IMMEDIATE_ATTEMPTS] == "6"
    assert flaky.attempts == [6]
    assert accounts.counters["failed"] == 6
    assert accounts.counters["retried"] == 5
    # And nothing was stored or published
    assert not accounts.storage.load("Account", "zoë-€").exists
    assert accounts.counters["dispatched"] == 0
    assert downstream.counters["received"] == 0
    assert ledger.entries == []


def test_f_immediate_retries_follow_the_retry_policy(make_endpoint: MakeEndpoint) -> None:
    # Given an endpoint allowed one immediate retry, and a handler that always fails
    flaky = FlakyAccounts(failures=1_000)
    accounts = make_endpoint("accounts", handlers=[flaky],
                             recoverability=Recoverability(
                                 retries=RetryPolicy(immediate_retries=1, delayed=())))
    dead_lettered = SignalCounter(accounts, "dead_lettered")
    accounts.start()

    # When a deposit arrives
    accounts.bus.send(Deposit(account="a", amount=5))

    # Then it is tried twice and then dead-lettered
    assert dead_lettered.wait_for(1)
    wait_until_idle([accounts])
    failed = accounts.transport.get(accounts.error_queue)
    assert failed is not None
    assert failed.headers[h.IMMEDIATE_ATTEMPTS] == "2"
    assert flaky.attempts == [2]
    assert not accounts.storage.load("Account", "a").exists


# -- g. bad input (all kinds: tests/test_bad_input.py) -------------------------------------


def test_g_an_unknown_message_type_goes_to_the_error_queue_without_retries(
    make_endpoint: MakeEndpoint,
) -> None:
    # Given a running accounts endpoint
    accounts = make_endpoint("accounts", handlers=[AccountHandler])
    dead_lettered = SignalCounter(accounts, "dead_lettered")
    accounts.start()

    # When a message of a type it does not know arrives, then a good one
    unknown_id = new_id()
    accounts.transport.send(Envelope(
        headers={h.MESSAGE_ID: unknown_id, h.MESSAGE_TYPE: "test.Withdraw"},
        body='{"account": "a", "amount": 5}', destination=accounts.name,
    ))
    accounts.bus.send(Deposit(account="a", amount=5))

    # Then the unknown one is dead-lettered at once with the reason; the good one is applied
    assert dead_lettered.wait_for(1)
    wait_until_idle([accounts])
    failed = accounts.transport.get(accounts.error_queue)
    assert failed is not None
    assert failed.headers[h.MESSAGE_ID] == unknown_id
    assert failed.headers[h.EXCEPTION_TYPE] == "idembus.errors.UnknownMessageType"
    assert "test.Withdraw" in failed.headers[h.EXCEPTION_MESSAGE]
    assert failed.headers[h.IMMEDIATE_ATTEMPTS] == "0"
    assert accounts.counters["failed"] == 0
    assert account(accounts, "a") == Account(balance=5, deposits=1)


# -- h. duplicate older than the dedup window ----------------------------------------------


def test_h_a_duplicate_older_than_the_dedup_window_is_processed_again_and_counted(
    make_endpoint: MakeEndpoint, unique: str,
) -> None:
    # Given an account that remembers only its last two processed messages
    storage = MongoStorage.embedded(f"window-{unique}", processed_window=2)
    accounts = make_endpoint("accounts", handlers=[AccountHandler], storage=storage)
    handled = SignalCounter(accounts, "handled")
    outside = SignalCounter(accounts, "outside_window")
    accounts.start()
    captured: list[Envelope] = []
    Bus(accounts.name, accounts.router, captured.append).send(Deposit(account="a", amount=1))
    (first,) = captured

    # ... and three deposits processed one after the other
    accounts.transport.send(first)
    assert handled.wait_for(1)
    accounts.bus.send(Deposit(account="a", amount=10))
    assert handled.wait_for(2)
    accounts.bus.send(Deposit(account="a", amount=100))
    assert handled.wait_for(3)
    assert outside.count == 0, "no message so far was sent before the window started"
    assert f"AccountHandler/{first.message_id}" not in storage.load("Account", "a").processed

    # When the first deposit is delivered again, byte for byte (same id, same time sent)
    accounts.transport.send(first)

    # Then it takes effect a second time (the documented limit), and that is counted
    assert handled.wait_for(4)
    wait_until_idle([accounts])
    assert account(accounts, "a") == Account(balance=112, deposits=4)
    assert accounts.counters["duplicate"] == 0
    assert outside.count == 1
    assert outside.details[0]["message_id"] == first.message_id
    assert accounts.counters["outside_window"] == 1
