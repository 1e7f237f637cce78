"""``idembus dashboard package.module:endpoint... --listen 127.0.0.1:8043``: serve the
dashboard of one or more endpoints (:mod:`idembus.dashboard`) until SIGINT or SIGTERM.

Credentials come from ``$IDEMBUS_GATEWAY_AUTH`` or ``--auth-file``, as the gateway's, never
from the command line. The dashboard retries and purges messages: without credentials it
listens on a loopback address only (anything else is refused with exit status 2 and what
to write instead). An endpoint whose storage or broker lives inside one process is refused
too: another process could not see its status reports, aggregates, journal or error queue.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError
from ..gateway.addresses import is_loopback
from ..logs import log_uncaught
from ..runtime.loading import load_endpoint, refuse_process_local
from ..runtime.shutdown import Deadline, StopSignals
from .gateway import AUTH_VARIABLE, served_part, serving_options

if TYPE_CHECKING:
    from ..dashboard.service import Dashboard
    from ..runtime.endpoint import Endpoint


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    dashboard = commands.add_parser(
        "dashboard", parents=[common],
        help="serve a dashboard of endpoints: instances and rates, failed messages (retry, "
             "purge), sagas and aggregates, the live event stream",
        description="Serve the dashboard of the endpoints named (pages /, /errors, "
                    "/aggregates, /journal). Basic authentication: user:password in "
                    f"${AUTH_VARIABLE} or in the file --auth-file names; without it, only a "
                    "loopback address may be listened on.")
    dashboard.add_argument("endpoints", nargs="+", metavar="endpoint",
                           help="package.module:endpoint (several: one section each)")
    dashboard.add_argument("--listen", default="127.0.0.1:8043",
                           help="host:port to listen on (127.0.0.1:8043; port 0 picks one)")
    dashboard.add_argument("--auth-file", metavar="PATH",
                           help="a file whose first line is user:password for HTTP basic "
                                f"authentication (default: ${AUTH_VARIABLE}; none if unset)")
    dashboard.add_argument("--auth", help=argparse.SUPPRESS)  # refused, with the reason
    dashboard.add_argument("--sample-interval", type=float, default=5.0,
                           help="seconds between reads of the status reports (5)")
    dashboard.add_argument("--refresh", type=float, default=5.0,
                           help="seconds between refreshes of the overview in the browser (5)")
    dashboard.add_argument("--idle-timeout", type=float, default=10.0,
                           help="seconds a connection may take to send a request (10)")
    dashboard.add_argument("--max-connections", type=int, default=100,
                           help="connections held at once, live streams included; beyond, "
                                "the one idle the longest is closed, or, if all are busy, the "
                                "new one answered 503 (100)")
    dashboard.add_argument("--stopped-shown-for", type=float, default=300.0, metavar="SECONDS",
                           help="how long an instance that stopped stays listed; after that "
                                "it is only counted (300)")
    dashboard.add_argument("--shutdown-timeout", type=float, default=10.0,
                           help="seconds to end the streams after SIGINT/SIGTERM (10)")
    dashboard.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    log_uncaught()
    dashboard_class = served_part("Dashboard", args)
    credentials, host, port = serving_options(args)
    if credentials is None and not is_loopback(host):
        raise ConfigurationError(
            f"--listen {args.listen}: the dashboard retries and purges messages, so without "
            f"credentials it listens on a loopback address only (127.0.0.1:{port}); put "
            f"user:password in ${AUTH_VARIABLE} or a file named by --auth-file to listen on "
            f"{host}")
    endpoints: list[Endpoint] = []
    dashboard: Dashboard | None = None
    with StopSignals() as signals:
        try:
            for reference in args.endpoints:
                endpoints.append(load_endpoint(reference))
                _refuse_unseen(endpoints[-1])
            dashboard = dashboard_class(
                endpoints, host=host, port=port, auth=credentials,
                sample_interval=args.sample_interval, refresh=args.refresh,
                idle_timeout=args.idle_timeout, max_connections=args.max_connections,
                stopped_shown_for=args.stopped_shown_for)
            dashboard.start()
            print(f"idembus dashboard: {', '.join(dashboard.endpoints)} on {dashboard.url}",
                  flush=True)
            signals.wait()
        finally:
            deadline = Deadline(args.shutdown_timeout)
            try:
                if dashboard is not None:
                    dashboard.stop(deadline.left())
            finally:
                for endpoint in endpoints:
                    endpoint.close(deadline.left())
    return 0


def _refuse_unseen(endpoint: Endpoint) -> None:
    refuse_process_local(endpoint.storage, endpoint=endpoint.name, role="storage",
                         unseen="status reports, aggregates and journal")
    refuse_process_local(endpoint.transport, endpoint=endpoint.name, role="transport",
                         unseen="error queue")

