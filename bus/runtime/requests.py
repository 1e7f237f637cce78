"""Requests someone waits for: what travels, and how a reply is read (``bus.request``).

A request is a command sent with ``idembus.reply_to`` naming a reply queue private to the
requesting process and with :data:`~idembus.headers.AWAITED` set. Its handler answers with
``self.bus.reply(...)``, which is recorded and committed with the handler's state like
any outgoing message; the reply carries the request's id as its correlation id, and the
requester's reply queue hands it to the caller waiting for that id.

Because the reply is stored with the state, a request sent again with the same message
id finds it processed and the *stored* reply is sent again, with its original id: the
handler does not run twice. A request whose handling fails for good goes to the error
queue, and its endpoint answers with a *failure reply* (:func:`failure_reply`), which the
requester raises as :class:`~idembus.errors.RequestFailed`.

:class:`Requests` is the endpoint's :class:`~idembus.sending.RequestChannel` in this
process: its reply queue, created at the first request — on RabbitMQ exclusive and
auto-delete, so the broker removes it when the process's connection ends, even if the
process is killed; elsewhere declared, then deleted when the endpoint closes, and on
Redis and the database queues held by a lease its process renews, so that a killed
process's queue is swept (:meth:`~idembus.transports.base.Transport.consume_replies`,
:mod:`idembus.transports.reply_leases`) — one consumer thread for it, and the callers
waiting, by request id.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from .. import headers as h
from ..context import MessageContext
from ..envelope import Envelope, format_utc, utc_now
from ..errors import InvalidMessage, RequestFailed, RequestTimeout, UnknownMessageType
from ..messages import Command, Event, Message, message_aliases, message_name
from ..storage.claims import resolved
from ..transports.base import Delivery
from ..transports.errors import TransportUnavailable
from .endpoint_context import EndpointContext

if TYPE_CHECKING:
    from .dispatching import Dispatcher

log = logging.getLogger(__name__)

#: The wire type of a failure reply: a JSON object with ``exception_type`` and ``message``.
FAILURE_TYPE = "idembus.RequestFailed"

ReplyT = TypeVar("ReplyT", bound=Message)

#: Seconds a first request waits for its reply queue to be consumed before it is sent.
_READY_TIMEOUT = 30.0


class Requests:
    """One endpoint's reply queue in this process, and the requests waiting on it.

    Thread-safe: every thread (and every asyncio task) of the process may wait for its
    own reply at once. :meth:`close` (``endpoint.close()``) stops the consumer, deletes
    the queue where the broker does not, and ends the waits still open with
    :class:`~idembus.errors.RequestTimeout`.
    """

    def __init__(self, context: EndpointContext, dispatcher: Dispatcher) -> None:
        self._context = context
        self._dispatcher = dispatcher
        #: The reply queue's name: the endpoint's, ``.replies.``, a random part.
        self.queue = f"{context.name}.replies.{uuid.uuid4().hex}"
        self._waiting: dict[str, concurrent.futures.Future[Envelope]] = {}
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def reply_queue(self) -> str:
        """The reply queue's name, once it is consumed (its consumer starts on the first
        call); :class:`~idembus.transports.errors.TransportUnavailable` if it cannot be
        within 30 s."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(
                    target=self._consume, name=f"idembus-{self._context.name}-replies",
                    daemon=True)
                self._thread.start()
        if not self._ready.wait(_READY_TIMEOUT):
            raise TransportUnavailable(
                f"the reply queue {self.queue!r} of endpoint {self._context.name!r} could "
                f"not be consumed within {_READY_TIMEOUT:g}s")
        return self.queue

    def call(self, envelope: Envelope, origin: MessageContext | None, *, timeout: float,
             expect: type[Message] | None) -> Message:
        """Send the request ``envelope`` and wait for its reply (``Bus.request``)."""
        future = self._expect(envelope.message_id)
        try:
            self._send(envelope, origin)
            reply = future.result(timeout)
        except RequestTimeout:  # the endpoint closed (a TimeoutError too)
            raise
        except concurrent.futures.TimeoutError:
            raise _timed_out(envelope, timeout) from None
        finally:
            self._forget(envelope.message_id)
        return read_reply(reply, envelope.message_id, expect)

    async def call_async(self, envelope: Envelope, origin: MessageContext | None, *,
                         timeout: float, expect: type[Message] | None) -> Message:
        """:meth:`call` for ``async`` code (``Bus.request_async``)."""
        future = self._expect(envelope.message_id)
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, self._send, envelope, origin)
            reply = await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except RequestTimeout:
            raise
        except (asyncio.TimeoutError, concurrent.futures.TimeoutError):
            raise _timed_out(envelope, timeout) from None
        finally:
            self._forget(envelope.message_id)
        return read_reply(reply, envelope.message_id, expect)

    def _expect(self, message_id: str) -> concurrent.futures.Future[Envelope]:
        future: concurrent.futures.Future[Envelope] = concurrent.futures.Future()
        with self._lock:
            self._waiting[message_id] = future
        return future

    def _forget(self, message_id: str) -> None:
        with self._lock:
            self._waiting.pop(message_id, None)

    def _send(self, envelope: Envelope, origin: MessageContext | None) -> None:
        """Through the endpoint's ``outgoing`` and ``dispatch`` middleware, as
        ``endpoint.bus`` sends."""
        self._dispatcher.dispatch_now(self._context.pipeline.prepare(envelope, origin))

    @property
    def waiting(self) -> int:
        """How many requests wait for their reply now."""
        with self._lock:
            return len(self._waiting)

    def _consume(self) -> None:
        try:
            self._context.transport.consume_replies(self.queue, self._on_reply,
                                                    stop=self._stop, ready=self._ready)
        except Exception:
            log.exception("consuming the reply queue %s of endpoint %s failed", self.queue,
                          self._context.name)
        finally:
            self._ready.clear()

    def _on_reply(self, delivery: Delivery) -> None:
        """Hand a reply to the caller waiting for it; a reply nobody waits for (it came
        after its timeout, or twice) is dropped."""
        request_id = delivery.headers.get(h.CORRELATION_ID, "")
        with self._lock:
            future = self._waiting.get(request_id)
        if future is not None and not future.done():
            try:  # a claim-checked reply: its body from the payload store
                body = resolved(delivery.headers, delivery.body, self._context.payloads())
            except Exception as unresolved:  # the waiter learns why, instead of a timeout
                future.set_exception(unresolved)
            else:
                future.set_result(Envelope(
                    headers=dict(delivery.headers), body=body.decode("utf-8", "replace"),
                    destination=None, content_type=delivery.content_type or h.CONTENT_TYPE))
        else:
            log.debug("reply %s to request %s dropped: nobody waits for it",
                      delivery.headers.get(h.MESSAGE_ID), request_id)
        delivery.ack()

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop consuming the reply queue (deleted where the broker does not delete it)
        and end the waits still open with :class:`~idembus.errors.RequestTimeout`."""
        with self._lock:
            thread, self._thread = self._thread, None
            waiting = list(self._waiting.items())
        self._stop.set()
        if thread is not None:
            thread.join(timeout)
        for message_id, future in waiting:
            if not future.done():
                future.set_exception(RequestTimeout(
                    f"endpoint {self._context.name!r} closed before the reply to "
                    f"{message_id} came", message_id=message_id))


def _timed_out(envelope: Envelope, timeout: float) -> RequestTimeout:
    return RequestTimeout(
        f"no reply to {envelope.message_type} {envelope.message_id} from "
        f"{envelope.destination!r} within {timeout:g}s", message_id=envelope.message_id)


def awaited_reply(envelope: Envelope) -> bool:
    """Whether ``envelope`` answers a request someone waits for (or waited for)."""
    return (envelope.headers.get(h.INTENT) == h.Intent.REPLY.value
            and bool(envelope.headers.get(h.AWAITED)))


def answers_request(outgoing: Sequence[Envelope]) -> bool:
    """Whether ``outgoing`` holds a reply to an awaited request: the entry then keeps the
    bodies it sent, so that the request sent again gets the same reply."""
    for envelope in outgoing:  # on every mark: a loop, no call for what has no header
        if h.AWAITED in envelope.headers and awaited_reply(envelope):
            return True
    return False


def answered_again(stored: tuple[Envelope, ...],
                   request: Mapping[str, str]) -> tuple[Envelope, ...]:
    """The stored messages of the request with headers ``request``, found processed, with
    its awaited replies addressed to whoever awaits it now (its ``idembus.reply_to``): the
    same request sent again from another process gets the stored reply in its own reply
    queue."""
    reply_to = request.get(h.REPLY_TO)
    if not reply_to or not request.get(h.AWAITED):
        return stored
    return tuple(dataclasses.replace(envelope, destination=reply_to)
                 if awaited_reply(envelope) and envelope.destination != reply_to else envelope
                 for envelope in stored)


def failure_reply(request: Mapping[str, str], failure: Mapping[str, str], *,
                  endpoint: str) -> Envelope | None:
    """The failure reply to the awaited request with headers ``request`` that went to the
    error queue with the headers ``failure``; ``None`` if nobody awaits it. Its id is
    derived from the request's, so a second failure of the same request sends the same
    reply."""
    request_id = request.get(h.MESSAGE_ID)
    reply_to = request.get(h.REPLY_TO, "").strip()
    if request.get(h.AWAITED) != "1" or not reply_to or not request_id:
        return None
    body = json.dumps({"exception_type": failure.get(h.EXCEPTION_TYPE, ""),
                       "message": failure.get(h.EXCEPTION_MESSAGE, "")})
    headers = {
        h.MESSAGE_ID: str(uuid.uuid5(uuid.NAMESPACE_URL, f"idembus:failure:{request_id}")),
        h.MESSAGE_TYPE: FAILURE_TYPE,
        h.INTENT: h.Intent.REPLY.value,
        h.CORRELATION_ID: request_id,
        h.CAUSATION_ID: request_id,
        h.CONVERSATION_ID: request.get(h.CONVERSATION_ID) or request_id,
        h.ORIGINATING_ENDPOINT: endpoint,
        h.TIME_SENT: format_utc(utc_now()),
        h.AWAITED: "1",
    }
    return Envelope(headers=headers, body=body, destination=reply_to)


def read_reply(reply: Envelope, request_id: str,
               expect: type[ReplyT] | None = None) -> Message:
    """The message ``reply`` carries, as ``expect`` (if given) or as the message type its
    wire name names; a failure reply raises :class:`~idembus.errors.RequestFailed`."""
    name = reply.message_type
    if name == FAILURE_TYPE:
        failure = json.loads(reply.body)
        raise RequestFailed(str(failure.get("message", "")), message_id=request_id,
                            exception_type=str(failure.get("exception_type", "")))
    wanted = expect if expect is not None else message_type_named(name)
    try:
        return wanted.model_validate_json(reply.body)
    except ValueError as error:
        raise InvalidMessage(
            f"the reply {reply.message_id} to request {request_id} is not a "
            f"{message_name(wanted)}: {error}") from error


def message_type_named(name: str) -> type[Message]:
    """The message class this process defines with wire name (or alias) ``name``."""
    pending: list[type[Message]] = [Message]
    while pending:
        candidate = pending.pop()
        pending.extend(candidate.__subclasses__())
        if candidate in (Message, Command, Event):
            continue
        if message_name(candidate) == name or name in message_aliases(candidate):
            return candidate
    raise UnknownMessageType(
        f"a reply of type {name!r} came, but no message class of that name is defined in "
        "this process: import it, or pass expect=<its class> to request()")
