"""The transport contract of ``transports/base.py``, on memory://, RabbitMQ, Redis, the
PostgreSQL transport, the MongoDB transport on mongomock and (with ``IDEMBUS_MONGODB_URL``)
on a real MongoDB.

Each test reads as one clause of the contract: declare is idempotent; send reaches only its
destination; publish reaches every subscribed queue and no other; a callback that raises
gets its delivery requeued; ack removes it for good; pending counts; get does not wait;
consume returns once stopped; capability flags tell the truth.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable

import pytest

from idembus import headers as h
from idembus.envelope import Envelope
from idembus.errors import ConfigurationError
from idembus.transports.base import Delivery, Transport
from idembus.transports.kombu import KombuTransport
from tests.conftest import ALL_TRANSPORT_URLS, is_kombu_url, required_transport

MakeTransport = Callable[..., Transport]
QueueName = Callable[[str], str]

#: How long a consumer may take to notice its stop flag (Redis polls in whole seconds).
STOP_WITHIN = 2.0
#: Upper bound on any wait for a delivery; a failing test fails, it does not hang.
DELIVERY_TIMEOUT = 10.0


@pytest.fixture(params=ALL_TRANSPORT_URLS)
def transport_url(request: pytest.FixtureRequest) -> str:
    """Every transport: kombu's brokers and the database transports."""
    return required_transport(request.param)


def envelope(message_type: str = "contract.Thing", *, destination: str | None = None,
             body: str = '{"text": "héllo €"}', intent: str = "send") -> Envelope:
    return Envelope(
        headers={
            h.MESSAGE_ID: str(uuid.uuid4()),
            h.MESSAGE_TYPE: message_type,
            h.INTENT: intent,
            "custom.header": "kept as is",
        },
        body=body,
        destination=destination,
    )


def event(message_type: str) -> Envelope:
    return envelope(message_type, intent=h.Intent.PUBLISH.value)


class Consumer:
    """Runs ``transport.consume`` in a thread with a callback; records what it saw."""

    def __init__(self, transport: Transport, queue: str,
                 callback: Callable[[Consumer, Delivery], None]) -> None:
        self.stop = threading.Event()
        self.seen: list[Delivery] = []
        self.errors: list[Exception] = []
        self.first = threading.Event()
        self._callback = callback
        self._thread = threading.Thread(target=self._run, args=(transport, queue), daemon=True)
        self._thread.start()

    def _run(self, transport: Transport, queue: str) -> None:
        try:
            transport.consume(queue, self._on_delivery, stop=self.stop)
        except Exception as exc:  # recorded for the test to report
            self.errors.append(exc)

    def _on_delivery(self, delivery: Delivery) -> None:
        self.seen.append(delivery)
        self.first.set()
        self._callback(self, delivery)

    def finish(self, timeout: float = STOP_WITHIN) -> None:
        """Set the stop flag and require the consumer to return within ``timeout``."""
        self.stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"consume did not return {timeout}s after stop"
        assert self.errors == []


def ack_and_stop(consumer: Consumer, delivery: Delivery) -> None:
    delivery.ack()
    consumer.stop.set()


# -- declare ----------------------------------------------------------------------------


def test_declaring_a_queue_twice_is_harmless_and_keeps_its_messages_and_bindings(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    # Given a declared, subscribed queue holding a message
    transport = make_transport()
    queue = queue_name("declared")
    transport.declare(queue, subscriptions=["contract.Happened"])
    sent = envelope(destination=queue)
    transport.send(sent)

    # When it is declared again, by this transport and by another (a restarted endpoint)
    transport.declare(queue, subscriptions=["contract.Happened"])
    make_transport().declare(queue, subscriptions=["contract.Happened"])

    # Then the message is still there, and the binding is neither lost nor doubled
    assert transport.pending(queue) == 1
    transport.publish(event("contract.Happened"))
    assert transport.pending(queue) == 2
    first = transport.get(queue)
    assert first is not None and first.headers[h.MESSAGE_ID] == sent.message_id


# -- send and publish -------------------------------------------------------------------


def test_send_reaches_only_the_destination_queue_with_headers_and_body_intact(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    # Given two queues, the other one subscribed to the type being sent
    transport = make_transport()
    target, other = queue_name("target"), queue_name("other")
    transport.declare(target)
    transport.declare(other, subscriptions=["contract.Thing"])

    # When a message is sent to one of them
    sent = envelope("contract.Thing", destination=target)
    transport.send(sent)

    # Then only that queue has it, unchanged
    assert transport.pending(target) == 1
    assert transport.pending(other) == 0
    received = transport.get(target)
    assert received is not None
    assert dict(received.headers) == dict(sent.headers)
    assert received.body == sent.body.encode("utf-8")
    assert received.content_type == h.CONTENT_TYPE
    assert received.queue == target
    assert transport.get(target) is None


def test_publish_reaches_every_queue_subscribed_to_the_type_and_no_other(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    # Given queues subscribed to A, to A and B, to B (a name extending A's), and to nothing
    transport = make_transport()
    type_a, type_b = "contract.Happened", "contract.Happened.Again"
    only_a, both, only_b, none = (queue_name(n) for n in ("only-a", "both", "only-b", "none"))
    transport.declare(only_a, subscriptions=[type_a])
    transport.declare(both, subscriptions=[type_a, type_b])
    transport.declare(only_b, subscriptions=[type_b])
    transport.declare(none)

    # When an A is published
    published = event(type_a)
    transport.publish(published)

    # Then every A subscriber has it once, nobody else has anything
    assert [transport.pending(q) for q in (only_a, both, only_b, none)] == [1, 1, 0, 0]
    for queue in (only_a, both):
        received = transport.get(queue)
        assert received is not None
        assert received.headers[h.MESSAGE_ID] == published.message_id
        assert received.body == published.body.encode("utf-8")

    # When a B is published
    transport.publish(event(type_b))

    # Then only the B subscribers have it
    assert [transport.pending(q) for q in (only_a, both, only_b, none)] == [0, 1, 1, 0]


def test_dispatch_sends_or_publishes_by_intent(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    # Given a queue subscribed to a type, and another queue
    transport = make_transport()
    subscriber, target = queue_name("subscriber"), queue_name("target")
    transport.declare(subscriber, subscriptions=["contract.Happened"])
    transport.declare(target)

    # When an event and a reply are dispatched
    transport.dispatch(event("contract.Happened"))
    transport.dispatch(envelope("contract.Happened", destination=target, intent="reply"))

    # Then the event was published and the reply was sent
    assert transport.pending(subscriber) == 1
    assert transport.pending(target) == 1


# -- consume, requeue and ack -----------------------------------------------------------


def test_a_callback_that_raises_gets_the_delivery_requeued_for_the_next_consumer(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    # Given a queue with one message
    transport = make_transport()
    queue = queue_name("requeue")
    transport.declare(queue)
    sent = envelope(destination=queue)
    transport.send(sent)

    # When a consumer's callback raises on it
    def fail(consumer: Consumer, delivery: Delivery) -> None:
        consumer.stop.set()
        raise RuntimeError("the callback failed")

    failing = Consumer(transport, queue, fail)
    assert failing.first.wait(DELIVERY_TIMEOUT)
    failing.finish()

    # Then the message is back in the queue, and the next consumer gets it
    assert transport.pending(queue) == 1
    succeeding = Consumer(transport, queue, ack_and_stop)
    assert succeeding.first.wait(DELIVERY_TIMEOUT)
    succeeding.finish()
    [again] = succeeding.seen
    assert again.headers[h.MESSAGE_ID] == sent.message_id
    assert again.body == sent.body.encode("utf-8")
    assert transport.pending(queue) == 0


def test_a_requeued_event_goes_back_only_to_the_queue_it_came_from(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    # Given two queues subscribed to one event type, each holding the published event
    transport = make_transport()
    failing_queue, other_queue = queue_name("failing"), queue_name("other")
    transport.declare(failing_queue, subscriptions=["contract.Happened"])
    transport.declare(other_queue, subscriptions=["contract.Happened"])
    transport.publish(event("contract.Happened"))
    assert [transport.pending(q) for q in (failing_queue, other_queue)] == [1, 1]

    # When the consumer of one queue fails on it and the delivery is requeued
    def fail(consumer: Consumer, delivery: Delivery) -> None:
        consumer.stop.set()
        raise RuntimeError("the callback failed")

    failing = Consumer(transport, failing_queue, fail)
    assert failing.first.wait(DELIVERY_TIMEOUT)
    failing.finish()

    # Then it is back in that queue only: the other subscriber still has exactly one copy
    assert transport.pending(failing_queue) == 1
    assert transport.pending(other_queue) == 1


def test_ack_removes_the_message_for_good_and_a_delivery_settles_once(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    # Given a queue with one message
    transport = make_transport()
    queue = queue_name("ack")
    transport.declare(queue)
    transport.send(envelope(destination=queue))
    second_settle: list[BaseException] = []

    # When a consumer acknowledges it (and then tries to settle it again)
    def ack_twice(consumer: Consumer, delivery: Delivery) -> None:
        delivery.ack()
        try:
            delivery.requeue()
        except RuntimeError as exc:
            second_settle.append(exc)
        consumer.stop.set()

    consumer = Consumer(transport, queue, ack_twice)
    assert consumer.first.wait(DELIVERY_TIMEOUT)
    consumer.finish()

    # Then it is gone for good, even after the consumer's connection closed
    assert len(consumer.seen) == 1
    assert consumer.seen[0].settled
    assert len(second_settle) == 1
    assert transport.pending(queue) == 0
    assert transport.get(queue) is None


def test_consume_returns_promptly_after_stop_is_set(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    # Given a consumer that is running (it has handled a message) on a now empty queue
    transport = make_transport()
    queue = queue_name("stop")
    transport.declare(queue)
    transport.send(envelope(destination=queue))
    consumer = Consumer(transport, queue, lambda _consumer, delivery: delivery.ack())
    assert consumer.first.wait(DELIVERY_TIMEOUT)

    # When its stop flag is set
    started = time.monotonic()
    consumer.finish(STOP_WITHIN)

    # Then consume returned within the bound (finish() asserts the thread ended)
    assert time.monotonic() - started < STOP_WITHIN


# -- pending and get --------------------------------------------------------------------


def test_pending_counts_the_messages_waiting(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    # Given a declared queue and a queue never declared
    transport = make_transport()
    queue, missing = queue_name("pending"), queue_name("never-declared")
    transport.declare(queue)
    assert transport.pending(queue) == 0
    assert transport.pending(missing) == 0

    # When three messages are sent and one is taken
    sent = [envelope(destination=queue) for _ in range(3)]
    for message in sent:
        transport.send(message)
    assert transport.pending(queue) == 3
    taken = transport.get(queue)

    # Then two remain, and the first sent was the first taken
    assert taken is not None and taken.headers[h.MESSAGE_ID] == sent[0].message_id
    assert transport.pending(queue) == 2


def test_get_returns_none_on_an_empty_queue(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    transport = make_transport()
    queue = queue_name("empty")
    transport.declare(queue)
    assert transport.get(queue) is None
    # and once more after a message came and went
    transport.send(envelope(destination=queue))
    assert transport.get(queue) is not None
    assert transport.get(queue) is None


# -- construction and capabilities ------------------------------------------------------


def test_an_unknown_url_scheme_is_a_configuration_error_naming_the_url() -> None:
    with pytest.raises(ConfigurationError, match=re.escape("'nosuch://'")):
        KombuTransport("nosuch://")


def test_publisher_confirms_are_on_for_amqp_only(
    make_transport: MakeTransport, transport_url: str,
) -> None:
    if not is_kombu_url(transport_url):
        pytest.skip("kombu's option; a database transport's send returns after its commit")
    transport = make_transport()
    assert transport.publisher_confirms is transport_url.startswith("amqp")
    assert make_transport(confirm_publish=False).publisher_confirms is False


# -- inspect ----------------------------------------------------------------------------


def _drain_ids(transport: Transport, queue: str) -> list[str]:
    """Take every message of ``queue`` (for good) and return their message ids in order."""
    ids = []
    while (delivery := transport.get(queue)) is not None:
        ids.append(delivery.headers[h.MESSAGE_ID])
    return ids


def test_inspect_shows_the_waiting_messages_removes_the_acked_and_gives_back_the_rest(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    # Given a queue holding five messages
    transport = make_transport()
    queue = queue_name("inspect")
    transport.declare(queue)
    sent = [envelope(destination=queue) for _ in range(5)]
    for message in sent:
        transport.send(message)

    # When a tool inspects it and acknowledges two of them
    with transport.inspect(queue) as deliveries:
        # Then it sees each message once, in queue order, intact and unsettled...
        assert [d.headers[h.MESSAGE_ID] for d in deliveries] == [m.message_id for m in sent]
        for delivery, message in zip(deliveries, sent, strict=True):
            assert dict(delivery.headers) == dict(message.headers)
            assert delivery.body == message.body.encode("utf-8")
        assert not any(d.settled for d in deliveries)
        # ... taken from the queue meanwhile, so nobody else receives them
        assert transport.pending(queue) == 0
        deliveries[1].ack()
        deliveries[3].ack()

    # Then the acknowledged ones are gone for good and the other three are back
    assert transport.pending(queue) == 3
    assert sorted(_drain_ids(transport, queue)) == sorted(
        sent[i].message_id for i in (0, 2, 4))


def test_inspect_honours_its_limit_and_loses_nothing(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    # Given a queue holding five messages
    transport = make_transport()
    queue = queue_name("inspect-limit")
    transport.declare(queue)
    sent = [envelope(destination=queue) for _ in range(5)]
    for message in sent:
        transport.send(message)

    # When a tool inspects at most two of them
    with transport.inspect(queue, limit=2) as deliveries:
        # Then it gets the first two; the other three still wait
        assert [d.headers[h.MESSAGE_ID] for d in deliveries] == [m.message_id for m in sent[:2]]
        assert transport.pending(queue) == 3

    # And afterwards all five are there once each (the order may have changed)
    assert sorted(_drain_ids(transport, queue)) == sorted(m.message_id for m in sent)


def test_inspect_gives_everything_back_when_the_block_raises(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    # Given a queue holding three messages
    transport = make_transport()
    queue = queue_name("inspect-raise")
    transport.declare(queue)
    sent = [envelope(destination=queue) for _ in range(3)]
    for message in sent:
        transport.send(message)

    # When the tool fails while inspecting, after acknowledging one of them
    with pytest.raises(RuntimeError, match="the tool failed"):
        with transport.inspect(queue) as deliveries:
            deliveries[0].ack()
            raise RuntimeError("the tool failed")

    # Then only that one is gone
    assert sorted(_drain_ids(transport, queue)) == sorted(m.message_id for m in sent[1:])


def test_inspect_gives_an_event_back_only_to_the_queue_it_came_from(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    # Given two queues subscribed to one event type, each holding the published event
    transport = make_transport()
    inspected, other = queue_name("inspected"), queue_name("other")
    transport.declare(inspected, subscriptions=["contract.Happened"])
    transport.declare(other, subscriptions=["contract.Happened"])
    published = event("contract.Happened")
    transport.publish(published)

    # When one queue is inspected and nothing is acknowledged
    with transport.inspect(inspected) as deliveries:
        assert [d.headers[h.MESSAGE_ID] for d in deliveries] == [published.message_id]

    # Then the event is back in that queue, and the other still has exactly one copy
    assert _drain_ids(transport, inspected) == [published.message_id]
    assert _drain_ids(transport, other) == [published.message_id]


def test_inspect_yields_nothing_for_an_empty_or_missing_queue(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    transport = make_transport()
    queue, missing = queue_name("inspect-empty"), queue_name("inspect-missing")
    transport.declare(queue)
    with transport.inspect(queue) as deliveries:
        assert deliveries == []
    with transport.inspect(missing) as deliveries:
        assert deliveries == []
    with transport.inspect(queue, limit=0) as deliveries:
        assert deliveries == []
