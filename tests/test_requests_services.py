"""bus.request on RabbitMQ with the responder's state in PostgreSQL: the stored reply of a
request sent again, a responder killed between commit and dispatch, a requester killed
while it waits, a thousand requests at once."""

from __future__ import annotations

import asyncio
import signal
import textwrap
import threading
import time
import uuid
from collections.abc import Callable

import pytest

from idembus import Endpoint
from idembus.handlers import handles
from idembus.storage.base import ParkingStore
from tests.conftest import AMQP_URL
from tests.test_requests import (
    CrashOnceAfterCommit,
    GetQuote,
    Quote,
    Quotes,
    _queue_exists,
    requester_process,
)

pytestmark = [
    pytest.mark.amqp, pytest.mark.postgres,
    pytest.mark.parametrize("transport_url", [pytest.param(AMQP_URL, id="amqp")],
                            indirect=True),
]


def test_a_request_sent_again_gets_the_reply_stored_in_postgresql(make_endpoint,
                                                                  postgres_storage):
    quotes = Quotes()
    pricing = make_endpoint("pricing", handlers=[quotes], storage=postgres_storage)
    shop = make_endpoint("shop", routes={GetQuote: pricing.name})
    pricing.start()
    request_id = str(uuid.uuid4())
    first = shop.bus.request(GetQuote(item="tea", quantity=2), timeout=20,
                             message_id=request_id)
    # Given the reply was sent and its entry marked dispatched (bodies are compacted then,
    # except an awaited reply's), when the client sends the same request again, from this
    # process and then from another one (another reply queue):
    again = shop.bus.request(GetQuote(item="tea", quantity=5), timeout=20,
                             message_id=request_id)
    other = make_endpoint("shop", routes={GetQuote: pricing.name}, send_only=True)
    elsewhere = other.bus.request(GetQuote(item="tea"), timeout=20, message_id=request_id)
    assert first == again == elsewhere == Quote(item="tea", price=14)
    assert quotes.runs == {request_id: 1}
    assert pricing.counters.snapshot()["duplicate"] == 2


def test_a_responder_killed_after_committing_its_reply_answers_after_redelivery(
        make_endpoint, postgres_storage):
    quotes, crash = Quotes(), CrashOnceAfterCommit()
    pricing = make_endpoint("pricing", handlers=[quotes], storage=postgres_storage,
                            middleware=[crash])
    shop = make_endpoint("shop", routes={GetQuote: pricing.name})
    pricing.start()
    reply = shop.bus.request(GetQuote(item="tea"), timeout=30)
    assert crash.crashed.is_set()
    assert reply == Quote(item="tea", price=7)
    assert list(quotes.runs.values()) == [1]


_REQUESTER = textwrap.dedent("""
    import sys
    from idembus import Endpoint
    from tests.test_requests import GetQuote

    url, destination = sys.argv[1], sys.argv[2]
    asker = Endpoint("asker-" + destination, transport=url, send_only=True,
                     routes={GetQuote: destination})
    print(asker._assembly.requests.reply_queue(), flush=True)
    asker.bus.request(GetQuote(item="tea"), timeout=120)
""")


class Held(Quotes):
    """Replies only once the test lets it; tells when the request arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived = threading.Event()
        self.release = threading.Event()

    @handles
    def quote(self, message: GetQuote) -> None:
        self.arrived.set()
        self.release.wait(60)
        super().quote(message)


@pytest.mark.timeout(180)
def test_a_requester_killed_while_waiting_leaves_no_queue_and_its_reply_is_dropped(
        make_endpoint, postgres_storage):
    held = Held()
    pricing = make_endpoint("pricing", handlers=[held], storage=postgres_storage)
    pricing.start()
    with requester_process(_REQUESTER, AMQP_URL, pricing.name) as (requester, queue):
        assert queue.startswith("asker-") and _queue_exists(pricing, queue)
        assert held.arrived.wait(60)
        # When the requester dies while it waits (SIGKILL: no clean-up of its own):
        requester.send_signal(signal.SIGKILL)
        requester.wait(30)
    # Then the broker deletes its reply queue (exclusive, auto-delete) ...
    deadline = time.monotonic() + 30
    while _queue_exists(pricing, queue) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _queue_exists(pricing, queue)
    # ... and the reply, committed afterwards, is dropped: not parked, not retried.
    held.release.set()
    deadline = time.monotonic() + 30
    while pricing.counters.snapshot()["handled"] < 1 and time.monotonic() < deadline:
        pricing.wait_for_activity(0.2)
    assert _settled(pricing)
    assert pricing.counters.snapshot()["handled"] == 1
    assert pricing.storage_as(ParkingStore).parked_messages(pricing.name) == []


def _settled(endpoint: Endpoint, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not endpoint.is_idle() and time.monotonic() < deadline:
        endpoint.wait_for_activity(0.2)
    return endpoint.is_idle()


@pytest.mark.timeout(300)
def test_a_thousand_concurrent_requests_are_all_answered(make_endpoint: Callable[..., Endpoint],
                                                         postgres_storage):
    quotes = Quotes()
    pricing = make_endpoint("pricing", handlers=[quotes], storage=postgres_storage,
                            concurrency=4)
    shop = make_endpoint("shop", routes={GetQuote: pricing.name})
    pricing.start()

    async def ask() -> list[object]:
        return list(await asyncio.gather(*(
            shop.bus.request_async(GetQuote(item=f"i{n}", quantity=n), timeout=200)
            for n in range(1000))))

    started = time.monotonic()
    replies = asyncio.run(ask())
    print(f"1000 concurrent requests (RabbitMQ, PostgreSQL) answered in "
          f"{time.monotonic() - started:.2f}s")
    assert replies == [Quote(item=f"i{n}", price=7 * n) for n in range(1000)]
    assert len(quotes.runs) == 1000 and set(quotes.runs.values()) == {1}
