"""The life of one delivery: decode, handle, dispatch, acknowledge.

For each handler of the message type: invoke it (exactly once per handler and message id,
see :mod:`idembus.runtime.invocation`), dispatch the outgoing messages it committed or had committed
before, and only when every handler is done acknowledge the delivery. All of it runs inside
the endpoint's middleware (:mod:`idembus.pipeline`): the ``message`` stage around the whole,
the ``handler`` stage around each handler attempt.

When a handler keeps raising, its retry policy decides: immediate retries, then delayed
rounds (the message comes back later with the same id, so handlers that already succeeded
find it processed), then the error queue with the reason. Bad input goes to the error queue
at once. Nothing is lost.

A message received after its ``idembus.discard_after`` (:mod:`idembus.expiry`) is
acknowledged without running the handlers that had not processed it yet (``discarded``);
those that had still send again what they stored.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .. import headers as h
from .. import wire
from ..envelope import Envelope, format_utc
from ..errors import BusError, MalformedMessage, MessageError
from ..expiry import expiry_of
from ..failures import MAX_EXCEPTION_MESSAGE, failure_headers
from ..handlers.registration import HandlerBinding
from ..logs import LIMIT, loggable, message_context, message_logger, per_message_level
from ..messages import Message
from ..pipeline import (
    HandlerCall,
    IncomingMessage,
    Pipeline,
    PipelineControl,
    RejectMessage,
    RetryLater,
    SkipMessage,
)
from ..policies import RetryPolicy
from ..redaction import redact
from ..storage.base import PARKED_FROM_ERROR_QUEUE, ParkingStore
from ..storage.claims import hold, is_claimed, keep_longer, resolved, retention_of
from ..storage.errors import (
    CommitOutcomeUnknown,
    StorageAccessDenied,
    StorageError,
    StorageUnavailable,
)
from ..transports.base import Delivery
from ..transports.errors import DestinationRefused, TransportUnavailable
from .decoding import UnorderedArrivals, decode
from .dispatching import Dispatcher, DispatchProgress
from .endpoint_context import EndpointContext
from .invocation import HandlerInvoker, Outcome
from .recoverability.parking import park
from .recoverability.policy import Recovery
from .requests import failure_reply

log = message_logger(__name__)
#: The one line per processed message (:func:`idembus.logs.log_per_message`).
per_message = logging.getLogger("idembus.per_message")


@dataclass(frozen=True)
class _Failure:
    """A handler that raised on every immediate attempt."""

    error: Exception
    attempts: int
    policy: RetryPolicy
    #: The handler that failed (``""``: before any handler, a middleware's hook).
    handler: str = ""


@dataclass
class _Dispatching(DispatchProgress):
    """:class:`DispatchProgress` of one handler's outgoing messages, and whether their
    redispatch was counted already."""

    redispatch_counted: bool = field(default=False)


def _dispatch_details(outcome: Outcome, headers: Mapping[str, str]) -> dict[str, object]:
    """What the ``left_to_outbox`` and ``redispatched`` signals say of ``outcome``'s
    outgoing messages (worked out only when one is sent, not for every message)."""
    return {"key": outcome.key, "count": len(outcome.outgoing),
            "message_id": headers.get(h.MESSAGE_ID),
            "message_type": headers.get(h.MESSAGE_TYPE), "handler": outcome.handler}


class MessageProcessor:
    """Processes deliveries of one endpoint; safe to call from several threads.

    The storage keeps what the error queue refuses
    (:mod:`idembus.runtime.recoverability.parking`); ``left_to_outbox`` is called when a
    duplicate left an entry to the outbox (which then looks sooner); the context's clock
    tells whether a message expired and when a delayed retry is due.
    """

    #: The storage role a processor uses: parking what the error queue refuses.
    storage_roles = (ParkingStore,)

    def __init__(self, context: EndpointContext, invoker: HandlerInvoker,
                 dispatcher: Dispatcher, recovery: Recovery, *,
                 left_to_outbox: Callable[[], None] = lambda: None) -> None:
        self._endpoint = context.name
        self._clock = context.clock
        self._error_queue = context.error_queue
        self._registry = context.registry
        self._table = context.table
        self._invoker = invoker
        self._dispatcher = dispatcher
        self._pipeline: Pipeline = context.pipeline
        self._recovery = recovery
        self._signals = context.signals
        self._storage = context.role(ParkingStore)
        self._max_message_bytes = context.max_message_bytes
        #: Where claim-checked bodies are read (``None``: nowhere, such a message fails).
        self._payloads = context.payloads()
        #: How long a claim-checked body is kept past a delayed retry's due time.
        self._retention = retention_of(context.claim_check)
        self._left_to_outbox = left_to_outbox
        self._unordered = UnorderedArrivals(context.name, context.table.message_types,
                                            context.router, context.signals)

    def __call__(self, delivery: Delivery) -> None:
        headers = delivery.headers
        with message_context(endpoint=self._endpoint, message_id=_logged_id(headers),
                             message_type=_logged_type(headers)):
            self._receive(delivery, headers)

    def _receive(self, delivery: Delivery, headers: Mapping[str, str]) -> None:
        message_id, message_type = headers.get(h.MESSAGE_ID), headers.get(h.MESSAGE_TYPE)
        signals = self._signals
        signals.emit("received", message_id=message_id, message_type=message_type)
        incoming = IncomingMessage(self._endpoint, delivery.queue, headers)
        started = time.perf_counter()
        try:
            pause = self._settle(delivery, incoming)
        finally:  # interrupted too (outcome None): what counts in-flight deliveries needs it
            signals.emit("settled", message_id=message_id, message_type=message_type,
                         outcome=incoming.outcome, effects=incoming.effects,
                         seconds=time.perf_counter() - started,
                         time_sent=headers.get(h.TIME_SENT),
                         deliver_at=headers.get(h.DELIVER_AT))
        delivery.ack()
        level = per_message_level()
        if level is not None:
            elapsed = round((time.perf_counter() - started) * 1000, 1)
            outcome = incoming.outcome or "interrupted"
            per_message.log(level, "%s %s %s in %.1f ms", outcome, _logged_type(headers) or "-",
                            _logged_id(headers), elapsed,
                            extra={"outcome": outcome, "duration_ms": elapsed})
        if pause:
            signals.emit("paused", message_id=message_id, message_type=message_type,
                         seconds=pause)
            self._recovery.stopping.wait(pause)

    def _settle(self, delivery: Delivery, incoming: IncomingMessage) -> float:
        """The delivery through the message stage until it is settled (not acknowledged);
        returns how long the breaker pauses."""
        headers = delivery.headers
        try:
            return self._pipeline.message(incoming, lambda: self._process(delivery, incoming))
        except PipelineControl as control:  # raised by a before_message hook
            self._steer(delivery, incoming, control)
        except (StorageUnavailable, TransportUnavailable):
            raise  # an outage while stopping: the broker delivers the message again
        except Exception as error:
            # A before_message hook failed (or a bug): the message's failure, not a requeue
            # that would bring it straight back, forever.
            log.exception("%s could not process %s", self._endpoint, _logged_id(headers))
            self._signals.emit("failed", message_id=headers.get(h.MESSAGE_ID),
                               message_type=headers.get(h.MESSAGE_TYPE), error=error,
                               attempt=1, time_sent=headers.get(h.TIME_SENT))
            return self._after_failure(delivery, incoming, _Failure(
                error, 1, self._recovery.settings.retries))
        return 0.0

    def _process(self, delivery: Delivery, incoming: IncomingMessage) -> float:
        """Everything but the acknowledgement; returns how long the breaker pauses."""
        problem = wire.problem_with(delivery, max_message_bytes=self._max_message_bytes)
        if problem is not None:
            self._dead_letter(delivery, incoming, MalformedMessage(problem), attempts=0)
            return 0.0
        try:
            message = decode(delivery.headers, self._body(delivery), delivery.content_type,
                             self._registry)
            expires = expiry_of(delivery.headers)
        except MessageError as error:
            self._dead_letter(delivery, incoming, error, attempts=0)
            return 0.0
        except StorageUnavailable:
            raise  # the payload store, while stopping: the broker delivers the message again
        except Exception as error:
            # Whatever else decoding raised (a header no check foresaw, a model validator
            # raising something pydantic does not wrap) is still the message's own fault:
            # to the error queue at once, never retried nor weighed by the circuit breaker.
            self._dead_letter(delivery, incoming, undecodable(error), attempts=0)
            return 0.0
        incoming.message = message
        unordered = self._unordered
        if unordered.types and type(message) in unordered.types \
                and h.ORDERING_KEY not in delivery.headers:
            unordered.arrived(message, delivery.headers)
        expired = expires is not None and self._clock.now() > expires
        try:
            failure = self._run_handlers(delivery, incoming, message, expired)
            if failure is not None and h.ORDERING_KEY in delivery.headers:
                return self._retry_in_place(delivery, incoming, message, expired, failure)
            if failure is not None:
                return self._after_failure(delivery, incoming, failure)
        except PipelineControl as control:  # RetryLater or RejectMessage
            self._steer(delivery, incoming, control)
        return 0.0

    def _run_handlers(self, delivery: Delivery, incoming: IncomingMessage, message: Message,
                      expired: bool) -> _Failure | None:
        """Every handler of ``message`` in turn; the first failure, or ``None`` once the
        message is settled (its outcome and effects said, the breaker told)."""
        discarded = False
        effects = "dropped"  # until a handler did more: see IncomingMessage.effects
        bindings = self._table.bindings_for(type(message))
        for binding in bindings:
            done = self._handle(binding, message, delivery, incoming, expired=expired,
                                last=binding is bindings[-1])
            if isinstance(done, _Failure):
                return done
            if done is not None:
                discarded |= done.discarded
                if done.duplicate:
                    effects = "duplicate" if effects == "dropped" else effects
                elif not (done.discarded or done.dropped):
                    effects = "handled"
        incoming.outcome = "discarded" if discarded else "handled"
        incoming.effects = effects
        self._recovery.message_succeeded()
        return None

    def _retry_in_place(self, delivery: Delivery, incoming: IncomingMessage, message: Message,
                        expired: bool, failure: _Failure) -> float:
        """The delayed retries of an ordered message (``idembus.ordering.key``), made while
        it holds its place: the consumer waits each delay out with the message
        unacknowledged, so that no later message of its key (nor of its partition) passes
        it. The endpoint stopping meanwhile gives it back to its queue, first in line.
        Once the policy gives up it goes to the error queue and its key moves on."""
        rounds = _header_count(delivery, h.DELAYED_ATTEMPTS)
        while True:
            delay = failure.policy.delay_after(failure.error, rounds)
            if delay is None:
                with message_context(handler=failure.handler or None, attempt=failure.attempts):
                    self._dead_letter(delivery, incoming, failure.error,
                                      attempts=failure.attempts)
                return self._recovery.message_failed(failure.error, failure.policy)
            rounds += 1
            log.info("%s failed on ordered %s; delayed retry %d in place in %.0fs: %s",
                     self._endpoint, _logged_id(delivery.headers), rounds, delay,
                     loggable(repr(failure.error), 500))
            self._signals.emit("retried", message_id=delivery.headers.get(h.MESSAGE_ID),
                               message_type=delivery.headers.get(h.MESSAGE_TYPE),
                               kind="delayed", attempt=rounds, error=failure.error,
                               delay=delay)
            if self._recovery.stopping.wait(delay):
                raise TransportUnavailable(
                    f"{self._endpoint} stopped while ordered message "
                    f"{_logged_id(delivery.headers)} waited for its delayed retry; it goes "
                    "back to its queue")
            next_failure = self._run_handlers(delivery, incoming, message, expired)
            if next_failure is None:
                return 0.0
            failure = next_failure

    def _body(self, delivery: Delivery) -> bytes:
        """The delivery's body, or the claim-checked body its reference names
        (:mod:`idembus.storage.claims`), read from the payload store; while the store is
        unreachable the message waits with backoff. A reference that cannot be resolved
        raises :class:`~idembus.errors.MalformedMessage`: to the error queue, reference
        kept."""
        if not is_claimed(delivery.headers):
            return delivery.body
        outages = 0
        while True:
            try:
                return resolved(delivery.headers, delivery.body, self._payloads)
            except StorageUnavailable as outage:
                self._recovery.wait_out(outage, outages, who=self._endpoint,
                                        message_id=_logged_id(delivery.headers))
                outages += 1

    def _steer(self, delivery: Delivery, incoming: IncomingMessage,
               control: PipelineControl) -> None:
        """Do what a control-flow exception of middleware or a handler asks."""
        if isinstance(control, SkipMessage):
            incoming.outcome = "skipped"
            self._skipped(self._endpoint, delivery.headers, control)
        elif isinstance(control, RetryLater):
            self._postpone(delivery, incoming, control)
        else:
            self._dead_letter(delivery, incoming, control, attempts=0)

    def _skipped(self, who: str, headers: Mapping[str, str], skip: PipelineControl,
                 **handler: str) -> None:
        """Say that ``who`` (the endpoint, or one handler) skipped the message."""
        message_id = headers.get(h.MESSAGE_ID)
        log.info("%s skipped %s: %s", who, _logged_id(headers), skip.reason)
        self._signals.emit("skipped", message_id=message_id,
                           message_type=headers.get(h.MESSAGE_TYPE), reason=skip.reason,
                           **handler)

    def _discarded(self, handler: str, headers: Mapping[str, str]) -> None:
        """Say that ``handler`` did not run on a message received after its time."""
        message_id = headers.get(h.MESSAGE_ID)
        log.info("%s discarded %s: received at %s, after its %s %s", handler,
                 _logged_id(headers), format_utc(self._clock.now()), h.DISCARD_AFTER,
                 loggable(headers.get(h.DISCARD_AFTER)),
                 extra={"endpoint": self._endpoint, "message_id": _logged_id(headers),
                        "message_type": loggable(headers.get(h.MESSAGE_TYPE)),
                        "handler": handler})
        self._signals.emit("discarded", message_id=message_id,
                           message_type=headers.get(h.MESSAGE_TYPE), handler=handler,
                           discard_after=headers.get(h.DISCARD_AFTER),
                           time_sent=headers.get(h.TIME_SENT))

    def _handle(
        self, binding: HandlerBinding, message: Message, delivery: Delivery,
        incoming: IncomingMessage, *, expired: bool = False, last: bool = False,
    ) -> _Failure | Outcome | None:
        """Invoke and dispatch with immediate retries; the failure if every attempt raised,
        else the outcome (``None``: the handler skipped the message). The ``last`` handler
        of the message may remove it from its queue in its commit (a shared transaction,
        :mod:`idembus.runtime.shared_transaction`).

        While the database or the broker is unreachable the message keeps its place: the
        attempt is repeated with backoff, retries are not used up, and when the endpoint
        stops meanwhile the delivery goes back to the broker. Once the handler's effects
        are committed, later attempts only dispatch what it committed: a re-attempt is not
        a duplicate. A :class:`SkipMessage` skips this handler; the other control-flow
        exceptions go up to the message. An ``expired`` message that the handler had not
        processed is discarded (:mod:`idembus.expiry`).
        """
        context = self._invoker.context_for(binding, delivery.headers)
        handler_name = context.handler_name
        attempts = 0
        outages = 0
        outcome: Outcome | None = None
        dispatching: _Dispatching | None = None  # once there is something to send
        commit_may_have_landed = False
        while True:
            attempts += 1
            with message_context(handler=handler_name, attempt=attempts):
                try:
                    if outcome is None:
                        call = HandlerCall(incoming, context, message, attempts,
                                           handler_object=binding.handler)
                        outcome = self._pipeline.handler(call, _invoking(
                            self._invoker, binding, call, commit_may_have_landed, expired,
                            delivery if last else None))
                        if outcome.discarded:
                            self._discarded(handler_name, delivery.headers)
                    if outcome.outgoing:  # else born dispatched: nothing to send or mark
                        dispatching = dispatching or _Dispatching()
                        self._dispatch(outcome, delivery.headers, dispatching)
                    self._recovery.recovered()
                    return outcome
                except SkipMessage as skip:
                    self._skipped(handler_name, delivery.headers, skip,
                                  handler=handler_name)
                    return None
                except PipelineControl:
                    raise
                except (StorageUnavailable, TransportUnavailable) as outage:
                    attempts -= 1
                    commit_may_have_landed |= isinstance(outage, CommitOutcomeUnknown)
                    self._recovery.wait_out(outage, outages, who=handler_name,
                                            message_id=context.message_id)
                    outages += 1
                except Exception as error:
                    details = {"message_id": context.message_id,
                               "message_type": context.message_type,
                               "handler": handler_name, "error": error,
                               "time_sent": delivery.headers.get(h.TIME_SENT)}
                    self._signals.emit("failed", attempt=attempts, **details)
                    policy = self._recovery.retry_policy(binding.handler)
                    if not policy.should_retry(error, attempts):
                        return _Failure(error, attempts, policy, handler_name)
                    log.info("%s failed on %s (attempt %d), retrying: %s", handler_name,
                             _logged_id(delivery.headers), attempts, loggable(repr(error), 500))
                    self._signals.emit("retried", attempt=attempts, kind="immediate", **details)

    def _after_failure(self, delivery: Delivery, incoming: IncomingMessage,
                       failure: _Failure) -> float:
        """Schedule the next delayed round, or give up; return the breaker's pause."""
        with message_context(handler=failure.handler or None, attempt=failure.attempts):
            return self._retry_or_give_up(delivery, incoming, failure)

    def _retry_or_give_up(self, delivery: Delivery, incoming: IncomingMessage,
                          failure: _Failure) -> float:
        rounds = _header_count(delivery, h.DELAYED_ATTEMPTS)
        delay = failure.policy.delay_after(failure.error, rounds)
        if delay is None:
            self._dead_letter(delivery, incoming, failure.error, attempts=failure.attempts)
        else:
            try:
                self._send_back(delivery, {h.DELAYED_ATTEMPTS: str(rounds + 1)}, delay)
            except DestinationRefused as refused:  # the delay itself is refused: give up
                log.warning("%s cannot retry %s later (%s); it goes to %s", self._endpoint,
                            _logged_id(delivery.headers), redact(str(refused)),
                            self._error_queue)
                self._dead_letter(delivery, incoming, failure.error, attempts=failure.attempts)
            else:
                incoming.outcome = "retrying"
                log.info("%s failed on %s; delayed retry %d in %.0fs: %s", self._endpoint,
                         _logged_id(delivery.headers), rounds + 1, delay,
                         loggable(repr(failure.error), 500))
                self._signals.emit("retried", message_id=delivery.headers.get(h.MESSAGE_ID),
                                   message_type=delivery.headers.get(h.MESSAGE_TYPE),
                                   kind="delayed", attempt=rounds + 1, error=failure.error,
                                   delay=delay)
        return self._recovery.message_failed(failure.error, failure.policy)

    def _postpone(self, delivery: Delivery, incoming: IncomingMessage,
                  later: RetryLater) -> None:
        """Send the message back for later (:class:`RetryLater`), or to the error queue once
        it was postponed ``give_up_after`` times in a row."""
        count = _header_count(delivery, h.POSTPONEMENTS) + later.counted
        if count > later.give_up_after:
            self._dead_letter(delivery, incoming, RejectMessage(
                f"postponed {count - 1} times in a row, the most allowed: {later.reason}"),
                attempts=0)
            return
        changes = {**later.headers, h.POSTPONEMENTS: str(count)} if later.counted else {
            **later.headers}
        self._send_back(delivery, changes, later.delay)
        incoming.outcome = "retry_later"
        # a limit's postponements are routine: not one INFO line for each
        log.log(logging.INFO if later.counted else logging.DEBUG,
                "%s postponed %s by %.0fs (%d in a row): %s", self._endpoint,
                _logged_id(delivery.headers), later.delay, count, later.reason)
        self._signals.emit("postponed", message_id=delivery.headers.get(h.MESSAGE_ID),
                           message_type=delivery.headers.get(h.MESSAGE_TYPE), delay=later.delay,
                           attempt=count, reason=later.reason)

    def _send_back(self, delivery: Delivery, changes: dict[str, str], delay: float) -> None:
        """Put the message back on its queue, same id and bytes, delivered after ``delay``
        seconds, with ``changes`` to its headers."""
        due = self._clock.now() + datetime.timedelta(seconds=delay)
        # its claim-checked body outlives the wait, whatever time it had left
        keep_longer(delivery.headers, self._payloads, until=due + self._retention)
        self._dispatcher.dispatch(Envelope(
            headers={**delivery.headers, **changes, h.DELIVER_AT: format_utc(due)},
            body=delivery.body.decode("utf-8", "surrogateescape"),
            destination=delivery.queue,
            content_type=delivery.content_type or h.CONTENT_TYPE,
            content_encoding=delivery.content_encoding,
        ))

    def _dispatch(self, outcome: Outcome, headers: Mapping[str, str],
                  progress: _Dispatching) -> None:
        """Send what ``outcome`` left and mark it (what an earlier attempt sent or parked is
        done); or, for a duplicate of an entry committed moments ago, leave it to the
        committer and the outbox."""
        if not outcome.outgoing:
            return  # an entry without outgoing messages is born dispatched
        if outcome.left_to_outbox:
            self._signals.emit("left_to_outbox", **_dispatch_details(outcome, headers))
            self._left_to_outbox()
            return
        already = len(progress.sent)
        try:
            self._dispatcher.send_committed(
                outcome.aggregate_type, outcome.aggregate_id, outcome.key, outcome.outgoing,
                source="redispatch" if outcome.duplicate else "handler", progress=progress)
        finally:
            for envelope in progress.sent[already:]:
                sent = envelope.headers
                self._signals.emit("dispatched", message_id=sent[h.MESSAGE_ID],
                                   message_type=sent[h.MESSAGE_TYPE], envelope=envelope)
            if (outcome.duplicate and outcome.outgoing and not progress.redispatch_counted
                    and len(progress.done) == len(outcome.outgoing)):
                progress.redispatch_counted = True
                self._signals.emit("redispatched", time_sent=headers.get(h.TIME_SENT),
                                   **_dispatch_details(outcome, headers))

    def reject(self, delivery: Delivery, reason: str) -> None:
        """Bad input found before decoding: straight to the error queue with ``reason``;
        then acknowledge it."""
        incoming = IncomingMessage(self._endpoint, delivery.queue, delivery.headers)
        self._dead_letter(delivery, incoming, MalformedMessage(reason), attempts=0)
        delivery.ack()

    def _dead_letter(self, delivery: Delivery, incoming: IncomingMessage, error: Exception, *,
                     attempts: int) -> None:
        """Forward the delivery, byte for byte, to the error queue (or park it, if the
        broker refuses the copy); the caller acknowledges it.

        Until one of them takes it the message keeps its place: an outage, or a storage
        that refuses even a copy without the body, is waited out with backoff (logged, and
        the latter shown by ``idembus status``) — never a hot loop, never dropped."""
        message_id = _logged_id(delivery.headers)
        waits = 0
        held: dict[str, str] | None = None
        while True:
            try:
                if held is None:  # once: the copy holds its claim-checked body
                    held = hold(delivery.headers, self._payloads)
                failure = self._move_aside(delivery, error, attempts=attempts, held=held)
                break
            except (StorageUnavailable, TransportUnavailable) as outage:
                blocked: BusError = outage
            except StorageError as refused:
                blocked = StorageAccessDenied(
                    f"the error queue refused {message_id} and the storage refused to park "
                    f"it, even without its body: {redact(str(refused))}")
            self._recovery.wait_out(blocked, waits, who=f"{self._endpoint} (moving it aside)",
                                    message_id=message_id)
            waits += 1
        self._recovery.recovered()
        self._answer_failure(delivery, failure)
        incoming.outcome = "dead_lettered"
        self._signals.emit("dead_lettered", message_id=delivery.headers.get(h.MESSAGE_ID),
                           message_type=delivery.headers.get(h.MESSAGE_TYPE), error=error,
                           time_sent=delivery.headers.get(h.TIME_SENT))

    def _answer_failure(self, delivery: Delivery, failure: Mapping[str, str]) -> None:
        """If someone awaits the failed message (``bus.request``), send them the failure
        (:func:`~.requests.failure_reply`); a requester gone, or any other trouble, only
        costs them the wait until their timeout."""
        reply = failure_reply(delivery.headers, failure, endpoint=self._endpoint)
        if reply is None:
            return
        try:
            self._dispatcher.dispatch(reply)
        except BusError as error:
            log.info("the failure of request %s could not be sent to %r: %s",
                     _logged_id(delivery.headers), reply.destination, redact(str(error)))

    def _move_aside(self, delivery: Delivery, error: Exception, *, attempts: int,
                    held: Mapping[str, str]) -> Mapping[str, str]:
        """One try at the error queue, then at parking, the copy with the headers of the
        hold on its claim-checked body (``held``); raises what stopped both. Returns the
        failure headers."""
        delayed = _header_count(delivery, h.DELAYED_ATTEMPTS)
        original_headers = {**delivery.headers, **held}
        headers = failure_headers(original_headers, error, queue=delivery.queue,
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
            original = Envelope(original_headers, body, delivery.queue, content_type,
                                delivery.content_encoding)
            park(self._storage, endpoint=self._endpoint, source=PARKED_FROM_ERROR_QUEUE,
                 envelope=original, queue=delivery.queue, attempts=attempts,
                 delayed_attempts=delayed, error=error, refusal=refused)
            return headers
        log.warning("moved %s from %s to %s: %s", _logged_id(delivery.headers),
                    delivery.queue, self._error_queue,
                    loggable(headers[h.EXCEPTION_MESSAGE], MAX_EXCEPTION_MESSAGE),
                    exc_info=(type(error), error, error.__traceback__)
                    if error.__traceback__ is not None else None,
                    extra={"endpoint": self._endpoint,
                           "message_id": _logged_id(delivery.headers),
                           "message_type": loggable(delivery.headers.get(h.MESSAGE_TYPE))})
        return headers


def _invoking(invoker: HandlerInvoker, binding: HandlerBinding, call: HandlerCall,
              commit_may_have_landed: bool, expired: bool,
              settle: Delivery | None) -> Callable[[], Outcome]:
    """The handler stage's body: ``invoker.invoke`` of ``call``, in a closure (a
    ``functools.partial`` with keywords merges them into a new dict at its call)."""
    return lambda: invoker.invoke(binding, call, commit_may_have_landed=commit_may_have_landed,
                                  expired=expired, settle=settle)


def _logged_id(headers: Mapping[str, str]) -> str:
    """The message id of ``headers`` as a log line carries it (:func:`loggable`; a short
    printable one is its own, told here without the call)."""
    message_id = headers.get(h.MESSAGE_ID)
    if not message_id:
        return "a message without id"
    if len(message_id) <= LIMIT and message_id.isprintable():
        return message_id
    return loggable(message_id)


def _logged_type(headers: Mapping[str, str]) -> str | None:
    """The message type of ``headers`` as a log line carries it (:func:`loggable`)."""
    message_type = headers.get(h.MESSAGE_TYPE)
    if message_type is None or len(message_type) <= LIMIT and message_type.isprintable():
        return message_type
    return loggable(message_type)


def undecodable(error: Exception) -> MalformedMessage:
    """The malformed-message failure of a delivery whose decoding raised ``error``."""
    malformed = MalformedMessage(
        f"the message could not be decoded: {type(error).__name__}: {error}")
    malformed.__cause__ = error
    return malformed


def _header_count(delivery: Delivery, name: str) -> int:
    """A count the message carries in header ``name`` (0 if absent or unreadable)."""
    try:
        return max(0, int(delivery.headers.get(name) or 0))
    except ValueError:
        return 0
