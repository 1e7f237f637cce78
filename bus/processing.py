"""The life of one delivery: decode, handle, dispatch, acknowledge.

For each handler of the message type: invoke it (exactly once per handler and message id,
see :mod:`idembus.invocation`), dispatch the outgoing messages it committed or had committed
before, and only when every handler is done acknowledge the delivery.

When a handler keeps raising, its retry policy decides: immediate retries, then delayed
rounds (the message comes back later with the same id, so handlers that already succeeded
find it processed), then the error queue with the reason. Bad input goes to the error queue
at once. Nothing is lost.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from . import headers as h
from . import wire
from .breaker import CircuitBreaker
from .decoding import decode
from .dispatching import Dispatcher
from .envelope import Envelope, format_utc, utc_now
from .errors import BusError, EndpointBlocked, MalformedMessage, MessageError, MessageRefused
from .faults import CrashPoint, FaultInjector
from .handlers.registration import HandlerBinding, HandlerTable
from .health import Health
from .invocation import HandlerInvoker, Outcome
from .logs import Throttle
from .messages import Message
from .parking import park
from .policies import Backoff, RetryPolicy
from .recoverability import failure_headers
from .redaction import redact
from .registry import MessageRegistry
from .signals import EndpointSignals
from .storage.base import PARKED_FROM_ERROR_QUEUE, Storage
from .storage.errors import (
    CommitOutcomeUnknown,
    StorageAccessDenied,
    StorageError,
    StorageUnavailable,
)
from .transports.base import Delivery
from .transports.errors import DestinationRefused, TransportUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Failure:
    """A handler that raised on every immediate attempt."""

    error: Exception
    attempts: int
    policy: RetryPolicy


@dataclass
class _Dispatching:
    """How far the dispatch of one handler's outgoing messages got, across the re-attempts
    an outage forces: what went out (or was parked) is not sent or counted again."""

    sent: list[Envelope] = field(default_factory=list)
    done: set[str] = field(default_factory=set)
    redispatch_counted: bool = False


class MessageProcessor:
    """Processes deliveries of one endpoint; safe to call from several threads."""

    def __init__(
        self,
        *,
        endpoint: str,
        error_queue: str,
        registry: MessageRegistry,
        table: HandlerTable,
        invoker: HandlerInvoker,
        dispatcher: Dispatcher,
        signals: EndpointSignals,
        faults: FaultInjector,
        retries: RetryPolicy,
        breaker: CircuitBreaker,
        compact_after_dispatch: bool,
        stopping: threading.Event,
        outage_backoff: Backoff | None = None,
        health: Health | None = None,
        max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
        storage: Storage,
        left_to_outbox: Callable[[], None] = lambda: None,
    ) -> None:
        self._endpoint = endpoint
        #: Where a message goes when the error queue refuses it (:mod:`idembus.parking`).
        self._storage = storage
        #: Called when a duplicate left an entry to the outbox (which then looks sooner).
        self._left_to_outbox = left_to_outbox
        self._error_queue = error_queue
        self._registry = registry
        self._table = table
        self._invoker = invoker
        self._dispatcher = dispatcher
        self._signals = signals
        self._faults = faults
        self._retries = retries
        self._breaker = breaker
        self._compact = compact_after_dispatch
        self._stopping = stopping
        self._outage_backoff = outage_backoff or Backoff()
        self._health = health or Health()
        self._max_message_bytes = max_message_bytes
        #: Repeated outage warnings: one line per cause every 10 s, with a count.
        self._outage_lines = Throttle(10.0)

    def __call__(self, delivery: Delivery) -> None:
        headers = delivery.headers
        self._signals.emit("received", message_id=headers.get(h.MESSAGE_ID),
                           message_type=headers.get(h.MESSAGE_TYPE))
        problem = wire.problem_with(delivery, max_message_bytes=self._max_message_bytes)
        if problem is not None:
            self._dead_letter(delivery, MalformedMessage(problem), attempts=0)
            return
        try:
            message = decode(headers, delivery.body, delivery.content_type, self._registry)
        except MessageError as error:
            self._dead_letter(delivery, error, attempts=0)
            return
        for binding in self._table.bindings_for(type(message)):
            failure = self._handle(binding, message, delivery)
            if failure is not None:
                self._after_failure(delivery, failure)
                return
        self._faults.reached(CrashPoint.AFTER_DISPATCH, headers[h.MESSAGE_ID])
        delivery.ack()
        self._breaker.succeeded()

    def _handle(
        self, binding: HandlerBinding, message: Message, delivery: Delivery
    ) -> _Failure | None:
        """Invoke and dispatch with immediate retries; the failure if every attempt raised.

        While the database or the broker is unreachable the message keeps its place: the
        attempt is repeated with backoff, retries are not used up, and when the endpoint
        stops meanwhile the delivery goes back to the broker. Once the handler's effects
        are committed, later attempts only dispatch what it committed: a re-attempt is not
        a duplicate.
        """
        policy = type(binding.handler).retry_policy or self._retries
        attempts = 0
        outages = 0
        outcome: Outcome | None = None
        dispatching = _Dispatching()
        commit_may_have_landed = False
        while True:
            attempts += 1
            try:
                if outcome is None:
                    outcome = self._invoker.invoke(
                        binding, message, delivery.headers,
                        commit_may_have_landed=commit_may_have_landed)
                    self._faults.reached(CrashPoint.AFTER_COMMIT,
                                         delivery.headers[h.MESSAGE_ID])
                self._dispatch(outcome, delivery.headers, dispatching)
                self._health.resolved()
                return None
            except (StorageUnavailable, TransportUnavailable) as outage:
                attempts -= 1
                commit_may_have_landed |= isinstance(outage, CommitOutcomeUnknown)
                if self._stopping.is_set():
                    raise
                delay = self._outage_backoff.delay(outages)
                outages += 1
                self._note_outage(outage, binding.handler_name,
                                  delivery.headers[h.MESSAGE_ID], delay)
                self._stopping.wait(delay)
            except Exception as error:
                details = {"message_id": delivery.headers[h.MESSAGE_ID],
                           "message_type": delivery.headers[h.MESSAGE_TYPE],
                           "handler": binding.handler_name, "error": error,
                           "time_sent": delivery.headers.get(h.TIME_SENT)}
                self._signals.emit("failed", attempt=attempts, **details)
                if not policy.should_retry(error, attempts):
                    return _Failure(error, attempts, policy)
                log.info("%s failed on %s (attempt %d), retrying: %r", binding.handler_name,
                         details["message_id"], attempts, error)
                self._signals.emit("retried", attempt=attempts, kind="immediate", **details)

    def _note_outage(self, outage: BusError, handler: str, message_id: str,
                     delay: float) -> None:
        """Say why the message waits: at ERROR, and in ``idembus status``, when only an
        operator can end the wait (a refused login, missing tables)."""
        fields = {"endpoint": self._endpoint, "message_id": message_id, "handler": handler}
        if isinstance(outage, EndpointBlocked):
            source = "storage" if isinstance(outage, StorageUnavailable) else "transport"
            self._health.problem(source, outage)
            log.error("%s cannot process %s: %s; trying again in %.1fs", handler, message_id,
                      redact(str(outage)), delay, extra=fields)
            return
        held_back = self._outage_lines.allow(type(outage).__name__)
        if held_back is not None:
            log.warning("%s cannot process %s (%s); trying again in %.1fs%s", handler,
                        message_id, redact(str(outage)), delay,
                        f" ({held_back} more such line(s) held back in 10s)" if held_back
                        else "", extra=fields)

    def _after_failure(self, delivery: Delivery, failure: _Failure) -> None:
        """Schedule the next delayed round, or give up; then let the breaker weigh in."""
        rounds = _delayed_rounds(delivery)
        delay = failure.policy.delay_after(failure.error, rounds)
        if delay is None:
            self._dead_letter(delivery, failure.error, attempts=failure.attempts)
        else:
            try:
                self._retry_later(delivery, failure.error, rounds + 1, delay)
            except DestinationRefused as refused:  # the delay itself is refused: give up
                log.warning("%s cannot retry %s later (%s); it goes to %s", self._endpoint,
                            delivery.headers.get(h.MESSAGE_ID), redact(str(refused)),
                            self._error_queue)
                self._dead_letter(delivery, failure.error, attempts=failure.attempts)
        if failure.policy.is_unrecoverable(failure.error) or isinstance(failure.error,
                                                                        MessageRefused):
            return  # the message's own fault: says nothing about the dependencies
        pause = self._breaker.failed()
        if pause:
            log.warning("%d messages in a row failed; %s pauses %.1fs before the next",
                        self._breaker.policy.threshold, self._endpoint, pause)
            self._signals.emit("paused", message_id=delivery.headers.get(h.MESSAGE_ID),
                               message_type=delivery.headers.get(h.MESSAGE_TYPE),
                               seconds=pause)
            self._stopping.wait(pause)

    def _retry_later(self, delivery: Delivery, error: Exception, round_number: int,
                     delay: float) -> None:
        """Put the message back on its queue, same id, delivered after ``delay`` seconds."""
        due = utc_now() + datetime.timedelta(seconds=delay)
        self._dispatcher.dispatch(Envelope(
            headers={**delivery.headers, h.DELAYED_ATTEMPTS: str(round_number),
                     h.DELIVER_AT: format_utc(due)},
            body=delivery.body.decode("utf-8", "surrogateescape"),
            destination=delivery.queue,
            content_type=delivery.content_type or h.CONTENT_TYPE,
            content_encoding=delivery.content_encoding,
        ))
        log.info("%s failed on %s; delayed retry %d in %.0fs: %r", self._endpoint,
                 delivery.headers.get(h.MESSAGE_ID), round_number, delay, error)
        self._signals.emit("retried", message_id=delivery.headers.get(h.MESSAGE_ID),
                           message_type=delivery.headers.get(h.MESSAGE_TYPE), kind="delayed",
                           attempt=round_number, error=error, delay=delay)
        delivery.ack()

    def _dispatch(self, outcome: Outcome, incoming: Mapping[str, str],
                  progress: _Dispatching) -> None:
        """Send what ``outcome`` left (what an earlier attempt sent or parked is done), then
        mark it dispatched; or, for a duplicate of an entry committed moments ago, leave it
        to the committer and the outbox."""
        if outcome.left_to_outbox:
            self._signals.emit("left_to_outbox", key=outcome.key, count=len(outcome.outgoing),
                               message_id=incoming.get(h.MESSAGE_ID),
                               message_type=incoming.get(h.MESSAGE_TYPE),
                               handler=outcome.handler)
            self._left_to_outbox()
            return
        for envelope in outcome.outgoing:
            if envelope.message_id in progress.done:
                continue
            went_out = self._dispatcher.dispatch_committed(envelope, endpoint=self._endpoint)
            progress.done.add(envelope.message_id)
            if went_out:
                progress.sent.append(envelope)
                self._signals.emit("dispatched", message_id=envelope.message_id,
                                   message_type=envelope.message_type, envelope=envelope)
        if not outcome.outgoing:
            return
        if outcome.duplicate and not progress.redispatch_counted:
            progress.redispatch_counted = True
            self._signals.emit("redispatched", key=outcome.key, count=len(outcome.outgoing),
                               message_id=incoming.get(h.MESSAGE_ID),
                               message_type=incoming.get(h.MESSAGE_TYPE),
                               handler=outcome.handler,
                               time_sent=incoming.get(h.TIME_SENT))
        self._dispatcher.mark_dispatched(outcome.aggregate_type, outcome.aggregate_id,
                                         outcome.key, progress.sent,
                                         keep_bodies=not self._compact)

    def reject(self, delivery: Delivery, reason: str) -> None:
        """Bad input found before decoding: straight to the error queue with ``reason``."""
        self._dead_letter(delivery, MalformedMessage(reason), attempts=0)

    def _dead_letter(self, delivery: Delivery, error: Exception, *, attempts: int) -> None:
        """Forward the delivery, byte for byte, to the error queue (or park it, if the
        broker refuses the copy); then acknowledge it.

        Until one of them takes it the message keeps its place: an outage, or a storage
        that refuses even a copy without the body, is waited out with backoff (logged, and
        the latter shown by ``idembus status``) — never a hot loop, never dropped."""
        message_id = delivery.headers.get(h.MESSAGE_ID) or "a message without id"
        waits = 0
        while True:
            try:
                self._move_aside(delivery, error, attempts=attempts)
                break
            except (StorageUnavailable, TransportUnavailable) as outage:
                blocked: BusError = outage
            except StorageError as refused:
                blocked = StorageAccessDenied(
                    f"the error queue refused {message_id} and the storage refused to park "
                    f"it, even without its body: {redact(str(refused))}")
            if self._stopping.is_set():
                raise blocked
            delay = self._outage_backoff.delay(waits)
            waits += 1
            self._note_outage(blocked, f"{self._endpoint} (moving it aside)", message_id,
                              delay)
            self._stopping.wait(delay)
        self._health.resolved()
        self._signals.emit("dead_lettered", message_id=delivery.headers.get(h.MESSAGE_ID),
                           message_type=delivery.headers.get(h.MESSAGE_TYPE), error=error,
                           time_sent=delivery.headers.get(h.TIME_SENT))
        delivery.ack()

    def _move_aside(self, delivery: Delivery, error: Exception, *, attempts: int) -> None:
        """One try at the error queue, then at parking; raises what stopped both."""
        delayed = _delayed_rounds(delivery)
        headers = failure_headers(delivery.headers, error, queue=delivery.queue,
                                  immediate_attempts=attempts, delayed_attempts=delayed)
        body = delivery.body.decode("utf-8", "surrogateescape")
        content_type = delivery.content_type or h.CONTENT_TYPE
        try:
            self._dispatcher.dispatch(Envelope(headers=headers, body=body,
                                               destination=self._error_queue,
                                               content_type=content_type,
                                               content_encoding=delivery.content_encoding))
        except DestinationRefused as refused:
            # The broker will not take the copy: keep the message in the storage instead.
            original = Envelope(dict(delivery.headers), body, delivery.queue, content_type,
                                delivery.content_encoding)
            park(self._storage, endpoint=self._endpoint, source=PARKED_FROM_ERROR_QUEUE,
                 envelope=original, queue=delivery.queue, attempts=attempts,
                 delayed_attempts=delayed, error=error, refusal=refused)
            return
        log.warning("moved %s from %s to %s: %s",
                    delivery.headers.get(h.MESSAGE_ID, "a message"), delivery.queue,
                    self._error_queue, headers[h.EXCEPTION_MESSAGE],
                    exc_info=(type(error), error, error.__traceback__)
                    if error.__traceback__ is not None else None,
                    extra={"endpoint": self._endpoint,
                           "message_id": delivery.headers.get(h.MESSAGE_ID),
                           "message_type": delivery.headers.get(h.MESSAGE_TYPE)})


def _delayed_rounds(delivery: Delivery) -> int:
    """How many delayed rounds the message has been through (0 on its first delivery)."""
    try:
        return max(0, int(delivery.headers.get(h.DELAYED_ATTEMPTS) or 0))
    except ValueError:
        return 0
