"""Every error idembus raises, as one tree.

Each package root keeps its own errors module, and every class below derives from
:class:`BusError`, so ``except bus.BusError`` catches them all::

    BusError
    ├── ConfigurationError          bad wiring; raised while an endpoint starts
    │   └── handlers.errors.HandlerDefinitionError
    ├── RoutingError                a command has no destination, a reply no return address
    ├── MessageError                an incoming message that no retry can fix
    │   ├── MalformedMessage        not JSON, wrong content type, a required header missing
    │   ├── UnknownMessageType      the type header names no registered message
    │   └── InvalidMessage          the body does not match the message's schema
    ├── storage.errors.StorageError
    │   ├── ConcurrencyConflict     the aggregate changed since it was loaded (retry)
    │   ├── AlreadyProcessed        the message was handled before (carries its outgoing)
    │   ├── ConflictRetriesExhausted
    │   ├── StaleLease              a lease's fencing token was superseded
    │   └── StorageUnavailable
    └── transports.errors.TransportError
        └── TransportUnavailable

``SimulatedCrash`` (in :mod:`bus.faults`) is deliberately *not* in this tree: it stands
for a process dying and derives from ``BaseException`` so that no handler can swallow it.
"""

from __future__ import annotations


class BusError(Exception):
    """Root of every error raised by idembus."""


class ConfigurationError(BusError):
    """The endpoint is wired wrongly; the message says what to change."""


class RoutingError(BusError):
    """An outgoing message has nowhere to go."""


class MessageError(BusError):
    """An incoming message cannot be processed, and retrying would not help.

    Messages failing this way go straight to the error queue with ``reason``.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class MalformedMessage(MessageError):
    """The body is not JSON, the content type is wrong, or a required header is missing."""


class UnknownMessageType(MessageError):
    """The message type header names a type this endpoint does not know."""


class InvalidMessage(MessageError):
    """The body is JSON but does not match the message type's schema."""


class BadStreamRequest(BusError):
    """A request to the event gateway it cannot serve (a bad ``Last-Event-ID``, an unknown
    filter); answered 400 with this reason."""
