"""Pipelined publisher confirms on RabbitMQ: publish many messages, then wait once.

kombu's ``confirm_publish`` makes py-amqp wait for each message's confirm before the next
publish (``Channel.basic_publish_confirm``): one round trip a message. Here a channel of
a connection opened *without* it is put in confirm mode (``confirm.select``) and the
broker's ``basic.ack`` / ``basic.nack`` (and, for ``mandatory`` messages nobody took,
``basic.return``, which comes before the message's ack) reach callbacks registered on
py-amqp's channel events. The publisher numbers its messages as the broker does — 1, 2, 3
… from ``confirm.select`` on the channel — so that an ack (possibly ``multiple``) says
which are confirmed. This stays on kombu and py-amqp, idembus' AMQP client everywhere
else; no second client is needed (README, "Batching").
"""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import amqp
import kombu
from amqp import spec

from .. import headers as h
from . import amqp_properties, amqp_publish, amqp_reads

#: How a published message ended: confirmed (``ACKED``) or refused (``NACKED``) by the
#: broker; ``RETURNED``: confirmed after the broker returned it (``mandatory``, no queue).
ACKED, NACKED, RETURNED = "acked", "nacked", "returned"
#: ``basic.ack``'s method signature, and its arguments after the class and method ids: the
#: delivery tag (long long) and the octet holding the ``multiple`` bit.
_BASIC_ACK = spec.Basic.Ack
_ACK_ARGUMENTS = struct.Struct(">QB")
#: Bytes of kept frames (:meth:`ConfirmingChannel.publish`) written before the wait.
_WRITE_AT = 256 * 1024


@dataclass
class _Published:
    tag: int
    message_id: str
    end: str | None = None
    #: Why the broker returned it.
    returned: str = ""


def _no_read_before_each_publish(connection: kombu.Connection) -> None:
    """Spare each publish on ``connection`` (this channel's own) py-amqp's look at the
    socket for a ``connection.blocked`` notice (a non-blocking read before every
    ``basic.publish`` of a connection that announced the capability). The broker still
    sends the notice; it is read with the confirms, at the batch's wait, and changed
    nothing here anyway (nobody listens for it: a blocked broker shows as confirms that do
    not come, an outage)."""
    amqp_connection: Any = getattr(connection, "connection", None)
    properties = getattr(amqp_connection, "client_properties", None)
    if not isinstance(properties, dict):
        return
    capabilities = properties.get("capabilities")
    if isinstance(capabilities, dict) and capabilities.get("connection.blocked"):
        # Copies: whatever else holds these dicts keeps them as they are.
        amqp_connection.client_properties = {
            **properties, "capabilities": {**capabilities, "connection.blocked": False}}


class ConfirmingChannel:
    """A channel in confirm mode on ``connection`` (a kombu connection to RabbitMQ opened
    without ``confirm_publish``); one thread at a time."""

    def __init__(self, connection: kombu.Connection) -> None:
        self.connection = connection
        _no_read_before_each_publish(connection)
        self._channel: Any = connection.channel()
        self._channel.confirm_select()
        self._frame_max = self._negotiated_frame_max()
        self._channel.events["basic_ack"].add(self._on_ack)
        self._channel.events["basic_nack"].add(self._on_nack)
        self._channel.events["basic_return"].add(self._on_return)
        self._producer = kombu.Producer(self._channel)
        self._next_tag = 1
        self._waiting: dict[int, _Published] = {}
        #: How many of those the broker has not answered yet.
        self._unanswered = 0
        #: Those messages by id, once a return needs them (``None``: not indexed yet).
        self._by_id: dict[str, list[_Published]] | None = None
        #: Frames of publishes not written yet, and their size: written together, at the
        #: wait (or sooner: see :meth:`flush`).
        self._unwritten: list[bytes] = []
        self._unwritten_bytes = 0
        # py-amqp's dispatch of this channel's methods, with basic.ack read here.
        self._dispatch_method = self._channel.dispatch_method
        self._channel.dispatch_method = self._dispatched

    def publish(self, body: bytes, *, headers: Mapping[str, str], exchange: str,
                routing_key: str, content_type: Any, content_encoding: Any) -> int:
        """Publish one persistent ``mandatory`` message with idembus's ``headers``, not
        waiting for its confirm; return its handle for :meth:`wait`. On the wire the core
        headers are AMQP basic properties (:mod:`.amqp_properties`); the message's id is
        its ``idembus.message_id``.

        The message goes straight to py-amqp's channel, as kombu's ``Producer.publish``
        would put it there for bytes with a content type (an encoding of ``binary`` when
        none is given), without kombu's serializer look-ups and retry wrapping; a message
        without a content type goes through kombu, which picks one.

        The frames written here are kept until :meth:`wait` (or :meth:`flush`) writes them
        with the others, in the order they were published: the broker numbers them as
        this channel does."""
        encoding = content_encoding or "binary"
        written = amqp_publish.envelope_frames(
            self._channel.channel_id, exchange=exchange, routing_key=routing_key,
            mandatory=True, body=body, headers=headers, frame_max=self._frame_max,
            content_type=content_type, content_encoding=encoding) if content_type else None
        if written is not None:
            self._unwritten.append(written)
            self._unwritten_bytes += len(written)
            if self._unwritten_bytes >= _WRITE_AT:
                self.flush()
        else:
            self._publish_split(body, headers, exchange, routing_key, content_type,
                                content_encoding)
        tag = self._next_tag
        published = _Published(tag, headers.get(h.MESSAGE_ID, ""))
        self._next_tag = tag + 1
        self._waiting[tag] = published
        self._by_id = None
        self._unanswered += 1
        return tag

    def _publish_split(self, body: bytes, idembus_headers: Mapping[str, str], exchange: str,
                       routing_key: str, content_type: Any, content_encoding: Any) -> None:
        """:meth:`publish` of what :func:`.amqp_publish.envelope_frames` does not write:
        the headers split first, then the frames written here if :func:`.amqp_publish.frames`
        writes them, else through py-amqp (or kombu, without a content type)."""
        self.flush()  # what was published before goes first
        headers, split_properties = amqp_properties.split(idembus_headers)
        properties: dict[str, Any] = dict(split_properties)
        written = amqp_publish.frames(
            self._channel.channel_id, exchange=exchange, routing_key=routing_key,
            mandatory=True, body=body, headers=headers, frame_max=self._frame_max,
            content_type=content_type, content_encoding=content_encoding or "binary",
            **properties) if content_type else None
        if written is not None:
            self._write(written)
        elif content_type:
            self._channel.basic_publish(
                amqp.Message(body, content_type=content_type,
                             content_encoding=content_encoding or "binary",
                             application_headers=headers, delivery_mode=2, **properties),
                exchange=exchange, routing_key=routing_key, mandatory=True)
        else:
            self._producer.publish(body, headers=headers, exchange=exchange,
                                   routing_key=routing_key, content_encoding=content_encoding,
                                   delivery_mode=2, mandatory=True, retry=False, **properties)

    def _negotiated_frame_max(self) -> int:
        """The largest frame the broker takes (0: unknown), as negotiated when the
        connection opened: read once, when this channel is made."""
        frame_max = getattr(self._channel.connection, "frame_max", None)
        return frame_max if isinstance(frame_max, int) else 0

    def flush(self) -> None:
        """Write the frames of the publishes kept so far (:meth:`publish`), in one write;
        before anything is sent another way that should follow them."""
        unwritten = self._unwritten
        if unwritten:
            frames = b"".join(unwritten)
            unwritten.clear()
            self._unwritten_bytes = 0
            self._write(frames)

    def _write(self, frames: bytes) -> None:
        """Write a publish's frames (:mod:`.amqp_publish`) as py-amqp's frame writer
        would: on an open channel, counted as data sent for the heartbeats."""
        connection = self._channel.connection
        if connection is None or not self._channel.is_open:
            raise amqp.exceptions.RecoverableConnectionError("basic_publish: connection closed")
        connection.transport.write(frames)
        connection.bytes_sent += 1

    def wait(self, timeout: float) -> dict[int, tuple[str, str]]:
        """Wait until the broker confirmed (or refused) every message published since the
        last wait; return each handle's end (:data:`ACKED`, :data:`NACKED`,
        :data:`RETURNED`) and the reason it was returned. Raises ``TimeoutError`` after
        ``timeout`` seconds, and what py-amqp raises if the connection fails."""
        deadline = time.monotonic() + timeout
        self.flush()
        waiting = list(self._waiting.values())
        while self._unanswered:  # a count: a scan of the batch after each frame was O(n²)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the broker confirmed {sum(p.end is not None for p in waiting)}"
                                   f" of {len(waiting)} messages in {timeout:.0f}s")
            amqp_reads.drain(self.connection, remaining)
        self._waiting.clear()
        self._by_id = None
        return {published.tag: (published.end or NACKED, published.returned)
                for published in waiting}

    def _ended(self, delivery_tag: int, multiple: bool, end: str) -> None:
        tags = ([tag for tag in self._waiting if tag <= delivery_tag] if multiple
                else [delivery_tag])
        for tag in tags:
            published = self._waiting.get(tag)
            if published is not None and published.end is None:
                published.end = RETURNED if end == ACKED and published.returned else end
                self._unanswered -= 1

    def _dispatched(self, method_sig: Any, payload: bytes, content: Any) -> Any:
        """The channel's ``dispatch_method``: a ``basic.ack`` (one a message, most of a
        wait's frames) has its delivery tag and ``multiple`` bit unpacked here and goes to
        the channel's ``basic_ack`` listeners, as py-amqp's own dispatch and
        ``_on_basic_ack`` hand it over, without its generic argument reader; anything else,
        and an ack on a closing channel or one that a ``wait`` of py-amqp's expects, goes
        through py-amqp's dispatch."""
        channel = self._channel
        if (method_sig == _BASIC_ACK and not channel.is_closing
                and _BASIC_ACK not in channel._pending):
            delivery_tag, bits = _ACK_ARGUMENTS.unpack_from(payload, 4)
            multiple = (bits & 1) == 1
            for listener in channel.events["basic_ack"]:
                listener(delivery_tag, multiple)
            return None
        return self._dispatch_method(method_sig, payload, content)

    def _on_ack(self, delivery_tag: int, multiple: bool) -> None:
        self._ended(delivery_tag, multiple, ACKED)

    def _on_nack(self, delivery_tag: int, multiple: bool) -> None:
        self._ended(delivery_tag, multiple, NACKED)

    def _on_return(self, error: Exception, exchange: str, routing_key: str,
                   message: Any) -> None:
        properties = getattr(message, "properties", None) or {}
        headers = getattr(message, "headers", None) or {}
        message_id = properties.get("message_id") or headers.get(h.MESSAGE_ID, "")
        by_id = self._by_id
        if by_id is None:  # indexed at the wait's first return, not at every publish
            by_id = self._by_id = {}
            for published in self._waiting.values():
                by_id.setdefault(published.message_id, []).append(published)
        for published in by_id.get(str(message_id), ()):
            if published.end is None and not published.returned:
                published.returned = str(error) or "returned"
                return
