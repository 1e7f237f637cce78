"""Delayed retries, deferred messages, saga timeouts, the circuit breaker and the retention
check, on memory://, RabbitMQ and Redis."""

from __future__ import annotations

import datetime
import threading
import time
import uuid

import pytest
from pydantic import BaseModel

from idembus import (
    Backoff,
    Batching,
    Command,
    ConfigurationError,
    Endpoint,
    Middleware,
    RetryPolicy,
)
from idembus import headers as h
from idembus.envelope import Envelope, parse_utc, utc_now
from idembus.handlers import AggregateHandler, Handler, handles
from idembus.runtime.recoverability.breaker import BreakerPolicy, CircuitBreaker
from idembus.runtime.recoverability.policy import Recoverability
from idembus.storage.memory import MemoryStorage
from idembus.testing.faults import CrashPoint, FaultInjector, SimulatedCrash
from tests.support import Account, AccountHandler, Deposit, SignalCounter

FAST = RetryPolicy(immediate_retries=2, delayed=(0.3, 0.3))


class Flaky(Handler):
    """Fails ``failures`` times, then records each message it handled (and when)."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.attempts: list[str] = []  # message ids, one per attempt
        self.done: list[tuple[str, datetime.datetime]] = []
        self._lock = threading.Lock()

    @handles
    def on(self, message: Deposit) -> None:
        with self._lock:
            self.attempts.append(self.context.message_id)
            if len(self.attempts) <= self.failures:
                raise ConnectionError(f"dependency down (attempt {len(self.attempts)})")
            self.done.append((self.context.message_id, utc_now()))


def test_a_handler_failing_past_its_immediate_retries_succeeds_in_a_delayed_round_once(
    make_endpoint,
):
    # Given a handler that fails 4 times: 3 immediate attempts, then once more
    flaky = Flaky(failures=4)
    service = make_endpoint("flaky", handlers=[flaky], recoverability=Recoverability(retries=FAST))
    handled = SignalCounter(service, "handled")
    retried = SignalCounter(service, "retried")
    service.start()

    # When a deposit arrives
    message_id = service.bus.send(Deposit(account="a", amount=1))

    # Then it comes back once after a delay, keeps its id, and takes effect once
    assert handled.wait_for(1, timeout=30)
    assert flaky.attempts == [message_id] * 5
    assert [d["kind"] for d in retried.details].count("delayed") == 1
    assert [d[0] for d in flaky.done] == [message_id]
    assert service.counters["dead_lettered"] == 0


def test_a_poison_message_reaches_the_error_queue_after_exactly_the_configured_attempts(
    make_endpoint,
):
    # Given a handler that always fails, 2 immediate retries and 2 delayed rounds
    flaky = Flaky(failures=10**6)
    service = make_endpoint("poison", handlers=[flaky], recoverability=Recoverability(retries=FAST))
    dead = SignalCounter(service, "dead_lettered")
    service.start()

    # When a deposit arrives
    message_id = service.bus.send(Deposit(account="a", amount=1))

    # Then it is attempted (1 + 2) x (1 + 2) times and dead-lettered with its story
    assert dead.wait_for(1, timeout=30)
    assert flaky.attempts == [message_id] * 9
    copy = service.transport.get(service.error_queue)
    assert copy is not None
    assert copy.headers[h.MESSAGE_ID] == message_id
    assert copy.headers[h.IMMEDIATE_ATTEMPTS] == "3"
    assert copy.headers[h.DELAYED_ATTEMPTS] == "2"
    assert copy.headers[h.EXCEPTION_TYPE] == "builtins.ConnectionError"
    assert copy.headers[h.FAILED_QUEUE] == service.name


def test_an_unrecoverable_error_skips_delayed_retries_too(make_endpoint):
    class Invalid(Handler):
        @handles
        def on(self, message: Deposit) -> None:
            Account.model_validate({"balance": "lots"})  # pydantic.ValidationError

    service = make_endpoint("invalid", handlers=[Invalid],
                            recoverability=Recoverability(retries=FAST))
    dead = SignalCounter(service, "dead_lettered")
    service.start()
    service.bus.send(Deposit(account="a", amount=1))
    assert dead.wait_for(1)
    assert service.counters["failed"] == 1
    assert service.counters["retried"] == 0


def test_a_handler_class_may_set_its_own_retry_policy(make_endpoint):
    # Given an endpoint with no retries at all, and a handler that wants immediate ones
    class Patient(Flaky):
        retry_policy = RetryPolicy(immediate_retries=3, delayed=())

    patient = Patient(failures=2)
    service = make_endpoint("patient", handlers=[patient],
                            recoverability=Recoverability(
                                retries=RetryPolicy(immediate_retries=0, delayed=())))
    handled = SignalCounter(service, "handled")
    service.start()
    service.bus.send(Deposit(account="a", amount=1))
    assert handled.wait_for(1)
    assert len(patient.attempts) == 3
    assert service.counters["dead_lettered"] == 0


def test_a_deferred_message_arrives_no_earlier_than_asked(make_endpoint):
    flaky = Flaky(failures=0)
    service = make_endpoint("deferred", handlers=[flaky])
    handled = SignalCounter(service, "handled")
    service.start()

    asked = utc_now() + datetime.timedelta(seconds=1)
    message_id = service.bus.send(Deposit(account="a", amount=1), deliver_at=asked)

    assert handled.wait_for(1, timeout=30)
    ((done_id, done_at),) = flaky.done
    assert done_id == message_id
    assert done_at >= asked


def test_a_deferred_message_survives_a_restart_of_the_endpoint(
    make_endpoint, make_transport
):
    # Given a message deferred by 1 s, and its endpoint stopped before it is due
    storage = MemoryStorage()
    transport = make_transport()
    first = make_endpoint("restart", handlers=[Flaky(failures=0)], storage=storage,
                          transport=transport)
    first.start()
    asked = utc_now() + datetime.timedelta(seconds=1)
    message_id = first.bus.send(Deposit(account="a", amount=1), deliver_at=asked)
    assert first.stop()

    # When the endpoint starts again (a new instance on the same storage and broker)
    flaky = Flaky(failures=0)
    second = Endpoint(first.name, handlers=[flaky], storage=storage, transport=transport,
                      error_queue=first.error_queue)
    handled = SignalCounter(second, "handled")
    second.start()
    try:
        # Then the message still arrives, on time and once
        assert handled.wait_for(1, timeout=30)
        assert [d[0] for d in flaky.done] == [message_id]
        assert flaky.done[0][1] >= asked
    finally:
        second.stop()


class OpenTab(Command, message_name="rec.OpenTab"):
    tab: str


class TabTimeout(Command, message_name="rec.TabTimeout"):
    tab: str


class Tab(BaseModel):
    status: str = "new"
    timeouts: int = 0


class TabHandler(AggregateHandler[Tab]):
    """Opens a tab and asks to be woken up half a second later to expire it."""

    def aggregate_id(self, message: OpenTab | TabTimeout) -> str:
        return message.tab

    @handles
    def open(self, message: OpenTab) -> None:
        self.state.status = "open"
        self.request_timeout(TabTimeout(tab=message.tab), 0.5)

    @handles
    def expire(self, message: TabTimeout) -> None:
        self.state.timeouts += 1
        if self.state.status == "open":
            self.state.status = "expired"


class CrashOnceBeforeCommit(FaultInjector):
    def __init__(self) -> None:
        self.crashed = False

    def reached(self, point: CrashPoint, message_id: str) -> None:
        if point is CrashPoint.BEFORE_COMMIT and not self.crashed:
            self.crashed = True
            raise SimulatedCrash("crash after the handler asked for its timeout")


def test_a_saga_timeout_is_handled_once_even_when_its_request_was_recorded_twice(
    make_endpoint,
):
    # Given a tab handler whose first run crashes after requesting its timeout
    crash = CrashOnceBeforeCommit()
    service = make_endpoint("tabs", handlers=[TabHandler], middleware=[crash])
    handled = SignalCounter(service, "handled")
    service.start()

    # When a tab is opened
    opened = utc_now()
    service.bus.send(OpenTab(tab="t1"))

    # Then the timeout arrives once, after its delay, and expires the tab
    assert handled.wait_for(2, timeout=30)
    assert crash.crashed
    record = service.storage.load("Tab", "t1")
    assert Tab.model_validate(record.state) == Tab(status="expired", timeouts=1)
    timeouts = [d for d in handled.details if d["message_type"] == "rec.TabTimeout"]
    assert len(timeouts) == 1
    assert utc_now() - opened >= datetime.timedelta(seconds=0.5)


def test_the_circuit_breaker_pauses_consumers_after_failures_in_a_row(make_endpoint):
    # Given a handler that always fails, no retries, and a breaker opening after 3, on an
    # endpoint taking one message at a time (batched, five messages sent at once may be
    # handled together before their failures open it: see the next test)
    flaky = Flaky(failures=10**6)
    service = make_endpoint(
        "breaker", handlers=[flaky], batching=None,
        recoverability=Recoverability(
            retries=RetryPolicy(immediate_retries=0, delayed=()),
            breaker=BreakerPolicy(threshold=3, backoff=Backoff((0.4,)))),
    )
    dead = SignalCounter(service, "dead_lettered")
    paused = SignalCounter(service, "paused")
    starts: list[float] = []
    service.signals.received.connect(lambda sender, **_: starts.append(time.monotonic()),
                                     weak=False)
    service.start()

    # When five deposits arrive
    for amount in range(5):
        service.bus.send(Deposit(account="a", amount=amount))

    # Then from the third failure on, each next message waits out the pause
    assert dead.wait_for(5, timeout=30)
    assert paused.count >= 2
    assert all(d["seconds"] == 0.4 for d in paused.details)
    gaps = [later - earlier for earlier, later in zip(starts, starts[1:], strict=False)]
    assert all(gap < 0.4 for gap in gaps[:2]), gaps  # closed: no waiting
    assert all(gap >= 0.4 for gap in gaps[2:]), gaps  # open: a pause before each


def test_once_the_circuit_breaker_is_open_a_batched_endpoint_pauses_between_messages(
    make_endpoint,
):
    # Given a batching endpoint whose breaker opens at the first failure of a handler that
    # always fails, and has opened
    flaky = Flaky(failures=10**6)
    service = make_endpoint(
        "breaker-batched", handlers=[flaky], batching=Batching(size=8, linger=0.05),
        recoverability=Recoverability(
            retries=RetryPolicy(immediate_retries=0, delayed=()),
            breaker=BreakerPolicy(threshold=1, backoff=Backoff((0.3,)))),
    )
    dead = SignalCounter(service, "dead_lettered")
    starts: list[float] = []
    service.signals.received.connect(lambda sender, **_: starts.append(time.monotonic()),
                                     weak=False)
    service.start()
    service.bus.send(Deposit(account="a", amount=0))
    assert dead.wait_for(1, timeout=30)

    # When four deposits arrive at once (a batch, or several)
    for amount in range(1, 5):
        service.bus.send(Deposit(account="a", amount=amount))

    # Then each one's handler runs only after the previous one's pause, as without batching
    assert dead.wait_for(5, timeout=30)
    handled_at = starts[1:]
    assert len(flaky.attempts) == 5
    gaps = [later - earlier for earlier, later in zip(handled_at, handled_at[1:], strict=False)]
    assert all(gap >= 0.3 for gap in gaps), gaps


def test_bad_input_does_not_open_the_circuit_breaker(make_endpoint, transport_url):
    # Given a breaker that would open at the first failure
    service = make_endpoint(
        "bad-input", handlers=[AccountHandler],
        recoverability=Recoverability(breaker=BreakerPolicy(threshold=1, backoff=Backoff((5.0,)))),
    )
    dead = SignalCounter(service, "dead_lettered")
    service.start()

    # When messages of an unknown type arrive
    for _ in range(3):
        service.transport.send(Envelope({h.MESSAGE_ID: str(uuid.uuid4()),
                                         h.MESSAGE_TYPE: "rec.Unknown"}, "{}", service.name))

    # Then they are dead-lettered without pausing anything
    assert dead.wait_for(3)
    assert service.counters["paused"] == 0


def test_the_circuit_breaker_grows_its_pauses_and_closes_after_a_success():
    breaker = CircuitBreaker(BreakerPolicy(threshold=2, backoff=Backoff((1.0, 2.0))))
    assert breaker.failed() == 0.0
    assert breaker.failed() == 1.0 and breaker.open
    assert breaker.failed() == 2.0
    breaker.succeeded()
    assert not breaker.open and breaker.failed() == 0.0


def test_retention_shorter_than_the_retry_path_fails_at_start():
    storage = MemoryStorage(retention=datetime.timedelta(seconds=30))
    with pytest.raises(ConfigurationError, match=r"remembers processed messages for 30s.*"
                                                 r"come back 60s after"):
        Endpoint("short-memory", storage=storage, handlers=[AccountHandler])

    # A handler's own, longer policy counts too
    class Slow(Flaky):
        retry_policy = RetryPolicy(delayed=(3600.0,))

    roomy = MemoryStorage(retention=datetime.timedelta(minutes=10))
    Endpoint("roomy", storage=roomy, handlers=[AccountHandler])
    with pytest.raises(ConfigurationError, match="come back 3600s after"):
        Endpoint("roomy", storage=roomy, handlers=[Slow(0)])


def test_delayed_retry_headers_carry_the_round_and_the_time(make_endpoint):
    flaky = Flaky(failures=3)
    service = make_endpoint("headers", handlers=[flaky],
                            recoverability=Recoverability(
                                retries=RetryPolicy(immediate_retries=2, delayed=(0.3,))))
    received = SignalCounter(service, "received")
    handled = SignalCounter(service, "handled")
    rounds: list[tuple[str | None, str | None]] = []

    class Spy(Middleware):
        def before_message(self, incoming):  # type: ignore[no-untyped-def]
            rounds.append((incoming.headers.get(h.DELAYED_ATTEMPTS),
                           incoming.headers.get(h.DELIVER_AT)))

    service.add_middleware(Spy())
    service.start()
    service.bus.send(Deposit(account="a", amount=1))
    assert handled.wait_for(1, timeout=30)
    assert received.count == 2
    assert rounds[1][0] == "1"
    assert parse_utc(rounds[1][1]) is not None
