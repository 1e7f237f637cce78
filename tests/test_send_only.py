"""Send-only endpoints (``Endpoint(name, send_only=True)``) and sends through the outbox
keyed only by an operation id (``endpoint.outbox(operation_id=...)``): no queue, no
consumer, no handlers; committed sends deduplicated by the operation id and repaired by the
outbox after a crash between commit and dispatch."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable, Collection
from typing import Any

import kombu
import pytest

from idembus import Command, Endpoint
from idembus.errors import ConfigurationError
from idembus.handlers import Handler, handles
from idembus.policies import OutboxPolicy
from idembus.schedules import Schedule
from idembus.testing.faults import SimulatedCrash
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL
from tests.support import SignalCounter


class PlaceOrder(Command, message_name="test.SendOnlyPlaceOrder"):
    order_id: str


class Orders(Handler):
    """Downstream: records the id of every PlaceOrder it handles (once per message)."""

    def __init__(self) -> None:
        self.placed: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    @handles
    def place(self, message: PlaceOrder) -> None:
        with self._lock:
            self.placed.append((self.context.message_id, message.order_id))


class Declaring(KombuTransport):
    """A kombu transport that notes every queue declared through it."""

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self.declared: list[str] = []

    def declare(self, queue: str, *, subscriptions: Collection[str] = ()) -> None:
        self.declared.append(queue)
        super().declare(queue, subscriptions=subscriptions)


def storefront_and_orders(make_endpoint: Callable[..., Endpoint], **options: Any,
                          ) -> tuple[Endpoint, Endpoint, Orders]:
    orders = Orders()
    downstream = make_endpoint("orders", handlers=[orders])
    storefront = make_endpoint("storefront", send_only=True,
                               routes={PlaceOrder: downstream.name}, **options)
    return storefront, downstream, orders


def queue_exists(url: str, queue: str) -> bool:
    with kombu.Connection(url) as connection:
        try:
            connection.default_channel.queue_declare(queue=queue, passive=True)
        except connection.channel_errors:
            return False
    return True


def test_a_send_only_endpoint_declares_no_queue_and_starts_no_consumer(
    make_endpoint, make_transport, transport_url
):
    # Before send_only existed, Endpoint() refused the keyword (TypeError).
    transport = Declaring(transport_url, exchange=make_transport().exchange_name)
    storefront = make_endpoint("storefront", send_only=True, transport=transport,
                               outbox=OutboxPolicy(grace=0))
    storefront.start()

    assert transport.declared == []
    assert storefront.running and storefront.is_idle()
    threads = [t.name for t in threading.enumerate()]
    assert f"idembus-{storefront.name}-outbox" in threads
    assert not [n for n in threads if re.fullmatch(rf"idembus-{storefront.name}-\d+", n)]
    assert storefront._assembly.status is None and storefront._assembly.processor is None
    if transport_url.startswith("amqp"):
        assert not queue_exists(transport_url, storefront.name)
    with pytest.raises(ConfigurationError, match="send-only"):
        storefront.reject(None, "no queue")  # type: ignore[arg-type]
    assert storefront.stop(5)
    assert not storefront.running


def test_handlers_or_schedules_given_to_a_send_only_endpoint_are_a_configuration_error():
    with pytest.raises(ConfigurationError, match="send-only: it has no queue"):
        Endpoint("storefront", send_only=True, handlers=[Orders])
    with pytest.raises(ConfigurationError, match="send-only: it runs no scheduler"):
        Endpoint("storefront", send_only=True, routes={PlaceOrder: "orders"},
                 schedules=[Schedule("tick", "* * * * *", PlaceOrder(order_id="t"))])


def test_the_same_operation_id_sends_one_message_downstream(make_endpoint, storage_factory):
    # Given a running send-only storefront and a running orders endpoint
    storefront, downstream, orders = storefront_and_orders(make_endpoint,
                                                            storage=storage_factory())
    handled = SignalCounter(downstream, "handled")
    downstream.start()
    storefront.start()

    # When the same request is sent twice through the outbox
    with storefront.outbox(operation_id="request-1") as first:
        sent = first.bus.send(PlaceOrder(order_id="o-1"))
    with storefront.outbox(operation_id="request-1") as again:
        again.bus.send(PlaceOrder(order_id="o-1"))

    # Then the order is placed once: the retry committed nothing new (what it sent again,
    # if the storage kept it, has the first one's id: a duplicate downstream)
    assert not first.duplicate and again.duplicate
    assert handled.wait_for(1)
    assert downstream.stop(10)
    assert orders.placed == [(sent, "o-1")]
    leftover = downstream.transport.get(downstream.name)
    assert leftover is None or leftover.headers["idembus.message_id"] == sent


def test_an_exception_inside_the_block_writes_and_sends_nothing(make_endpoint):
    storefront, downstream, _ = storefront_and_orders(make_endpoint)
    downstream.transport.declare(downstream.name)
    with pytest.raises(LookupError):
        with storefront.outbox(operation_id="request-2") as work:
            work.bus.send(PlaceOrder(order_id="o-2"))
            raise LookupError("the request was invalid")
    assert storefront.transport.pending(downstream.name) == 0
    with storefront.outbox(operation_id="request-2") as work:  # not a duplicate: not stored
        work.bus.send(PlaceOrder(order_id="o-2"))
    assert not work.duplicate
    assert storefront.transport.pending(downstream.name) == 1


def crashed_after_commit(storefront: Endpoint, operation_id: str, order_id: str,
                         monkeypatch: pytest.MonkeyPatch) -> str:
    """Send through the outbox as a process killed right after the commit does."""

    def crash(*args: Any, **options: Any) -> None:
        raise SimulatedCrash("killed between commit and dispatch")

    monkeypatch.setattr(storefront.dispatcher, "send_committed", crash)
    with pytest.raises(SimulatedCrash):
        with storefront.outbox(operation_id=operation_id) as work:
            sent = work.bus.send(PlaceOrder(order_id=order_id))
    monkeypatch.undo()
    return sent


def test_a_crash_between_commit_and_dispatch_is_sent_once_by_the_outbox(
    make_endpoint, storage_factory, monkeypatch
):
    # Given a send-only storefront whose process "died" right after its commit
    storefront, downstream, orders = storefront_and_orders(
        make_endpoint, storage=storage_factory(), outbox=OutboxPolicy(grace=0))
    handled = SignalCounter(downstream, "handled")
    downstream.start()
    sent = crashed_after_commit(storefront, "request-3", "o-3", monkeypatch)
    assert downstream.transport.pending(downstream.name) == 0

    # When the storefront starts again (its outbox relay runs)
    storefront.start()
    storefront.outbox.wake()

    # Then the committed message goes out once, with the id the block gave it
    assert handled.wait_for(1)
    assert storefront.outbox.run_once() == 0  # marked: nothing left to repair
    assert downstream.stop(10)
    assert orders.placed == [(sent, "o-3")]


def test_a_retried_operation_sends_what_a_crash_left_with_the_same_ids(
    make_endpoint, monkeypatch
):
    # Given an operation committed by a process that died before sending
    storefront, downstream, _ = storefront_and_orders(make_endpoint, outbox=False)
    downstream.transport.declare(downstream.name)
    sent = crashed_after_commit(storefront, "request-6", "o-6", monkeypatch)

    # When the request is retried: the stored message goes out, its id kept; nothing new
    with storefront.outbox(operation_id="request-6") as work:
        work.bus.send(PlaceOrder(order_id="o-6-changed"))
    assert work.duplicate
    delivery = downstream.transport.get(downstream.name)
    assert delivery is not None and delivery.headers["idembus.message_id"] == sent
    assert b"o-6-changed" not in delivery.body
    assert downstream.transport.pending(downstream.name) == 0


def test_async_with_sends_through_the_outbox_once(make_endpoint):
    storefront, downstream, _ = storefront_and_orders(make_endpoint)
    downstream.transport.declare(downstream.name)

    async def request(key: str) -> bool:
        async with storefront.outbox(operation_id=key) as work:
            work.bus.send(PlaceOrder(order_id=key))
        return work.duplicate

    assert asyncio.run(request("request-4")) is False
    assert asyncio.run(request("request-4")) is True
    assert storefront.transport.pending(downstream.name) == 1
    with pytest.raises(ValueError, match="operation_id"):
        storefront.outbox(operation_id="")


@pytest.mark.amqp
@pytest.mark.postgres
def test_on_rabbitmq_and_postgresql_a_send_only_endpoint_sends_once_and_declares_nothing(
    rabbitmq, postgres_storage
):
    transport, name = rabbitmq
    orders = Orders()
    downstream = Endpoint(name("orders"), transport=KombuTransport(
        AMQP_URL, exchange=transport.exchange_name), handlers=[orders],
        error_queue=name("error"))
    storefront = Endpoint(name("storefront"), transport=transport, storage=postgres_storage,
                          send_only=True, routes={PlaceOrder: downstream.name},
                          error_queue=name("error"), outbox=OutboxPolicy(grace=0))
    handled = SignalCounter(downstream, "handled")
    try:
        downstream.start()
        storefront.start()
        assert not queue_exists(AMQP_URL, storefront.name)
        for _ in range(2):
            with storefront.outbox(operation_id="request-5") as work:
                sent = work.bus.send(PlaceOrder(order_id="o-5"))
        assert work.duplicate
        assert handled.wait_for(1)
        assert downstream.stop(10)
        assert orders.placed == [(sent, "o-5")]
        leftover = transport.get(downstream.name)  # a re-sent copy, if any: the same id
        assert leftover is None or leftover.headers["idembus.message_id"] == sent
    finally:
        storefront.close()
        downstream.close()
