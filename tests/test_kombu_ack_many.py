"""A RabbitMQ batch acknowledged at once (idembus.transports.kombu_consuming.ack_many):
one ``basic.ack`` with ``multiple`` for consecutive tags on one channel, every earlier
one unsettled; one by one otherwise."""

from __future__ import annotations

from typing import Any

import pytest

from idembus.transports.kombu import KombuTransport
from idembus.transports.kombu_delivery import _KombuDelivery


class FakeMessage:
    def __init__(self, tag: int, channel: object, acks: list[tuple[int, bool]]) -> None:
        self.delivery_tag, self.channel, self._acks = tag, channel, acks

    def ack(self, multiple: bool = False) -> None:
        self._acks.append((self.delivery_tag, multiple))


def deliveries(tags: list[int], channels: list[object] | None = None
               ) -> tuple[list[Any], list[tuple[int, bool]]]:
    acks: list[tuple[int, bool]] = []
    made = []
    for index, tag in enumerate(tags):
        delivery = _KombuDelivery.__new__(_KombuDelivery)
        delivery._message = FakeMessage(tag, (channels or [None] * len(tags))[index], acks)
        delivery.settled, delivery.queue, delivery._outage = False, "q", ()
        made.append(delivery)
    return made, acks


@pytest.fixture
def transport() -> KombuTransport:
    return KombuTransport("amqp://guest:guest@127.0.0.1:5672/%2F")


def test_consecutive_tags_of_one_channel_take_one_ack_of_the_last(transport):
    held, acks = deliveries([7, 5, 6])
    transport.ack_many(held)
    assert acks == [(7, True)] and all(delivery.settled for delivery in held)


@pytest.mark.parametrize("tags, channels", [
    ([5, 7, 8], None),  # a gap: 6 is not in the batch
    ([5, 6], [object(), object()]),  # two channels
])
def test_anything_else_is_acknowledged_one_by_one(transport, tags, channels):
    held, acks = deliveries(tags, channels)
    transport.ack_many(held)
    assert acks == [(tag, False) for tag in tags] and all(d.settled for d in held)


def test_a_settled_delivery_in_the_batch_is_refused_as_one_by_one_refuses_it(transport):
    held, acks = deliveries([5, 6])
    held[0].settled = True
    with pytest.raises(RuntimeError, match="already settled"):
        transport.ack_many(held)
    assert acks == []
