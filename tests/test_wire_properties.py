"""The core headers as AMQP basic properties (``idembus.transports.amqp_properties``).

On RabbitMQ idembus publishes ``idembus.message_id``, ``.message_type``,
``.correlation_id``, ``.reply_to`` and ``.originating_endpoint`` as the properties
``message_id``, ``type``, ``correlation_id``, ``reply_to`` and ``app_id``, and reads both
shapes: the properties, and the headers table of the earlier wire format (older idembus,
foreign producers, error-queue copies, delay levels). The AMQP client on the other side
here is pika, which shares no code with idembus, kombu or py-amqp.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import kombu
import pytest

from idembus import Command, Endpoint, Event, RetryPolicy
from idembus import headers as h
from idembus.envelope import Envelope
from idembus.handlers import Handler, handles
from idembus.runtime.recoverability.policy import Recoverability
from idembus.testing import wait_until_idle
from idembus.transports import amqp_properties
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL, require_service

pika = pytest.importorskip("pika")

# -- splitting and merging (no broker) --------------------------------------------------


def test_the_core_headers_go_to_properties_and_the_rest_stays_in_the_table() -> None:
    headers = {h.MESSAGE_ID: "m-1", h.MESSAGE_TYPE: "shop.Placed", h.CORRELATION_ID: "c",
               h.REPLY_TO: "sales", h.ORIGINATING_ENDPOINT: "sales", h.CONVERSATION_ID: "v",
               h.TIME_SENT: "2026-11-28T10:00:00+00:00", "tenant": "t-7"}

    table, properties = amqp_properties.split(headers)

    assert properties == {"message_id": "m-1", "type": "shop.Placed", "correlation_id": "c",
                          "reply_to": "sales", "app_id": "sales"}
    assert table == {h.CONVERSATION_ID: "v", h.TIME_SENT: "2026-11-28T10:00:00+00:00",
                     "tenant": "t-7"}
    assert h.MESSAGE_ID in headers  # the envelope's headers are left as they are
    assert amqp_properties.merged(table, properties) == headers


def test_a_value_a_short_string_cannot_carry_stays_in_the_table() -> None:
    long_id = "é" * 128  # 128 characters, 256 bytes of UTF-8
    escaped = "a\udce9"  # a surrogate escape: no UTF-8 for a short string

    table, properties = amqp_properties.split({h.MESSAGE_ID: long_id,
                                               h.MESSAGE_TYPE: escaped,
                                               h.REPLY_TO: "q" * 255})

    assert table == {h.MESSAGE_ID: long_id, h.MESSAGE_TYPE: escaped}
    assert properties == {"reply_to": "q" * 255}


def test_the_table_wins_over_a_property_and_nothing_is_changed_in_place() -> None:
    table = {h.MESSAGE_ID: "from-the-table"}

    merged = amqp_properties.merged(table, {"message_id": "from-a-property",
                                            "type": "shop.Placed", "priority": 0})

    assert merged == {h.MESSAGE_ID: "from-the-table", h.MESSAGE_TYPE: "shop.Placed"}
    assert table == {h.MESSAGE_ID: "from-the-table"}
    assert amqp_properties.merged(table, {"priority": 0}) is table
    assert amqp_properties.carried({"message_id": "m", "priority": 0, "type": None}) == {
        "message_id": "m"}


# -- pika on both sides of an endpoint (RabbitMQ) -----------------------------------------


class Reserve(Command, message_name="wire.Reserve"):
    sku: str
    quantity: int


class Reserved(Event, message_name="wire.Reserved"):
    sku: str
    quantity: int


class Stock(Handler):
    """Reserves stock and publishes Reserved; a quantity below 0 fails for good."""

    seen: list[tuple[str, str, int]] = []

    @handles
    def reserve(self, message: Reserve) -> None:
        if message.quantity < 0:
            raise ValueError("a negative quantity")
        Stock.seen.append((self.context.message_id, message.sku, message.quantity))
        self.bus.publish(Reserved(sku=message.sku, quantity=message.quantity))


@pytest.fixture
def broker(unique: str) -> Iterator[tuple[Any, Callable[[], Endpoint]]]:
    """A pika channel on ``AMQP_URL``'s broker and a maker of this test's stock endpoint;
    everything deleted after."""
    require_service(AMQP_URL, "RabbitMQ")
    Stock.seen = []
    # kombu reads the default vhost from "//", pika from "/%2F": take kombu's reading.
    url = kombu.Connection(AMQP_URL)
    parameters = pika.ConnectionParameters(
        host=url.hostname, port=url.port or 5672, virtual_host=url.virtual_host,
        credentials=pika.PlainCredentials(url.userid, url.password))
    connection = pika.BlockingConnection(parameters)
    channel = connection.channel()
    exchange = f"test-events-{unique}"
    endpoints: list[Endpoint] = []

    def make() -> Endpoint:
        endpoint = Endpoint(f"stock-{unique}", handlers=[Stock],
                            transport=KombuTransport(AMQP_URL, exchange=exchange),
                            error_queue=f"error-{unique}",
                            recoverability=Recoverability(
                                retries=RetryPolicy(immediate_retries=0, delayed=())))
        endpoints.append(endpoint)
        return endpoint

    yield channel, make
    for endpoint in endpoints:
        endpoint.close()
    cleaner = connection.channel()  # the test's may have been closed by the broker
    for queue in (f"stock-{unique}", f"error-{unique}", f"watch-{unique}"):
        cleaner.queue_delete(queue)
    cleaner.exchange_delete(exchange)
    connection.close()


def wait_until(condition: Callable[[], bool], timeout: float) -> None:
    """Return once ``condition()`` holds, polled every 20 ms; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not so within {timeout}s")
        pause.wait(0.02)


def _received(channel: Any, queue: str) -> tuple[Any, dict[str, Any], bytes]:
    """The next message of ``queue``, taken by pika: its properties, headers and body."""
    found: list[tuple[Any, bytes]] = []

    def taken() -> bool:
        method, properties, body = channel.basic_get(queue, auto_ack=True)
        if method is not None:
            found.append((properties, body))
        return bool(found)

    wait_until(taken, timeout=20)
    properties, body = found[0]
    return properties, dict(properties.headers or {}), body


@pytest.mark.amqp
def test_pika_sends_both_shapes_and_reads_every_core_field_of_what_idembus_publishes(
    broker: tuple[Any, Callable[[], Endpoint]], unique: str,
) -> None:
    # Given a stock endpoint, and a queue of pika's own bound to its Reserved events
    channel, make = broker
    stock = make()
    stock.transport.declare(stock.name, subscriptions=stock.subscriptions)
    watch = f"watch-{unique}"
    channel.exchange_declare(f"test-events-{unique}", "topic", durable=True)
    channel.queue_declare(watch, durable=False)
    channel.queue_bind(watch, f"test-events-{unique}", routing_key="wire.Reserved")
    stock.start()

    # When pika sends one command as properties (the new shape) and one in the headers
    # table (the earlier shape), each twice (a producer's retry: same id)
    new_id, old_id = str(uuid.uuid4()), str(uuid.uuid4())
    shapes = {
        new_id: pika.BasicProperties(content_type="application/json", delivery_mode=2,
                                     message_id=new_id, type="wire.Reserve"),
        old_id: pika.BasicProperties(content_type="application/json", delivery_mode=2,
                                     headers={h.MESSAGE_ID: old_id,
                                              h.MESSAGE_TYPE: "wire.Reserve"}),
    }
    for _retry in range(2):
        for message_id, properties in shapes.items():
            channel.basic_publish("", stock.name, json.dumps(
                {"sku": message_id, "quantity": 2}).encode(), properties)
    wait_until(lambda: stock.counters.snapshot()["duplicate"] == 2, timeout=30)
    wait_until_idle([stock])

    # Then both are handled once each, by the id they came with
    assert sorted(Stock.seen) == sorted((each, each, 2) for each in shapes)
    # And pika reads every core field of the events idembus published
    for _event in shapes:
        properties, headers, body = _received(channel, watch)
        assert properties.type == "wire.Reserved"
        assert properties.content_type == "application/json"
        assert properties.app_id == stock.name  # idembus.originating_endpoint
        assert properties.reply_to == stock.name
        incoming = json.loads(body)["sku"]
        assert properties.correlation_id == incoming  # propagated from the command
        assert headers[h.CAUSATION_ID] == incoming
        assert headers[h.CONVERSATION_ID] == incoming
        assert headers[h.INTENT] == "publish"
        assert headers[h.MESSAGE_VERSION] == "1"
        assert headers[h.ENCLOSED_TYPES] == "wire.Reserved"
        assert headers[h.TIME_SENT].endswith("+00:00")
        assert uuid.UUID(properties.message_id)
        assert h.MESSAGE_ID not in headers and h.MESSAGE_TYPE not in headers


@pytest.mark.amqp
def test_a_failed_message_of_the_new_shape_reaches_the_error_queue_with_its_properties(
    broker: tuple[Any, Callable[[], Endpoint]], unique: str,
) -> None:
    # Given a stock endpoint without retries
    channel, make = broker
    stock = make()
    stock.start()

    # When pika sends it a command, as properties, that fails
    message_id = str(uuid.uuid4())
    channel.basic_publish("", stock.name, b'{"sku": "s", "quantity": -1}', pika.BasicProperties(
        content_type="application/json", delivery_mode=2, message_id=message_id,
        type="wire.Reserve", correlation_id="corr-9", headers={"tenant": "t-7"}))

    # Then pika finds it in the error queue with its id, type and correlation as
    # properties, its own header and the failure in the table
    properties, headers, body = _received(channel, f"error-{unique}")
    assert (properties.message_id, properties.type, properties.correlation_id) == (
        message_id, "wire.Reserve", "corr-9")
    assert headers["tenant"] == "t-7"
    assert headers[h.EXCEPTION_TYPE].endswith("ValueError")
    assert headers[h.FAILED_QUEUE] == stock.name
    assert body == b'{"sku": "s", "quantity": -1}'


@pytest.mark.amqp
def test_a_batch_publishes_non_ascii_and_long_core_values_as_a_single_message_does(
    broker: tuple[Any, Callable[[], Endpoint]], unique: str,
) -> None:
    # Given a queue of pika's own, and a transport with publisher confirms
    channel, _ = broker
    queue = f"watch-{unique}"
    channel.queue_declare(queue, durable=False)
    transport = KombuTransport(AMQP_URL, exchange=f"test-events-{unique}")
    plain = {h.MESSAGE_ID: "m-plain", h.MESSAGE_TYPE: "wire.Reserve",
             h.ORIGINATING_ENDPOINT: "stock", h.REPLY_TO: "stock", "tenant": "t-7"}
    non_ascii = {**plain, h.MESSAGE_ID: "m-non-ascii", h.ORIGINATING_ENDPOINT: "lager-ö"}
    long_name = "ö" * 128  # 128 characters, 256 bytes of UTF-8: over a short string
    long = {**plain, h.MESSAGE_ID: "m-long", h.ORIGINATING_ENDPOINT: long_name}
    try:
        # When one batch sends a message with short ASCII core values, one with a
        # non-ASCII endpoint name and one whose endpoint name is too long for a property
        results = transport.dispatch_many([
            Envelope(headers=headers, body='{"sku": "s", "quantity": 1}', destination=queue)
            for headers in (plain, non_ascii, long)])

        # Then each went out, and pika reads each core value where split puts it: the
        # short ones as properties, the long one in the headers table
        assert results == [None, None, None]
        for sent in (plain, non_ascii, long):
            properties, headers, _ = _received(channel, queue)
            table, carried = amqp_properties.split(sent)
            assert properties.message_id == sent[h.MESSAGE_ID]
            assert properties.app_id == carried.get("app_id")
            assert properties.type == "wire.Reserve" and properties.reply_to == "stock"
            assert {name: value for name, value in headers.items()} == table
        assert long_name not in (properties.app_id or "")
        assert headers[h.ORIGINATING_ENDPOINT] == long_name
    finally:
        transport.close()
