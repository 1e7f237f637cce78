"""The gateway's HTTP server: ``GET /`` (the event stream) and ``GET /status``.

A thread per connection (:class:`http.server.ThreadingHTTPServer`): a stream's thread
mostly waits on its subscription, and a slow client only ever blocks its own thread — the
hub never waits for it (:mod:`bus.gateway.hub`).

Nothing it says carries a password: answers and log lines go through
:func:`~bus.redaction.redact`, an unexpected error is answered with a 500 that names only
its type, and tracebacks are logged redacted (``http.server`` would print them raw to
stderr).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import logging
import select
import socket
import sys
import threading
import traceback
import urllib.parse
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from ..errors import BadStreamRequest, ConfigurationError
from ..handlers.base import AggregateHandler
from ..redaction import redact
from ..shutdown import Deadline
from ..storage.errors import StorageUnavailable
from .hub import JournalHub
from .request import filters_from, resume_point
from .stream import ClientStream, StreamCounters, StreamSettings, plan

if TYPE_CHECKING:
    from ..endpoint import Endpoint

log = logging.getLogger(__name__)

#: Media types a client may accept to get the stream.
_STREAM_ACCEPTED = ("text/event-stream", "text/*", "*/*")


class Gateway:
    """Serves an endpoint's event journal over HTTP as Server-Sent Events.

    ``auth`` (``"user:password"``) protects the stream and the status with HTTP basic
    authentication. ``buffer``: live events a client may have waiting before it is
    disconnected (it then resumes with ``Last-Event-ID``): keep it above the bursts of
    events you expect, or a client reading slower than a burst arrives is disconnected
    during it; ``heartbeat``: seconds between keep-alive comments; ``poll_interval``:
    seconds between looks at the journal; ``cors_origins``: web origins (such as
    ``https://app.example.com``, or ``*``) whose pages may read the stream and the status
    from another origin (CORS, with credentials). The endpoint's own consumers are not
    started.
    """

    def __init__(self, endpoint: Endpoint, *, host: str = "127.0.0.1", port: int = 8042,
                 auth: str | None = None, buffer: int = 1000, heartbeat: float = 15.0,
                 poll_interval: float = 0.05, cors_origins: Sequence[str] = ()) -> None:
        if buffer < 1:
            raise ConfigurationError(f"the client buffer must hold at least 1 event, got {buffer}")
        if heartbeat <= 0 or poll_interval <= 0:
            raise ConfigurationError("heartbeat and poll_interval must be positive seconds")
        if auth is not None and ":" not in auth:
            raise ConfigurationError("auth must be 'user:password'")
        self.endpoint = endpoint
        self._auth = auth
        #: Origins whose pages may read the stream and the status (``*``: any).
        self.cors_origins = frozenset(cors_origins)
        self._address = (host, port)
        # Half a buffer per round: two rounds in a row fit a client that is reading.
        self.hub = JournalHub(endpoint.storage, interval=poll_interval,
                              batch=max(1, min(500, buffer // 2)))
        self.counters = StreamCounters()
        self._stopping = threading.Event()
        self._settings = StreamSettings(
            storage=endpoint.storage, hub=self.hub, aggregates=_aggregates_of(endpoint),
            counters=self.counters, stopping=self._stopping, buffer=buffer,
            heartbeat=heartbeat)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()

    @property
    def address(self) -> tuple[str, int]:
        """Where it listens (the real port once started with port 0)."""
        if self._server is None:
            return self._address
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}"

    def start(self) -> None:
        """Listen and serve in background threads."""
        self.endpoint.storage.verify()
        self._stopping.clear()
        self.hub.start()
        try:
            server = _Server(self._address, _handler_for(self))
        except OSError as error:
            self.hub.stop()
            raise ConfigurationError(
                f"cannot listen on {self._address[0]}:{self._address[1]}: {error}") from error
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, args=(0.1,),
                                        name="idembus-gateway", daemon=True)
        self._thread.start()
        log.info("event gateway of %s listening on %s", self.endpoint.name, self.url)

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop accepting, end every stream, release the port; the waits for the journal's
        reader and the server's thread share ``timeout`` seconds."""
        deadline = Deadline(timeout)
        self._stopping.set()
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
        self.hub.stop(deadline.left())
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            _shut(connection)
        if server is not None:
            server.server_close()
        if self._thread is not None:
            self._thread.join(deadline.left())
            self._thread = None

    def status(self) -> dict[str, Any]:
        """The counters ``GET /status`` returns."""
        bounds = self.endpoint.storage.journal_bounds()
        reports = self.endpoint.storage.status_reports(self.endpoint.name)
        return {
            **self.counters.snapshot(),
            "overflows": self.hub.overflows,
            "position": self.hub.position,
            "journal": {"size": bounds.size, "oldest": bounds.oldest, "newest": bounds.newest},
            "endpoint": {"name": self.endpoint.name,
                         "counters": self.endpoint.counters.snapshot(),
                         "instances": [{"instance": r.instance, "counters": dict(r.counters),
                                        "updated_at": r.updated_at.isoformat(),
                                        "stopped": r.stopped} for r in reports]},
        }

    def cors_headers(self, origin: str | None) -> dict[str, str]:
        """The CORS headers answering a request from ``origin`` (none if not allowed)."""
        if not origin or not ("*" in self.cors_origins or origin in self.cors_origins):
            return {}
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin",
                "Access-Control-Allow-Credentials": "true"}

    def authorized(self, header: str | None) -> bool:
        if self._auth is None:
            return True
        if not header or not header.startswith("Basic "):
            return False
        try:
            given = base64.b64decode(header[6:].strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return False
        return hmac.compare_digest(given.encode("utf-8"), self._auth.encode("utf-8"))

    def serve_stream(self, handler: BaseHTTPRequestHandler, query: str) -> None:
        """Answer one stream request on ``handler``'s connection."""
        parameters = urllib.parse.parse_qs(query, keep_blank_values=True)
        try:
            filters = filters_from(parameters)
            last_event_id = handler.headers.get("Last-Event-ID")
            if last_event_id is None and "last_event_id" in parameters:
                last_event_id = parameters["last_event_id"][-1]
            start = plan(resume_point(last_event_id), self.endpoint.storage)
        except BadStreamRequest as error:
            self.counters.add(rejected=1)
            _answer(handler, HTTPStatus.BAD_REQUEST, {"error": redact(str(error))})
            return
        except StorageUnavailable as error:
            _answer(handler, HTTPStatus.SERVICE_UNAVAILABLE, _unavailable(error))
            return
        except Exception as error:
            _failed(handler, error)
            return
        handler.send_response(HTTPStatus.OK)
        handler.send_header("Content-Type", "text/event-stream; charset=utf-8")
        handler.send_header("Cache-Control", "no-cache")
        handler.send_header("X-Accel-Buffering", "no")
        handler.end_headers()
        connection = handler.connection
        with self._lock:
            self._connections.add(connection)
        self.counters.add(clients=1, connections=1)
        stream = ClientStream(self._settings, filters, start, _writer(handler),
                              disconnect=lambda: _shut(connection),
                              gone=lambda: _hung_up(connection))
        try:
            stream.run()
        except OSError:
            pass  # the client went away, or was disconnected for falling behind
        except StorageUnavailable as error:
            log.warning("ending a stream: %s (the client resumes when it reconnects)",
                        redact(str(error)))
        finally:
            self.counters.add(clients=-1)
            with self._lock:
                self._connections.discard(connection)
            handler.close_connection = True


def _handler_for(gateway: Gateway) -> type[BaseHTTPRequestHandler]:
    class GatewayRequestHandler(BaseHTTPRequestHandler):
        server_version = "idembus-gateway"

        def do_GET(self) -> None:  # noqa: N802 (the name http.server dispatches to)
            path, _, query = self.path.partition("?")
            if not gateway.authorized(self.headers.get("Authorization")):
                gateway.counters.add(unauthorized=1)
                self.send_response(HTTPStatus.UNAUTHORIZED)
                self.send_header("WWW-Authenticate", 'Basic realm="idembus gateway"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if path == "/status":
                try:
                    _answer(self, HTTPStatus.OK, gateway.status())
                except StorageUnavailable as error:
                    _answer(self, HTTPStatus.SERVICE_UNAVAILABLE, _unavailable(error))
                except Exception as error:
                    _failed(self, error)
            elif path == "/":
                if not _accepts_stream(self.headers.get("Accept")):
                    _answer(self, HTTPStatus.NOT_ACCEPTABLE, {
                        "error": "the stream is text/event-stream: send Accept: "
                                 "text/event-stream"})
                    return
                gateway.serve_stream(self, query)
            else:
                _answer(self, HTTPStatus.NOT_FOUND,
                        {"error": f"no {path}: GET / for the stream, GET /status"})

        def do_OPTIONS(self) -> None:  # noqa: N802
            """A browser's CORS preflight: answered without authentication."""
            self.send_response(HTTPStatus.NO_CONTENT)
            if gateway.cors_headers(self.headers.get("Origin")):
                self.send_header("Access-Control-Allow-Methods", "GET, OPTIONS")
                self.send_header("Access-Control-Allow-Headers",
                                 "Authorization, Last-Event-ID, Accept, Cache-Control")
                self.send_header("Access-Control-Max-Age", "600")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def end_headers(self) -> None:
            for name, value in gateway.cors_headers(self.headers.get("Origin")).items():
                self.send_header(name, value)
            super().end_headers()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            if log.isEnabledFor(logging.DEBUG):  # the request line may carry a password
                log.debug("%s %s", self.address_string(), redact(format % args))

    return GatewayRequestHandler


class _Server(ThreadingHTTPServer):
    """:class:`~http.server.ThreadingHTTPServer` whose unexpected errors are logged with
    their traceback redacted, instead of printed raw to stderr."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):  # the client went away
            log.debug("connection from %s ended: %s", client_address, redact(str(error)))
            return
        log.error("a request from %s failed:\n%s", client_address,
                  redact(traceback.format_exc().rstrip()))


def _failed(handler: BaseHTTPRequestHandler, error: Exception) -> None:
    """Answer 500 for an unexpected error, naming only its type; log it redacted."""
    log.error("answering %s failed:\n%s", handler.path.partition("?")[0],
              redact("".join(traceback.format_exception(error)).rstrip()))
    _answer(handler, HTTPStatus.INTERNAL_SERVER_ERROR, {
        "error": f"the gateway failed to answer ({type(error).__name__}); its log says why"})


def _aggregates_of(endpoint: Endpoint) -> dict[str, type[BaseModel]]:
    """The aggregate types the endpoint's handlers keep, with their state models."""
    return {type(handler).storage_name(): type(handler).state_type
            for handler in endpoint.table.handlers if isinstance(handler, AggregateHandler)}


def _unavailable(error: StorageUnavailable) -> dict[str, Any]:
    return {"error": f"the storage cannot be reached ({redact(str(error))}); try again shortly"}


def _accepts_stream(accept: str | None) -> bool:
    if accept is None:
        return True
    kinds = {part.split(";")[0].strip().lower() for part in accept.split(",")}
    return not kinds.isdisjoint(_STREAM_ACCEPTED)


def _answer(handler: BaseHTTPRequestHandler, status: HTTPStatus, body: dict[str, Any]) -> None:
    payload = json.dumps(body, indent=1).encode("utf-8")
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(payload)))
    handler.end_headers()
    handler.wfile.write(payload)


def _writer(handler: BaseHTTPRequestHandler) -> Any:
    def write(data: bytes) -> None:
        handler.wfile.write(data)
        handler.wfile.flush()

    return write


def _hung_up(connection: socket.socket) -> bool:
    """True once the client closed its side (a stream client sends nothing after its
    request, so anything readable is the end of the connection)."""
    try:
        readable, _, _ = select.select([connection], [], [], 0)
        return bool(readable) and connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _shut(connection: socket.socket) -> None:
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed
