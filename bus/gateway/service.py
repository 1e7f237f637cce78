"""The gateway as a running service: the journal hub and the HTTP app (:mod:`.server`)
served by uvicorn in a thread of its own, started and stopped from Python or by
``idembus gateway``.

uvicorn's asyncio loop holds every connection — an idle one costs a few kilobytes, not a
thread — and notices a client that hangs up through the ASGI receive channel. What uvicorn
leaves open is closed here: a connection that sends no whole request within
``idle_timeout`` seconds (:mod:`.protocol`), a stream whose client stops reading for
``write_timeout`` seconds (:mod:`.response`), and, at stop, any connection still open
once the streams had their ``timeout`` to end.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import uvicorn
from pydantic import BaseModel

from ..errors import ConfigurationError
from ..handlers.base import AggregateHandler
from ..journal import current_entry
from ..registry import MessageRegistry
from ..shutdown import Deadline
from ..storage.base import JournalEntry
from .auth import Credentials
from .encoded import EventCache
from .hub import JournalHub
from .protocol import GatewayProtocol
from .server import build_app
from .stream import StreamCounters, StreamSettings

if TYPE_CHECKING:
    from ..endpoint import Endpoint

log = logging.getLogger(__name__)

#: Connections the listening socket queues before uvicorn accepts them.
BACKLOG = 2048

#: Seconds the hub may go without reading the journal before ``/healthz`` says so (at
#: least; ten poll intervals if that is longer).
STALE_AFTER = 10.0

#: Seconds ``start`` waits for the server to be up.
START_TIMEOUT = 30.0


class Gateway:
    """Serves an endpoint's event journal over HTTP as Server-Sent Events.

    ``auth`` (``"user:password"`` or :class:`~idembus.gateway.auth.Credentials`, both parts
    non-empty) protects the stream and the status with HTTP basic authentication.
    ``buffer``: live events a client may have waiting before it is disconnected (it then
    resumes with ``Last-Event-ID``): keep it above the bursts of events you expect, or a
    client reading slower than a burst arrives is disconnected during it; ``heartbeat``:
    seconds between keep-alive comments; ``poll_interval``: seconds between looks at the
    journal; ``cors_origins``: web origins (such as ``https://app.example.com``) whose pages
    may read the stream and the status from another origin, with credentials — or ``*``:
    every origin, without credentials; ``max_clients``: streams open at once (more are
    answered 503); ``idle_timeout``: seconds a connection may take to send a request, on
    opening and between requests; ``write_timeout``: seconds a stream's client may accept
    no data before its connection is aborted. The endpoint's own consumers are not started.
    """

    def __init__(self, endpoint: Endpoint, *, host: str = "127.0.0.1", port: int = 8042,
                 auth: str | Credentials | None = None, buffer: int = 1000,
                 heartbeat: float = 15.0, poll_interval: float = 0.05,
                 cors_origins: Sequence[str] = (), max_clients: int = 1000,
                 idle_timeout: float = 10.0, write_timeout: float = 30.0) -> None:
        if buffer < 1:
            raise ConfigurationError(f"the client buffer must hold at least 1 event, got {buffer}")
        if min(heartbeat, poll_interval, idle_timeout, write_timeout) <= 0:
            raise ConfigurationError("heartbeat, poll_interval, idle_timeout and write_timeout "
                                     "must be positive seconds")
        if max_clients < 1:
            raise ConfigurationError(f"max_clients must be at least 1, got {max_clients}")
        origins = frozenset(cors_origins)
        if "*" in origins and len(origins) > 1:
            raise ConfigurationError("CORS origin '*' already lets every origin read (without "
                                     "credentials): give '*' alone, or the origins by name")
        self.endpoint = endpoint
        #: Who may read (``None``: anybody).
        self.credentials = Credentials.parse(auth) if isinstance(auth, str) else auth
        #: Origins whose pages may read the stream and the status (``*``: any).
        self.cors_origins = origins
        self.max_clients = max_clients
        self.idle_timeout = idle_timeout
        self.write_timeout = write_timeout
        self._address = (host, port)
        # Half a buffer per round: two rounds in a row fit a client that is reading.
        self.hub = JournalHub(endpoint.storage, interval=poll_interval,
                              batch=max(1, min(500, buffer // 2)),
                              cache=EventCache(current=_current_entries(endpoint)))
        self.counters = StreamCounters()
        #: Set while stopping: new streams are turned away, open ones end.
        self.stopping = threading.Event()
        self.settings = StreamSettings(
            storage=endpoint.storage, hub=self.hub, aggregates=_aggregates_of(endpoint),
            counters=self.counters, stopping=self.stopping, buffer=buffer,
            heartbeat=heartbeat)
        self._stale_after = max(STALE_AFTER, 10 * poll_interval)
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

    def start(self) -> None:
        """Listen, and serve in background threads until :meth:`stop`."""
        self.endpoint.storage.verify()
        self.stopping.clear()
        try:
            listening = _listen(*self._address)
        except OSError as error:
            raise ConfigurationError(
                f"cannot listen on {self._address[0]}:{self._address[1]}: {error}") from error
        self._socket = listening
        host, port = listening.getsockname()[:2]
        self._bound = (str(host), int(port))
        self.hub.start()
        config = uvicorn.Config(
            build_app(self), http=GatewayProtocol, ws="none", lifespan="off",
            log_config=None, log_level=logging.WARNING, access_log=False,
            server_header=False, timeout_keep_alive=max(1, round(self.idle_timeout)),
            backlog=BACKLOG)
        config.timeout_keep_alive = self.idle_timeout  # type: ignore[assignment]  # fractions too
        server = _Server(config)
        self._server = server
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]},
                                        name="idembus-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not server.ready.wait(0.05):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop(0)
                raise ConfigurationError(f"the gateway's HTTP server did not start on {self.url}"
                                         " (its log says why)")
        log.info("event gateway of %s listening on %s", self.endpoint.name, self.url)

    def stop(self, timeout: float | None = 30.0) -> None:
        """Turn new streams away, end every stream, close every connection and release the
        port; the waits share ``timeout`` seconds (connections still open then are
        aborted)."""
        deadline = Deadline(timeout)
        self.stopping.set()
        self.hub.stop(deadline.left())  # ends the live streams
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

    def problem(self) -> str | None:
        """Why the gateway is not serving its journal, or ``None`` (``GET /healthz``)."""
        if self.stopping.is_set():
            return "stopping"
        if self.hub.failure is not None:
            return (f"the journal cannot be read ({self.hub.failure}; the gateway's log says "
                    "why)")
        quiet = time.monotonic() - self.hub.last_read
        if quiet > self._stale_after:
            return (f"the journal was last read {quiet:.0f}s ago (the storage may be "
                    "unreachable: see the gateway's log)")
        return None

    def status(self, *, private: bool = True) -> dict[str, Any]:
        """The counters ``GET /status`` returns; without ``private``, the instances' names
        (host:pid:tag) are cut to their tags."""
        bounds = self.endpoint.storage.journal_bounds()
        reports = self.endpoint.storage.status_reports(self.endpoint.name)
        server = self._server
        return {
            **self.counters.snapshot(),
            "open_connections": len(server.server_state.connections) if server else 0,
            "max_clients": self.max_clients,
            "overflows": self.hub.overflows,
            "encoded": self.hub.cache.encoded,
            "position": self.hub.position,
            "journal": {"size": bounds.size, "oldest": bounds.oldest, "newest": bounds.newest},
            "endpoint": {"name": self.endpoint.name,
                         "counters": self.endpoint.counters.snapshot(),
                         "instances": [{"instance": r.instance if private
                                        else r.instance.rsplit(":", 1)[-1],
                                        "counters": dict(r.counters),
                                        "updated_at": r.updated_at.isoformat(),
                                        "stopped": r.stopped} for r in reports]},
        }


class _Server(uvicorn.Server):
    """uvicorn's server, saying when it is up, and aborting at the end of its shutdown the
    connections still open (a client that does not read would hold its own forever)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            self.ready.set()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        for connection in list(self.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()
        await asyncio.sleep(0)  # their connection_lost runs: the sockets close


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=BACKLOG)


def _current_entries(endpoint: Endpoint) -> Callable[[JournalEntry], JournalEntry]:
    """Journal entries as the current versions of the event types the endpoint knows: those
    its handlers handle and those it journals by name (``journal=[...]``)."""
    known = MessageRegistry(endpoint.registry)
    for event_type in endpoint.journal.message_types if endpoint.journal else ():
        known.add(event_type)
    return functools.partial(current_entry, known=known)


def _aggregates_of(endpoint: Endpoint) -> dict[str, type[BaseModel]]:
    """The aggregate types the endpoint's handlers keep, with their state models."""
    return {type(handler).storage_name(): type(handler).state_type
            for handler in endpoint.table.handlers if isinstance(handler, AggregateHandler)}
