"""The Bus API: ``send``, ``publish``, ``reply``, ``defer`` and ``request``.

One class serves both places a bus is used. ``endpoint.bus`` sends at once, with fresh ids.
Inside a handler, ``self.bus`` *records*: the endpoint commits the recorded messages with
the aggregate's state and dispatches them only afterwards; their ids are derived from the
incoming message so a re-run produces the same ones. ``request`` (and
``request_async``) sends at once in both places and waits for the reply
(:mod:`idembus.requesting`).
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar, overload

from . import headers as h
from .clock import Clock, SystemClock
from .context import MessageContext
from .envelope import Envelope, format_utc
from .errors import HandlerContractError, RoutingError
from .expiry import TimeToLive, discard_time, time_to_live
from .hierarchy import type_headers
from .messages import (
    Command,
    Event,
    Message,
    parents_of,
    partition_of,
)
from .routing import Router, partition_queue

Emit = Callable[[Envelope], object]
ReplyT = TypeVar("ReplyT", bound=Message)


class RequestChannel(Protocol):
    """Where a bus sends requests and waits for their replies: the endpoint's reply queue
    in this process (:class:`idembus.runtime.requests.Requests`)."""

    def reply_queue(self) -> str:
        """The name of this process's reply queue, consumed from now on."""

    def call(self, envelope: Envelope, origin: MessageContext | None, *, timeout: float,
             expect: type[Message] | None) -> Message:
        """Send the request ``envelope`` now and return its reply (see ``Bus.request``)."""

    async def call_async(self, envelope: Envelope, origin: MessageContext | None, *,
                         timeout: float, expect: type[Message] | None) -> Message:
        """:meth:`call` for ``async`` code."""


class Bus:
    """Sends commands, publishes events and replies.

    Every method takes ``discard_after`` (seconds or a timedelta): the message is worthless
    to its receiver that much later than it is sent — or, deferred, than it is due — and
    discarded if received after that (:mod:`idembus.expiry`). Without it, the message
    type's default applies (``class Quote(Event, discard_after=30)``), if it has one.

    Parameters
    ----------
    endpoint:
        Name (and queue) of the endpoint this bus speaks for; used as the reply address.
    router:
        Where commands go.
    emit:
        What to do with each finished envelope: dispatch it, or record it.
    origin:
        The message being handled, inside a handler; ``None`` outside handlers.
    clock:
        Where "now" comes from (the endpoint's :class:`~idembus.clock.Clock`): the time
        sent, when a deferred message is due, when a message expires.
    requests:
        Where :meth:`request` sends and waits (the endpoint's reply queue); ``None``:
        this bus cannot wait for replies.
    """

    def __init__(
        self,
        endpoint: str,
        router: Router,
        emit: Emit,
        origin: MessageContext | None = None,
        *,
        clock: Clock | None = None,
        requests: RequestChannel | None = None,
    ) -> None:
        self._endpoint = endpoint
        self._router = router
        self._emit = emit
        self._origin = origin
        self._clock = clock or SystemClock()
        self._requests = requests
        self._count = 0

    def send(
        self,
        command: Command,
        *,
        to: str | None = None,
        headers: Mapping[str, str] | None = None,
        message_id: str | None = None,
        deliver_at: datetime.datetime | None = None,
        discard_after: TimeToLive | None = None,
    ) -> str:
        """Send a command to the one endpoint that handles it; return its message id.

        ``to`` overrides the route; ``message_id`` lets a caller outside handlers make a
        retried send deduplicate (e.g. an id taken from an HTTP request); ``deliver_at``
        (an aware datetime) holds the command back until then.
        """
        return self._command(command, to, headers, message_id, deliver_at, discard_after)

    def defer(
        self,
        command: Command,
        delay: float | datetime.timedelta,
        *,
        to: str | None = None,
        headers: Mapping[str, str] | None = None,
        discard_after: TimeToLive | None = None,
    ) -> str:
        """Send a command that is delivered ``delay`` (seconds or a timedelta) from now.

        Inside a handler "now" is when the handler ran: a re-run after a crash keeps the
        recorded time, and the message keeps its derived id.
        """
        return self.send(command, to=to, headers=headers, deliver_at=self._due(delay),
                         discard_after=discard_after)

    def defer_timeout(self, command: Command, delay: float | datetime.timedelta, *,
                      to: str, aggregate: str) -> str:
        """A saga's timeout (:meth:`~idembus.handlers.AggregateHandler.request_timeout`):
        :meth:`defer` ``command`` to ``to`` with the ``idembus.saga_timeout`` header naming
        ``aggregate`` (``<type>/<id>``), so that it is dropped if it arrives once that
        aggregate was completed."""
        return self._command(command, to, None, None, self._due(delay), None,
                             marks={h.SAGA_TIMEOUT: aggregate})

    def _command(self, command: Command, to: str | None, headers: Mapping[str, str] | None,
                 message_id: str | None, deliver_at: datetime.datetime | None,
                 discard_after: TimeToLive | None,
                 marks: Mapping[str, str] | None = None) -> str:
        if not isinstance(command, Command):
            raise TypeError(
                f"send() takes a Command, got {type(command).__qualname__}; "
                "publish events with publish()"
            )
        destination = to or self._router.destination_for(type(command))
        return self._put(command, h.Intent.SEND, destination, headers, message_id, deliver_at,
                         discard_after, marks)

    def _due(self, delay: float | datetime.timedelta) -> datetime.datetime:
        """When a message deferred by ``delay`` (seconds or a timedelta) from now is due."""
        seconds = delay.total_seconds() if isinstance(delay, datetime.timedelta) else delay
        if seconds < 0:
            raise ValueError(f"delay cannot be negative, got {delay!r}")
        return self._clock.now() + datetime.timedelta(seconds=seconds)

    def publish(
        self,
        event: Event,
        *,
        headers: Mapping[str, str] | None = None,
        message_id: str | None = None,
        discard_after: TimeToLive | None = None,
    ) -> str:
        """Publish an event to every endpoint subscribed to its type; return its id."""
        if not isinstance(event, Event):
            raise TypeError(
                f"publish() takes an Event, got {type(event).__qualname__}; "
                "send commands with send()"
            )
        return self._put(event, h.Intent.PUBLISH, None, headers, message_id,
                         discard_after=discard_after)

    def reply(self, message: Message, *, headers: Mapping[str, str] | None = None,
              discard_after: TimeToLive | None = None) -> str:
        """Reply to the sender of the message being handled; return the reply's id."""
        if self._origin is None:
            raise RoutingError("reply() works only inside a handler, in answer to a message")
        if not isinstance(message, Message):
            raise TypeError(f"reply() takes a message, got {type(message).__qualname__}")
        destination = self._origin.reply_to
        if destination is None:
            raise RoutingError(
                f"cannot reply to {self._origin.message_type} {self._origin.message_id}: "
                f"it carries no {h.REPLY_TO} header"
            )
        awaited = {h.AWAITED: "1"} if self._origin.headers.get(h.AWAITED) else None
        return self._put(message, h.Intent.REPLY, destination, headers, None,
                         discard_after=discard_after, marks=awaited)

    @overload
    def request(self, command: Command, *, timeout: float = ..., expect: None = None,
                to: str | None = ..., headers: Mapping[str, str] | None = ...,
                message_id: str | None = ...) -> Message: ...

    @overload
    def request(self, command: Command, *, timeout: float = ..., expect: type[ReplyT],
                to: str | None = ..., headers: Mapping[str, str] | None = ...,
                message_id: str | None = ...) -> ReplyT: ...

    def request(self, command: Command, *, timeout: float = 30.0,
                expect: type[Message] | None = None, to: str | None = None,
                headers: Mapping[str, str] | None = None,
                message_id: str | None = None) -> Message:
        """Send ``command`` at once and wait for the reply its handler sends with
        ``bus.reply(...)``; return that reply (as ``expect`` if given, else as the class
        its wire name names).

        Raises :class:`~idembus.errors.RequestTimeout` after ``timeout`` seconds without
        a reply, :class:`~idembus.errors.RequestFailed` if its handler failed for good (it
        went to the error queue). Send it again with the same ``message_id`` to get the
        stored reply of a request already handled. Inside a handler the request is sent
        at once too (not recorded): its id is derived, so a re-run of the handler gets
        the stored reply; it may not go to the handler's own endpoint.
        """
        channel, envelope = self._request(command, to, headers, message_id)
        return channel.call(envelope, self._origin, timeout=timeout, expect=expect)

    @overload
    async def request_async(self, command: Command, *, timeout: float = ...,
                            expect: None = None, to: str | None = ...,
                            headers: Mapping[str, str] | None = ...,
                            message_id: str | None = ...) -> Message: ...

    @overload
    async def request_async(self, command: Command, *, timeout: float = ...,
                            expect: type[ReplyT], to: str | None = ...,
                            headers: Mapping[str, str] | None = ...,
                            message_id: str | None = ...) -> ReplyT: ...

    async def request_async(self, command: Command, *, timeout: float = 30.0,
                            expect: type[Message] | None = None, to: str | None = None,
                            headers: Mapping[str, str] | None = None,
                            message_id: str | None = None) -> Message:
        """:meth:`request` for ``async`` code (``await bus.request_async(...)``): the send
        runs in the loop's default executor and the wait holds up no thread."""
        channel, envelope = self._request(command, to, headers, message_id)
        return await channel.call_async(envelope, self._origin, timeout=timeout,
                                        expect=expect)

    def _request(self, command: Command, to: str | None, headers: Mapping[str, str] | None,
                 message_id: str | None) -> tuple[RequestChannel, Envelope]:
        """The channel to send through, and the request's envelope (not yet sent)."""
        if self._requests is None:
            raise RoutingError("this bus cannot wait for replies: request from "
                               "endpoint.bus or from a handler's self.bus")
        if not isinstance(command, Command):
            raise TypeError(f"request() takes a Command, got {type(command).__qualname__}")
        destination = to or self._router.destination_for(type(command))
        if self._origin is not None and destination == self._endpoint:
            raise HandlerContractError(
                f"a handler of {self._endpoint!r} cannot wait for a reply from "
                f"{self._endpoint!r} itself: the consumer that would answer may be the one "
                "waiting. Send the command and handle the reply in a handler instead")
        built: list[Envelope] = []
        self._put(command, h.Intent.SEND, destination, headers, message_id,
                  marks={h.REPLY_TO: self._requests.reply_queue(), h.AWAITED: "1"},
                  emit=built.append)
        return self._requests, built[0]

    def _put(
        self,
        message: Message,
        intent: h.Intent,
        destination: str | None,
        extra: Mapping[str, str] | None,
        message_id: str | None,
        deliver_at: datetime.datetime | None = None,
        discard_after: TimeToLive | None = None,
        marks: Mapping[str, str] | None = None,
        emit: Emit | None = None,
    ) -> str:
        """Build the envelope and emit it (through ``emit`` if given); return its id."""
        # default_time_to_live(message), read straight from the class (once a message)
        ttl = (type(message).__discard_after__ if discard_after is None
               else time_to_live(discard_after))
        now = self._clock.now()
        headers = self._headers(message, intent, extra, message_id, now)
        if marks:
            headers.update(marks)  # idembus's own headers, which callers may not set
        if deliver_at is not None:
            headers[h.DELIVER_AT] = format_utc(deliver_at)
        if ttl is not None:
            # A deferred message lives from when it is due: it is meant to be received then.
            headers[h.DISCARD_AFTER] = discard_time(max(now, deliver_at or now), ttl)
        order = self._router.order_of(message)
        if order is not None:
            key, partitions = order
            partition = partition_of(key, partitions)
            headers.update({h.ORDERING_KEY: key, h.PARTITIONS: str(partitions),
                            h.PARTITION: str(partition)})
            if destination is not None:
                destination = partition_queue(destination, partition)
        if (isinstance(message, Event)
                and type(message).journal_parents is not Event.journal_parents):
            parents = parents_of(message)  # names none unless the class overrides it
            if parents:
                headers[h.PARENTS] = ",".join(parents)
        envelope = Envelope(headers=headers, body=message.model_dump_json(),
                            destination=destination)
        (emit or self._emit)(envelope)
        return headers[h.MESSAGE_ID]

    def _headers(
        self,
        message: Message,
        intent: h.Intent,
        extra: Mapping[str, str] | None,
        message_id: str | None,
        now: datetime.datetime,
    ) -> dict[str, str]:
        origin = self._origin
        if message_id is None:
            message_id = origin.outgoing_id(self._count) if origin else str(uuid.uuid4())
        self._count += 1
        if extra:
            result = {key: str(value) for key, value in extra.items()}
            reserved = [key for key in result if key.startswith("idembus.")]
            if reserved:
                raise ValueError(f"headers starting with 'idembus.' are reserved: {reserved}")
        else:
            result = {}
        result[h.MESSAGE_ID] = message_id
        result.update(type_headers(type(message)))
        result[h.INTENT] = intent.value
        result[h.ORIGINATING_ENDPOINT] = self._endpoint
        result[h.REPLY_TO] = self._endpoint
        result[h.TIME_SENT] = format_utc(now)
        if origin is None:
            result[h.CONVERSATION_ID] = message_id
            result[h.CORRELATION_ID] = message_id
        else:
            result[h.CONVERSATION_ID] = origin.conversation_id
            result[h.CAUSATION_ID] = origin.message_id
            result[h.CORRELATION_ID] = (
                origin.message_id if intent is h.Intent.REPLY else origin.correlation_id
            )
        return result

