"""The failure taxonomy on the consumer's side (DESIGN §2b): transient failures are waited
out, failures that are the message's own go through its retry policy without tripping the
circuit breaker, failures only an operator can end are logged at ERROR and shown by the
endpoint's health, and a re-attempt after an outage is counted as what it is."""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest

from idembus import Backoff, Endpoint, RetryPolicy
from idembus import headers as h
from idembus.envelope import utc_now
from idembus.handlers import Handler, handles
from idembus.runtime.recoverability.breaker import BreakerPolicy
from idembus.runtime.recoverability.policy import Recoverability
from idembus.storage.errors import StorageAccessDenied, StorageRefused, StorageUnavailable
from idembus.storage.memory import MemoryStorage
from idembus.testing import wait_until_idle
from idembus.transports.errors import (
    BrokerAccessDenied,
    DestinationRefused,
    TransportUnavailable,
)
from idembus.transports.kombu import KombuTransport
from tests.support import Account, AccountHandler, Deposit, Ledger, SignalCounter

NO_WAIT = Backoff((0.0,))
MakeEndpoint = Callable[..., Endpoint]


class CommitLandsThenConnectionDrops(MemoryStorage):
    """The first commit is applied, then its reply is lost with the connection."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def commit(self, loaded: Any, **kwargs: Any) -> None:
        super().commit(loaded, **kwargs)
        if self.dropped == 0:
            self.dropped += 1
            raise StorageUnavailable("server closed the connection unexpectedly (simulated)")


class CommitLostWithTheConnection(MemoryStorage):
    """The first commit never reaches the database."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def commit(self, loaded: Any, **kwargs: Any) -> None:
        if self.dropped == 0:
            self.dropped += 1
            raise StorageUnavailable("connection refused (simulated)")
        super().commit(loaded, **kwargs)


@pytest.mark.parametrize("storage_type", [CommitLandsThenConnectionDrops,
                                          CommitLostWithTheConnection])
def test_a_commit_cut_by_an_outage_counts_as_handled_once_and_sends_its_messages_once(
    make_endpoint: MakeEndpoint, storage_type: type[MemoryStorage],
) -> None:
    # Given an endpoint whose first commit is cut by a lost connection
    storage = storage_type()
    ledger = Ledger()
    accounts = make_endpoint("accounts", handlers=[AccountHandler], storage=storage,
                             recoverability=Recoverability(outage_backoff=NO_WAIT))
    downstream = make_endpoint("ledger", handlers=[ledger])
    recorded = SignalCounter(downstream, "handled")
    accounts.start()
    downstream.start()

    # When a deposit arrives
    accounts.bus.send(Deposit(account="a", amount=5))

    # Then it is applied once, counted once as handled and never as a duplicate
    assert recorded.wait_for(1)
    wait_until_idle([accounts, downstream])
    assert accounts.counters["handled"] == 1
    assert accounts.counters["duplicate"] == 0
    assert accounts.counters["redispatched"] == 0
    assert accounts.counters["failed"] == 0
    assert Account.model_validate(storage.load("Account", "a").state).balance == 5
    assert [entry[1:] for entry in ledger.entries] == [("a", 5)]


class DeniedForAWhile(MemoryStorage):
    """Refuses this endpoint's login until ``allow`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.allow = threading.Event()
        self.refused = threading.Event()  # set on a second refusal: the first was noted
        self._refusals = 0

    def load(self, *args: Any, **kwargs: Any) -> Any:
        if not self.allow.is_set():
            self._refusals += 1
            if self._refusals > 1:
                self.refused.set()
            raise StorageAccessDenied(
                "password authentication failed for user app (postgresql://app:s3cr3t@db/x)")
        return super().load(*args, **kwargs)


def test_a_refused_login_is_logged_at_error_and_shown_until_it_works_and_the_message_waits(
    make_endpoint: MakeEndpoint, caplog: pytest.LogCaptureFixture,
) -> None:
    # Given an endpoint whose database refuses its login
    storage = DeniedForAWhile()
    accounts = make_endpoint("accounts", handlers=[AccountHandler], storage=storage,
                             recoverability=Recoverability(
                                 outage_backoff=Backoff((0.01,)),
                                 retries=RetryPolicy(immediate_retries=0)))
    handled = SignalCounter(accounts, "handled")
    caplog.set_level(logging.ERROR, logger="idembus.runtime.processing")
    accounts.start()

    # When a deposit arrives while the login is refused
    accounts.bus.send(Deposit(account="a", amount=5))
    assert storage.refused.wait(10)

    # Then the problem is shown by the endpoint's health, without the password
    problems = accounts.health.problems()
    assert "authentication failed" in problems["storage"]
    assert "s3cr3t" not in problems["storage"]
    # And every attempt is an ERROR line, redacted
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and all("s3cr3t" not in r.getMessage() for r in errors)

    # When the operator fixes the login
    storage.allow.set()

    # Then the message is applied, never failed or dead-lettered, and the problem is gone
    assert handled.wait_for(1)
    accounts.stop()  # joins the consumer: the message's processing has finished
    assert accounts.counters["failed"] == 0
    assert accounts.counters["dead_lettered"] == 0
    assert accounts.health.problems() == {}


class RefusesNulCharacters(MemoryStorage):
    """Refuses to store a NUL character, as PostgreSQL's jsonb does."""

    def commit(self, loaded: Any, *, outgoing: Any = (), **kwargs: Any) -> None:
        if any("\\u0000" in envelope.body for envelope in outgoing):
            raise StorageRefused("unsupported Unicode escape sequence (SQLSTATE 22P05)")
        super().commit(loaded, outgoing=outgoing, **kwargs)


def test_a_message_the_database_refuses_goes_to_the_error_queue_without_pausing_others(
    make_endpoint: MakeEndpoint,
) -> None:
    # Given an endpoint with a breaker that would pause after one failed message
    accounts = make_endpoint(
        "accounts", handlers=[AccountHandler], storage=RefusesNulCharacters(),
        recoverability=Recoverability(
            retries=RetryPolicy(immediate_retries=2, delayed=()),
            breaker=BreakerPolicy(threshold=1, backoff=Backoff((30.0,))),
            outage_backoff=NO_WAIT))
    dead_lettered = SignalCounter(accounts, "dead_lettered")
    handled = SignalCounter(accounts, "handled")
    accounts.start()

    # When a deposit the database cannot store arrives, and then a good one
    accounts.bus.send(Deposit(account="nul\x00here", amount=5))
    accounts.bus.send(Deposit(account="b", amount=7))

    # Then the bad one used its retries and went to the error queue with the reason
    assert dead_lettered.wait_for(1)
    assert handled.wait_for(1, timeout=10)  # not held back by a 30 s pause
    wait_until_idle([accounts])
    copy = accounts.transport.get(accounts.error_queue)
    assert copy is not None
    assert copy.headers[h.EXCEPTION_TYPE] == "idembus.storage.errors.StorageRefused"
    assert "22P05" in copy.headers[h.EXCEPTION_MESSAGE]
    assert copy.headers[h.IMMEDIATE_ATTEMPTS] == "3"
    assert accounts.counters["paused"] == 0


class RefusesOneQueue(KombuTransport):
    """The broker refuses sends to ``refused`` (no such queue)."""

    def __init__(self, *args: Any, refused: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refused = refused
        self.refusals = 0

    def send(self, envelope: Any) -> None:
        if envelope.destination == self.refused:
            self.refusals += 1
            raise DestinationRefused(f"NOT_FOUND - no queue '{self.refused}' (simulated)")
        super().send(envelope)


class Forwarder(AccountHandler):
    """Applies the deposit, then forwards a copy to the queue ``nowhere``."""

    @handles
    def deposit(self, message: Deposit) -> None:
        super().deposit(message)
        self.bus.send(Deposit(account="x", amount=message.amount), to="nowhere")


def test_a_committed_message_the_broker_refuses_is_parked_and_the_incoming_one_is_done(
    make_endpoint: MakeEndpoint, transport_url: str, make_transport: Callable[..., Any],
) -> None:
    # Given an endpoint whose handler sends to a queue the broker refuses
    transport = RefusesOneQueue(transport_url, exchange=make_transport().exchange_name,
                                refused="nowhere")
    accounts = make_endpoint("accounts", handlers=[Forwarder], transport=transport,
                             recoverability=Recoverability(
                                 retries=RetryPolicy(immediate_retries=2, delayed=()),
                                 breaker=BreakerPolicy(threshold=1, backoff=Backoff((30.0,)))))
    handled = SignalCounter(accounts, "handled")
    accounts.start()

    # When a deposit arrives
    accounts.bus.send(Deposit(account="a", amount=5))

    # Then its effect is committed once, the refused message is tried once and parked
    # with the broker's reason (its entry marked: the outbox will not try it again), and
    # the deposit is acknowledged: not failed, not in the error queue, no pause
    assert handled.wait_for(1)
    wait_until_idle([accounts])
    accounts.stop()
    assert transport.refusals == 1
    [parked] = accounts.storage.parked_messages(accounts.name)
    assert parked.envelope.destination == "nowhere"
    assert "no queue 'nowhere'" in parked.envelope.headers[h.EXCEPTION_MESSAGE]
    assert accounts.storage.undispatched(
        committed_before=utc_now() + datetime.timedelta(minutes=1)) == []
    assert accounts.transport.get(accounts.error_queue) is None
    assert (accounts.counters["handled"], accounts.counters["failed"]) == (1, 0)
    assert Account.model_validate(accounts.storage.load("Account", "a").state).balance == 5
    assert accounts.counters["paused"] == 0


class RefusedLoginForAWhile(KombuTransport):
    """``consume`` raises a refused login until ``allow`` is set."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allow = threading.Event()
        self.refusals = 0

    def consume(self, *args: Any, **kwargs: Any) -> None:
        if not self.allow.is_set():
            self.refusals += 1
            raise BrokerAccessDenied("amqp://app:hunter2@broker//: ACCESS_REFUSED - Login was "
                                     "refused (simulated)")
        super().consume(*args, **kwargs)


class RefusalsLogged(logging.Handler):
    """Collects the ERROR lines about a refused login and, as each is logged (in the
    consumer's thread, right after it reported the problem), what the endpoint's health
    showed: before it tries again and clears the problem for that try."""

    def __init__(self, endpoint: Endpoint) -> None:
        super().__init__(logging.ERROR)
        self.endpoint = endpoint
        self.lines: list[str] = []
        self.problems: list[dict[str, str]] = []
        self._logged = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        if "Login was refused" not in record.getMessage():
            return
        with self._logged:
            self.lines.append(record.getMessage())
            self.problems.append(dict(self.endpoint.health.problems()))
            self._logged.notify_all()

    def wait_for(self, count: int, timeout: float = 30.0) -> bool:
        """True once ``count`` lines were logged; False after ``timeout``."""
        with self._logged:
            return self._logged.wait_for(lambda: len(self.lines) >= count, timeout)


def test_a_refused_broker_login_keeps_the_consumer_trying_and_shows_the_problem(
    make_endpoint: MakeEndpoint, transport_url: str, make_transport: Callable[..., Any],
) -> None:
    # Given an endpoint whose broker refuses its login at first
    transport = RefusedLoginForAWhile(transport_url, exchange=make_transport().exchange_name)
    accounts = make_endpoint("accounts", handlers=[AccountHandler], transport=transport,
                             recoverability=Recoverability(outage_backoff=Backoff((0.01,))))
    handled = SignalCounter(accounts, "handled")
    logged = RefusalsLogged(accounts)
    logger = logging.getLogger("idembus")  # whichever module of the package logs it
    logger.addHandler(logged)
    try:
        accounts.start()
        accounts.bus.send(Deposit(account="a", amount=5))

        # Then the consumer thread stays alive, logs each refusal at ERROR (without the
        # password) and shows it in the endpoint's health
        assert logged.wait_for(3)
        assert accounts.running
        assert transport.refusals >= 3
        assert all("Login was refused" in problems.get("transport", "")
                   for problems in logged.problems[:3]), logged.problems[:3]
        assert not any("hunter2" in line for line in logged.lines)
    finally:
        logger.removeHandler(logged)

    # When the login works again, the waiting message is handled and the problem clears
    transport.allow.set()
    assert handled.wait_for(1)
    assert accounts.health.problems() == {}


class RefusesDelays(KombuTransport):
    """The broker refuses the delay levels (a delayed retry), as if they were missing."""

    def send(self, envelope: Any) -> None:
        if h.DELIVER_AT in envelope.headers:
            raise DestinationRefused("NOT_FOUND - no exchange 'idembus.delay.00' (simulated)")
        super().send(envelope)


class AlwaysFails(Handler):
    @handles
    def deposit(self, message: Deposit) -> None:
        raise RuntimeError("the payment service said no")


@pytest.mark.amqp
def test_a_refused_delayed_retry_sends_the_message_to_the_error_queue_instead(
    make_endpoint: MakeEndpoint, transport_url: str, make_transport: Callable[..., Any],
) -> None:
    if not transport_url.startswith("amqp"):
        pytest.skip("only RabbitMQ holds delayed retries in the broker")
    # Given an endpoint whose broker refuses delayed messages
    transport = RefusesDelays(transport_url, exchange=make_transport().exchange_name)
    failing = make_endpoint("failing", handlers=[AlwaysFails], transport=transport,
                            recoverability=Recoverability(
                                retries=RetryPolicy(immediate_retries=0, delayed=(5.0,))))
    dead_lettered = SignalCounter(failing, "dead_lettered")
    failing.start()

    # When its handler fails and the message would come back later
    failing.bus.send(Deposit(account="a", amount=1))

    # Then it goes to the error queue with the handler's reason instead of looping
    assert dead_lettered.wait_for(1)
    copy = failing.transport.get(failing.error_queue)
    assert copy is not None
    assert "the payment service said no" in copy.headers[h.EXCEPTION_MESSAGE]


class BrokerLostAfterOneSend(KombuTransport):
    """Sends to ``watched`` fail with a lost connection once, after the first went out."""

    def __init__(self, *args: Any, watched: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.watched = watched
        self.sends: list[str] = []
        self.lost = False

    def send(self, envelope: Any) -> None:
        if envelope.destination == self.watched:
            if len(self.sends) == 1 and not self.lost:
                self.lost = True
                raise TransportUnavailable("connection reset by peer (simulated)")
            self.sends.append(envelope.message_id)
        super().send(envelope)


class SendsThree(AccountHandler):
    """Applies the deposit, then sends three copies of it to ``watched``."""

    watched = ""

    @handles
    def deposit(self, message: Deposit) -> None:
        super().deposit(message)
        for _ in range(3):
            self.bus.send(Deposit(account="x", amount=message.amount), to=self.watched)


def test_an_outage_in_the_middle_of_a_dispatch_sends_and_counts_only_what_is_left(
    make_endpoint: MakeEndpoint, transport_url: str, make_transport: Callable[..., Any],
) -> None:
    # Given an endpoint that sends three messages and loses the broker after the first
    watched = make_endpoint("watched", handlers=[])
    watched.transport.declare(watched.name)
    SendsThree.watched = watched.name
    transport = BrokerLostAfterOneSend(transport_url, exchange=make_transport().exchange_name,
                                       watched=watched.name)
    accounts = make_endpoint("accounts", handlers=[SendsThree], transport=transport,
                             recoverability=Recoverability(outage_backoff=NO_WAIT))
    dispatched = SignalCounter(accounts, "dispatched")
    accounts.start()

    # When a deposit arrives
    accounts.bus.send(Deposit(account="a", amount=5))

    # Then after the outage only what had not gone out is sent again: each message once,
    # counted once, and nothing is a duplicate or a redispatch
    assert dispatched.wait_for(4)  # the Deposited event, then the three copies
    wait_until_idle([accounts])
    assert transport.lost
    assert len(transport.sends) == len(set(transport.sends)) == 3
    assert (accounts.counters["dispatched"], accounts.counters["handled"]) == (4, 1)
    assert (accounts.counters["duplicate"], accounts.counters["redispatched"]) == (0, 0)
