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


def drain(connection: Any, timeout: float) -> None:
    """``connection.drain_events(timeout=timeout)`` (a kombu connection to RabbitMQ): one
    whole method read and handled, or ``TimeoutError``. The frames py-amqp holds in its
    read buffer already are handled first, straight from it (:func:`_buffered_frame`),
    without the socket's timeout set and restored, nor kombu's and py-amqp's layers
    around each read; the rest as kombu reads it. A connection without py-amqp's buffer
    drains as kombu drains it."""
    # kombu's ``connection`` property checks the connection at each call; an unusable one
    # has no transport (or no kombu connection at all), and drains as kombu drains it.
    amqp_connection: Any = getattr(connection, "_connection", None)
    transport = getattr(amqp_connection, "transport", None)
    if type(getattr(transport, "_read_buffer", None)) is bytes:
        on_frame = amqp_connection.on_inbound_frame
        frame = _buffered_frame(transport)
        while frame is not None:
            if on_frame(frame):
                return
            frame = _buffered_frame(transport)
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
    ``None`` while ``buffered`` does not hold the whole frame."""
    if len(buffered) < 8:
        return None
    end = 7 + int.from_bytes(buffered[3:7], "big")
    return end if len(buffered) > end else None


def _buffered_frame(transport: Any) -> tuple[int, int, bytes] | None:
    """The first frame of py-amqp's read buffer, taken out of it, as its ``read_frame``
    gives it (and with its error for a frame that does not end as a frame must); ``None``
    while the buffer does not hold a whole frame."""
    buffered: bytes = transport._read_buffer
    end = _whole_frame_end(buffered)
    if end is None:
        return None
    if buffered[end] != _FRAME_END:
        raise UnexpectedFrame(f"Received frame_end {buffered[end]:#04x} while expecting 0xce")
    transport._read_buffer = buffered[end + 1:]
    return buffered[0], int.from_bytes(buffered[1:3], "big"), buffered[7:end]
