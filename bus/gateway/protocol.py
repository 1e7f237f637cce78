"""uvicorn's HTTP/1.1 protocol (h11) with what the gateway adds per connection.

* **A deadline for every request.** A connection must send a whole request head within
  ``timeout_keep_alive`` seconds of opening, and of the end of its previous response.
  uvicorn closes a keep-alive connection that stays silent that long, but not one that never
  sends a request, nor one that sends half a request and stops: both held a socket forever.
* **A way to reset the connection.** The request's scope carries, under the ASGI
  ``extensions`` key :data:`ABORT`, a callable that aborts the connection (its unsent data
  dropped). An event stream whose client stopped reading cannot be ended otherwise: a
  graceful close waits for the client to read what is buffered.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

#: Scope extension holding the connection's abort callable.
ABORT = "idembus.abort"


class GatewayProtocol(H11Protocol):
    """See the module docstring."""

    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and self.cycle is not None:  # a whole request came
            self._disarm()
            scope: Any = self.cycle.scope  # its task has not started yet
            scope.setdefault("extensions", {})[ABORT] = self.transport.abort

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.timeout_keep_alive, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        busy = self.cycle is not None and not self.cycle.response_complete
        if not busy and not self.transport.is_closing():
            self.transport.close()
