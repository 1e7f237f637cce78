"""Broker failures classified at the kombu seam (DESIGN §2b), sends that fail loudly, and
RabbitMQ's queue types."""

from __future__ import annotations

import datetime
import shutil
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator

import pytest

from idembus import headers as h
from idembus.envelope import Envelope
from idembus.errors import ConfigurationError
from idembus.transports.errors import BrokerAccessDenied, DestinationRefused
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL, require_service

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


@pytest.fixture
def rabbitmq(unique: str) -> Iterator[tuple[KombuTransport, Callable[[str], str]]]:
    require_service(AMQP_URL, "RabbitMQ")
    transport = KombuTransport(AMQP_URL, exchange=f"test-events-{unique}")
    names: list[str] = []

    def name(prefix: str) -> str:
        names.append(f"{prefix}-{unique}")
        return names[-1]

    yield transport, name
    for queue in names:
        transport.delete_queue(queue)
    transport.delete_exchange()
    transport.close()


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
