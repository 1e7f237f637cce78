"""Handler time limits: a handler past its limit commits nothing, is retried per policy and
ends in the error queue with ``TimeLimitExceeded``; async handlers are cancelled; sync ones
abandoned on a thread that is replaced, and the process asks to be recycled when too many
are stuck; hung handlers show in ``idembus status`` and the dashboard. On memory:// and on
RabbitMQ with PostgreSQL."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from idembus import (
    Endpoint,
    RetryPolicy,
    TimeLimitExceeded,
    TimeLimits,
)
from idembus import headers as h
from idembus.cli import main
from idembus.cli.supervisor import Supervisor
from idembus.errors import ConfigurationError
from idembus.handlers import AggregateHandler, Handler, handles
from idembus.runtime.recoverability.policy import Recoverability
from idembus.runtime.recoverability.time_limits import EXIT_RECYCLE
from idembus.storage.base import AggregateStore
from idembus.storage.memory import MemoryStorage
from idembus.transports.base import Delivery
from idembus.transports.kombu import KombuTransport
from tests.conftest import POSTGRES_URL
from tests.support import Account, Deposit, Deposited, SignalCounter
from tests.test_cli_errors import SharedMemoryStorage
from tests.test_status import wait_until

#: Two attempts a round, two rounds: four attempts in all.
TWICE_TWICE = RetryPolicy(immediate_retries=1, delayed=(0.1,))
ONCE = RetryPolicy(immediate_retries=0, delayed=())
EXCEEDED = "idembus.errors.TimeLimitExceeded"


class Stalling(AggregateHandler[Account]):
    """Adds each deposit and publishes ``Deposited``; on the accounts in ``slow`` it blocks
    (after changing the state) until ``release`` is set, then tries to publish."""

    time_limit = 0.3

    def __init__(self, slow: set[str] | None = None) -> None:
        self.slow = slow or set()
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)
        self.threads: list[str] = []
        #: What publishing raised in abandoned threads, once released.
        self.late: list[BaseException] = []

    def aggregate_id(self, message: Deposit) -> str:
        return message.account

    @handles
    def deposit(self, message: Deposit) -> None:
        self.threads.append(threading.current_thread().name)
        self.state.balance += message.amount
        if message.account in self.slow:
            self.entered.release()
            self.release.wait(60)
        try:
            self.bus.publish(Deposited(account=message.account, amount=message.amount))
        except TimeLimitExceeded as late:
            self.late.append(late)
            raise


class Unlimited(Stalling):
    """:class:`Stalling` without a time limit of its own."""

    time_limit = None


@pytest.fixture(params=[pytest.param("memory", id="memory"),
                        pytest.param("amqp-postgres", id="amqp-postgres",
                                     marks=[pytest.mark.amqp, pytest.mark.postgres]),
                        pytest.param("postgres-queues", id="postgres-queues",
                                     marks=pytest.mark.postgres)])
def services(request: pytest.FixtureRequest, unique: str
             ) -> Iterator[Callable[[str], dict[str, Any]]]:
    """``services("name")``: the options of an endpoint named ``name-<unique>`` on memory://
    with a MemoryStorage, on RabbitMQ with PostgreSQL, or on PostgreSQL's queues and
    storage in one database (queues and tables dropped afterwards)."""
    if request.param == "memory":
        def memory(name: str) -> dict[str, Any]:
            return {"name": f"{name}-{unique}", "error_queue": f"error-{unique}",
                    "transport": KombuTransport("memory://"), "storage": MemoryStorage()}
        yield memory
        return
    if request.param == "postgres-queues":
        from idembus.transports.postgres import PostgresTransport

        storage = request.getfixturevalue("postgres_storage")
        queues = PostgresTransport(POSTGRES_URL, table_prefix=f"q{unique}")

        def database(name: str) -> dict[str, Any]:
            return {"name": f"{name}-{unique}", "error_queue": f"error-{unique}",
                    "transport": queues, "storage": storage}
        yield database
        queues.drop_tables()
        queues.close()
        return
    transport, queue = request.getfixturevalue("rabbitmq")
    storage = request.getfixturevalue("postgres_storage")

    def real(name: str) -> dict[str, Any]:
        return {"name": queue(name), "error_queue": queue("error"), "transport": transport,
                "storage": storage}
    yield real


def endpoint_of(options: dict[str, Any], **more: Any) -> Endpoint:
    options = {**options, **more}
    return Endpoint(options.pop("name"), **options)


def test_a_handler_past_its_limit_commits_nothing_and_ends_in_the_error_queue_after_retries(
    services: Callable[[str], dict[str, Any]],
):
    # Given a handler limited to 0.3 s that hangs on account "slow", 2 x 2 attempts
    stalling = Stalling(slow={"slow"})
    service = endpoint_of(services("limits"), handlers=[stalling],
                          recoverability=Recoverability(retries=TWICE_TWICE))
    dead = SignalCounter(service, "dead_lettered")
    dispatched = SignalCounter(service, "dispatched")
    service.start()
    try:
        # When a deposit to it arrives
        message_id = service.bus.send(Deposit(account="slow", amount=5))

        # Then every attempt is abandoned, and after the retries it is in the error queue
        assert dead.wait_for(1, timeout=60)
        copy = service.transport.get(service.error_queue)
        assert copy is not None
        assert copy.headers[h.MESSAGE_ID] == message_id
        assert copy.headers[h.EXCEPTION_TYPE] == EXCEEDED
        assert "time limit of 0.3 s" in copy.headers[h.EXCEPTION_MESSAGE]
        assert copy.headers[h.IMMEDIATE_ATTEMPTS] == "2"
        assert copy.headers[h.DELAYED_ATTEMPTS] == "1"
        assert len(stalling.threads) == 4
        assert len(set(stalling.threads)) == 4  # a new handler thread for every attempt
        # ... and nothing it did was committed or sent
        storage = service.storage
        assert isinstance(storage, AggregateStore)
        assert not storage.load("Account", "slow", "probe").live
        assert dispatched.count == 0
        assert service.time_limits is not None and service.time_limits.stuck == 4
    finally:
        # When the abandoned threads return at last, what they send is refused
        stalling.release.set()
    assert wait_until(lambda: len(stalling.late) == 4)
    assert all("abandoned" in str(late) for late in stalling.late)
    assert wait_until(lambda: service.time_limits is not None
                      and service.time_limits.stuck == 0)
    assert dispatched.count == 0
    service.close()


def test_a_handler_within_its_limit_commits_as_ever_on_its_handler_thread(
    services: Callable[[str], dict[str, Any]],
):
    stalling = Stalling()
    service = endpoint_of(services("within"), handlers=[stalling])
    handled = SignalCounter(service, "handled")
    with service:
        service.bus.send(Deposit(account="a", amount=2))
        service.bus.send(Deposit(account="a", amount=3))
        assert handled.wait_for(2, timeout=30)
        storage = service.storage
        assert isinstance(storage, AggregateStore)
        assert storage.load("Account", "a", "probe").state == {"balance": 5, "deposits": 0}
    # one handler thread, reused: none was abandoned; it ended with its consumer thread
    assert len(set(stalling.threads)) == 1 and "-handler-" in stalling.threads[0]
    assert wait_until(lambda: all(thread.name != stalling.threads[0]
                                  for thread in threading.enumerate()))


class Waiting(Handler):
    """An async handler that waits 60 s for something; it notes its cancellation."""

    time_limit = 0.3

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.attempts: list[str] = []  # (the handler object is copied for each message)

    @handles
    async def on(self, message: Deposit) -> None:
        self.attempts.append(self.context.message_id)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        self.bus.publish(Deposited(account=message.account, amount=message.amount))


def test_an_async_handler_past_its_limit_is_cancelled_and_its_thread_kept(
    services: Callable[[str], dict[str, Any]],
):
    waiting = Waiting()
    service = endpoint_of(services("async"), handlers=[waiting],
                          recoverability=Recoverability(retries=ONCE))
    dead = SignalCounter(service, "dead_lettered")
    with service:
        service.bus.send(Deposit(account="a", amount=1))
        assert dead.wait_for(1, timeout=30)
        assert waiting.cancelled.is_set() and len(waiting.attempts) == 1
        copy = service.transport.get(service.error_queue)
        assert copy is not None and copy.headers[h.EXCEPTION_TYPE] == EXCEEDED
        assert "cancelled" in copy.headers[h.EXCEPTION_MESSAGE]
        assert service.time_limits is not None and service.time_limits.stuck == 0
        assert service.counters["handled"] == 0


def test_an_async_handler_that_blocks_its_loop_is_abandoned_after_the_grace():
    release = threading.Event()

    class Blocking(Handler):
        time_limit = 0.2

        @handles
        async def on(self, message: Deposit) -> None:
            release.wait(60)  # synchronous: the cancellation cannot reach it

    service = Endpoint("blocking", handlers=[Blocking], recoverability=Recoverability(
        retries=ONCE, time_limits=TimeLimits(grace=0.1)))
    dead = SignalCounter(service, "dead_lettered")
    try:
        with service:
            service.bus.send(Deposit(account="a", amount=1))
            assert dead.wait_for(1, timeout=30)
            assert service.time_limits is not None and service.time_limits.stuck == 1
            copy = service.transport.get(service.error_queue)
            assert copy is not None and copy.headers[h.EXCEPTION_TYPE] == EXCEEDED
            assert "abandoned" in copy.headers[h.EXCEPTION_MESSAGE]
    finally:
        release.set()


def test_status_and_the_dashboard_show_a_hung_handler_while_it_hangs(exposed_endpoint,
                                                                     capsys):
    # Given a handler without limit, hung on a message; runs longer than 0 s are reported
    stalling = Unlimited(slow={"hung"})
    storage = SharedMemoryStorage()
    service = Endpoint("hangs", handlers=[stalling], storage=storage, status_interval=0.05,
                       recoverability=Recoverability(time_limits=TimeLimits(report_after=0)))
    with service:
        message_id = service.bus.send(Deposit(account="hung", amount=1))
        try:
            assert stalling.entered.acquire(timeout=30)

            # When idembus status runs while it hangs
            def reported() -> bool:
                return any("handling test.Deposit" in text for report in
                           storage.status_reports(service.name)
                           for text in report.problems.values())
            assert wait_until(reported)
            viewer = Endpoint(service.name, storage=storage, handlers=[Stalling])
            assert main(["status", exposed_endpoint(viewer)]) == 0
            # (a problem line wider than 120 columns wraps: read it unwrapped)
            table = " ".join(capsys.readouterr().out.split())

            # Then it shows the handler, the message and how long it has run
            assert "PROBLEM" in table and f"(handler {type(stalling).name()} #1)" in table
            assert f"handling test.Deposit {message_id} for " in table
            assert "(no time limit)" in table

            # And so does the dashboard
            from idembus.dashboard import Dashboard

            dashboard = Dashboard([viewer], port=0, sample_interval=0.05)
            dashboard.start()
            try:
                dashboard.sample()
                page = httpx.get(f"{dashboard.url}/fragment/overview", timeout=10)
            finally:
                dashboard.stop(5)
            assert page.status_code == 200
            assert f"handling test.Deposit {message_id} for " in page.text
        finally:
            stalling.release.set()
        # Once it returned, the next reports no longer show it
        assert wait_until(lambda: not reported())


@pytest.fixture
def exposed_endpoint(monkeypatch: pytest.MonkeyPatch) -> Callable[[Endpoint], str]:
    import sys
    import types

    def expose(endpoint: Endpoint) -> str:
        module = types.ModuleType("time_limits_app")
        module.endpoint = endpoint  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "time_limits_app", module)
        return "time_limits_app:endpoint"
    return expose


def test_too_many_stuck_threads_stop_the_endpoint_to_be_recycled(caplog):
    # Given at most one stuck handler thread, and a handler that hangs on every message
    stalling = Stalling(slow={"a", "b"})
    service = Endpoint("recycled", handlers=[stalling], recoverability=Recoverability(
        retries=ONCE, time_limits=TimeLimits(max_stuck_threads=1)))
    dead = SignalCounter(service, "dead_lettered")
    try:
        service.start()
        # When two messages are abandoned
        service.bus.send(Deposit(account="a", amount=1))
        service.bus.send(Deposit(account="b", amount=1))
        assert dead.wait_for(2, timeout=30)

        # Then the endpoint stops by itself, asking to be recycled, and says why
        assert service.context.stopping.wait(10)
        assert service.recycle_requested
        assert service.time_limits is not None
        assert "2 handler threads are stuck" in service.time_limits.hung()["time limits"]
        # and each abandonment was logged with where the handler hung
        abandoned = [r.getMessage() for r in caplog.records if "abandoned (its" in r.getMessage()]
        assert len(abandoned) == 2
        assert all("in deposit\n    self.release.wait(60)" in line for line in abandoned)
        assert service.stop(10)
    finally:
        stalling.release.set()
        service.close()


def test_a_batch_with_one_slow_message_commits_its_mates_once_and_loses_none(
    services: Callable[[str], dict[str, Any]],
):
    # Given a batch of five deposits, one of which hangs past its limit on every attempt
    stalling = Stalling(slow={"slow"})
    options = services("batch")
    service = endpoint_of(options, handlers=[stalling],
                          recoverability=Recoverability(retries=RetryPolicy(
                              immediate_retries=1, delayed=())))
    dispatched = SignalCounter(service, "dispatched")
    accounts = ["a", "b", "slow", "c", "d"]
    try:
        service.transport.declare(service.name)
        service.transport.declare(service.error_queue)
        for account in accounts:
            service.bus.send(Deposit(account=account, amount=1), message_id=f"m-{account}")
        deliveries: list[Delivery] = []
        assert wait_until(lambda: service.transport.pending(service.name) == len(accounts))
        while len(deliveries) < len(accounts):
            delivery = service.transport.get(service.name)  # taken off the queue
            assert delivery is not None
            deliveries.append(_again(delivery))
        # (one batch; on the database queues, commit, send and acknowledgement are one
        # transaction and messages go one at a time)
        assert (service.batch_size or 0) >= len(accounts) or service.shared_transaction

        # When the batch is processed, then again (as if redelivered)
        service.process_batch(deliveries)
        service.process_batch([_again(delivery) for delivery in deliveries
                               if delivery.headers[h.MESSAGE_ID] != "m-slow"])

        # Then each mate took effect once, its event sent once (again with the same id on
        # the redelivery), and the slow one committed nothing and is in the error queue
        storage = service.storage
        assert isinstance(storage, AggregateStore)
        for account in ("a", "b", "c", "d"):
            assert storage.load("Account", account, "probe").state == {
                "balance": 1, "deposits": 0}
        assert not storage.load("Account", "slow", "probe").live
        sent = [d["envelope"] for d in dispatched.details]
        assert sorted({e.message_id for e in sent}) == sorted(
            {e.message_id for e in sent if e.message_type == "test.Deposited"})
        assert len({e.message_id for e in sent}) == 4
        copy = service.transport.get(service.error_queue)
        assert copy is not None and copy.headers[h.MESSAGE_ID] == "m-slow"
        assert copy.headers[h.EXCEPTION_TYPE] == EXCEEDED
        assert service.counters["handled"] == 4 and service.counters["duplicate"] == 4
    finally:
        stalling.release.set()
        service.close()


def _again(delivery: Delivery) -> Delivery:
    """A delivery of the same message, which the test settles (a redelivery)."""
    from tests.support import RecordedDelivery

    return RecordedDelivery(delivery.queue, dict(delivery.headers), delivery.body,
                            redelivered=True)


def test_bad_time_limits_fail_when_the_endpoint_is_created():
    class Negative(Stalling):
        time_limit = -1.0

    with pytest.raises(ConfigurationError, match=r"Negative.time_limit must be a positive"):
        Endpoint("bad", handlers=[Negative])
    with pytest.raises(ConfigurationError, match=r"TimeLimits\(default=...\) must be"):
        TimeLimits(default=0)
    with pytest.raises(ConfigurationError, match="max_stuck_threads"):
        TimeLimits(max_stuck_threads=-2)

    class Misspelt(Stalling):
        time_limt = 3.0

    with pytest.raises(ConfigurationError, match="did you mean 'time_limit'"):
        Endpoint("misspelt", handlers=[Misspelt])


def test_the_endpoints_default_limit_applies_to_handlers_without_their_own():
    stalling = Unlimited(slow={"x"})
    service = Endpoint("defaulted", handlers=[stalling], recoverability=Recoverability(
        retries=ONCE, time_limits=TimeLimits(default=0.2)))
    dead = SignalCounter(service, "dead_lettered")
    try:
        with service:
            service.bus.send(Deposit(account="x", amount=1))
            assert dead.wait_for(1, timeout=30)
            copy = service.transport.get(service.error_queue)
            assert copy is not None and "time limit of 0.2 s" in copy.headers[
                h.EXCEPTION_MESSAGE]
    finally:
        stalling.release.set()


def test_idembus_run_exits_3_to_be_recycled_and_the_supervisor_restarts_at_once(
    exposed_endpoint,
):
    # Given an endpoint that tolerates no stuck thread, with a message that hangs waiting
    stalling = Stalling(slow={"a"})
    service = Endpoint("recycling", handlers=[stalling], recoverability=Recoverability(
        retries=ONCE, time_limits=TimeLimits(max_stuck_threads=0)))
    service.transport.declare(service.name)
    service.bus.send(Deposit(account="a", amount=1))
    try:
        # When idembus run runs it
        status = main(["run", exposed_endpoint(service), "--shutdown-timeout", "10"])
    finally:
        stalling.release.set()

    # Then it stops by itself with the status that asks for a new process
    assert status == EXIT_RECYCLE == 3
    assert service.counters["dead_lettered"] == 1

    # And a supervisor starts a worker that exited so at once, where a crash waits
    supervisor = Supervisor("app:endpoint", workers=1)
    (worker,) = supervisor._workers
    worker.process, worker.started_at, worker.quick_deaths = _Exited(), 100.0, 3
    supervisor._schedule_restart(worker, EXIT_RECYCLE, now=101.0)
    assert worker.restart_at == 101.0 and worker.quick_deaths == 3
    worker.process = _Exited()
    supervisor._schedule_restart(worker, 1, now=102.0)
    assert worker.restart_at is not None and worker.restart_at > 102.0


class _Exited:
    """What the supervisor reads of a worker process that exited."""

    pid = 4242
