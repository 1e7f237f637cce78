"""OpenTelemetry tracing of an endpoint, as middleware (:mod:`idembus.pipeline`)::

    from idembus.observability.tracing import Tracing

    Endpoint("sales", middleware=[Tracing()], ...)  # the global tracer provider
    Endpoint("sales", middleware=[Tracing(tracer_provider=provider)], ...)

Needs ``opentelemetry-api`` only (``pip install 'idembus[otel]'``); the application chooses
and configures an SDK. Spans follow the OpenTelemetry semantic conventions for messaging:

``process <queue>`` (CONSUMER)
    one delivery, from before it is decoded until it is settled. By default it starts a
    trace of its own, with a *link* to the creation context the message carries (W3C
    ``traceparent``/``tracestate``, or whatever the global propagator reads): whoever can
    publish to the endpoint writes that context, and a parent would let them decide
    whether this endpoint records the trace. With ``trust_incoming=True`` (every publisher
    is one of yours) that context is its parent instead, and a trace runs across
    endpoints.
``handle <handler>`` (INTERNAL)
    one attempt of one handler: load, run, commit; ``idembus.duplicate`` says whether the
    message was found already processed (not an error).
``commit <handler>`` (INTERNAL)
    the conditional write of an attempt.
``send|publish|reply <destination>`` (PRODUCER)
    each dispatch to the broker: the first one, a duplicate's redispatch, an outbox repair.
    Its parent is the creation context stored with the message, so a redispatch and an
    outbox repair minutes later continue the trace of the handler that created the message
    (``idembus.redispatched`` marks them; a redispatch also links to the delivery that
    caused it).

A message's **creation context** is the context current when a handler, a unit of work or
``endpoint.bus`` records it — the handler's span, or the caller's — injected into its
headers *before* it is committed, so it is stored with the message. The consumer's
``process`` span is thus a child of the handler span that created the message (or of the
caller of ``endpoint.bus``) when it trusts its senders (``trust_incoming=True``), and
linked to it otherwise. Only a message recorded where no span is current gets a span of
its own, ``create <destination>`` (PRODUCER), so that it still starts a trace. (The
conventions' separate ``create`` span for every message would cost a span per message for
no information: the handler span is the creation.) A message that already carries a
creation context (a header set by the caller) keeps it.

**Baggage** (W3C ``baggage``) a message carries reaches the handlers' context, and so every
message they send, only by an allow-list: ``Tracing(baggage=("tenant",))`` keeps those
entries and drops the others. Without one, all of it passes when ``trust_incoming=True``
and none of it otherwise.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Collection, Mapping
from typing import Any, cast

from .. import headers as h
from ..context import MessageContext
from ..envelope import Envelope
from ..pipeline import Dispatch, HandlerCall, IncomingMessage, Middleware, RetryLater, SkipMessage
from ..redaction import redact, redacted_traceback
from ..storage.errors import AlreadyProcessed, ConcurrencyConflict

try:
    from opentelemetry import baggage as otel_baggage
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.context import Context
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.trace import (
        Link,
        Span,
        SpanContext,
        SpanKind,
        Status,
        StatusCode,
        TracerProvider,
    )

    from .trace_propagation import HeaderCodec
except ImportError as missing:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"idembus.observability.tracing needs opentelemetry-api: "
        f"pip install 'idembus[otel]' ({missing})"
    ) from missing

#: The value of ``messaging.system`` by transport URL scheme; others use the scheme itself.
_SYSTEMS = {"amqp": "rabbitmq", "amqps": "rabbitmq", "pyamqp": "rabbitmq",
            "librabbitmq": "rabbitmq", "redis": "redis", "rediss": "redis",
            "memory": "memory"}
#: Dispatch sources that send a message again (``idembus.redispatched``).
_AGAIN = frozenset({"redispatch", "outbox"})
#: Dispatch sources that send a message in the trace context it was recorded in.
_RECORDED_HERE = frozenset({"handler", "unit_of_work", "bus"})

# Attribute names (OpenTelemetry messaging semantic conventions, then idembus's own).
SYSTEM = "messaging.system"
OPERATION_TYPE = "messaging.operation.type"
OPERATION_NAME = "messaging.operation.name"
DESTINATION = "messaging.destination.name"
MESSAGE_ID = "messaging.message.id"
CONVERSATION_ID = "messaging.message.conversation_id"
ERROR_TYPE = "error.type"
ENDPOINT = "idembus.endpoint"
MESSAGE_TYPE = "idembus.message_type"
HANDLER = "idembus.handler"
ATTEMPT = "idembus.attempt"
DUPLICATE = "idembus.duplicate"
REDISPATCHED = "idembus.redispatched"
SOURCE = "idembus.dispatch.source"
OUTCOME = "idembus.outcome"
OUTGOING = "idembus.outgoing"
CONFLICT = "idembus.conflict"


class Tracing(Middleware):
    """Spans for every delivery, handler attempt, commit, created message and dispatch.

    ``tracer_provider``: where the spans go (default: the global one, looked up through
    the OpenTelemetry API's proxy, so it may be set after this middleware is created).
    ``propagator``: how the trace context is written to and read from message headers
    (default: the global one, W3C ``traceparent``/``tracestate`` and ``baggage`` unless
    configured otherwise; read again for every delivery and every message recorded or
    sent, so a global propagator set later takes effect from the next message on).
    ``messaging_system``: the ``messaging.system`` attribute (default: from the endpoint's
    transport: ``rabbitmq``, ``redis``, ``memory``).
    ``trust_incoming``: whether the trace context of an incoming message is the parent of
    its ``process`` span (``True``: one trace across endpoints, and the sender's sampling
    decision is followed) or only linked from it (``False``, the default: a trace of this
    endpoint's own, sampled by its own sampler, so that no publisher can force or suppress
    recording). Set it when only your own endpoints can publish to this one.
    ``baggage``: the names of the incoming baggage entries kept (and so sent on with every
    message the handlers send); ``None``: all of them if ``trust_incoming``, none
    otherwise.

    One instance may serve several endpoints.
    """

    def __init__(self, tracer_provider: TracerProvider | None = None, *,
                 propagator: TextMapPropagator | None = None,
                 messaging_system: str | None = None, trust_incoming: bool = False,
                 baggage: Collection[str] | None = None) -> None:
        if isinstance(baggage, str):
            raise TypeError(f"baggage takes a collection of names, got the string {baggage!r}")
        self._tracer = trace.get_tracer("idembus", _version(), tracer_provider=tracer_provider)
        self._propagator = propagator
        self._system = messaging_system
        self._trust = trust_incoming
        #: The baggage names kept; ``None``: all.
        self._baggage: frozenset[str] | None = (
            frozenset(baggage) if baggage is not None
            else None if trust_incoming else frozenset())
        #: ``messaging.system`` of each endpoint set up with this middleware.
        self._systems: dict[str, str] = {}
        #: Where this instance keeps its span and context token in a stage's ``items`` (the
        #: handler and commit stages share theirs).
        key = f"idembus.observability.tracing.{id(self):x}"
        self._key, self._commit_key = key, f"{key}.commit"
        #: The key, in the context of a delivery, of its :class:`_Recorded`.
        self._recorded_key = otel_context.create_key(f"{key}.recorded")
        #: The codec of the propagator last used (a new one when the propagator changes).
        self._codec: HeaderCodec | None = None

    # -- set-up ---------------------------------------------------------------------------

    def setup(self, endpoint: Any) -> None:
        """Learn the endpoint's ``messaging.system`` from its transport."""
        self._systems[endpoint.name] = self._system or _system_of(endpoint.transport)

    def _system_for(self, endpoint: str | None) -> str:
        return self._systems.get(endpoint or "") or self._system or "idembus"

    def _headers(self) -> HeaderCodec:
        """How trace contexts go in and out of headers: through the propagator given, or
        the global one as it is now."""
        propagator = self._propagator or propagate.get_global_textmap()
        codec = self._codec
        if codec is None or codec.propagator is not propagator:
            codec = self._codec = HeaderCodec.of(propagator)
        return codec

    # -- message --------------------------------------------------------------------------

    def before_message(self, incoming: IncomingMessage) -> None:
        headers = incoming.headers
        parent, carrier = self._headers().read(headers)
        sender = trace.get_current_span(parent).get_span_context()
        links: tuple[Link, ...] = ()
        if not self._trust:
            # A trace of this endpoint's own, linked to the sender's: its sampler decides.
            parent, carrier = _only_baggage(parent), None
            if sender.is_valid:
                links = (Link(sender),)
        if self._baggage is not None:
            parent = self._allowed_baggage(parent)
        # Shared by the handlers of this delivery and the dispatches that follow them: the
        # context a message was last recorded in, and the headers that carry it.
        recorded = _Recorded()
        parent = otel_context.set_value(self._recorded_key, recorded, parent)
        if carrier is not None:
            recorded.remember(carrier, parent, sender.trace_flags.sampled)
        if self._trust and _sampled_out(sender):
            # The sender decided not to record this trace: make no span here either, only
            # carry its context on, so that what this message causes stays unrecorded too.
            incoming.items[self._key] = (None, otel_context.attach(parent), recorded)
            return
        attributes: dict[str, Any] = {
            SYSTEM: self._system_for(incoming.endpoint),
            OPERATION_TYPE: "process",
            OPERATION_NAME: "process",
            DESTINATION: incoming.queue,
            ENDPOINT: incoming.endpoint,
        }
        _put(attributes, MESSAGE_ID, headers.get(h.MESSAGE_ID))
        _put(attributes, CONVERSATION_ID, headers.get(h.CONVERSATION_ID))
        _put(attributes, MESSAGE_TYPE, headers.get(h.MESSAGE_TYPE))
        span = self._tracer.start_span(f"process {incoming.queue}", context=parent,
                                       kind=SpanKind.CONSUMER, attributes=attributes,
                                       links=links)
        incoming.items[self._key] = (
            span, otel_context.attach(trace.set_span_in_context(span, parent)), recorded)

    def _allowed_baggage(self, context: Context) -> Context:
        """``context`` without the baggage entries that are not allowed."""
        allowed = self._baggage
        for name in otel_baggage.get_all(context):
            if allowed is not None and name not in allowed:
                context = otel_baggage.remove_baggage(name, context)
        return context

    def after_message(self, incoming: IncomingMessage, error: BaseException | None) -> None:
        entered = incoming.items.pop(self._key, None)
        if entered is None:
            return
        span, token, recorded = entered
        otel_context.detach(token)
        recorded.forget()  # it holds a context that holds it: let both go now
        if span is None:
            return
        if incoming.outcome is not None:
            span.set_attribute(OUTCOME, incoming.outcome)
        if error is None and incoming.outcome == "dead_lettered":
            span.set_status(Status(StatusCode.ERROR, "moved to the error queue"))
        _end(span, error)

    # -- handler and commit ---------------------------------------------------------------

    def before_handler(self, call: HandlerCall) -> None:
        current = otel_context.get_current()
        if _unrecorded(trace.get_current_span(current)):
            return  # a trace the sampler left out: nothing to record under
        context = call.context
        self._start(call.items, self._key, f"handle {call.handler}", current, {
            HANDLER: call.handler,
            ATTEMPT: call.attempt,
            MESSAGE_ID: context.message_id,
            CONVERSATION_ID: context.conversation_id,
        })

    def after_handler(self, call: HandlerCall, error: BaseException | None) -> None:
        span = self._leave(call.items, self._key)
        if span is None:
            return
        span.set_attributes({DUPLICATE: call.duplicate, OUTGOING: len(call.outgoing)})
        _end(span, error)

    def before_commit(self, call: HandlerCall) -> None:
        current = otel_context.get_current()
        if _unrecorded(trace.get_current_span(current)):
            return
        # A child of the handler span, which names the handler, the attempt, the message
        # and what it recorded: nothing is repeated here.
        self._start(call.items, self._commit_key, f"commit {call.handler}", current, None)

    def after_commit(self, call: HandlerCall, error: BaseException | None) -> None:
        span = self._leave(call.items, self._commit_key)
        if span is None:
            return
        if isinstance(error, AlreadyProcessed):  # committed by another delivery meanwhile
            span.set_attribute(DUPLICATE, True)
            error = None
        elif isinstance(error, ConcurrencyConflict):  # a lost optimistic race: tried again
            span.set_attribute(CONFLICT, True)
            error = None
        _end(span, error)

    # -- outgoing messages ----------------------------------------------------------------

    def outgoing(self, envelope: Envelope, origin: MessageContext | None) -> Envelope:
        """Inject the current context — the handler's span, or the caller's — into the
        headers, which are then stored with the message: its creation context. Only where
        no span is current (``endpoint.bus`` called outside any trace) is a ``create`` span
        started for it, so that the message still starts a trace. A message that carries
        a trace context already keeps it."""
        codec = self._headers()
        headers = envelope.headers
        if codec.carries_context(headers):
            return envelope
        current = otel_context.get_current()
        recorded = cast("_Recorded | None", current.get(self._recorded_key))
        if recorded is not None and recorded.context is current:
            carrier = recorded.carrier  # recorded in the same context as the last one
            return envelope.with_headers(carrier) if carrier else envelope
        creator = trace.get_current_span(current)
        span_context = creator.get_span_context()
        if span_context.is_valid:
            carrier = codec.inject(creator, current)
            if recorded is not None:
                recorded.remember(carrier, current, span_context.trace_flags.sampled)
            return envelope.with_headers(carrier) if carrier else envelope
        destination = _destination(envelope)
        attributes: dict[str, Any] = {
            SYSTEM: self._system_for(headers.get(h.ORIGINATING_ENDPOINT)),
            OPERATION_TYPE: "create",
            OPERATION_NAME: "create",
            DESTINATION: destination,
            MESSAGE_ID: envelope.message_id,
            MESSAGE_TYPE: envelope.message_type,
        }
        _put(attributes, CONVERSATION_ID, headers.get(h.CONVERSATION_ID))
        _put(attributes, ENDPOINT, headers.get(h.ORIGINATING_ENDPOINT))
        if origin is not None:
            attributes[HANDLER] = origin.handler_name
        span = self._tracer.start_span(f"create {destination}", context=current,
                                       kind=SpanKind.PRODUCER, attributes=attributes)
        span.end()
        carrier = codec.inject(span, trace.set_span_in_context(span, current))
        return envelope.with_headers(carrier) if carrier else envelope

    # -- dispatch -------------------------------------------------------------------------

    def before_dispatch(self, dispatch: Dispatch) -> None:
        envelope = dispatch.envelope
        headers = envelope.headers
        current = otel_context.get_current()
        recorded = cast("_Recorded | None", current.get(self._recorded_key))
        parent = None
        if recorded is not None:  # in a delivery: recorded there? then no need to read
            parent = recorded.context_of(headers)
            if parent is not None and not recorded.sampled:
                return  # recorded in a trace the sampler left out
        if parent is None:  # recorded elsewhere, or earlier: its headers say where
            if dispatch.source in _RECORDED_HERE and _unrecorded(
                    trace.get_current_span(current)):
                return  # recorded in this very trace, which the sampler left out
            parent = self._headers().extract(headers)
            if not _has_span(parent):  # stored before tracing was on: the caller's context
                parent = current
            if _sampled_out(trace.get_current_span(parent).get_span_context()):
                return  # the message's trace is not recorded
        links: tuple[Link, ...] = ()
        if dispatch.source == "redispatch":
            cause = trace.get_current_span(current).get_span_context()
            if cause.is_valid:
                links = (Link(cause),)  # the duplicate delivery that sends it again
        destination = _destination(envelope)
        operation = headers.get(h.INTENT) or "send"
        attributes: dict[str, Any] = {
            SYSTEM: self._system_for(dispatch.endpoint),
            OPERATION_TYPE: "send",
            OPERATION_NAME: operation,
            DESTINATION: destination,
            SOURCE: dispatch.source,
            REDISPATCHED: dispatch.source in _AGAIN,
        }
        _put(attributes, MESSAGE_ID, headers.get(h.MESSAGE_ID))
        _put(attributes, CONVERSATION_ID, headers.get(h.CONVERSATION_ID))
        self._start(dispatch.items, self._key, f"{operation} {destination}", parent,
                    attributes, SpanKind.PRODUCER, links)

    def after_dispatch(self, dispatch: Dispatch, error: BaseException | None) -> None:
        span = self._leave(dispatch.items, self._key)
        if span is not None:
            _end(span, error)

    # -- keeping spans between hooks ------------------------------------------------------

    def _start(self, items: dict[str, Any], key: str, name: str, parent: Context,
               attributes: dict[str, Any] | None, kind: SpanKind = SpanKind.INTERNAL,
               links: tuple[Link, ...] = ()) -> None:
        """Start a span under ``parent`` and make it current until :meth:`_leave`."""
        span = self._tracer.start_span(name, context=parent, kind=kind, attributes=attributes,
                                       links=links)
        items[key] = (span, otel_context.attach(trace.set_span_in_context(span, parent)))

    @staticmethod
    def _leave(items: dict[str, Any], key: str) -> Span | None:
        entered = items.pop(key, None)
        if entered is None:
            return None
        span, token = entered
        otel_context.detach(token)
        return span  # type: ignore[no-any-return]


class _Recorded:
    """The context the handlers of one delivery last recorded a message in, and the
    headers that carry it: a message recorded in the same context gets the same headers
    without writing them again, and the dispatch of a message with those headers continues
    that context without reading them back. It lives in the delivery's context, which it
    also holds: :meth:`forget` when the delivery is settled."""

    __slots__ = ("carrier", "context", "sampled")

    def __init__(self) -> None:
        self.carrier: dict[str, str] = {}
        self.context: Context | None = None
        #: The remembered context's trace is recorded (its sampled flag is on).
        self.sampled = False

    def remember(self, carrier: dict[str, str], context: Context, sampled: bool) -> None:
        self.carrier, self.context, self.sampled = carrier, context, sampled

    def forget(self) -> None:
        self.carrier, self.context = {}, None

    def context_of(self, headers: Mapping[str, str]) -> Context | None:
        """The remembered context, if ``headers`` carry exactly it; else ``None``."""
        carrier = self.carrier
        if not carrier:
            return None
        for name, value in carrier.items():
            if headers.get(name) != value:
                return None
        return self.context


def _end(span: Span, error: BaseException | None) -> None:
    """End ``span``, recording ``error`` on it unless it only steers the message."""
    try:
        if error is None:
            return
        if isinstance(error, SkipMessage | RetryLater):
            span.set_attribute(OUTCOME, "skipped" if isinstance(error, SkipMessage)
                               else "retry_later")
            return
        kind = f"{type(error).__module__}.{type(error).__qualname__}"
        message = redact(str(error))
        span.record_exception(error, attributes={"exception.message": message,
                                                 "exception.stacktrace": redacted_traceback(error)})
        span.set_attribute(ERROR_TYPE, kind)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {message}"))
    finally:
        span.end()


def _only_baggage(context: Context) -> Context:
    """A fresh context with the baggage of ``context`` and nothing else (no span)."""
    fresh = Context()
    for name, value in otel_baggage.get_all(context).items():
        fresh = otel_baggage.set_baggage(name, value, fresh)
    return fresh


def _unrecorded(span: Span) -> bool:
    """A span of a trace the sampler left out (not merely no span at all)."""
    return not span.is_recording() and span.get_span_context().is_valid


def _sampled_out(span_context: SpanContext) -> bool:
    """A trace context whose trace is not to be recorded (its sampled flag is off)."""
    return span_context.is_valid and not span_context.trace_flags.sampled


def _has_span(context: Context) -> bool:
    return trace.get_current_span(context).get_span_context().is_valid


def _destination(envelope: Envelope) -> str:
    """The queue of a sent or replied message; the message type of a published event (the
    routing key on the endpoint's exchange)."""
    return envelope.destination or envelope.headers.get(h.MESSAGE_TYPE) or "unknown"


def _put(attributes: dict[str, Any], name: str, value: str | None) -> None:
    if value:
        attributes[name] = value


def _system_of(transport: Any) -> str:
    url = getattr(transport, "url", None)
    if not isinstance(url, str) or "://" not in url:
        return "idembus"
    scheme = url.split("://", 1)[0].lower()
    return _SYSTEMS.get(scheme, scheme or "idembus")


def _version() -> str | None:
    try:
        return importlib.metadata.version("idembus")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - not installed
        return None

