"""The dashboard as a running service: the status sampler, each journal's hub, and the
HTTP app (:mod:`.app`) served by uvicorn in a thread of its own (the gateway's way,
:mod:`idembus.gateway.serving`), started and stopped from Python or by
``idembus dashboard``."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..envelope import utc_now
from ..errors import ConfigurationError
from ..gateway.addresses import is_loopback
from ..gateway.auth import Credentials
from ..gateway.limits import ConnectionLimit
from ..gateway.service import Gateway, aggregates_of
from ..gateway.serving import ServedApp
from ..logs import Throttle
from ..redaction import redact
from ..runtime.background import Periodic
from ..runtime.shutdown import Deadline
from ..storage.base import StatusStore
from .app import build_app
from .history import Sampler
from .pages import Refused
from .security import LOOPBACK_NAMES, Csrf, Guard

if TYPE_CHECKING:
    from ..runtime.endpoint import Endpoint

log = logging.getLogger(__name__)


class Dashboard:
    """Serves the dashboard of ``endpoints`` (loaded, not started: the dashboard only reads
    what their processes report and store, and acts on their error queues).

    ``auth`` (``"user:password"`` or :class:`~idembus.gateway.auth.Credentials`): HTTP
    basic authentication on every request, as the gateway's; ``sample_interval``: seconds
    between reads of the status reports (the charts' source); ``refresh``: seconds between
    the overview's refreshes in the browser; ``list_limit``: failed messages listed on a
    page at most (all are counted); ``idle_timeout``: seconds a connection may take to send
    a request; ``max_connections``: connections held at once, live streams included (beyond
    it the connection idle the longest is closed, or, if all are busy, the newcomer answered
    503: :mod:`~idembus.gateway.limits`); failed logins are throttled per client address
    (:attr:`logins`).
    """

    def __init__(self, endpoints: Sequence[Endpoint], *, host: str = "127.0.0.1",
                 port: int = 8043, auth: str | Credentials | None = None,
                 sample_interval: float = 5.0, refresh: float = 5.0, list_limit: int = 500,
                 idle_timeout: float = 10.0, max_connections: int = 100,
                 stopped_shown_for: float = 300.0) -> None:
        if not endpoints:
            raise ConfigurationError("the dashboard needs at least one endpoint")
        names = [endpoint.name for endpoint in endpoints]
        if len(set(names)) != len(names):
            raise ConfigurationError(f"endpoint names must differ, got {', '.join(names)}")
        if min(sample_interval, refresh, idle_timeout) <= 0:
            raise ConfigurationError("sample_interval, refresh and idle_timeout must be "
                                     "positive seconds")
        if list_limit < 1:
            raise ConfigurationError(f"list_limit must be at least 1, got {list_limit}")
        if stopped_shown_for < 0:
            raise ConfigurationError(
                f"stopped_shown_for must be 0 or more seconds, got {stopped_shown_for!r}")
        #: The endpoints shown, by name, in the order given.
        self.endpoints = {endpoint.name: endpoint for endpoint in endpoints}
        #: Who may look and act (``None``: anybody who reaches the port).
        self.credentials = Credentials.parse(auth) if isinstance(auth, str) else auth
        #: Whether instances are shown with their host and pid: to authenticated viewers,
        #: and on a loopback address, where only this machine's users can look.
        self.shows_hosts = self.credentials is not None or is_loopback(host)
        #: How long a stopped instance stays listed (then it is counted, not shown).
        self.stopped_shown_for = datetime.timedelta(seconds=stopped_shown_for)
        self.sample_interval = sample_interval
        self.refresh = refresh
        self.list_limit = list_limit
        self.csrf = Csrf()
        self.started_at = utc_now()
        #: Per endpoint: its status reports as last read, and an hour of minutes.
        self.samplers = {name: Sampler(self.started_at) for name in self.endpoints}
        #: Per endpoint: why its status reports could not be read last time, if so.
        self.problems: dict[str, str] = {}
        #: Per endpoint with a journal: the gateway whose stream the live page follows.
        self.gateways = {endpoint.name: Gateway(endpoint, auth=self.credentials)
                         for endpoint in endpoints if endpoint.journal is not None}
        self._outage_lines = Throttle(10.0)
        self._poller = _Poller(self)
        self.app = build_app(self)
        guard = Guard(self.app, self.credentials, LOOPBACK_NAMES | {host})
        #: Failed logins per client address.
        self.logins = guard.logins
        self._served = ServedApp(guard, host=host, port=port, idle_timeout=idle_timeout,
                                 name="idembus-dashboard", max_connections=max_connections)

    @property
    def url(self) -> str:
        return self._served.url

    @property
    def address(self) -> tuple[str, int]:
        return self._served.address

    @property
    def limit(self) -> ConnectionLimit:
        """The connection cap, and what was done at it."""
        return self._served.limit

    def now(self) -> datetime.datetime:
        return utc_now()

    def endpoint(self, name: str | None) -> Endpoint:
        """The endpoint called ``name`` (the first if ``None``); a 404 if none is."""
        if name is None or name == "":
            return next(iter(self.endpoints.values()))
        try:
            return self.endpoints[name]
        except KeyError:
            raise Refused(f"this dashboard shows no endpoint {name!r}", 404) from None

    def aggregate_types(self, name: str) -> list[str]:
        """The aggregate (and saga) types the endpoint's handlers keep."""
        return sorted(aggregates_of(self.endpoints[name]))

    def sample(self) -> None:
        """Read every endpoint's status reports once (what the sampler thread does every
        ``sample_interval`` seconds)."""
        for name, endpoint in self.endpoints.items():
            try:
                reports = endpoint.storage_as(StatusStore).status_reports(name)
            except Exception as error:
                self.problems[name] = redact(str(error)) or type(error).__name__
                held = self._outage_lines.allow(f"{name}:{type(error).__name__}")
                if held is not None:  # one line per cause every 10 s
                    log.warning("could not read the status reports of %s: %s%s", name,
                                self.problems[name], self._outage_lines.said(held))
                continue
            self.problems.pop(name, None)
            self.samplers[name].sample(reports, self.now())

    def start(self) -> None:
        """Check the storages, follow the journals, sample, and serve until :meth:`stop`."""
        for endpoint in self.endpoints.values():
            endpoint.storage.verify()
        try:
            for gateway in self.gateways.values():
                gateway.follow()
            self.sample()
            self._poller.start()
            self._served.start()
        except BaseException:
            self.stop(0)
            raise
        log.info("dashboard of %s listening on %s", ", ".join(self.endpoints), self.url)
        if self.credentials is None and not is_loopback(self.address[0]):
            log.warning("the dashboard listens on %s without credentials: anyone who reaches "
                        "it (with a Host header naming it) retries and purges messages",
                        self.url)

    def stop(self, timeout: float | None = 30.0) -> None:
        """End the live streams, stop sampling, close every connection and release the
        port, within ``timeout`` seconds in all."""
        deadline = Deadline(timeout)
        for gateway in self.gateways.values():
            gateway.unfollow(deadline.left())
        self._poller.stop(deadline.left())
        self._served.stop(deadline.left())


class _Poller(Periodic):
    """Samples the status reports every ``sample_interval`` seconds."""

    def __init__(self, dashboard: Dashboard) -> None:
        super().__init__("idembus-dashboard-sampler")
        self._dashboard = dashboard

    def round(self) -> float:
        self._dashboard.sample()
        return self._dashboard.sample_interval
