"""memory:// reached without kombu's producer and consumer machinery
(:mod:`idembus.transports.kombu_in_process`): the messages idembus puts on the process's
broker stay in kombu's format, so kombu's own channels read what idembus put there and
idembus's consumers take what a kombu producer put there."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator, Sequence

import kombu
import pytest

from idembus import headers as h
from idembus.envelope import Envelope
from idembus.transports.base import Delivery
from idembus.transports.kombu import KombuTransport

#: Body bytes that are not UTF-8 (carried as surrogate escapes in an envelope's body).
RAW = b'{"name": "caf\xe9"}'


def sent(queue: str) -> Envelope:
    return Envelope(headers={h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Thing",
                             h.INTENT: "send", "custom": "value"},
                    body=RAW.decode("utf-8", "surrogateescape"), destination=queue,
                    content_encoding="latin-1")


@pytest.fixture
def transport(unique: str) -> Iterator[KombuTransport]:
    made = KombuTransport("memory://", exchange=f"in-process-{unique}")
    yield made
    made.close()


def test_what_idembus_puts_on_memory_reads_the_same_through_kombus_own_channel(
        transport: KombuTransport, unique: str) -> None:
    queue = f"in-process-{unique}"
    transport.declare(queue)
    first, second = sent(queue), sent(queue)
    transport.send(first)
    transport.send(second)
    with kombu.Connection("memory://") as connection:
        channel = connection.channel()
        taken = [channel.basic_get(queue, no_ack=True) for _ in range(2)]
    assert [message.headers for message in taken] == [dict(first.headers),
                                                      dict(second.headers)]
    assert all(message.body == RAW for message in taken)  # bytes as sent, not re-encoded
    assert all(message.content_encoding == "latin-1" for message in taken)
    assert taken[0].delivery_tag != taken[1].delivery_tag


@pytest.mark.timeout(30)
def test_a_consumer_takes_what_a_kombu_producer_put_on_memory_in_batches(
        transport: KombuTransport, unique: str) -> None:
    queue = f"in-process-{unique}"
    transport.declare(queue)
    with kombu.Connection("memory://") as connection:  # base64 bodies, uuid tags
        for index in range(5):
            connection.Producer().publish(
                RAW, exchange="", routing_key=queue, content_type="application/json",
                content_encoding="latin-1",
                headers={h.MESSAGE_ID: f"m{index}", h.MESSAGE_TYPE: "test.Thing"})
    batches: list[list[str]] = []
    bodies: list[bytes] = []
    stop = threading.Event()

    def on_batch(deliveries: Sequence[Delivery]) -> None:
        batches.append([delivery.headers[h.MESSAGE_ID] for delivery in deliveries])
        bodies.extend(delivery.body for delivery in deliveries)
        for delivery in deliveries:
            delivery.ack()
        if sum(map(len, batches)) == 5:
            stop.set()

    consumer = threading.Thread(target=transport.consume_batches, args=(queue, on_batch),
                                kwargs={"stop": stop, "prefetch": 4, "size": 4,
                                        "linger": 0.0})
    consumer.start()
    consumer.join(20)
    assert not consumer.is_alive()
    assert batches == [["m0", "m1", "m2", "m3"], ["m4"]]
    assert bodies == [RAW] * 5
    assert transport.pending(queue) == 0


@pytest.mark.timeout(30)
def test_a_batch_left_unsettled_by_a_failure_goes_back_to_its_queue(
        transport: KombuTransport, unique: str) -> None:
    queue = f"in-process-{unique}"
    transport.declare(queue)
    for _ in range(3):
        transport.send(sent(queue))
    stop = threading.Event()
    calls: list[int] = []

    def on_batch(deliveries: Sequence[Delivery]) -> None:
        calls.append(len(deliveries))
        deliveries[0].ack()
        stop.set()
        raise RuntimeError("the handler blew up")

    transport.consume_batches(queue, on_batch, stop=stop, prefetch=8, size=8, linger=0.0)
    assert calls == [3]
    assert transport.pending(queue) == 2  # the two left unsettled, requeued
    again = transport.get(queue)
    assert again is not None and again.body == RAW
