"""What guards the dashboard: HTTP basic authentication (the gateway's credentials,
:mod:`idembus.gateway.auth`) on every request, a CSRF token on every form that changes
something, and headers that keep the browser from running anything the pages did not ship.

* **Authentication**: with credentials, every request — pages, static files, the live
  stream, and above all every POST — needs them (401 otherwise); after too many failed
  logins from one address, that address is answered 429 for a while
  (:mod:`idembus.gateway.logins`).
* **CSRF**: a browser sends basic-auth credentials with any request to the site, a forged
  one from another site's page included. Every form that changes something carries a
  token, the HMAC of a random cookie (``SameSite=Strict``, ``HttpOnly``) under a key that
  lives only in this process: a page of another origin can neither read the token nor
  make one. A POST without the cookie, with a token that does not match it, or with an
  ``Origin`` other than the dashboard's own is refused (403).
* **Cross-site reads**: a page of another site can make the browser send a GET (an
  ``<img>``, a link) with the credentials and cookies it holds, and the dashboard's pages
  read the broker and the storage (moving the error queue into the storage). A request
  whose ``Sec-Fetch-Site`` says it comes from another site (``cross-site``, or
  ``same-site``: another port of the same host) is refused (403) before anything is read,
  except the overview at ``/`` (a link to it may come from anywhere; it reads counts).
* **Host**: without credentials, a request must name the dashboard by a loopback name or
  address (``Host``), so that a page of another site whose name was made to resolve to
  127.0.0.1 (DNS rebinding) cannot use it as its own origin (400 otherwise).
* **Headers**: a Content-Security-Policy allowing scripts, styles, images and connections
  from the dashboard itself only (no inline script, no inline style, no ``eval``, no
  frames), ``X-Content-Type-Options: nosniff``, ``Referrer-Policy: same-origin``, and
  ``Cache-Control: no-store`` (pages show message bodies: no copy stays on disk).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Mapping

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..gateway.auth import Credentials
from ..gateway.logins import LoginThrottle

#: The cookie a form's token is bound to.
CSRF_COOKIE = "idembus_csrf"
#: The form field carrying the token.
CSRF_FIELD = "csrf_token"

#: Sent with every response.
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
          "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
HEADERS = {
    "Content-Security-Policy": POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}


class Csrf:
    """Tokens bound to a browser's cookie under a key of this process."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or secrets.token_bytes(32)

    def token(self, cookie: str) -> str:
        """The form token that goes with ``cookie``."""
        digest = hmac.new(self._key, cookie.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    @staticmethod
    def cookie_of(request: Request) -> str | None:
        return request.cookies.get(CSRF_COOKIE) or None

    def issue(self, request: Request) -> tuple[str, str | None]:
        """The token for the page answering ``request``, and a new cookie to set if the
        browser has none yet."""
        cookie = self.cookie_of(request)
        if cookie:
            return self.token(cookie), None
        cookie = secrets.token_urlsafe(24)
        return self.token(cookie), cookie

    def problem(self, request: Request, form: Mapping[str, str]) -> str | None:
        """Why a POST is refused, or ``None`` if its token and origin are right."""
        origin = request.headers.get("origin")
        if origin is not None and origin != _own_origin(request):
            return "this form was sent from another site's page"
        cookie = self.cookie_of(request)
        sent = form.get(CSRF_FIELD, "")
        if not cookie or not sent or not hmac.compare_digest(sent, self.token(cookie)):
            return ("the form's token is missing or out of date (cookies must be on for this "
                    "site): open the page again and resend")
        return None


def set_cookie(response: Response, cookie: str | None) -> None:
    """Give the browser its CSRF cookie (if it has none yet)."""
    if cookie is not None:
        response.set_cookie(CSRF_COOKIE, cookie, httponly=True, samesite="strict", path="/")


def _own_origin(request: Request) -> str:
    return f"{request.url.scheme}://{request.headers.get('host', '')}"


#: The names a dashboard without credentials answers to (and the address it listens on).
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


#: What ``Sec-Fetch-Site`` says of a request the dashboard's own page (or the person, by
#: typing the address: ``none``) made.
SAME_ORIGIN = frozenset({"same-origin", "none"})
#: The paths another site may link to.
LINKABLE = frozenset({"/"})


class Guard:
    """ASGI middleware: authentication on every HTTP request (with credentials), or else
    a ``Host`` among ``hosts``; no request from another site but to :data:`LINKABLE`; and
    :data:`HEADERS` on every response."""

    def __init__(self, app: ASGIApp, credentials: Credentials | None,
                 hosts: frozenset[str] = LOOPBACK_NAMES,
                 logins: LoginThrottle | None = None) -> None:
        self._app = app
        self._credentials = credentials
        self._hosts = hosts
        #: Failed logins per client address.
        self.logins = logins or LoginThrottle()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return

        async def send_guarded(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in HEADERS.items():
                    if name not in headers:
                        headers[name] = value
            await send(message)

        credentials = self._credentials
        headers = Headers(scope=scope)
        if credentials is None and _host_name(headers.get("host", "")) not in self._hosts:
            wrong = PlainTextResponse("this dashboard answers to a loopback name only "
                                      "(127.0.0.1, localhost)", status_code=400)
            await wrong(scope, receive, send_guarded)
            return
        if credentials is not None:
            refused = self._refusal(credentials, headers, scope)
            if refused is not None:
                await refused(scope, receive, send_guarded)
                return
        if scope.get("path", "/") not in LINKABLE and \
                headers.get("sec-fetch-site", "same-origin") not in SAME_ORIGIN:
            refused = PlainTextResponse("refused: this request comes from another site's page "
                                        "(open the dashboard itself)", status_code=403)
            await refused(scope, receive, send_guarded)
            return
        await self._app(scope, receive, send_guarded)

    def _refusal(self, credentials: Credentials, headers: Headers,
                 scope: Scope) -> Response | None:
        """A 429 for an address that failed too often, a 401 without the credentials."""
        client = scope.get("client")
        address = str(client[0]) if client else ""
        wait = self.logins.retry_after(address)
        if wait is not None:
            return PlainTextResponse(f"too many failed logins from this address; try again "
                                     f"in {wait}s", status_code=429,
                                     headers={"Retry-After": str(wait)})
        header = headers.get("authorization")
        if credentials.admit(header):
            self.logins.succeeded(address)
            return None
        if header is not None:  # a guess: counted
            self.logins.failed(address)
        return PlainTextResponse(
            "authentication required (HTTP basic)", status_code=401,
            headers={"WWW-Authenticate": 'Basic realm="idembus dashboard", charset="UTF-8"'})


def _host_name(host: str) -> str:
    """The name in a ``Host`` header, without its port (and an IPv6 address's brackets)."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host
