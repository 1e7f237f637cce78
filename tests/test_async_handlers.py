"""asyncio handlers: ``async def`` handling methods run to completion on an event loop per
consumer thread (``idembus.runtime.aio``) with exactly the commit and deduplication of a plain
``def``; ``idembus.testing.handle`` and ``handle_async`` run them; ``async with
endpoint.unit_of_work(...)`` does its storage and broker work off the event loop.

The endpoint tests run on memory:// with MemoryStorage and on RabbitMQ with PostgreSQL.
Async code in the tests themselves is driven with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from bench.async_handlers import main as bench_main
from idembus import Endpoint, MessageContext
from idembus.errors import HandlerContractError
from idembus.handlers import AggregateHandler, Handler, HandlerDefinitionError, handles
from idembus.policies import OutboxPolicy
from idembus.runtime.aio import LoopLocal, close_thread_loop, run_to_completion
from idembus.storage.base import Storage
from idembus.storage.errors import AlreadyProcessed, ConcurrencyConflict
from idembus.storage.memory import MemoryStorage
from idembus.storage.postgres import PostgresStorage
from idembus.testing import handle, handle_async, wait_until_idle
from idembus.testing.faults import SimulatedCrash
from idembus.transports.errors import TransportUnavailable
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL, POSTGRES_URL, require_service
from tests.support import Account, Deposit, Deposited, SignalCounter

MakeEndpoint = Callable[..., Endpoint]
MakeStorage = Callable[[], Storage]

#: Long enough for the slowest broker, short enough that a broken test does not hang.
WAIT = 10.0

# -- the two backends ----------------------------------------------------------------------

BACKENDS = [
    pytest.param("memory", id="memory"),
    pytest.param("rabbitmq-postgres", id="rabbitmq-postgres",
                 marks=[pytest.mark.amqp, pytest.mark.postgres]),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    if kind == "rabbitmq-postgres":
        require_service(AMQP_URL, "RabbitMQ")
        require_service(POSTGRES_URL, "PostgreSQL")
    return kind


@pytest.fixture
def transport_url(backend: str) -> str:
    """Overrides conftest's: the broker of this module's backends (make_endpoint uses it)."""
    return "memory://" if backend == "memory" else AMQP_URL


@pytest.fixture
def make_storage(backend: str, unique: str) -> Iterator[MakeStorage]:
    """Fresh storages of the backend; PostgreSQL tables are dropped afterwards (by a
    storage of their own: the endpoints close theirs)."""
    prefixes: list[str] = []

    def make() -> Storage:
        if backend == "memory":
            return MemoryStorage()
        prefixes.append(f"a{unique}_{len(prefixes)}")
        storage = PostgresStorage(POSTGRES_URL, table_prefix=prefixes[-1])
        storage.verify()
        return storage

    yield make
    for prefix in prefixes:
        cleaner = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
        cleaner.drop_tables()
        cleaner.close()


# -- async handlers ------------------------------------------------------------------------


class CardDeclined(Exception):
    """What a handler that fails once raises."""


@dataclass(frozen=True)
class Run:
    """One run of an async handling method, as the method saw it."""

    message_id: str
    thread: str
    loop: asyncio.AbstractEventLoop
    balance_before: int


class AsyncAccounts(AggregateHandler[Account]):
    """``AccountHandler`` as ``async def``: it awaits, changes the state, publishes.

    ``crash_first``: the first run raises a :class:`SimulatedCrash` (the process dies
    before the commit); ``fail_first``: it raises :class:`CardDeclined`; ``meet``: the first
    run of each message waits there until as many runs are waiting (a forced race).
    """

    def __init__(self, *, crash_first: bool = False, fail_first: bool = False,
                 meet: threading.Barrier | None = None) -> None:
        self.crash_first = crash_first
        self.fail_first = fail_first
        self.meet = meet
        self.met: list[bool] = []
        self.runs: list[Run] = []  # shared by the per-message copies the endpoint makes
        self._lock = threading.Lock()

    def aggregate_id(self, message: Deposit) -> str:
        return message.account

    @handles
    async def deposit(self, message: Deposit) -> None:
        before = self.state.balance
        await asyncio.sleep(0)  # a real suspension on the consumer thread's loop
        self.state.balance += message.amount
        self.state.deposits += 1
        self.bus.publish(Deposited(account=message.account, amount=message.amount))
        with self._lock:
            first = all(run.message_id != self.context.message_id for run in self.runs)
            self.runs.append(Run(self.context.message_id, threading.current_thread().name,
                                 asyncio.get_running_loop(), before))
            attempt = len(self.runs)
        if self.meet is not None and first:
            self._wait_for_the_others()
        if attempt == 1 and self.crash_first:
            raise SimulatedCrash("the process dies before the commit (simulated)")
        if attempt == 1 and self.fail_first:
            raise CardDeclined("declined on the first attempt")

    def _wait_for_the_others(self) -> None:
        """Blocks this consumer thread's own loop only: the other racer runs on another."""
        assert self.meet is not None
        try:
            self.meet.wait()
        except threading.BrokenBarrierError:
            self.met.append(False)
        else:
            self.met.append(True)


class AsyncLedger(Handler):
    """A stateless async handler whose effect (an entry) must happen once per event."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()

    @handles
    async def record(self, message: Deposited) -> None:
        await asyncio.sleep(0)
        with self._lock:
            self.entries.append((self.context.message_id, message.account, message.amount))


def new_id() -> str:
    return str(uuid.uuid4())


def first_outgoing_id(endpoint: Endpoint, message_id: str, handler: str = "AsyncAccounts") -> str:
    """The id a handler's first outgoing message must have: uuid5 of (handler, incoming id)."""
    context = MessageContext(message_id=message_id, message_type="test.Deposit", headers={},
                             handler_name=handler, endpoint=endpoint.name)
    return context.outgoing_id(0)


def account(endpoint: Endpoint, name: str) -> Account | None:
    record = endpoint.storage.load("Account", name)
    return Account.model_validate(record.state) if record.exists else None


def accounts_and_ledger(
    make_endpoint: MakeEndpoint, make_storage: MakeStorage, handler: AsyncAccounts,
    **options: Any,
) -> tuple[Endpoint, Endpoint, AsyncLedger]:
    accounts = make_endpoint("accounts", handlers=[handler], storage=make_storage(), **options)
    ledger = AsyncLedger()
    downstream = make_endpoint("ledger", handlers=[ledger], storage=make_storage())
    return accounts, downstream, ledger


# -- on an endpoint ------------------------------------------------------------------------


def test_async_handlers_are_handled_once_and_commit_what_they_record(
    make_storage: MakeStorage, make_endpoint: MakeEndpoint,
) -> None:
    # Given an async aggregate handler whose event an async stateless handler records
    handler = AsyncAccounts()
    accounts, downstream, ledger = accounts_and_ledger(make_endpoint, make_storage, handler)
    recorded = SignalCounter(downstream, "handled")
    accounts.start()
    downstream.start()

    # When a deposit arrives
    deposit_id = accounts.bus.send(Deposit(account="a", amount=5))

    # Then both ran once and what the first published was committed and dispatched
    assert recorded.wait_for(1, WAIT)
    wait_until_idle([accounts, downstream])
    assert [run.message_id for run in handler.runs] == [deposit_id]
    assert account(accounts, "a") == Account(balance=5, deposits=1)
    assert ledger.entries == [(first_outgoing_id(accounts, deposit_id), "a", 5)]
    assert (accounts.counters["handled"], downstream.counters["handled"]) == (1, 1)


def test_a_duplicate_resends_the_stored_messages_with_their_ids_and_does_not_run_again(
    make_storage: MakeStorage, make_endpoint: MakeEndpoint,
) -> None:
    # Given async handlers that handled a deposit (bodies kept after dispatch)
    handler = AsyncAccounts()
    accounts, downstream, ledger = accounts_and_ledger(
        make_endpoint, make_storage, handler, outbox=OutboxPolicy(compact_after_dispatch=False))
    dispatched = SignalCounter(accounts, "dispatched")
    duplicate = SignalCounter(accounts, "duplicate")
    recorded = SignalCounter(downstream, "handled")
    ledger_duplicate = SignalCounter(downstream, "duplicate")
    accounts.start()
    downstream.start()
    deposit_id = new_id()
    accounts.bus.send(Deposit(account="a", amount=5), message_id=deposit_id)
    assert recorded.wait_for(1, WAIT)

    # When the same message is delivered again
    accounts.bus.send(Deposit(account="a", amount=5), message_id=deposit_id)

    # Then the stored Deposited goes out again with its id; no handler runs again
    assert duplicate.wait_for(1, WAIT)
    assert ledger_duplicate.wait_for(1, WAIT)
    wait_until_idle([accounts, downstream])
    expected = first_outgoing_id(accounts, deposit_id)
    assert [d["message_id"] for d in dispatched.details] == [expected, expected]
    assert accounts.counters["redispatched"] == 1
    assert len(handler.runs) == 1
    assert account(accounts, "a") == Account(balance=5, deposits=1)
    assert ledger.entries == [(expected, "a", 5)]


def test_a_crash_before_the_commit_stores_nothing_and_the_redelivery_runs_it_again(
    make_storage: MakeStorage, make_endpoint: MakeEndpoint,
) -> None:
    # Given an async handler whose first run dies after changing state and publishing
    handler = AsyncAccounts(crash_first=True)
    accounts, downstream, ledger = accounts_and_ledger(make_endpoint, make_storage, handler)
    received = SignalCounter(accounts, "received")
    recorded = SignalCounter(downstream, "handled")
    accounts.start()
    downstream.start()

    # When a deposit arrives
    deposit_id = accounts.bus.send(Deposit(account="a", amount=5))

    # Then the broker's redelivery runs the handler again and commits it once
    assert recorded.wait_for(1, WAIT)
    wait_until_idle([accounts, downstream])
    assert received.count == 2, "the crashed delivery must have been delivered again"
    assert [run.message_id for run in handler.runs] == [deposit_id, deposit_id]
    assert handler.runs[1].balance_before == 0, "the crashed run must have stored nothing"
    assert accounts.counters["handled"] == 1
    assert account(accounts, "a") == Account(balance=5, deposits=1)
    assert ledger.entries == [(first_outgoing_id(accounts, deposit_id), "a", 5)]


def test_a_failing_attempt_commits_nothing_and_the_retry_commits_once(
    make_storage: MakeStorage, make_endpoint: MakeEndpoint,
) -> None:
    # Given an async handler that fails its first attempt after recording an event
    handler = AsyncAccounts(fail_first=True)
    accounts, downstream, ledger = accounts_and_ledger(make_endpoint, make_storage, handler)
    failed = SignalCounter(accounts, "failed")
    recorded = SignalCounter(downstream, "handled")
    accounts.start()
    downstream.start()

    # When a deposit arrives
    deposit_id = accounts.bus.send(Deposit(account="a", amount=5))

    # Then the immediate retry commits it, and nothing of the failed attempt remains
    assert recorded.wait_for(1, WAIT)
    wait_until_idle([accounts, downstream])
    assert [type(d["error"]) for d in failed.details] == [CardDeclined]
    assert len(handler.runs) == 2 and handler.runs[1].balance_before == 0
    assert account(accounts, "a") == Account(balance=5, deposits=1)
    assert ledger.entries == [(first_outgoing_id(accounts, deposit_id), "a", 5)]


def test_a_lost_optimistic_race_runs_the_async_method_again_on_fresh_state(
    make_storage: MakeStorage, make_endpoint: MakeEndpoint,
) -> None:
    # Given two consumer threads whose async runs both load the account before either
    # commits (each waits for the other inside the method, blocking only its own loop)
    handler = AsyncAccounts(meet=threading.Barrier(2, timeout=WAIT))
    accounts, downstream, ledger = accounts_and_ledger(
        make_endpoint, make_storage, handler, concurrency=2, prefetch=1)
    conflict = SignalCounter(accounts, "conflict")
    recorded = SignalCounter(downstream, "handled")
    accounts.start()
    downstream.start()

    # When two deposits to one account arrive together
    first = accounts.bus.send(Deposit(account="a", amount=10))
    second = accounts.bus.send(Deposit(account="a", amount=100))

    # Then one commit wins and the loser's method runs again on the winner's state
    assert recorded.wait_for(2, WAIT)
    wait_until_idle([accounts, downstream])
    assert handler.met == [True, True], "both runs must have loaded before either committed"
    assert conflict.count == 1
    assert len(handler.runs) == 3
    loser = handler.runs[2]
    winner_amount = 10 if loser.message_id == second else 100
    assert loser.balance_before == winner_amount
    assert account(accounts, "a") == Account(balance=110, deposits=2)
    assert sorted(entry[2] for entry in ledger.entries) == [10, 100]
    # And the racers ran on two consumer threads, each with its own loop; the re-run on
    # the loser's thread and loop
    racers = handler.runs[:2]
    assert {run.message_id for run in racers} == {first, second}
    assert racers[0].thread != racers[1].thread
    assert racers[0].loop is not racers[1].loop
    (loser_first_run,) = [run for run in racers if run.message_id == loser.message_id]
    assert (loser.thread, loser.loop) == (loser_first_run.thread, loser_first_run.loop)


def test_one_consumer_thread_runs_its_messages_on_one_loop(
    make_storage: MakeStorage, make_endpoint: MakeEndpoint,
) -> None:
    # Given one consumer thread
    handler = AsyncAccounts()
    accounts, downstream, _ = accounts_and_ledger(make_endpoint, make_storage, handler)
    recorded = SignalCounter(downstream, "handled")
    accounts.start()
    downstream.start()

    # When two messages are handled
    accounts.bus.send(Deposit(account="a", amount=1))
    accounts.bus.send(Deposit(account="b", amount=2))

    # Then both saw the same thread and the same loop, which is still open between them
    assert recorded.wait_for(2, WAIT)
    wait_until_idle([accounts, downstream])
    first, second = handler.runs
    assert first.thread == second.thread != threading.current_thread().name
    assert first.loop is second.loop
    assert not first.loop.is_closed()


def test_stopping_the_endpoint_closes_its_consumer_threads_loops_gracefully(
    make_storage: MakeStorage, make_endpoint: MakeEndpoint,
) -> None:
    # Given an async handler holding a loop-local resource that must be closed on its loop
    closed: list[asyncio.AbstractEventLoop] = []

    async def close(loop: asyncio.AbstractEventLoop) -> None:
        closed.append(asyncio.get_running_loop())

    resources = LoopLocal(asyncio.get_running_loop, close=close)

    class UsesResource(Handler):
        @handles
        async def record(self, message: Deposit) -> None:
            resources.get()

    endpoint = make_endpoint("resource", handlers=[UsesResource()], storage=make_storage())
    handled = SignalCounter(endpoint, "handled")
    endpoint.start()
    endpoint.bus.send(Deposit(account="a", amount=1))
    assert handled.wait_for(1, WAIT)

    # When the endpoint stops
    assert endpoint.stop()

    # Then the resource was closed on its loop, and the loop closed
    assert len(closed) == 1
    assert closed[0].is_closed()


# -- idembus.testing -----------------------------------------------------------------------


class SimpleAsyncAccounts(AggregateHandler[Account]):
    """An async aggregate handler that notes the loop it ran on."""

    loops: list[asyncio.AbstractEventLoop] = []

    def aggregate_id(self, message: Deposit) -> str:
        return message.account

    @handles
    async def deposit(self, message: Deposit) -> None:
        await asyncio.sleep(0)
        self.loops.append(asyncio.get_running_loop())
        self.state.balance += message.amount
        self.state.deposits += 1
        self.bus.publish(Deposited(account=message.account, amount=message.amount))


@pytest.fixture
def noted_loops() -> Iterator[list[asyncio.AbstractEventLoop]]:
    SimpleAsyncAccounts.loops = []
    yield SimpleAsyncAccounts.loops


def test_handle_runs_an_async_handler_to_completion_on_a_loop_it_closes(
    noted_loops: list[asyncio.AbstractEventLoop],
) -> None:
    result = handle(SimpleAsyncAccounts, Deposit(account="a", amount=5),
                    state=Account(balance=10, deposits=1))

    assert result.published == [Deposited(account="a", amount=5)]
    assert result.state == Account(balance=15, deposits=2)
    (loop,) = noted_loops
    assert loop.is_closed()


def test_handle_works_inside_a_running_event_loop(
    noted_loops: list[asyncio.AbstractEventLoop],
) -> None:
    async def an_async_test() -> tuple[Any, asyncio.AbstractEventLoop]:
        result = handle(SimpleAsyncAccounts, Deposit(account="a", amount=5))
        return result, asyncio.get_running_loop()

    result, running = asyncio.run(an_async_test())

    assert result.state == Account(balance=5, deposits=1)
    (loop,) = noted_loops
    assert loop is not running and loop.is_closed()


def test_handle_async_lets_the_calling_loop_go_on_while_the_handler_runs() -> None:
    started, released = threading.Event(), threading.Event()

    class Waits(Handler):
        @handles
        async def record(self, message: Deposited) -> None:
            started.set()
            # Blocks its own loop, not the test's: only the test's loop can release it
            assert released.wait(WAIT), "the calling loop was held up"
            self.bus.publish(Deposited(account=message.account, amount=message.amount + 1))

    async def an_async_test() -> Any:
        handled = asyncio.create_task(handle_async(Waits, Deposited(account="a", amount=1)))
        assert await asyncio.to_thread(started.wait, WAIT)
        released.set()  # runs on the test's loop while the handler waits
        return await handled

    result = asyncio.run(an_async_test())

    assert result.published == [Deposited(account="a", amount=2)]


def test_an_async_method_may_await_work_done_in_a_thread() -> None:
    class Offloads(Handler):
        @handles
        async def record(self, message: Deposited) -> None:
            doubled = await asyncio.to_thread(lambda: message.amount * 2)
            self.bus.publish(Deposited(account=message.account, amount=doubled))

    result = handle(Offloads, Deposited(account="a", amount=21))

    assert result.published == [Deposited(account="a", amount=42)]


def test_an_async_method_that_returns_a_value_breaks_the_contract() -> None:
    class Returning(Handler):
        @handles
        async def record(self, message: Deposited) -> Any:
            await asyncio.sleep(0)
            return {"ok": True}

    with pytest.raises(HandlerContractError, match=r"Returning.record returned \{'ok': True\}"):
        handle(Returning, Deposited(account="a", amount=1))


def test_an_async_method_behind_a_decorator_runs() -> None:
    def logged(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*args: Any) -> Any:
            return function(*args)
        return wrapper

    class Wrapped(Handler):
        @handles
        @logged
        async def record(self, message: Deposited) -> None:
            await asyncio.sleep(0)
            self.bus.publish(Deposited(account=message.account, amount=message.amount * 2))

    result = handle(Wrapped, Deposited(account="a", amount=2))

    assert result.published == [Deposited(account="a", amount=4)]


def test_an_async_generator_is_refused_and_async_hooks_still_are() -> None:
    class Generates(Handler):
        @handles
        async def record(self, message: Deposited) -> Any:
            yield None

    class AsyncAddress(AggregateHandler[Account]):
        async def aggregate_id(self, message: Deposit) -> str:  # type: ignore[override]
            return message.account

        @handles
        async def deposit(self, message: Deposit) -> None:
            self.state.balance += message.amount

    with pytest.raises(HandlerDefinitionError, match="Generates.record is an async generator"):
        Endpoint("async-generator", handlers=[Generates], storage=MemoryStorage())
    with pytest.raises(HandlerDefinitionError) as refused:
        Endpoint("async-address", handlers=[AsyncAddress], storage=MemoryStorage())
    assert "AsyncAddress.aggregate_id is 'async def'" in str(refused.value)
    assert "plain 'def'" in str(refused.value)


# -- idembus.runtime.aio ---------------------------------------------------------------------------


def in_a_thread(work: Callable[[], Any]) -> Any:
    """Run ``work`` in a new thread and return (or raise) what it did."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(("returned", work()))
        except BaseException as error:
            outcome.append(("raised", error))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(WAIT)
    ((how, value),) = outcome
    if how == "raised":
        raise value
    return value


async def running_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


def test_close_thread_loop_closes_loop_locals_and_left_tasks_then_a_new_loop_is_made() -> None:
    closed: list[str] = []

    async def close(value: str) -> None:
        closed.append(value)

    names = LoopLocal(lambda: f"value-{len(closed)}", close=close)
    forgotten: list[asyncio.Task[None]] = []

    async def leaves_a_task_behind() -> tuple[asyncio.AbstractEventLoop, str, str]:
        forgotten.append(asyncio.get_running_loop().create_task(asyncio.sleep(3600)))
        return asyncio.get_running_loop(), names.get(), names.get()

    def work() -> tuple[Any, ...]:
        loop, value, again = run_to_completion(leaves_a_task_behind())
        same_loop = run_to_completion(running_loop())
        close_thread_loop()
        was_closed = loop.is_closed()
        new_loop = run_to_completion(running_loop())
        close_thread_loop()
        return loop, value, again, same_loop, was_closed, new_loop

    loop, value, again, same_loop, was_closed, new_loop = in_a_thread(work)

    assert value == again == "value-0"
    assert same_loop is loop and was_closed and new_loop is not loop
    assert closed == ["value-0"]
    assert forgotten[0].cancelled()


def test_loop_locals_are_one_per_loop() -> None:
    made: list[object] = []

    def make() -> object:
        made.append(object())
        return made[-1]

    resources = LoopLocal(make)

    async def get() -> object:
        return resources.get()

    def twice() -> tuple[object, object]:
        try:
            return run_to_completion(get()), run_to_completion(get())
        finally:
            close_thread_loop()

    first, again = in_a_thread(twice)
    other, _ = in_a_thread(twice)

    assert first is again and other is not first and len(made) == 2


def test_a_handler_run_from_inside_a_handler_runs_in_a_helper_thread() -> None:
    async def inner() -> str:
        await asyncio.sleep(0)
        return threading.current_thread().name

    async def outer() -> tuple[str, str]:
        # A synchronous call (as testing.handle would make) on the running loop's thread
        return threading.current_thread().name, run_to_completion(inner())

    def work() -> tuple[str, str]:
        try:
            return run_to_completion(outer())
        finally:
            close_thread_loop()

    caller, helper = in_a_thread(work)

    assert helper != caller and helper.startswith("idembus-async-handler")


def test_what_an_async_method_raises_comes_through_even_from_the_helper_thread() -> None:
    async def crashes() -> None:
        await asyncio.sleep(0)
        raise SimulatedCrash("dies")

    async def from_a_running_loop() -> None:
        run_to_completion(crashes())

    with pytest.raises(SimulatedCrash):
        in_a_thread(lambda: run_to_completion(crashes()))
    with pytest.raises(SimulatedCrash):
        asyncio.run(from_a_running_loop())


def on_a_thread_loop(*coroutines: Callable[[], Coroutine[Any, Any, Any]]) -> list[Any]:
    """Run each coroutine to completion in turn on one new thread's loop, then close it;
    what each returned, or ``("raised", error)``."""

    def work() -> list[Any]:
        results: list[Any] = []
        try:
            for make in coroutines:
                try:
                    results.append(run_to_completion(make()))
                except BaseException as error:
                    results.append(("raised", error))
        finally:
            close_thread_loop()
        return results

    results: list[Any] = in_a_thread(work)
    return results


def test_a_method_that_does_not_wait_runs_in_its_own_task_on_the_running_loop() -> None:
    async def looks_around() -> tuple[Any, ...]:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        return loop, loop.is_running(), task, task.done(), task.get_coro()

    def work() -> tuple[Any, ...]:
        coroutine = looks_around()
        try:
            loop, running, task, done, coro = run_to_completion(coroutine)
            after = (asyncio.events._get_running_loop(), loop.is_running(), task.done())
        finally:
            close_thread_loop()
        return running, done, coro is coroutine, after

    running, done, own_coroutine, after = in_a_thread(work)

    # Inside: the loop runs, and the current task is the method's, not yet done
    assert running and not done and own_coroutine
    # After: no loop runs in the thread any more, and the task is done
    assert after == (None, False, True)


def test_context_variables_reach_a_method_and_what_it_sets_stays_inside() -> None:
    tenant: contextvars.ContextVar[str] = contextvars.ContextVar("tenant")

    async def swaps() -> str:
        seen = tenant.get()
        tenant.set("inside")
        return seen

    def work() -> tuple[str, str, str]:
        tenant.set("outside")
        try:
            seen = run_to_completion(swaps())
            seen_waiting = run_to_completion(waits_then(swaps))
        finally:
            close_thread_loop()
        return seen, seen_waiting, tenant.get()

    assert in_a_thread(work) == ("outside", "outside", "outside")


async def waits_then(then: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    await asyncio.sleep(0)
    return await then()


def test_what_a_method_raises_or_is_cancelled_by_comes_through_and_the_loop_goes_on() -> None:
    async def fails() -> None:
        raise CardDeclined("at once")

    async def crashes() -> None:
        raise SimulatedCrash("at once")

    async def cancels_itself() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(0)

    async def raises_cancelled() -> None:
        raise asyncio.CancelledError()

    results = on_a_thread_loop(fails, crashes, cancels_itself, raises_cancelled, running_loop,
                               lambda: waits_then(running_loop))

    kinds = [type(result[1]) for result in results[:4]]
    assert kinds == [CardDeclined, SimulatedCrash, asyncio.CancelledError,
                     asyncio.CancelledError]
    # And the thread's loop still runs the next methods, waiting or not
    assert isinstance(results[4], asyncio.AbstractEventLoop) and results[5] is results[4]


def test_a_method_that_does_not_wait_takes_no_loop_iteration() -> None:
    # Given a method that leaves a callback on its loop
    ran: list[str] = []

    async def leaves_a_callback() -> None:
        asyncio.get_running_loop().call_soon(ran.append, "callback")

    async def counts() -> int:
        return len(ran)

    # When later methods run on the same loop, first one that does not wait, then one that
    # does
    results = on_a_thread_loop(leaves_a_callback, counts, lambda: waits_then(counts))

    # Then the callback ran only when a method waited on the loop: nothing else turned it
    assert results == [None, 0, 1]


def test_an_async_generator_a_method_leaves_unfinished_is_closed_with_the_loop() -> None:
    closed: list[str] = []
    kept: list[Any] = []

    async def numbers() -> Any:
        try:
            yield 1
            yield 2
        finally:
            closed.append("closed")

    async def takes_one() -> int:
        generator = numbers()
        kept.append(generator)  # alive: only the loop's shutdown may close it
        first: int = await generator.__anext__()
        return first

    async def looks() -> list[str]:
        return list(closed)

    assert on_a_thread_loop(takes_one, looks) == [1, []]
    assert closed == ["closed"]  # by close_thread_loop, on the loop


def test_a_task_factory_set_on_the_loop_makes_the_methods_tasks() -> None:
    made: list[str] = []

    def factory(loop: asyncio.AbstractEventLoop, coroutine: Any, **options: Any) -> Any:
        made.append(coroutine.__qualname__)
        return asyncio.Task(coroutine, loop=loop, **options)

    async def installs() -> None:
        asyncio.get_running_loop().set_task_factory(factory)

    async def current() -> bool:
        return asyncio.current_task() is not None

    results = on_a_thread_loop(installs, current, lambda: waits_then(current))

    assert results == [None, True, True]
    # the methods' tasks (the loop's shutdown made more, with the factory too)
    assert [name.rsplit(".", 1)[-1] for name in made[:2]] == ["current", "waits_then"]


class MarkedLoop(asyncio.SelectorEventLoop):
    """The loop of an event loop policy the application installed."""


class MarkedPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return MarkedLoop()


def test_under_another_event_loop_policy_methods_run_on_its_loops() -> None:
    before = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(MarkedPolicy())
    try:
        results = on_a_thread_loop(running_loop, lambda: waits_then(running_loop))
    finally:
        asyncio.set_event_loop_policy(before)

    assert isinstance(results[0], MarkedLoop) and results[1] is results[0]


# -- async with endpoint.unit_of_work ------------------------------------------------------


def test_an_async_unit_of_work_commits_then_dispatches(
    make_storage: MakeStorage, make_endpoint: MakeEndpoint,
) -> None:
    # Given accounts (not consuming) and a running ledger subscribed to Deposited
    accounts = make_endpoint("accounts", handlers=[AsyncAccounts()], storage=make_storage())
    ledger = AsyncLedger()
    downstream = make_endpoint("ledger", handlers=[ledger], storage=make_storage())
    recorded = SignalCounter(downstream, "handled")
    downstream.start()

    # When an async web request deposits through a unit of work
    async def request() -> str:
        async with accounts.unit_of_work(Account, "a", operation_id="req-1") as work:
            work.state.balance += 5
            work.state.deposits += 1
            return work.bus.publish(Deposited(account="a", amount=5))

    event_id = asyncio.run(request())

    # Then the state is stored and the event went out with its derived id
    assert account(accounts, "a") == Account(balance=5, deposits=1)
    assert event_id == MessageContext("req-1", "unit-of-work", {}, "unit-of-work",
                                      accounts.name).outgoing_id(0)
    assert recorded.wait_for(1, WAIT)
    assert ledger.entries == [(event_id, "a", 5)]


def test_an_exception_inside_an_async_unit_of_work_writes_and_sends_nothing(
    make_storage: MakeStorage, make_endpoint: MakeEndpoint,
) -> None:
    accounts = make_endpoint("accounts", handlers=[AsyncAccounts()], storage=make_storage())
    downstream = make_endpoint("ledger", handlers=[AsyncLedger()], storage=make_storage())
    downstream.transport.declare(downstream.name, subscriptions=downstream.subscriptions)

    async def request() -> None:
        async with accounts.unit_of_work(Account, "a") as work:
            work.state.balance = 100
            work.bus.publish(Deposited(account="a", amount=100))
            raise LookupError("the request was invalid")

    with pytest.raises(LookupError):
        asyncio.run(request())

    assert account(accounts, "a") is None
    assert accounts.transport.pending(downstream.name) == 0


def test_a_retried_async_operation_resends_what_it_stored_and_raises_already_processed(
    make_storage: MakeStorage, make_endpoint: MakeEndpoint, make_transport: Callable[..., Any],
    transport_url: str,
) -> None:
    # Given a transport whose publishes fail (the broker is away)
    class Away(KombuTransport):
        away = True

        def publish(self, envelope: Any) -> None:
            if self.away:
                raise TransportUnavailable("the broker is away (simulated)")
            super().publish(envelope)

    transport = Away(transport_url, exchange=make_transport().exchange_name)
    accounts = make_endpoint("accounts", handlers=[AsyncAccounts()], transport=transport,
                             storage=make_storage())
    ledger = AsyncLedger()
    downstream = make_endpoint("ledger", handlers=[ledger], storage=make_storage())
    recorded = SignalCounter(downstream, "handled")
    downstream.start()
    operation = new_id()

    async def request() -> str:
        async with accounts.unit_of_work(Account, "a", operation_id=operation) as work:
            work.state.balance += 5
            return work.bus.publish(Deposited(account="a", amount=5))

    # When an operation commits but cannot send its event, and is retried
    event_id = asyncio.run(request())
    assert accounts.transport.pending(downstream.name) == 0
    transport.away = False
    with pytest.raises(AlreadyProcessed):
        asyncio.run(request())

    # Then the retry sent the stored event, with its id, and changed nothing
    assert recorded.wait_for(1, WAIT)
    assert ledger.entries == [(event_id, "a", 5)]
    assert account(accounts, "a") == Account(balance=5, deposits=0)


def test_a_concurrent_change_makes_the_async_exit_raise_a_conflict(
    make_storage: MakeStorage, make_endpoint: MakeEndpoint,
) -> None:
    accounts = make_endpoint("accounts", handlers=[AsyncAccounts()], storage=make_storage())

    async def two_requests() -> None:
        async with accounts.unit_of_work(Account, "a") as first:
            async with accounts.unit_of_work(Account, "a") as second:
                second.state.balance = 1
            first.state.balance = 2

    with pytest.raises(ConcurrencyConflict):
        asyncio.run(two_requests())

    assert account(accounts, "a") == Account(balance=1)


class ThreadNoting(MemoryStorage):
    """A MemoryStorage that notes which thread loads and commits."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def load(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        return super().load(*args, **kwargs)

    def commit(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        return super().commit(*args, **kwargs)


def test_an_async_unit_of_work_keeps_storage_work_off_the_event_loop() -> None:
    storage = ThreadNoting()
    accounts = Endpoint("uow-threads", handlers=[AsyncAccounts()], storage=storage)

    async def request() -> str:
        async with accounts.unit_of_work(Account, "a") as work:
            work.state.balance = 3
        return threading.current_thread().name

    try:
        loop_thread = asyncio.run(request())
    finally:
        accounts.close()

    assert len(storage.threads) == 2
    assert loop_thread not in storage.threads


# -- the benchmark -------------------------------------------------------------------------


def test_the_benchmark_runs_at_a_reduced_size(
    tmp_path: Any, capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench_main(["--transports", "memory", "--messages", "30", "--rounds", "1",
                 "--json", str(tmp_path / "async_handlers.json")]) == 0

    summary = capsys.readouterr().out.splitlines()
    (line,) = [text for text in summary if text.startswith("async_handlers: memory+memory")]
    assert "sync=" in line and "async=" in line and "ratio_async=" in line
    assert (tmp_path / "async_handlers.json").exists()
