"""Reading RabbitMQ's frames from the socket in chunks instead of piece by piece.

py-amqp reads a frame from a plain TCP socket with one ``recv`` for its 7-byte header and
another for its payload and end byte, each asking for exactly the bytes it needs; a
delivery is three frames (method, content header, body), so it costs six or more
``recv`` system calls, and every publisher confirm two more. On a virtual machine a system
call costs several microseconds of kernel time plus the Python around it; this was about a
fifth of a consumer's CPU in ``bench.postgres``'s duplicate path.

py-amqp already keeps whatever it received beyond the frame it is reading in its own read
buffer (``_read_buffer``), across frames and across timeouts, and its reader serves frames
from that buffer before it touches the socket. :func:`read_in_chunks` only changes how much
each ``recv`` asks for: at least :data:`CHUNK` bytes, so one call takes every frame the
broker has sent so far. Nothing else changes: no frame is parsed differently, a frame
larger than the chunk is read as before, and a read that times out keeps its bytes as
before.

Connections over TLS read through the SSL object's own buffer and are left as they are;
so is a py-amqp whose transport lacks the attributes this relies on (a later release may
change them): then reads stay exact, and correct.

:func:`readable_within` waits for the socket the way a batch's short waits need: a socket
timeout is a ``poll`` in whole milliseconds, rounded up, so a 0.2 ms wait for a second
delivery took 1 ms; ``select`` waits in microseconds.
"""

from __future__ import annotations

import select
import socket
import ssl
from collections.abc import Callable
from typing import Any

from amqp.exceptions import UnexpectedFrame

#: The octet that ends every frame.
_FRAME_END = 0xCE
#: The class and method ids of the methods whose content follows them, as a method
#: frame's payload starts: ``basic.return``, ``basic.deliver``, ``basic.get-ok``.
_CONTENT_METHODS = frozenset({b"\x00\x3c\x00\x32", b"\x00\x3c\x00\x3c",
                              b"\x00\x3c\x00\x47"})
#: A content header's body size (after its class id and weight) when there is no body.
_NO_BODY = bytes(8)
#: The least a ``recv`` asks for: far more than a batch of small deliveries, and below
#: the allocator's threshold for a separate mapping (glibc: 128 KiB).
CHUNK = 64 * 1024


def read_in_chunks(amqp_transport: Any) -> bool:
    """Make ``amqp_transport`` (py-amqp's transport of a connection) ask its socket for
    :data:`CHUNK` bytes at least at each ``recv``; True if it did, False if the transport
    is not a plain TCP one this applies to."""
    sock = getattr(amqp_transport, "sock", None)
    if (not isinstance(sock, socket.socket) or isinstance(sock, ssl.SSLSocket)
            or not hasattr(amqp_transport, "_read_buffer")
            or getattr(amqp_transport, "_quick_recv", None) != sock.recv):
        return False
    amqp_transport._quick_recv = _chunked(sock.recv)
    return True


def _chunked(recv: Callable[[int], bytes]) -> Callable[[int], bytes]:
    def receive(wanted: int) -> bytes:
        return recv(wanted if wanted > CHUNK else CHUNK)

    return receive


def drain(connection: Any, timeout: float, *, every: bool = False) -> None:
    """``connection.drain_events(timeout=timeout)`` (a kombu connection to RabbitMQ): one
    whole method read and handled, or ``TimeoutError``. The frames py-amqp holds in its
    read buffer already are handled first, straight from it, without the socket's timeout
    set and restored, nor kombu's and py-amqp's layers around each read; the rest as kombu
    reads it. A connection without py-amqp's buffer drains as kombu drains it.

    A frame taken from the buffer is cut from it (the rest copied) only before a frame
    that may complete a method, whose handling may read the connection again: a
    delivery's method and content header frames, which only start a message
    (:func:`_starts_content`), are cut with the frame after them, so that a delivery costs
    one copy of what follows it in the buffer, not three.

    ``every``: the caller's handlers of what arrives only take note of it (a batch's
    consumer, which collects deliveries), never reading the connection meanwhile: then
    every whole frame of the buffer is handled, the buffer cut once after the last, and
    the socket read only when they complete no method."""
    # kombu's ``connection`` property checks the connection at each call; an unusable one
    # has no transport (or no kombu connection at all), and drains as kombu drains it.
    amqp_connection: Any = getattr(connection, "_connection", None)
    transport: Any = getattr(amqp_connection, "transport", None)
    buffered = getattr(transport, "_read_buffer", None)
    if type(buffered) is bytes:
        on_frame = amqp_connection.on_inbound_frame
        at = 0  # where the frames not handled yet start in ``buffered``
        completed = False
        size = len(buffered)
        try:
            # each whole frame (what _whole_frame_end tells, without a call a frame)
            while size >= at + 8 and size > (
                    end := at + 7 + int.from_bytes(buffered[at + 3:at + 7], "big")):
                if buffered[end] != _FRAME_END:
                    raise UnexpectedFrame(
                        f"Received frame_end {buffered[end]:#04x} while expecting 0xce")
                kind, payload = buffered[at], buffered[at + 7:end]
                frame = (kind, int.from_bytes(buffered[at + 1:at + 3], "big"), payload)
                at = end + 1
                if not every and not _starts_content(kind, payload):
                    transport._read_buffer = buffered = buffered[at:]
                    at, size = 0, len(buffered)
                if on_frame(frame):
                    if not every:
                        return
                    completed = True
        finally:
            if at:  # what was handled leaves the buffer (an error too: as py-amqp reads)
                transport._read_buffer = buffered[at:]
        if completed:
            return
    connection.drain_events(timeout=timeout)


def readable_within(connection: Any, timeout: float) -> bool:
    """Whether ``connection`` (a kombu connection to RabbitMQ) has something to read within
    ``timeout`` seconds (0: only what has arrived already): at once when py-amqp's read
    buffer holds a whole frame, else when its socket becomes readable, waited for with
    ``select``, to the microsecond (a socket timeout would round it up to a whole
    millisecond). True, without waiting, where that cannot be told (TLS, a transport
    without py-amqp's buffer, a descriptor ``select`` cannot watch): the caller's drain
    then waits with its own timeout, as before."""
    amqp_connection: Any = getattr(connection, "_connection", None)
    transport = getattr(amqp_connection, "transport", None)
    buffered = getattr(transport, "_read_buffer", None)
    sock = getattr(transport, "sock", None)
    if (type(buffered) is not bytes or not isinstance(sock, socket.socket)
            or isinstance(sock, ssl.SSLSocket)):
        return True
    if _whole_frame_end(buffered) is not None:
        return True  # a whole frame, read already
    try:
        readable, _, _ = select.select([sock], [], [], max(timeout, 0.0))
    except (ValueError, OSError):  # a descriptor beyond select's range, a closed socket
        return True
    return bool(readable)


def _whole_frame_end(buffered: bytes) -> int | None:
    """Where the first frame of ``buffered`` ends (the index of its frame-end octet), or
    ``None`` while ``buffered`` does not hold the whole frame. :func:`drain` makes the
    same test inline for each frame of its loop (a call a frame saved)."""
    if len(buffered) < 8:
        return None
    end = 7 + int.from_bytes(buffered[3:7], "big")
    return end if len(buffered) > end else None


def _starts_content(kind: int, payload: bytes) -> bool:
    """Whether a frame of ``kind`` with ``payload`` only starts a message, the content
    frames after it still to come: the method frame of ``basic.deliver``, ``basic.return``
    or ``basic.get-ok``, or a content header whose body size is not 0. Handling it only
    notes it; nothing else is called."""
    if kind == 1:
        return payload[:4] in _CONTENT_METHODS
    return kind == 2 and payload[4:12] != _NO_BODY
