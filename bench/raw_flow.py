"""The baseline: the same broker work as the idembus flow, done by a bare kombu loop.

Why the comparison is fair
==========================
* Same input: the N PlaceOrder messages are built by idembus' own ``Bus`` (same body
  bytes, same headers) and queued on a durable queue before the consumers start.
* Same topology: a durable input queue fed through the default exchange, a durable topic
  exchange routing ``sales.OrderPlaced`` to a second durable queue, and a second hop
  publishing ``billing.OrderBilled`` to that exchange, where nothing is bound.
* Same broker work per message: consume (prefetch 16), publish one persistent
  ``application/json`` message with headers of the same size on a *separate* publishing
  connection with the same ``confirm_publish`` transport option, then ack.
* Same concurrency: one consumer thread per queue, both in this process.
* Same clock: from the first delivery on the input queue to the Nth ack of the second hop
  (idembus: to Billing's Nth handled message, which precedes its publish and ack).

What the raw loop does *not* do is the work idembus exists for: decoding and validating
the message, loading and conditionally committing the aggregate with its outgoing
messages, deriving deterministic ids, and marking the outgoing messages dispatched.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import kombu
from kombu import Exchange, Queue

from bench.common import (
    DRAIN_TIMEOUT,
    PREFETCH,
    FlowClock,
    kombu_options,
    orders,
    timeout_for,
    unique_suffix,
)
from idembus import headers as h
from idembus.envelope import Envelope
from idembus.messages import message_name
from idembus.routing import Router
from idembus.sending import Bus
from samples.ordering.messages import OrderBilled, OrderPlaced, PlaceOrder


@dataclass(frozen=True)
class Hop:
    """Consume ``queue``; for each message publish one to ``exchange`` with ``routing_key``."""

    queue: str
    exchange: Exchange
    routing_key: str


@dataclass(frozen=True)
class Topology:
    inbound: str
    middle: str
    events: Exchange

    @classmethod
    def fresh(cls) -> Topology:
        suffix = unique_suffix()
        return cls(f"bench-raw-in-{suffix}", f"bench-raw-mid-{suffix}",
                   Exchange(f"bench-raw.events.{suffix}", type="topic", durable=True))

    @property
    def hops(self) -> tuple[Hop, Hop]:
        return (Hop(self.inbound, self.events, message_name(OrderPlaced)),
                Hop(self.middle, self.events, message_name(OrderBilled)))

    def declare(self, channel: kombu.Channel) -> None:
        self.events(channel).declare()
        Queue(self.inbound, durable=True)(channel).declare()
        Queue(self.middle, self.events, routing_key=message_name(OrderPlaced),
              durable=True)(channel).declare()

    def delete(self, channel: kombu.Channel) -> None:
        for queue in (self.inbound, self.middle):
            channel.queue_delete(queue=queue)
        channel.exchange_delete(self.events.name)


def place_order_envelopes(queue: str, count: int) -> list[Envelope]:
    """The PlaceOrder messages exactly as ``endpoint.bus.send`` would put them on the wire."""
    captured: list[Envelope] = []
    bus = Bus("bench-raw-client", Router({PlaceOrder: queue}), captured.append)
    for command in orders(count):
        bus.send(command)
    return captured


def preload(connection: kombu.Connection, queue: str, count: int) -> None:
    producer = kombu.Producer(connection.default_channel)
    for envelope in place_order_envelopes(queue, count):
        producer.publish(envelope.body.encode("utf-8"), exchange="", routing_key=queue,
                         headers=dict(envelope.headers), content_type=h.CONTENT_TYPE,
                         content_encoding="utf-8", delivery_mode=2)


class Forwarder(threading.Thread):
    """One consumer thread: consume, publish one message on its own connection, ack."""

    def __init__(self, url: str, hop: Hop, *, confirm: bool, stop: threading.Event,
                 on_received: Callable[[], None], on_acked: Callable[[], None]) -> None:
        super().__init__(name=f"bench-raw-{hop.queue}", daemon=True)
        self.url, self.hop, self.stop = url, hop, stop
        self.options = kombu_options(url, confirm=confirm)
        self.on_received, self.on_acked = on_received, on_acked
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with kombu.Connection(self.url, transport_options=self.options) as consuming, \
                    kombu.Connection(self.url, transport_options=self.options) as publishing:
                self._consume(consuming, kombu.Producer(publishing.default_channel))
        except Exception as exc:  # noqa: BLE001 - the waiting caller reports it
            self.error = exc

    def _consume(self, connection: kombu.Connection, producer: kombu.Producer) -> None:
        def on_message(message: kombu.Message) -> None:
            self.on_received()
            self._forward(producer, message)
            message.ack()
            self.on_acked()

        queue = Queue(self.hop.queue, durable=True, no_declare=True)
        with connection.Consumer([queue], on_message=on_message, prefetch_count=PREFETCH):
            while not self.stop.is_set():
                try:
                    connection.drain_events(timeout=DRAIN_TIMEOUT)
                except TimeoutError:  # socket.timeout: nothing arrived
                    continue

    def _forward(self, producer: kombu.Producer, message: kombu.Message) -> None:
        headers = dict(message.headers or {})
        headers[h.CAUSATION_ID] = headers.get(h.MESSAGE_ID, "")
        headers[h.MESSAGE_ID] = str(uuid.uuid4())
        headers[h.MESSAGE_TYPE] = self.hop.routing_key
        producer.publish(message.body, exchange=self.hop.exchange.name,
                         routing_key=self.hop.routing_key, headers=headers,
                         content_type=h.CONTENT_TYPE, content_encoding="utf-8",
                         delivery_mode=2)


def run(url: str, count: int, *, confirm: bool = True) -> float:
    """One timed run; returns the seconds taken for 2 x ``count`` acked messages."""
    topology = Topology.fresh()
    clock, stop = FlowClock(count), threading.Event()
    first, second = topology.hops
    workers = [
        Forwarder(url, second, confirm=confirm, stop=stop, on_received=_nothing,
                  on_acked=clock.finish_one),
        Forwarder(url, first, confirm=confirm, stop=stop, on_received=clock.start,
                  on_acked=_nothing),
    ]
    options = kombu_options(url, confirm=confirm)
    with kombu.Connection(url, transport_options=options) as admin:
        topology.declare(admin.default_channel)
        try:
            preload(admin, topology.inbound, count)
            for worker in workers:
                worker.start()
            seconds = _wait(clock, workers, 2 * count)
        finally:
            stop.set()
            for worker in workers:
                worker.join(30)
            topology.delete(admin.default_channel)
    return seconds


def _wait(clock: FlowClock, workers: list[Forwarder], messages: int) -> float:
    try:
        return clock.wait(timeout_for(messages))
    except TimeoutError as exc:
        errors = [repr(worker.error) for worker in workers if worker.error is not None]
        raise TimeoutError(f"{exc}; consumer errors: {errors or 'none'}") from None


def _nothing() -> None:
    return None
