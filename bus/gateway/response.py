"""The HTTP response carrying one event stream.

Starlette's :class:`~starlette.responses.StreamingResponse` sends the chunks and ends the
stream when the client disconnects (it listens on the ASGI receive channel: no socket is
polled by hand). This one adds what a long-lived stream needs:

* a **write timeout**: a client that accepts no data for ``write_timeout`` seconds (its
  socket buffers full: it stopped reading) has its connection aborted, through the server's
  :data:`~idembus.gateway.protocol.ABORT` extension where the server offers one — a graceful
  close would wait for that client forever;
* ``on_end`` called once however the stream ends, and the chunks' generator closed (its
  ``finally`` blocks run at once, not when it is collected).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .protocol import ABORT


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` from ``chunks``; see the module docstring."""

    media_type = "text/event-stream; charset=utf-8"

    def __init__(self, chunks: AsyncGenerator[bytes, None], *, write_timeout: float,
                 on_end: Callable[[], None], headers: Mapping[str, str] | None = None) -> None:
        super().__init__(chunks, headers=headers)
        self._chunks = chunks
        self._write_timeout = write_timeout
        self._on_end = on_end
        self._abort: Callable[[], None] | None = None
        #: True if the stream ended because the client stopped reading.
        self.timed_out = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._abort = scope.get("extensions", {}).get(ABORT)
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._chunks.aclose()
            finally:
                self._on_end()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for chunk in self._chunks:
            with anyio.move_on_after(self._write_timeout) as waited:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if waited.cancelled_caught:
                self.timed_out = True
                if self._abort is not None:
                    self._abort()
                    await anyio.sleep(0)  # the server notes the connection lost
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
