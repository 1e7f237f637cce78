"""uvicorn's HTTP/1.1 protocol (h11) with what idembus's servers add per connection.

* **A deadline for every request.** A connection must send a whole request — head and
  body — within ``timeout_keep_alive`` seconds of opening, and of the end of its previous
  response. uvicorn closes a keep-alive connection that stays silent that long, but not one
  that never sends a request, nor one that sends half a request and stops: both held a
  socket forever. A connection whose last answer its client does not read is reset then,
  not closed (a graceful close would wait for the client).
* **A cap on connections** (:class:`~idembus.gateway.limits.ConnectionLimit`, the
  protocol's :attr:`GatewayProtocol.limit`): beyond it, the connection idle the longest is
  closed to make room, or, if none is idle, the newcomer is answered :data:`BUSY` and
  closed.
* **A way to reset the connection.** The request's scope carries, under the ASGI
  ``extensions`` key :data:`ABORT`, a callable that aborts the connection (its unsent data
  dropped). An event stream whose client stopped reading cannot be ended otherwise: a
  graceful close waits for the client to read what is buffered.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import ConnectionLimit

#: Scope extension holding the connection's abort callable.
ABORT = "idembus.abort"

#: Seconds a connection turned away may take to read its 503 before it is reset.
LINGER = 1.0

_BUSY_TEXT = b"too many connections at once; try again shortly\n"
#: The whole answer of a connection turned away at the cap (fixed: nothing about the server).
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\n"
        b"content-type: text/plain; charset=utf-8\r\n"
        b"content-length: " + str(len(_BUSY_TEXT)).encode() + b"\r\n"
        b"retry-after: 5\r\n"
        b"cache-control: no-store\r\n"
        b"x-content-type-options: nosniff\r\n"
        b"connection: close\r\n\r\n" + _BUSY_TEXT)


class GatewayProtocol(H11Protocol):
    """See the module docstring."""

    #: The cap this server's connections share (``None``: no cap).
    limit: ClassVar[ConnectionLimit | None] = None

    _deadline: asyncio.TimerHandle | None = None
    #: Since when (``time.monotonic()``) the connection waits for a request; ``None``
    #: while one is in progress.
    _idle_since: float | None = None
    _turned_away = False

    @classmethod
    def limited(cls, limit: ConnectionLimit) -> type[GatewayProtocol]:
        """This protocol with ``limit`` as its cap (one class per server)."""
        return type("LimitedGatewayProtocol", (cls,), {"limit": limit})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limit = self.limit
        if limit is not None and len(self.connections) > limit.cap and not self._make_room(
                limit):
            self._turn_away(limit)
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if not self._turned_away:  # its request is read and dropped while it lingers
            super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._turned_away and self.limit is not None:
            self.limit.lingering -= 1
            self._turned_away = False
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        current = self.cycle
        if current is not cycle and current is not None:  # a request head came
            self._idle_since = None
            scope: Any = current.scope  # its task has not started yet
            scope.setdefault("extensions", {})[ABORT] = self.transport.abort
        if current is not None and not current.more_body:  # the whole request came
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def _make_room(self, limit: ConnectionLimit) -> bool:
        """Close the connection idle the longest, if there is one (True then)."""
        idle = [connection for connection in self.connections
                if isinstance(connection, GatewayProtocol) and connection is not self
                and connection._idle_since is not None]
        if not idle:
            return False
        oldest = min(idle, key=lambda connection: connection._idle_since or 0.0)
        oldest._idle_since = None
        oldest._disarm()
        oldest.connections.discard(oldest)  # its place is taken now
        oldest.transport.abort()
        limit.note_evicted()
        return True

    def _turn_away(self, limit: ConnectionLimit) -> None:
        """Answer :data:`BUSY` and close; reset at once if too many are closing already."""
        self.connections.discard(self)
        limit.note_turned_away()
        if limit.lingering >= limit.lingering_cap:
            self.transport.abort()
            return
        limit.lingering += 1
        self._turned_away = True
        self.transport.write(BUSY)
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the client reads the answer, then closes
        self._deadline = self.loop.call_later(LINGER, self.transport.abort)

    def _arm(self) -> None:
        self._disarm()
        if self._idle_since is None and (self.cycle is None or self.cycle.response_complete):
            self._idle_since = time.monotonic()
        self._deadline = self.loop.call_later(self.timeout_keep_alive, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        cycle = self.cycle
        working = (cycle is not None and not cycle.more_body and not cycle.response_complete)
        if working:
            return
        if self.transport.get_write_buffer_size():
            self.transport.abort()  # its client does not read: a close would wait for it
        elif not self.transport.is_closing():
            self.transport.close()
