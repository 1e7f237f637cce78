"""The gateway's HTTP API, as a Starlette app: ``GET /`` (the event stream), ``GET /status``
and ``GET /healthz``.

* ``/`` and ``/status`` need the gateway's credentials when it has some (401 otherwise);
  ``/healthz`` never does, and says only whether the gateway follows its journal;
* ``/status`` names hosts and process ids (its instances) only to an authenticated client;
* a stream request beyond ``max_clients`` open streams, or while the gateway stops, is
  answered 503 with the reason and ``Retry-After``;
* after too many failed logins from one address, that address is answered 429 for a while
  (:mod:`~idembus.gateway.logins`);
* a bad request is answered 400 with the reason; an unreachable storage 503 with a fixed
  text (the error, which names the database's host, user and name, goes to the log, once
  per :data:`OUTAGE_LOG_INTERVAL` seconds per kind); an unexpected error 500 naming only its
  type — its traceback goes to the log, redacted, like everything the gateway says
  (:func:`~idembus.redaction.redact`);
* CORS (:class:`starlette.middleware.cors.CORSMiddleware`): named origins may read with
  credentials; ``*`` lets every origin read, never with credentials.

:class:`~idembus.gateway.service.Gateway` serves it with uvicorn.
"""

from __future__ import annotations

import logging
import traceback
import urllib.parse
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import BadStreamRequest
from ..logs import Throttle
from ..redaction import redact
from ..storage.base import JournalStore
from ..storage.errors import StorageUnavailable
from .request import filters_from, resume_point
from .response import EventStreamResponse
from .stream import ClientStream, plan

if TYPE_CHECKING:
    from .service import Gateway

log = logging.getLogger(__name__)

#: Media types a client may accept to get the stream.
_STREAM_ACCEPTED = ("text/event-stream", "text/*", "*/*")

#: Seconds a client turned away (503) is asked to wait before trying again.
RETRY_AFTER = 5

#: Request headers a page of another origin may send (CORS preflight).
_CORS_HEADERS = ["Authorization", "Last-Event-ID", "Cache-Control"]

#: Seconds between log lines about the storage being unreachable (per kind of error).
OUTAGE_LOG_INTERVAL = 10.0

#: What a client is told when the storage cannot be reached (the reason is in the log).
UNAVAILABLE = "the storage cannot be reached now; try again shortly (the gateway's log says why)"


def build_app(gateway: Gateway) -> Starlette:
    """The Starlette app answering for ``gateway``."""
    routes = _Routes(gateway)
    middleware = []
    if gateway.cors_origins:
        any_origin = "*" in gateway.cors_origins
        middleware.append(Middleware(
            CORSMiddleware, allow_origins=sorted(gateway.cors_origins),
            allow_methods=["GET"], allow_headers=_CORS_HEADERS,
            allow_credentials=not any_origin, max_age=600))
    return Starlette(
        routes=[Route("/", routes.stream, methods=["GET"]),
                Route("/status", routes.status, methods=["GET"]),
                Route("/healthz", routes.healthz, methods=["GET"])],
        middleware=middleware,
        exception_handlers={404: _not_found, 405: _not_allowed})


class _Routes:
    """The endpoints, each bound to one gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._outage_lines = Throttle(OUTAGE_LOG_INTERVAL)

    async def stream(self, request: Request) -> Response:
        gateway = self._gateway
        refused = self._unauthorized(request)
        if refused is not None:
            return refused
        if not _accepts_stream(request.headers.get("accept")):
            return _answer(406, {"error": "the stream is text/event-stream: send Accept: "
                                          "text/event-stream"})
        if request.method == "HEAD":
            return Response(media_type="text/event-stream")
        if gateway.stopping.is_set():
            return _busy("the gateway is stopping; reconnect to another, or shortly")
        counters = gateway.counters
        if counters.clients >= gateway.max_clients:
            counters.add(over_capacity=1)
            return _busy(f"the gateway serves at most {gateway.max_clients} streams at once "
                         "(--max-clients); try again shortly")
        counters.add(clients=1)  # reserved now: requests planning meanwhile count
        try:
            query = request.scope["query_string"].decode("latin-1")
            parameters = urllib.parse.parse_qs(query, keep_blank_values=True)
            filters = filters_from(parameters)
            last_event_id = request.headers.get("last-event-id")
            if last_event_id is None and "last_event_id" in parameters:
                last_event_id = parameters["last_event_id"][-1]
            start = await run_in_threadpool(plan, resume_point(last_event_id),
                                            gateway.endpoint.storage_as(JournalStore))
        except BaseException as error:
            counters.add(clients=-1)
            if isinstance(error, BadStreamRequest):
                counters.add(rejected=1)
                return _answer(400, {"error": redact(str(error))})
            if isinstance(error, StorageUnavailable):
                return self._unavailable(request, error)
            if isinstance(error, Exception):
                return _failed(request, error)
            raise
        counters.add(connections=1)
        stream = ClientStream(gateway.settings, filters, start)
        return EventStreamResponse(
            stream.chunks(), write_timeout=gateway.write_timeout,
            on_end=lambda: counters.add(clients=-1),
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def status(self, request: Request) -> Response:
        refused = self._unauthorized(request)
        if refused is not None:
            return refused
        try:
            # Authenticated, if the gateway has credentials: only then hosts and pids
            private = self._gateway.credentials is not None
            body = await run_in_threadpool(self._gateway.status, private=private)
        except StorageUnavailable as error:
            return self._unavailable(request, error)
        except Exception as error:
            return _failed(request, error)
        return _answer(200, body)

    async def healthz(self, request: Request) -> Response:
        problem = self._gateway.problem()
        if problem is not None:
            return _answer(503, {"status": "unavailable", "reason": problem})
        return _answer(200, {"status": "ok"})

    def _unauthorized(self, request: Request) -> Response | None:
        credentials = self._gateway.credentials
        if credentials is None:
            return None
        address = request.client.host if request.client else ""
        logins = self._gateway.logins
        wait = logins.retry_after(address)
        if wait is not None:
            self._gateway.counters.add(throttled=1)
            return _answer(429, {"error": "too many failed logins from this address; try "
                                          f"again in {wait}s"},
                           headers={"Retry-After": str(wait)})
        header = request.headers.get("authorization")
        if credentials.admit(header):
            logins.succeeded(address)
            return None
        if header is not None:  # a guess: counted
            logins.failed(address)
        self._gateway.counters.add(unauthorized=1)
        return _answer(401, {"error": "authentication required (HTTP basic)"},
                       headers={"WWW-Authenticate": 'Basic realm="idembus gateway", '
                                                    'charset="UTF-8"'})

    def _unavailable(self, request: Request, error: StorageUnavailable) -> Response:
        """503 with :data:`UNAVAILABLE`; the error in the log (throttled)."""
        held = self._outage_lines.allow(type(error).__name__)
        if held is not None:
            log.warning("answering %s with 503: %s%s", ascii(request.url.path[:100]),
                        redact(str(error)),
                        self._outage_lines.said(held))
        return _answer(503, {"error": UNAVAILABLE}, headers={"Retry-After": str(RETRY_AFTER)})


def _failed(request: Request, error: Exception) -> Response:
    """Answer 500 for an unexpected error, naming only its type; log it redacted."""
    log.error("answering %s failed:\n%s", request.url.path,
              redact("".join(traceback.format_exception(error)).rstrip()))
    return _answer(500, {"error": f"the gateway failed to answer ({type(error).__name__}); "
                                  "its log says why"})


def _busy(reason: str) -> Response:
    return _answer(503, {"error": reason}, headers={"Retry-After": str(RETRY_AFTER)})


def _accepts_stream(accept: str | None) -> bool:
    if accept is None:
        return True
    kinds = {part.split(";")[0].strip().lower() for part in accept.split(",")}
    return not kinds.isdisjoint(_STREAM_ACCEPTED)


def _answer(status: int, body: dict[str, Any],
            headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(body, status_code=status, headers=headers)


async def _not_found(request: Request, error: Exception) -> Response:
    return _answer(404, {"error": f"no {redact(request.url.path)}: GET / for the stream, "
                                  "GET /status, GET /healthz"})


async def _not_allowed(request: Request, error: Exception) -> Response:
    headers = dict(error.headers or {}) if isinstance(error, HTTPException) else {}
    return _answer(405, {"error": f"{request.method} is not served here: the gateway "
                                  "answers GET"}, headers=headers)
