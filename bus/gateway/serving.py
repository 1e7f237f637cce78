"""An ASGI app served by uvicorn in a thread of its own, as the gateway, the dashboard and
the metrics endpoint serve theirs: listening on a socket of its own (port 0 picks one), the
per-connection request deadline and the connection cap of :mod:`.protocol` and
:mod:`.limits`, accept failures and uvicorn's line per bad request logged once a second,
no access log and no server header,
and at stop every connection still open aborted once the graceful wait is over.

Needs uvicorn only (not Starlette): the metrics endpoint serves through it too.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING

import uvicorn

from ..errors import ConfigurationError
from ..runtime.shutdown import Deadline
from .limits import (
    ConnectionLimit,
    accept_backlog,
    connection_cap,
    descriptor_limit,
    quiet_per_connection_lines,
)
from .protocol import GatewayProtocol

if TYPE_CHECKING:
    from starlette.types import ASGIApp

log = logging.getLogger(__name__)

#: Connections the listening socket queues before uvicorn accepts them (asyncio accepts
#: fewer in one turn of its loop when the descriptor limit is low,
#: :func:`~.limits.accept_backlog`).
BACKLOG = 2048

#: Seconds ``start`` waits for the server to be up.
START_TIMEOUT = 30.0


class ServedApp:
    """``app`` served on ``host:port`` by uvicorn in a daemon thread named ``name``;
    ``idle_timeout``: seconds a connection may take to send a request, on opening and
    between requests; ``max_connections``: connections held at once (lowered to what the
    process's descriptor limit leaves room for, :func:`~.limits.connection_cap`)."""

    def __init__(self, app: ASGIApp, *, host: str, port: int, idle_timeout: float,
                 name: str, max_connections: int = 1000) -> None:
        if max_connections < 1:
            raise ConfigurationError(f"max_connections must be at least 1, got "
                                     f"{max_connections}")
        self._app = app
        self._address = (host, port)
        self._idle_timeout = idle_timeout
        self._name = name
        self._requested = max_connections
        #: The connection cap and what was done at it (set by :meth:`start`).
        self.limit = ConnectionLimit(max_connections, name=name)
        self._socket: socket.socket | None = None
        self._bound: tuple[str, int] | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """Where it listens (the real port once started with port 0)."""
        return self._bound or self._address

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def open_connections(self) -> int:
        server = self._server
        return len(server.server_state.connections) if server else 0

    def start(self) -> None:
        """Listen, and serve in a background thread until :meth:`stop`;
        ConfigurationError if the address is taken or the server does not come up."""
        descriptors = descriptor_limit()
        try:
            listening = _listen(*self._address)
        except OSError as error:
            raise ConfigurationError(
                f"cannot listen on {self._address[0]}:{self._address[1]}: {error}") from error
        self._socket = listening
        host, port = listening.getsockname()[:2]
        self._bound = (str(host), int(port))
        cap = connection_cap(self._requested, descriptors)
        if cap < self._requested:
            log.warning("%s: holding at most %d connections, not %d: this process may open "
                        "%s descriptors (ulimit -n), and needs some for its own connections",
                        self._name, cap, self._requested, descriptors)
        self.limit = ConnectionLimit(cap, name=self._name)
        quiet_per_connection_lines(logging.getLogger("uvicorn.error"))
        config = uvicorn.Config(
            self._app, http=GatewayProtocol.limited(self.limit), ws="none", lifespan="off",
            log_config=None, log_level=logging.WARNING, access_log=False,
            server_header=False, timeout_keep_alive=max(1, round(self._idle_timeout)),
            backlog=accept_backlog(BACKLOG, descriptors))
        config.timeout_keep_alive = self._idle_timeout  # type: ignore[assignment]  # fractions too
        server = _Server(config, self.limit)
        self._server = server
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]},
                                        name=self._name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not server.ready.wait(0.05):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop(0)
                raise ConfigurationError(f"the HTTP server did not start on {self.url} (its "
                                         "log says why)")

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop serving: connections get ``timeout`` seconds to finish, then are aborted;
        the port is released."""
        deadline = Deadline(timeout)
        server, thread = self._server, self._thread
        if server is not None and thread is not None:
            left = deadline.left()
            server.config.timeout_graceful_shutdown = (
                None if left is None else max(0, int(left * 0.8)))
            server.should_exit = True
            thread.join(left)
        if self._socket is not None:
            self._socket.close()
        self._server = self._thread = None


class _Server(uvicorn.Server):
    """uvicorn's server, saying when it is up, and aborting at the end of its shutdown the
    connections still open (a client that does not read would hold its own forever)."""

    def __init__(self, config: uvicorn.Config, limit: ConnectionLimit) -> None:
        super().__init__(config)
        self.ready = threading.Event()
        self._limit = limit

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(self._limit.exception_handler)
        await super().startup(sockets)
        for listening in sockets or ():
            # asyncio listened with the config's backlog, which is also how many it accepts
            # in one turn of its loop: the kernel may queue more (they hold no descriptor
            # of this process), so that a burst is not met with dropped SYNs.
            listening.listen(BACKLOG)
        if not self.should_exit:
            self.ready.set()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._limit.stopping = True
        await super().shutdown(sockets)
        for connection in list(self.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()
        await asyncio.sleep(0)  # their connection_lost runs: the sockets close


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=BACKLOG)
