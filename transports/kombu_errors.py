"""How the kombu transport classifies what the broker and its driver raise (the failure
taxonomy of DESIGN 2b, from kombu's and py-amqp's own error classes): transient
(``TransportUnavailable``), permanent for the message (``DestinationRefused``) or for the
endpoint (``BrokerAccessDenied``)."""

from __future__ import annotations

from collections.abc import Iterator

import amqp.exceptions
import kombu
import kombu.exceptions

from ..redaction import redact
from .errors import BrokerAccessDenied, TransportError, TransportUnavailable

#: What py-amqp raises when the broker refuses a login or its virtual host at connection.
_LOGIN_REFUSED: tuple[type[BaseException], ...] = (amqp.exceptions.AccessRefused,
                                                   amqp.exceptions.NotAllowed)
#: Errors that a publish's content caused: the same publish would fail again.
_MESSAGE_CAUSED: tuple[type[BaseException], ...] = (
    amqp.exceptions.ContentTooLarge, amqp.exceptions.FrameError,
    amqp.exceptions.FrameSyntaxError)


def _broker_errors(connection: kombu.Connection) -> tuple[type[BaseException], ...]:
    """What a delivery's connection raises once it is gone (acknowledging then fails)."""
    return (*connection.connection_errors, *connection.channel_errors,
            kombu.exceptions.OperationalError)


def _causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and what it was raised from (kombu wraps driver errors)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _classified(error: BaseException, connection: kombu.Connection, what: str, *,
                refusal: type[TransportError], url: str,
                preposition: str = "on") -> TransportError | None:
    """The failure taxonomy for a broker error met while doing ``what``: transient
    (``TransportUnavailable``), or ``refusal`` — ``DestinationRefused`` where the broker
    refused this message's destination or content, ``BrokerAccessDenied`` where it refused
    the endpoint's own queue. ``None``: not a broker error."""
    # Some driver errors say nothing (a reset connection's bare ConnectionError): their
    # type says it then.
    text = f"{what} {preposition} {url}: {redact(str(error)) or type(error).__name__}"
    if isinstance(error, TransportError):
        return error
    recoverable = _recoverable(connection)
    for cause in _causes(error):
        if isinstance(cause, _MESSAGE_CAUSED):
            return refusal(text)
        if isinstance(cause, recoverable):
            return TransportUnavailable(text)
        if isinstance(cause, tuple(connection.channel_errors)):
            return refusal(text)
        if isinstance(cause, (*connection.connection_errors,
                              kombu.exceptions.OperationalError)):
            return TransportUnavailable(text)
    if isinstance(error, AttributeError):
        # After its connection died for good, kombu's producer has no connection left.
        return TransportUnavailable(text)
    return None


def _recoverable(connection: kombu.Connection) -> tuple[type[BaseException], ...]:
    """The errors that kombu's transport says go away by themselves. Where a transport does
    not say (memory://, redis://), kombu counts every channel error as recoverable, so a
    missing queue would be waited out forever: only connection errors are, then."""
    transport = connection.get_transport_cls()
    if hasattr(transport, "recoverable_connection_errors"):
        return (*transport.recoverable_connection_errors,
                *getattr(transport, "recoverable_channel_errors", ()))
    return tuple(connection.connection_errors)


def _connection_failure(error: Exception, connection: kombu.Connection,
                        url: str) -> Exception:
    """A failure to connect: a refused login or virtual host is the endpoint's to fix
    (``BrokerAccessDenied``); anything else a broker can say, an outage."""
    for cause in _causes(error):
        if isinstance(cause, _LOGIN_REFUSED) or _is_redis_auth_error(cause):
            return BrokerAccessDenied(f"{url} refused this endpoint: {redact(str(cause))}")
    classified = _classified(error, connection, "cannot connect", refusal=TransportUnavailable,
                             url=url, preposition="to")
    return classified if classified is not None else TransportUnavailable(
        f"cannot connect to {url}: {redact(str(error))}")


def _is_redis_auth_error(error: BaseException) -> bool:
    """redis-py's refusal of a password (or of a missing one)."""
    name = type(error).__name__
    return (type(error).__module__.startswith("redis") and name.startswith("Authentication")
            or "NOAUTH" in str(error) or "WRONGPASS" in str(error))

