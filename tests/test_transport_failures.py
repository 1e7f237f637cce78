"""Broker failures classified at the kombu seam (DESIGN §2b), sends that fail loudly, and
RabbitMQ's queue types."""

from __future__ import annotations

import contextlib
import datetime
import shutil
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator

import amqp
import kombu
import pytest

from idembus import headers as h
from idembus.envelope import Envelope
from idembus.errors import ConfigurationError
from idembus.transports import delays
from idembus.transports.errors import BrokerAccessDenied, DestinationRefused
from idembus.transports.kombu import REDIS_QUEUES, KombuTransport
from tests.conftest import AMQP_URL, REDIS_URL, require_service
from tests.hostile import plain_amqp

MakeTransport = Callable[..., KombuTransport]


def envelope(destination: str | None, **headers: str) -> Envelope:
    return Envelope(headers={h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Deposit",
                             **headers},
                    body='{"account": "a", "amount": 1}', destination=destination)


def test_a_send_to_a_queue_nobody_declared_is_refused_and_creates_nothing(
    make_transport: MakeTransport, queue_name: Callable[[str], str],
) -> None:
    # Given a transport and one declared queue
    transport = make_transport()
    declared = queue_name("declared")
    transport.declare(declared)
    mistyped = queue_name("declraed")

    # When a message is sent to a mistyped queue name
    with pytest.raises(DestinationRefused, match="declraed"):
        transport.send(envelope(mistyped))

    # Then no queue of that name holds it, and a send to the right queue still works
    assert transport.pending(mistyped) == 0
    transport.send(envelope(declared))
    assert transport.get(declared) is not None


@pytest.mark.amqp
@pytest.mark.parametrize("destination", ["amq.gen-not-yours", "r" * 300])
def test_a_reply_to_a_queue_the_broker_refuses_fails_this_message_only(
    rabbitmq: tuple[KombuTransport, Callable[[str], str]], destination: str,
) -> None:
    # Given a transport that publishes on RabbitMQ
    transport, name = rabbitmq
    good = name("good")
    transport.declare(good)

    # When a message goes to a reserved name, or to one longer than AMQP allows
    with pytest.raises(DestinationRefused):
        transport.send(envelope(destination))

    # Then the next message on the same transport and thread goes through
    transport.send(envelope(good))
    assert transport.get(good) is not None


@pytest.mark.amqp
def test_headers_that_cannot_fit_one_frame_are_refused_before_the_broker_cuts_the_connection(
    rabbitmq: tuple[KombuTransport, Callable[[str], str]],
) -> None:
    transport, name = rabbitmq
    queue = name("frames")
    transport.declare(queue)

    with pytest.raises(DestinationRefused, match="frame_max"):
        transport.send(envelope(queue, **{"x-huge": "x" * 200_000}))

    transport.send(envelope(queue))
    assert transport.pending(queue) == 1


@pytest.mark.amqp
def test_a_refused_login_is_access_denied_without_the_password(unique: str) -> None:
    require_service(AMQP_URL, "RabbitMQ")
    wrong = AMQP_URL.replace("guest:guest@", "guest:Wr0ng-Pa55@")
    assert wrong != AMQP_URL
    transport = KombuTransport(wrong)

    with pytest.raises(BrokerAccessDenied) as refused:
        transport.declare(f"never-{unique}")

    assert "ACCESS_REFUSED" in str(refused.value)
    assert "Wr0ng-Pa55" not in str(refused.value)


@pytest.mark.amqp
def test_consuming_a_queue_that_is_gone_raises_for_the_endpoint_instead_of_ending_quietly(
    rabbitmq: tuple[KombuTransport, Callable[[str], str]],
) -> None:
    transport, name = rabbitmq
    stop = threading.Event()

    with pytest.raises(BrokerAccessDenied, match="NOT_FOUND"):
        transport.consume(name("missing"), lambda delivery: None, stop=stop)


@pytest.mark.amqp
def test_queues_are_quorum_by_default_and_redeclaring_as_classic_says_what_to_change(
    rabbitmq: tuple[KombuTransport, Callable[[str], str]],
) -> None:
    # Given a queue declared by a default transport
    transport, name = rabbitmq
    queue = name("typed")
    transport.declare(queue)

    # Then RabbitMQ holds it as a quorum queue
    if shutil.which("rabbitmqctl"):
        vhost = AMQP_URL.rsplit("/", 1)[-1] or "/"
        listed = subprocess.run(["rabbitmqctl", "-q", "list_queues", "-p", vhost, "name", "type"],
                                capture_output=True, text=True, timeout=60, check=True).stdout
        assert any(line.split() == [queue, "quorum"] for line in listed.splitlines()), listed

    # And a transport configured for classic queues refuses to start on it, saying why
    classic = KombuTransport(AMQP_URL, queue_type="classic")
    try:
        with pytest.raises(ConfigurationError) as refused:
            classic.declare(queue)
    finally:
        classic.close()
    assert "x-queue-type" in str(refused.value)
    assert "queue_type=" in str(refused.value)


def listed_queue(queue: str) -> str:
    """The line ``rabbitmqctl list_queues name type arguments`` shows for ``queue``, on the
    virtual host of ``AMQP_URL``; skips where rabbitmqctl is not installed."""
    if not shutil.which("rabbitmqctl"):
        pytest.skip("rabbitmqctl is not installed here")
    vhost = AMQP_URL.rsplit("/", 1)[-1] or "/"
    listed = subprocess.run(
        ["rabbitmqctl", "-q", "list_queues", "-p", vhost, "name", "type", "arguments"],
        capture_output=True, text=True, timeout=60, check=True).stdout
    return next(line for line in listed.splitlines() if line.split("\t", 1)[0] == queue)


@pytest.mark.amqp
@pytest.mark.parametrize(("queue_type", "arguments", "shown"), [
    ("classic", {"x-max-length": 2}, '{"x-max-length",2}'),
    ("quorum", {"x-delivery-limit": 5}, '{"x-delivery-limit",5}'),
])
def test_queue_arguments_reach_the_broker_and_a_transport_without_them_is_refused(
    rabbitmq: tuple[KombuTransport, Callable[[str], str]], queue_type: str,
    arguments: dict[str, int], shown: str,
) -> None:
    # Given a queue declared with further arguments
    _, name = rabbitmq
    queue = name(f"arguments-{queue_type}")
    limited = KombuTransport(AMQP_URL, queue_type=queue_type, queue_arguments=arguments)
    plain = KombuTransport(AMQP_URL, queue_type=queue_type)
    try:
        limited.declare(queue)

        # Then RabbitMQ holds the queue with them
        line = listed_queue(queue)
        assert queue_type in line and shown in line, line

        # And a transport of the same queue type without them refuses to start on it,
        # naming the argument
        with pytest.raises(ConfigurationError) as refused:
            plain.declare(queue)
        assert next(iter(arguments)) in str(refused.value)
        assert f"queue {queue!r} exists" in str(refused.value)
    finally:
        limited.close()
        plain.close()


@pytest.mark.amqp
def test_a_max_length_given_as_queue_argument_is_enforced_by_the_broker(
    rabbitmq: tuple[KombuTransport, Callable[[str], str]],
) -> None:
    _, name = rabbitmq
    queue = name("bounded")
    transport = KombuTransport(AMQP_URL, queue_type="classic",
                               queue_arguments={"x-max-length": 2})
    try:
        transport.declare(queue)
        for _ in range(3):
            transport.send(envelope(queue))

        assert transport.pending(queue) == 2  # RabbitMQ dropped the oldest
    finally:
        transport.close()


def _delete_topology(levels: delays.Topology) -> None:
    """Delete every queue and exchange of ``levels`` (a topology of one test's own)."""
    names = [level.name for level in levels.levels()]
    with plain_amqp(AMQP_URL) as channel:
        for queue in [*names, levels.undeliverable]:
            channel.queue_delete(queue)
        for exchange in [*names, levels.deliver_exchange, levels.undeliverable]:
            channel.exchange_delete(exchange)


@pytest.fixture
def own_delay_levels(unique: str) -> Iterator[delays.Topology]:
    """Quorum delay levels under a prefix of this test's own, deleted afterwards: the
    shared ``idembus.qdelay.*`` levels must not be redeclared otherwise under other tests."""
    require_service(AMQP_URL, "RabbitMQ")
    levels = delays.Topology(f"test-{unique}.qdelay", quorum=True)
    yield levels
    _delete_topology(levels)


@pytest.mark.amqp
def test_declaring_a_queue_binds_it_for_delayed_messages_before_anything_is_delayed(
    rabbitmq: tuple[KombuTransport, Callable[[str], str]],
) -> None:
    # Given a queue declared by a transport that has sent nothing
    transport, name = rabbitmq
    queue = name("bound-at-start")
    transport.declare(queue)

    # When a message whose delay is over reaches the delay levels' delivery exchange
    levels = delays.Topology.for_queue_type("quorum")
    with plain_amqp(AMQP_URL) as channel:
        channel.basic_publish(amqp.Message(b"{}"), exchange=levels.deliver_exchange,
                              routing_key=delays.routing_key(1, queue))

    # Then the queue has it: the binding was made when the queue was declared
    assert transport.pending(queue) == 1


@pytest.mark.amqp
def test_delay_levels_declared_otherwise_fail_the_declare_naming_the_exchange_and_the_fix(
    rabbitmq: tuple[KombuTransport, Callable[[str], str]], own_delay_levels: delays.Topology,
) -> None:
    # Given a broker whose delivery exchange was declared by an older idembus: no
    # alternate exchange
    _, name = rabbitmq
    with plain_amqp(AMQP_URL) as channel:
        channel.exchange_declare(own_delay_levels.deliver_exchange, "topic", durable=True,
                                 auto_delete=False)
    transport = KombuTransport(AMQP_URL)
    transport._delay_levels = own_delay_levels  # this test's own levels, not the shared

    # When an endpoint declares its queue, before any delayed message
    try:
        with pytest.raises(ConfigurationError) as refused:
            transport.declare(name("starting"))
    finally:
        transport.close()

    # Then it fails then and there, naming the exchange and what to do
    said = str(refused.value)
    assert f"exchange {own_delay_levels.deliver_exchange!r}" in said
    assert "alternate-exchange" in said
    assert f"delete the {own_delay_levels.prefix}.* queues and exchanges" in said
    assert "\n" not in said


@pytest.mark.amqp
def test_delay_levels_the_broker_lost_are_declared_again_by_the_next_declare(
    rabbitmq: tuple[KombuTransport, Callable[[str], str]], own_delay_levels: delays.Topology,
) -> None:
    # Given a transport that declared its delay levels, on a broker that then lost them
    observer, name = rabbitmq
    transport = KombuTransport(AMQP_URL)
    transport._delay_levels = own_delay_levels  # this test's own levels, not the shared
    try:
        transport.declare(name("first"))
        _delete_topology(own_delay_levels)

        # When the endpoint declares again (as it does after a failure), the first attempt
        # may fail, but not every attempt after it
        second = name("second")
        with contextlib.suppress(BrokerAccessDenied):
            transport.declare(second)
        transport.declare(second)
    finally:
        transport.close()

    # Then the levels are back, and the queue is bound to them
    with plain_amqp(AMQP_URL) as channel:
        channel.exchange_declare(own_delay_levels.deliver_exchange, "topic", passive=True)
        channel.basic_publish(amqp.Message(b"{}"), exchange=own_delay_levels.deliver_exchange,
                              routing_key=delays.routing_key(1, second))
    assert observer.pending(second) == 1


@pytest.mark.amqp
def test_an_events_exchange_declared_otherwise_is_named_as_an_exchange_not_a_queue(
    rabbitmq: tuple[KombuTransport, Callable[[str], str]], unique: str,
) -> None:
    # Given an events exchange that exists as a fanout exchange
    _, name = rabbitmq
    exchange = f"test-fanout-{unique}"
    with plain_amqp(AMQP_URL) as channel:
        channel.exchange_declare(exchange, "fanout", durable=True, auto_delete=False)
    transport = KombuTransport(AMQP_URL, exchange=exchange)
    queue = name("subscriber")
    try:
        # When an endpoint that subscribes to events declares its queue
        with pytest.raises(ConfigurationError) as refused:
            transport.declare(queue, subscriptions=["test.Deposited"])
    finally:
        transport.delete_exchange()
        transport.close()

    # Then the error is about the exchange, and says what to change
    said = str(refused.value)
    assert said.startswith(f"exchange {exchange!r} exists")
    assert "KombuTransport(exchange=...)" in said
    assert repr(queue) not in said


@pytest.fixture
def redis_names(unique: str) -> Iterator[Callable[[str], str]]:
    """Queue names on Redis for this test, deleted (and unrecorded) afterwards."""
    require_service(REDIS_URL, "Redis")
    names: list[str] = []

    def name(prefix: str) -> str:
        names.append(f"{prefix}-{unique}")
        return names[-1]

    yield name
    cleaner = KombuTransport(REDIS_URL, exchange=f"test-events-{unique}")
    for queue in names:
        cleaner.delete_queue(queue)
    cleaner.delete_exchange()
    cleaner.close()


@pytest.mark.redis
def test_on_redis_a_queue_an_older_idembus_declared_with_subscriptions_takes_sends(
    redis_names: Callable[[str], str], unique: str,
) -> None:
    # Given queues declared as an idembus that did not record them did: one subscribed to
    # an event, one not
    exchange = kombu.Exchange(f"test-events-{unique}", type="topic", durable=True)
    subscribed, plain = redis_names("old-subscriber"), redis_names("old-plain")
    with kombu.Connection(REDIS_URL) as connection:
        channel = connection.channel()
        kombu.Queue(subscribed, durable=True,
                    bindings=[kombu.binding(exchange, routing_key="test.Deposited")]
                    )(channel).declare()
        kombu.Queue(plain, durable=True)(channel).declare()
        assert not channel.client.sismember(REDIS_QUEUES, subscribed)
    transport = KombuTransport(REDIS_URL, exchange=exchange.name)
    try:
        # When a new transport sends to each
        transport.send(envelope(subscribed))

        # Then the subscribed one, bound to the events exchange, takes the message and is
        # recorded; the other cannot be told from a mistyped name and is refused, saying
        # that its endpoint needs a restart
        assert transport.get(subscribed) is not None
        with kombu.Connection(REDIS_URL) as connection:
            assert connection.channel().client.sismember(REDIS_QUEUES, subscribed)
        with pytest.raises(DestinationRefused, match="older idembus.*restart that endpoint"):
            transport.send(envelope(plain))
    finally:
        transport.close()


def test_an_unknown_queue_type_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="queue_type 'lazy'"):
        KombuTransport("memory://", queue_type="lazy")


@pytest.mark.amqp
def test_the_delay_levels_of_quorum_queues_dead_letter_at_least_once(
    rabbitmq: tuple[KombuTransport, Callable[[str], str]],
) -> None:
    if not shutil.which("rabbitmqctl"):
        pytest.skip("rabbitmqctl is not installed here")
    # Given a delayed message sent by a default (quorum) transport
    transport, name = rabbitmq
    queue = name("later")
    transport.declare(queue)
    soon = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=2)
    transport.send(envelope(queue, **{h.DELIVER_AT: soon.isoformat()}))

    # Then its levels are quorum queues with at-least-once dead-lettering
    vhost = AMQP_URL.rsplit("/", 1)[-1] or "/"
    listed = subprocess.run(
        ["rabbitmqctl", "-q", "list_queues", "-p", vhost, "name", "type", "arguments"],
        capture_output=True, text=True, timeout=60, check=True).stdout
    level = next(line for line in listed.splitlines() if line.startswith("idembus.qdelay.0\t")
                 or line.startswith("idembus.qdelay.0 "))
    assert "quorum" in level
    assert "at-least-once" in level
    assert "reject-publish" in level
