"""``Transport.depth(queue)``: what each broker or database can tell of a queue now, and
``None`` for what it cannot — shown as "–" by ``idembus status`` and the dashboard, never
as an error."""

from __future__ import annotations

import datetime
import threading

import pytest

from idembus import headers as h
from idembus.envelope import Envelope, format_utc, utc_now
from idembus.runtime.status import queue_depth
from idembus.transports.base import Delivery, QueueDepth
from idembus.transports.errors import TransportUnavailable
from tests.conftest import ALL_TRANSPORT_URLS, required_transport
from tests.support import DrivenTransport

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=ALL_TRANSPORT_URLS)
def transport_url(request: pytest.FixtureRequest) -> str:
    return required_transport(request.param)


def envelope(queue: str, number: int, **headers: str) -> Envelope:
    return Envelope(headers={h.MESSAGE_ID: f"m-{number}", h.MESSAGE_TYPE: "test.Deposit",
                             h.TIME_SENT: format_utc(utc_now()), **headers},
                    body='{"account": "a", "amount": 1}', destination=queue)


def test_depth_counts_ready_held_and_delayed_messages_and_consumers_where_it_can(
    make_transport, queue_name, transport_url: str
) -> None:
    # Given a queue with three messages, and on a database one more due in an hour
    transport = make_transport()
    queue = queue_name("depth")
    transport.declare(queue)
    for number in range(3):
        transport.send(envelope(queue, number))
    in_database = not transport_url.startswith(("memory", "amqp", "redis"))
    if in_database:
        later = utc_now() + datetime.timedelta(hours=1)
        transport.send(envelope(queue, 9, **{h.DELIVER_AT: format_utc(later)}))
    assert transport.depth(queue).ready == 3

    # When a consumer holds one of them, unacknowledged
    held, release, stop = threading.Event(), threading.Event(), threading.Event()

    def hold(delivery: Delivery) -> None:
        held.set()
        release.wait(30)
        delivery.ack()

    consumer = threading.Thread(target=transport.consume, args=(queue, hold),
                                kwargs={"stop": stop}, daemon=True)
    consumer.start()
    try:
        assert held.wait(15)
        depth = transport.depth(queue)
    finally:
        release.set()
        stop.set()
        consumer.join(15)

    # Then two are ready; RabbitMQ tells its consumers, a database its leased and delayed
    # messages and how long the oldest ready one has waited; what one cannot tell is None
    assert depth.ready == 2
    if transport_url.startswith("amqp"):
        assert depth.consumers == 1
        assert (depth.unacked, depth.delayed, depth.oldest_seconds) == (None, None, None)
    elif in_database:
        assert (depth.unacked, depth.delayed, depth.consumers) == (1, 1, None)
        assert depth.oldest_seconds is not None and 0 <= depth.oldest_seconds < 60
    else:  # memory://, redis://: kombu's virtual queues count their messages only
        assert (depth.unacked, depth.delayed, depth.consumers,
                depth.oldest_seconds) == (None, None, None, None)


def test_a_queue_nobody_declared_has_nothing_ready(make_transport, queue_name) -> None:
    transport = make_transport()
    transport.declare(queue_name("somebody"))  # a database's tables exist then
    assert transport.depth(queue_name("nobody")).ready == 0


class KnowsLittle(DrivenTransport):
    """A transport that implements only the contract's ``pending``, not ``depth``."""

    def send(self, envelope: Envelope) -> None:
        pass

    def publish(self, envelope: Envelope) -> bool | None:
        return None


class Unreachable(KnowsLittle):
    """A broker that cannot be reached, whose error names the URL with its password."""

    def pending(self, queue: str) -> int:
        raise TransportUnavailable("connection refused: amqp://shop:hunter2@rabbit:5672/")


def test_a_transport_that_cannot_tell_says_why_without_raising_or_leaking_secrets() -> None:
    # Given a transport that only knows pending(), and one that cannot reach its broker
    knows_little = KnowsLittle()
    # When the status reads their depth
    little = queue_depth(knows_little, "orders")
    failing = queue_depth(Unreachable(), "orders")
    local = queue_depth(knows_little, "orders", visible=False)
    # Then the first tells what it can (None for the rest), the second why it cannot,
    # without the password, and a process-local one is not asked
    assert little == {"queue": "orders", "ready": 0, "unacked": None, "delayed": None,
                      "consumers": None, "oldest_seconds": None, "unknown": None}
    assert failing["ready"] is None and "connection refused" in failing["unknown"]
    assert "hunter2" not in failing["unknown"]
    assert local["ready"] is None and "process-local" in local["unknown"]
    assert QueueDepth() == QueueDepth(None, None, None, None, None)
