"""Every error idembus raises, as one tree.

Each package root keeps its own errors module, and every class below derives from
:class:`BusError`, so ``except idembus.BusError`` catches them all::

    BusError
    ├── ConfigurationError          bad wiring; raised while an endpoint starts
    │   └── idembus.handlers.errors.HandlerDefinitionError
    ├── RoutingError                a command has no destination, a reply no return address
    ├── RequestTimeout              no reply to ``bus.request`` in time (also a TimeoutError)
    ├── RequestFailed               the request's handler failed for good; carries its error
    ├── HandlerContractError        a handler broke the calling contract on a message (also a
    │                               TypeError): returned a value, gave no aggregate id
    ├── IncompatibleState           a stored state the state model cannot read as it is: a
    │                               version without upcaster, fields it no longer declares
    ├── TimeLimitExceeded           a handler ran past its time limit and was abandoned
    │                               (or cancelled); retried per policy
    ├── MessageError                an incoming message that no retry can fix
    │   ├── MalformedMessage        not JSON, wrong content type, a required header missing
    │   ├── UnknownMessageType      the type header names no registered message
    │   └── InvalidMessage          the body does not match the message's schema
    ├── idembus.storage.errors.StorageError
    │   ├── ConcurrencyConflict     the aggregate changed since it was loaded (retry)
    │   ├── AlreadyProcessed        the message was handled before (carries its outgoing)
    │   ├── ConflictRetriesExhausted
    │   ├── StaleLease              a lease's fencing token was superseded
    │   ├── StorageUnavailable      transient: unreachable, timed out, restarting, deadlock
    │   │   ├── CommitOutcomeUnknown    ... during a commit, which may have been applied
    │   │   └── StorageAccessDenied     permanent for the endpoint (+ EndpointBlocked)
    │   └── StorageRefused          permanent for this message (+ MessageRefused)
    └── idembus.transports.errors.TransportError
        ├── TransportUnavailable    transient: connection lost or refused, broker restarting
        │   └── BrokerAccessDenied      permanent for the endpoint (+ EndpointBlocked)
        └── DestinationRefused      permanent for this message (+ MessageRefused)

The failure taxonomy (README, "When the infrastructure fails") is read off this tree:

* *transient* — ``StorageUnavailable`` and ``TransportUnavailable``: wait with backoff; the
  message keeps its place and its retries.
* *permanent for this message* — :class:`MessageRefused` (``StorageRefused``,
  ``DestinationRefused``): an ordinary failure that goes through the retry policy to the
  error queue and never trips the circuit breaker.
* *permanent for the endpoint* — :class:`EndpointBlocked` (``StorageAccessDenied``,
  ``BrokerAccessDenied``): no message can be processed until an operator acts. Logged at
  ERROR on every attempt and shown by ``idembus status``; the message keeps its place, as
  in an outage, and the endpoint keeps trying. Met while starting, it is a configuration
  error (exit status 2).

``SimulatedCrash`` (in :mod:`idembus.testing.faults`) is deliberately *not* in this tree: it stands
for a process dying and derives from ``BaseException`` so that no handler can swallow it.
"""

from __future__ import annotations


class BusError(Exception):
    """Root of every error raised by idembus."""


class ConfigurationError(BusError):
    """The endpoint is wired wrongly; the message says what to change."""


class RoutingError(BusError):
    """An outgoing message has nowhere to go."""


class RequestTimeout(BusError, TimeoutError):
    """No reply came to a request (``bus.request``) within its timeout. The request may
    still be handled later: send it again with the same ``message_id`` to get its stored
    reply rather than a second handling."""

    def __init__(self, reason: str, *, message_id: str) -> None:
        super().__init__(reason)
        #: The id of the request that timed out.
        self.message_id = message_id


class RequestFailed(BusError):
    """The handler of a request (``bus.request``) failed for good: the request went to
    the error queue, and its endpoint answered with this failure instead of a reply.
    ``exception_type`` and ``reason`` are the ones the error queue shows."""

    def __init__(self, reason: str, *, message_id: str, exception_type: str) -> None:
        super().__init__(f"request {message_id} failed: {exception_type}: {reason}")
        #: The id of the request.
        self.message_id = message_id
        #: The qualified name of the exception its handler raised.
        self.exception_type = exception_type
        #: The exception's message, as the error queue keeps it.
        self.reason = reason


class HandlerContractError(BusError, TypeError):
    """A handler broke the calling contract while handling a message: its method returned
    a value (handlers record what they send; they return nothing), ``aggregate_id`` gave no
    id, ``self.state`` was replaced by something else. Retrying cannot help: the message
    goes to the error queue at once with this reason."""


class IncompatibleState(BusError):
    """An aggregate's stored state cannot be loaded into its state model without losing or
    guessing something: it is newer than the model, no upcaster goes from its version, an
    upcaster failed, or it holds fields the model no longer declares (README, "Evolving
    messages and state"). Retrying cannot help until the code changes: the message goes to
    the error queue at once with this reason, and can be retried from there after the fix."""


class TimeLimitExceeded(BusError):
    """A handler ran past its time limit (``time_limit`` on its class, or the endpoint's
    ``Recoverability(time_limits=...)``): it was abandoned (a plain ``def``) or cancelled (an
    ``async def``), and nothing it did is committed. The message goes through the retry
    policy like any failure, and to the error queue after the retries with this type in
    ``idembus.exception.type``. Also raised, in an abandoned handler's own thread, by what it
    sends through ``self.bus`` after its time (:mod:`idembus.runtime.recoverability.time_limits`).
    """


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


class MessageRefused(BusError):
    """Mixin: the broker or the database refused something that belongs to this message
    (its destination, its size, a character the database cannot store). Retrying later
    does not change the message, so it goes through the retry policy to the error queue;
    it says nothing about the health of the dependencies, so the circuit breaker ignores
    it."""


class EndpointBlocked(BusError):
    """Mixin: the endpoint itself cannot work until an operator acts (its login refused,
    its own queue refused, its tables missing or forbidden). Not the message's fault:
    every attempt is logged at ERROR and shown by ``idembus status``."""


class BadStreamRequest(BusError):
    """A request to the event gateway it cannot serve (a bad ``Last-Event-ID``, an unknown
    filter); answered 400 with this reason."""
