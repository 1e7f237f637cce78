"""bus.request: awaited replies, committed with the responder's state (README, "Requests").

Each test runs on memory:// and on RabbitMQ (the ``transport_url`` fixture); the RabbitMQ
ones that need a database use PostgreSQL in tests/test_requests_services.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from idembus import (
    Command,
    Endpoint,
    Event,
    Recoverability,
    RequestFailed,
    RequestTimeout,
    RetryPolicy,
    RoutingError,
)
from idembus import headers as h
from idembus.errors import HandlerContractError
from idembus.handlers import Handler, handles
from idembus.testing.faults import CrashPoint, FaultInjector, SimulatedCrash
from tests.conftest import AMQP_URL

pytestmark = pytest.mark.parametrize(
    "transport_url", [pytest.param("memory://", id="memory"),
                      pytest.param(AMQP_URL, id="amqp", marks=pytest.mark.amqp)],
    indirect=True)

NO_RETRIES = Recoverability(retries=RetryPolicy(immediate_retries=0, delayed=()))


class GetQuote(Command, message_name="requests.GetQuote"):
    item: str
    quantity: int = 1


class Quote(Event, message_name="requests.Quote"):
    item: str
    price: int


class Quotes(Handler):
    """Answers every GetQuote; counts how often it really ran, per request id."""

    def __init__(self) -> None:
        self.runs: dict[str, int] = {}
        self.lock = threading.Lock()

    @handles
    def quote(self, message: GetQuote) -> None:
        with self.lock:
            self.runs[self.context.message_id] = self.runs.get(self.context.message_id, 0) + 1
        if message.item == "unobtainium":
            raise ValueError(f"no price for {message.item}")
        self.bus.reply(Quote(item=message.item, price=7 * message.quantity))


@pytest.fixture
def quoting(make_endpoint: Callable[..., Endpoint]) -> tuple[Endpoint, Endpoint, Quotes]:
    """A started responder ``pricing`` and a started ``shop`` routing GetQuote to it."""
    quotes = Quotes()
    pricing = make_endpoint("pricing", handlers=[quotes], recoverability=NO_RETRIES,
                            concurrency=4)
    shop = make_endpoint("shop", routes={GetQuote: pricing.name})
    pricing.start()
    shop.start()
    return shop, pricing, quotes


def test_a_request_returns_the_reply_its_handler_sent(quoting):
    shop, _, _ = quoting
    reply = shop.bus.request(GetQuote(item="tea", quantity=3), timeout=10)
    assert reply == Quote(item="tea", price=21)


def test_expect_reads_the_reply_as_the_given_class(quoting):
    shop, _, _ = quoting
    reply = shop.bus.request(GetQuote(item="tea"), timeout=10, expect=Quote)
    assert isinstance(reply, Quote) and reply.price == 7


def test_a_request_sent_again_with_its_id_gets_the_stored_reply_and_the_handler_runs_once(
        quoting):
    shop, _, quotes = quoting
    request_id = str(uuid.uuid4())
    first = shop.bus.request(GetQuote(item="tea"), timeout=10, message_id=request_id)
    # When the same request comes again (a client's retry), its entry is found processed:
    again = shop.bus.request(GetQuote(item="tea", quantity=99), timeout=10,
                             message_id=request_id)
    # Then the stored reply comes back, and the handler ran only the first time.
    assert again == first == Quote(item="tea", price=7)
    assert quotes.runs[request_id] == 1


def test_the_same_request_sent_again_from_another_process_gets_the_stored_reply_there(
        quoting, make_endpoint):
    shop, pricing, quotes = quoting
    request_id = str(uuid.uuid4())
    first = shop.bus.request(GetQuote(item="tea"), timeout=10, message_id=request_id)
    # When another process (its own endpoint object, its own reply queue) retries it:
    other = make_endpoint("shop", routes={GetQuote: pricing.name}, send_only=True)
    other.start()
    again = other.bus.request(GetQuote(item="tea"), timeout=10, message_id=request_id)
    # Then the stored reply comes to that process's reply queue; the handler ran once.
    assert again == first
    assert quotes.runs == {request_id: 1}
    assert other._assembly.requests.queue != shop._assembly.requests.queue


def test_a_request_whose_handler_failed_for_good_gets_the_failure_not_the_timeout(quoting):
    shop, _, _ = quoting
    started = time.monotonic()
    with pytest.raises(RequestFailed) as failed:
        shop.bus.request(GetQuote(item="unobtainium"), timeout=30)
    assert time.monotonic() - started < 15
    assert failed.value.exception_type == "builtins.ValueError"
    assert failed.value.reason == "no price for unobtainium"


def test_no_reply_in_time_raises_request_timeout(make_endpoint):
    silent = make_endpoint("silent", handlers=[Silent()])
    shop = make_endpoint("shop", routes={GetQuote: silent.name})
    silent.start()
    with pytest.raises(RequestTimeout) as timed_out:
        shop.bus.request(GetQuote(item="tea"), timeout=0.5)
    assert isinstance(timed_out.value, TimeoutError)
    assert "within 0.5s" in str(timed_out.value)


class Silent(Handler):
    @handles
    def ignore(self, message: GetQuote) -> None:
        """Never replies."""


def test_a_request_can_be_awaited(quoting):
    shop, _, _ = quoting

    async def ask() -> list[object]:
        return list(await asyncio.gather(*(
            shop.bus.request_async(GetQuote(item=f"i{n}", quantity=n), timeout=20)
            for n in range(20))))

    replies = asyncio.run(ask())
    assert replies == [Quote(item=f"i{n}", price=7 * n) for n in range(20)]


@pytest.mark.timeout(300)
def test_a_thousand_concurrent_requests_from_one_process_are_all_answered(quoting):
    shop, _, quotes = quoting

    async def ask() -> list[object]:
        return list(await asyncio.gather(*(
            shop.bus.request_async(GetQuote(item=f"i{n}", quantity=n), timeout=120)
            for n in range(1000))))

    started = time.monotonic()
    replies = asyncio.run(ask())
    elapsed = time.monotonic() - started
    assert replies == [Quote(item=f"i{n}", price=7 * n) for n in range(1000)]
    assert len(quotes.runs) == 1000
    print(f"1000 concurrent requests answered in {elapsed:.2f}s")


def test_threads_wait_for_their_own_replies(quoting):
    shop, _, _ = quoting
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(
            lambda n: shop.bus.request(GetQuote(item="t", quantity=n), timeout=30), range(50)))
    assert [reply.price for reply in replies] == [7 * n for n in range(50)]  # type: ignore


class CrashOnceAfterCommit(FaultInjector):
    """The responder dies once, right after committing its reply and before sending it."""

    def __init__(self) -> None:
        self.crashed = threading.Event()

    def reached(self, point: CrashPoint, message_id: str) -> None:
        if point is CrashPoint.AFTER_COMMIT and not self.crashed.is_set():
            self.crashed.set()
            raise SimulatedCrash(f"killed after committing {message_id}")


def test_a_responder_killed_after_its_commit_still_answers_after_the_redelivery(
        make_endpoint):
    quotes, crash = Quotes(), CrashOnceAfterCommit()
    pricing = make_endpoint("pricing", handlers=[quotes], middleware=[crash])
    shop = make_endpoint("shop", routes={GetQuote: pricing.name})
    pricing.start()
    reply = shop.bus.request(GetQuote(item="tea"), timeout=30)
    assert crash.crashed.is_set()
    assert reply == Quote(item="tea", price=7)
    assert list(quotes.runs.values()) == [1]  # redelivered, found committed: not run again


class Asks(Handler):
    """Handles Restock by asking pricing for a quote, from inside its unit of work."""

    def __init__(self) -> None:
        self.prices: list[int] = []

    @handles
    def restock(self, message: Restock) -> None:
        quote = self.bus.request(GetQuote(item=message.item), timeout=20, expect=Quote)
        self.prices.append(quote.price)


class Restock(Command, message_name="requests.Restock"):
    item: str


def test_a_handler_may_wait_for_a_reply_from_another_endpoint(quoting, make_endpoint):
    _, pricing, _ = quoting
    asks = Asks()
    stock = make_endpoint("stock", handlers=[asks], routes={GetQuote: pricing.name})
    stock.start()
    stock.bus.send(Restock(item="tea"))
    deadline = time.monotonic() + 20
    while not asks.prices and time.monotonic() < deadline:
        stock.wait_for_activity(0.2)
    assert asks.prices == [7]


class AsksAsync(Handler):
    """Asks from an ``async def`` handling method, on its consumer thread's loop."""

    def __init__(self) -> None:
        self.prices: list[int] = []

    @handles
    async def restock(self, message: Restock) -> None:
        quote = await self.bus.request_async(GetQuote(item=message.item, quantity=2),
                                             timeout=20, expect=Quote)
        self.prices.append(quote.price)


def test_an_async_handler_may_await_a_reply_from_another_endpoint(quoting, make_endpoint):
    _, pricing, _ = quoting
    asks = AsksAsync()
    stock = make_endpoint("stock", handlers=[asks], routes={GetQuote: pricing.name})
    stock.start()
    stock.bus.send(Restock(item="tea"))
    deadline = time.monotonic() + 20
    while not asks.prices and time.monotonic() < deadline:
        stock.wait_for_activity(0.2)
    assert asks.prices == [14]


class AsksItself(Handler):
    @handles
    def restock(self, message: Restock) -> None:
        self.bus.request(GetQuote(item=message.item), timeout=5)

    @handles
    def quote(self, message: GetQuote) -> None:
        self.bus.reply(Quote(item=message.item, price=1))


def test_a_handler_waiting_for_its_own_endpoint_is_refused_with_the_reason(make_endpoint):
    stock = make_endpoint("stock", handlers=[AsksItself()], recoverability=NO_RETRIES)
    stock.start()
    message_id = stock.bus.send(Restock(item="tea"))
    copy = _wait_for(lambda: stock.transport.get(stock.error_queue))
    assert copy.headers[h.MESSAGE_ID] == message_id
    assert copy.headers[h.EXCEPTION_TYPE] == (
        f"{HandlerContractError.__module__}.{HandlerContractError.__qualname__}")
    assert "cannot wait for a reply from" in copy.headers[h.EXCEPTION_MESSAGE]


def test_request_takes_commands_only_and_needs_a_bus_that_can_wait(quoting):
    shop, _, _ = quoting
    with pytest.raises(TypeError, match="takes a Command"):
        shop.bus.request(Quote(item="x", price=1), timeout=1)  # type: ignore[arg-type]
    from idembus import Bus
    from idembus.routing import Router

    with pytest.raises(RoutingError, match="cannot wait for replies"):
        Bus("x", Router({GetQuote: "y"}), lambda envelope: None).request(GetQuote(item="t"))


def test_closing_the_endpoint_ends_the_wait_and_deletes_the_reply_queue(make_endpoint):
    silent = make_endpoint("silent", handlers=[Silent()])
    shop = make_endpoint("shop", routes={GetQuote: silent.name})
    silent.start()
    failures: list[BaseException] = []

    def ask() -> None:
        try:
            shop.bus.request(GetQuote(item="tea"), timeout=60)
        except BaseException as error:
            failures.append(error)

    asker = threading.Thread(target=ask)
    asker.start()
    requests = shop._assembly.requests
    _wait_for(lambda: requests.waiting or None)
    queue = requests.queue
    shop.close()
    asker.join(10)
    assert len(failures) == 1 and isinstance(failures[0], RequestTimeout)
    assert "closed" in str(failures[0])
    assert not _queue_exists(silent, queue)


def _queue_exists(endpoint: Endpoint, queue: str) -> bool:
    """Whether ``queue`` exists on the endpoint's broker (a passive declare: RabbitMQ
    answers NOT_FOUND, or RESOURCE_LOCKED for a queue exclusive to another connection)."""
    transport = endpoint.transport
    with transport._channel() as channel:  # type: ignore[attr-defined]
        try:
            channel.queue_declare(queue=queue, passive=True)
        except Exception as error:
            if "locked" in str(error).lower():
                return True
            return False
    return True


@contextlib.contextmanager
def requester_process(script: str, *args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Run ``script`` (which prints its reply queue, then waits for a reply) in a process of
    its own, from the repository's root; yield the process and that queue's name. Killed
    (SIGKILL) at the end if it still runs."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    process = subprocess.Popen([sys.executable, "-c", script, *args], cwd=root,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        yield process, process.stdout.readline().strip()
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(30)
        if process.stdout is not None:
            process.stdout.close()


def _wait_for(probe: Callable[[], object], timeout: float = 20.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(0.02)
    raise AssertionError(f"nothing came within {timeout}s")
