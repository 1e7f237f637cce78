"""The dashboard's HTTP side, as a Starlette app: the pages, the overview's refreshed
part, the confirmed POSTs, the shipped static files and, per endpoint with a journal, its
gateway's stream mounted under ``/stream/N/``. :class:`~.security.Guard` wraps it all.

Every page handler runs its storage and broker reads in a worker thread. Input a page
cannot use is a page saying why (400, 404, 409); an unreachable broker or storage is a 503
with a fixed text (the error, which names hosts, users and databases, goes to the log,
redacted, once per :data:`OUTAGE_LOG_INTERVAL` seconds per kind); anything unexpected a 500
naming only its type, its traceback in the log, redacted.
"""

from __future__ import annotations

import logging
import pathlib
import traceback
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import ImmutableMultiDict
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from ..logs import Throttle
from ..redaction import redact
from ..storage.errors import StorageError
from ..transports.errors import TransportError
from . import aggregates, failed, journal, overview
from .html import Markup, tag
from .layout import document, notice
from .pages import Page, Refused
from .security import set_cookie

if TYPE_CHECKING:
    from ..runtime.endpoint import Endpoint
    from .service import Dashboard

log = logging.getLogger(__name__)

STATIC = pathlib.Path(__file__).with_name("static")
#: The largest form body accepted (a selection of ids).
FORM_BYTES = 256 * 1024
#: Seconds between log lines about an unreachable broker or storage (per kind of error).
OUTAGE_LOG_INTERVAL = 10.0
#: What a page says when the broker or the storage cannot be reached.
UNAVAILABLE = ("the broker or the storage cannot be read now; try again shortly (the "
               "dashboard's log says why)")


def build_app(dashboard: Dashboard) -> Starlette:
    """The Starlette app answering for ``dashboard``."""
    pages = _Pages(dashboard)
    routes: list[BaseRoute] = [
        Route("/", pages.overview),
        Route("/fragment/overview", pages.overview_fragment),
        Route("/errors", pages.errors),
        Route("/errors/message", pages.error_message),
        Route("/errors/confirm", pages.confirm),
        Route("/errors/{action:str}", pages.act, methods=["POST"]),
        Route("/aggregates", pages.aggregates),
        Route("/journal", pages.journal),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ]
    for index, gateway in enumerate(dashboard.gateways.values()):
        routes.append(Mount(f"/stream/{index}", app=gateway.app))
    return Starlette(routes=routes, exception_handlers={404: pages.not_found,
                                                         405: pages.not_allowed})


class _Pages:
    """The page handlers, bound to one dashboard."""

    def __init__(self, dashboard: Dashboard) -> None:
        self._dashboard = dashboard
        self._outage_lines = Throttle(OUTAGE_LOG_INTERVAL)
        self._streams = {name: f"/stream/{index}/"
                         for index, name in enumerate(dashboard.gateways)}

    async def overview(self, request: Request) -> Response:
        dashboard = self._dashboard
        body = await run_in_threadpool(overview.overview, dashboard, dashboard.now())
        refreshed = tag("div", body, id="overview", data_refresh="/fragment/overview",
                        data_interval=int(dashboard.refresh * 1000))
        return self._page(request, Page("Overview", refreshed), "/", None)

    async def overview_fragment(self, request: Request) -> Response:
        dashboard = self._dashboard
        body = await run_in_threadpool(overview.overview, dashboard, dashboard.now())
        return HTMLResponse(body)

    async def errors(self, request: Request) -> Response:
        return await self._answer(request, "/errors", lambda endpoint, _: failed.listing(
            endpoint, request.query_params, limit=self._dashboard.list_limit))

    async def error_message(self, request: Request) -> Response:
        return await self._answer(request, "/errors", lambda endpoint, _: failed.message(
            endpoint, request.query_params))

    async def confirm(self, request: Request) -> Response:
        return await self._answer(request, "/errors", lambda endpoint, token: failed.confirm(
            endpoint, request.query_params, token=token, limit=self._dashboard.list_limit))

    async def aggregates(self, request: Request) -> Response:
        def page(endpoint: Endpoint, _: str) -> Page:
            known = self._dashboard.aggregate_types(endpoint.name)
            return aggregates.aggregates(endpoint, request.query_params, known)
        return await self._answer(request, "/aggregates", page)

    async def journal(self, request: Request) -> Response:
        return await self._answer(request, "/journal", lambda endpoint, _: journal.journal(
            endpoint, request.query_params, self._streams.get(endpoint.name)))

    async def act(self, request: Request) -> Response:
        action = request.path_params["action"]
        if action not in failed.ACTIONS:
            return await self.not_found(request, HTTPException(404))
        body = await request.body()
        if len(body) > FORM_BYTES:
            return self._refusal(request, Refused("the form is too large", 413))
        form = ImmutableMultiDict(urllib.parse.parse_qsl(body.decode("utf-8", "replace"),
                                                         keep_blank_values=True))
        problem = self._dashboard.csrf.problem(request, form)
        if problem is not None:
            return self._refusal(request, Refused(f"refused: {problem}", 403))
        try:
            endpoint = self._dashboard.endpoint(form.get("endpoint"))
            target = await run_in_threadpool(failed.act, endpoint, action, form)
        except Exception as error:
            return self._failure(request, error, "/errors")
        return RedirectResponse(target, status_code=303)

    async def not_found(self, request: Request, error: Exception) -> Response:
        return self._refusal(request, Refused(f"no page {request.url.path}", 404))

    async def not_allowed(self, request: Request, error: Exception) -> Response:
        return self._refusal(request, Refused(f"{request.method} is not served here", 405))

    # -- helpers ----------------------------------------------------------------------------

    async def _answer(self, request: Request, active: str,
                      build: Callable[[Endpoint, str], Page]) -> Response:
        """The page ``build`` makes for the requested endpoint (in a worker thread), with
        the CSRF token of this browser."""
        token, cookie = self._dashboard.csrf.issue(request)
        try:
            endpoint = self._dashboard.endpoint(request.query_params.get("endpoint"))
            page = await run_in_threadpool(build, endpoint, token)
        except Exception as error:
            return self._failure(request, error, active)
        response = self._page(request, page, active, endpoint.name)
        set_cookie(response, cookie)
        return response

    def _page(self, request: Request, page: Page, active: str,
              endpoint: str | None) -> Response:
        html = document(page.title, page.body, active=active,
                        endpoints=list(self._dashboard.endpoints), endpoint=endpoint)
        return HTMLResponse(html, status_code=page.status)

    def _failure(self, request: Request, error: Exception, active: str) -> Response:
        if isinstance(error, Refused):
            return self._refusal(request, error, active)
        if isinstance(error, StorageError | TransportError):
            held = self._outage_lines.allow(type(error).__name__)
            if held is not None:
                log.warning("answering %s with 503: %s%s", ascii(request.url.path[:100]),
                            redact(str(error)), self._outage_lines.said(held))
            return self._refusal(request, Refused(UNAVAILABLE, 503), active)
        log.error("answering %s failed:\n%s", request.url.path,
                  redact("".join(traceback.format_exception(error)).rstrip()))
        return self._refusal(request, Refused(
            f"the dashboard failed to answer ({type(error).__name__}); its log says why",
            500), active)

    def _refusal(self, request: Request, refused: Refused, active: str = "") -> Response:
        body: Markup = notice(str(refused), "error")
        return self._page(request, Page("Cannot show this", body, refused.status), active, None)
