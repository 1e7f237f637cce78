"""The failure taxonomy at the broker seam, offline: py-amqp's and kombu's own error classes
decide whether a failed publish is an outage (wait), the message's own fault (retries, then
the error queue or parking) or the endpoint's (an operator must act). No broker is needed:
the classes and kombu's recoverable tuples are what the running code sees."""

from __future__ import annotations

import amqp.exceptions as amqp_errors
import kombu
import kombu.exceptions
import pytest

from idembus.transports.errors import (
    BrokerAccessDenied,
    DestinationRefused,
    TransportError,
    TransportUnavailable,
)
from idembus.transports.kombu import _classified, _connection_failure

URL = "amqp://app:Sw0rdf1sh@broker.example:5672//"

OUTAGES = [
    amqp_errors.ConnectionForced("CONNECTION_FORCED - broker shutting down"),
    amqp_errors.RecoverableConnectionError("connection already closed"),
    amqp_errors.ResourceLocked("RESOURCE_LOCKED - queue in use"),
    amqp_errors.NoConsumers("NO_CONSUMERS"),
    amqp_errors.MessageNacked("the broker nacked the message"),
    ConnectionResetError("Connection reset by peer"),
    TimeoutError("timed out"),
    kombu.exceptions.OperationalError("[Errno 111] Connection refused"),
]
MESSAGE_FAULTS = [
    amqp_errors.NotFound("NOT_FOUND - no exchange 'idembus.delay.00'"),
    amqp_errors.PreconditionFailed("PRECONDITION_FAILED - inequivalent arg 'x-queue-type'"),
    amqp_errors.AccessRefused("ACCESS_REFUSED - queue name 'amq.gen-x' contains reserved prefix"),
    amqp_errors.ContentTooLarge("message size 200000000 is larger than configured max size"),
    amqp_errors.FrameError("FRAME_ERROR - type 1, first 16 octets"),
]


@pytest.fixture
def connection() -> kombu.Connection:
    return kombu.Connection(URL)  # resolves the transport; never connects


@pytest.mark.parametrize("error", OUTAGES, ids=lambda e: type(e).__name__)
def test_errors_kombu_and_py_amqp_call_recoverable_are_outages(
    connection: kombu.Connection, error: BaseException,
) -> None:
    classified = _classified(error, connection, "publishing m-1", refusal=DestinationRefused,
                             url=URL)
    assert isinstance(classified, TransportUnavailable)
    assert not isinstance(classified, BrokerAccessDenied)


@pytest.mark.parametrize("error", MESSAGE_FAULTS, ids=lambda e: type(e).__name__)
def test_every_other_channel_error_on_a_publish_is_the_messages_own(
    connection: kombu.Connection, error: BaseException,
) -> None:
    classified = _classified(error, connection, "publishing m-1", refusal=DestinationRefused,
                             url=URL)
    assert isinstance(classified, DestinationRefused)
    assert "publishing m-1" in str(classified)


@pytest.mark.parametrize("error", MESSAGE_FAULTS[:3], ids=lambda e: type(e).__name__)
def test_the_same_refusal_of_the_endpoints_own_queue_blocks_the_endpoint(
    connection: kombu.Connection, error: BaseException,
) -> None:
    classified = _classified(error, connection, "consuming 'sales'", refusal=BrokerAccessDenied,
                             url=URL)
    assert isinstance(classified, BrokerAccessDenied)


def test_a_wrapped_driver_error_is_classified_by_its_cause(
    connection: kombu.Connection,
) -> None:
    try:
        try:
            raise amqp_errors.NotFound("NOT_FOUND - no queue 'gone'")
        except amqp_errors.NotFound as cause:
            raise RuntimeError("kombu wrapped it") from cause
    except RuntimeError as wrapped:
        classified = _classified(wrapped, connection, "publishing m-1",
                                 refusal=DestinationRefused, url=URL)
    assert isinstance(classified, DestinationRefused)


def test_what_is_not_a_broker_error_is_left_to_the_caller(
    connection: kombu.Connection,
) -> None:
    assert _classified(ValueError("a bug"), connection, "publishing m-1",
                       refusal=DestinationRefused, url=URL) is None


@pytest.mark.parametrize("error", [
    amqp_errors.AccessRefused("(0, 0): (403) ACCESS_REFUSED - Login was refused using "
                              "authentication mechanism AMQPLAIN"),
    amqp_errors.NotAllowed("(0, 0): (530) NOT_ALLOWED - vhost shop does not exist"),
], ids=["login", "vhost"])
def test_a_login_or_virtual_host_refused_at_connection_blocks_the_endpoint_without_secrets(
    connection: kombu.Connection, error: BaseException,
) -> None:
    classified = _connection_failure(error, connection, "amqp://app:***@broker.example:5672//")
    assert isinstance(classified, BrokerAccessDenied)
    assert "Sw0rdf1sh" not in str(classified)


def test_a_refused_connection_is_an_outage(connection: kombu.Connection) -> None:
    classified = _connection_failure(ConnectionRefusedError(111, "Connection refused"),
                                     connection, "amqp://app:***@broker.example:5672//")
    assert isinstance(classified, TransportUnavailable)
    assert isinstance(classified, TransportError)


def test_an_outage_that_says_nothing_is_named_by_its_type(connection: kombu.Connection) -> None:
    # A reset connection can end a publish with a bare ConnectionError: no text at all
    classified = _classified(ConnectionError(), connection, "publishing m-1",
                             refusal=DestinationRefused, url=URL)

    assert isinstance(classified, TransportUnavailable)
    assert str(classified).endswith(": ConnectionError")
