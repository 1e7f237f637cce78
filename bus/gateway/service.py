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

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from ..errors import ConfigurationError
from ..handlers.base import AggregateHandler
from ..registry import MessageRegistry
from ..runtime.journal import current_entry
from ..runtime.shutdown import Deadline
from ..storage.base import JournalEntry, JournalStore, StatusStore, Storage
from .addresses import is_loopback
from .auth import Credentials
from .encoded import EventCache
from .hub import JournalHub
from .limits import ConnectionLimit
from .logins import LoginThrottle
from .server import build_app
from .serving import ServedApp
from .stream import StreamCounters, StreamSettings

if TYPE_CHECKING:
    from ..runtime.endpoint import Endpoint

log = logging.getLogger(__name__)

#: Seconds the hub may go without reading the journal before ``/healthz`` says so (at
#: least; ten poll intervals if that is longer).
STALE_AFTER = 10.0


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
    answered 503); ``max_connections``: connections held at once, streams included
    (``max_clients`` + 100 by default; beyond it the connection idle the longest is closed,
    or, if all are busy, the newcomer answered 503: :mod:`~idembus.gateway.limits`);
    ``idle_timeout``: seconds a connection may take to send a request, on opening and
    between requests; ``write_timeout``: seconds a stream's client may accept no data before
    its connection is aborted; ``logins``: how failed logins are throttled per client
    address (:class:`~idembus.gateway.logins.LoginThrottle`: 10 a minute by default). The
    endpoint's own consumers are not started.
    """

    def __init__(self, endpoint: Endpoint, *, host: str = "127.0.0.1", port: int = 8042,
                 auth: str | Credentials | None = None, buffer: int = 1000,
                 heartbeat: float = 15.0, poll_interval: float = 0.05,
                 cors_origins: Sequence[str] = (), max_clients: int = 1000,
                 idle_timeout: float = 10.0, write_timeout: float = 30.0,
                 max_connections: int | None = None,
                 logins: LoginThrottle | None = None) -> None:
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
        #: Failed logins per client address.
        self.logins = logins or LoginThrottle()
        self.idle_timeout = idle_timeout
        self.write_timeout = write_timeout
        self._address = (host, port)
        # Half a buffer per round: two rounds in a row fit a client that is reading.
        self.hub = JournalHub(endpoint.storage_as(JournalStore), interval=poll_interval,
                              batch=max(1, min(500, buffer // 2)),
                              cache=EventCache(current=_current_entries(endpoint)))
        self.counters = StreamCounters()
        #: Set while stopping: new streams are turned away, open ones end.
        self.stopping = threading.Event()
        self.settings = StreamSettings(
            storage=endpoint.storage_as(Storage), hub=self.hub, aggregates=aggregates_of(endpoint),
            counters=self.counters, stopping=self.stopping, buffer=buffer,
            heartbeat=heartbeat)
        self._stale_after = max(STALE_AFTER, 10 * poll_interval)
        #: The HTTP API (a Starlette app): what :meth:`start` serves, or what another app
        #: mounts (the dashboard's live stream) after :meth:`follow`.
        self.app = build_app(self)
        self._served = ServedApp(
            self.app, host=host, port=port, idle_timeout=idle_timeout, name="idembus-gateway",
            max_connections=max_clients + 100 if max_connections is None else max_connections)

    @property
    def address(self) -> tuple[str, int]:
        """Where it listens (the real port once started with port 0)."""
        return self._served.address

    @property
    def url(self) -> str:
        return self._served.url

    def start(self) -> None:
        """Listen, and serve in background threads until :meth:`stop`."""
        self.follow()
        try:
            self._served.start()
        except BaseException:
            self.stop(0)
            raise
        log.info("event gateway of %s listening on %s", self.endpoint.name, self.url)
        if self.credentials is None and not is_loopback(self.address[0]):
            log.warning("the event gateway of %s listens on %s without credentials: anyone "
                        "who reaches it reads the journal", self.endpoint.name, self.url)

    @property
    def limit(self) -> ConnectionLimit:
        """The connection cap, and what was done at it."""
        return self._served.limit

    def stop(self, timeout: float | None = 30.0) -> None:
        """Turn new streams away, end every stream, close every connection and release the
        port; the waits share ``timeout`` seconds (connections still open then are
        aborted)."""
        deadline = Deadline(timeout)
        self.unfollow(deadline.left())
        self._served.stop(deadline.left())

    def follow(self) -> None:
        """Check the storage and follow its journal: what :attr:`app` needs to serve
        streams, whoever serves it."""
        self.endpoint.storage.verify()
        self.stopping.clear()
        self.hub.start()

    def unfollow(self, timeout: float | None = 30.0) -> None:
        """Turn new streams away and end every stream (within ``timeout`` seconds)."""
        self.stopping.set()
        self.hub.stop(timeout)  # ends the live streams

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
        bounds = self.endpoint.storage_as(JournalStore).journal_bounds()
        reports = self.endpoint.storage_as(StatusStore).status_reports(self.endpoint.name)
        return {
            **self.counters.snapshot(),
            "open_connections": self._served.open_connections,
            "max_clients": self.max_clients,
            "max_connections": self.limit.cap,
            "connections_turned_away": self.limit.turned_away,
            "idle_connections_closed": self.limit.evicted,
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


def _current_entries(endpoint: Endpoint) -> Callable[[JournalEntry], JournalEntry]:
    """Journal entries as the current versions of the event types the endpoint knows: those
    its handlers handle and those it journals by name (``journal=[...]``)."""
    known = MessageRegistry(endpoint.registry)
    for event_type in endpoint.journal.message_types if endpoint.journal else ():
        known.add(event_type)
    return functools.partial(current_entry, known=known)


def aggregates_of(endpoint: Endpoint) -> dict[str, type[BaseModel]]:
    """The aggregate types the endpoint's handlers keep, with their state models."""
    return {type(handler).storage_name(): type(handler).state_type
            for handler in endpoint.table.handlers if isinstance(handler, AggregateHandler)}
