"""``idembus gateway package.module:endpoint --listen 127.0.0.1:8042``: serve the event
journal of the endpoint's storage as a Server-Sent Events stream (:mod:`bus.gateway`), until
SIGINT or SIGTERM.

The signals only set a flag (:class:`~bus.shutdown.StopSignals`) that the main thread looks
at between short waits; it then stops the gateway and closes the endpoint within
``--shutdown-timeout`` seconds. (A handler setting a ``threading.Event`` hung when SIGINT and
SIGTERM arrived together.)
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from .errors import ConfigurationError
from .gateway import Gateway
from .loading import load_endpoint
from .logs import log_uncaught
from .shutdown import Deadline, StopSignals

#: Environment variable holding ``user:password`` when ``--auth`` is not given.
AUTH_VARIABLE = "IDEMBUS_GATEWAY_AUTH"


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    gateway = commands.add_parser(
        "gateway", parents=[common],
        help="serve the event journal as a resumable Server-Sent Events stream",
        description="Serve GET / (text/event-stream; Last-Event-ID resumes, 0 replicates; "
                    "filters types=a,b and parents=user/42) and GET /status.")
    gateway.add_argument("endpoint", help="package.module:endpoint whose storage holds the "
                                          "journal (Endpoint(journal=...))")
    gateway.add_argument("--listen", default="127.0.0.1:8042",
                         help="host:port to listen on (127.0.0.1:8042; port 0 picks one)")
    gateway.add_argument("--auth", help=f"user:password for HTTP basic authentication "
                                        f"(default: ${AUTH_VARIABLE}; none if unset)")
    gateway.add_argument("--buffer", type=int, default=1000,
                         help="live events a client may have waiting before it is "
                              "disconnected to resume (1000)")
    gateway.add_argument("--heartbeat", type=float, default=15.0,
                         help="seconds between keep-alive comments (15)")
    gateway.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                         help="a web origin (https://app.example.com, or *) whose pages may "
                              "read the stream from another origin; repeat for several")
    gateway.add_argument("--consume", action="store_true",
                         help="also run the endpoint: consume its queue in this process")
    gateway.add_argument("--shutdown-timeout", type=float, default=30.0,
                         help="seconds to end the streams and, with --consume, finish the "
                              "messages in progress after SIGINT/SIGTERM (30)")
    gateway.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    log_uncaught()  # its threads' tracebacks, redacted like the log lines
    host, port = _address(args.listen)
    endpoint = load_endpoint(args.endpoint)
    gateway: Gateway | None = None
    with StopSignals() as signals:
        try:
            gateway = Gateway(endpoint, host=host, port=port,
                              auth=args.auth or os.environ.get(AUTH_VARIABLE) or None,
                              buffer=args.buffer, heartbeat=args.heartbeat,
                              cors_origins=args.cors_origin)
            if args.consume:
                endpoint.start()
            gateway.start()
            print(f"idembus gateway: {endpoint.name} on {gateway.url}", flush=True)
            signals.wait()
        finally:
            deadline = Deadline(args.shutdown_timeout)
            try:
                if gateway is not None:
                    gateway.stop(deadline.left())
            finally:
                endpoint.close(deadline.left())
    return 0


def _address(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ConfigurationError(f"--listen {listen!r}: give host:port, such as 127.0.0.1:8042")
    return host.strip("[]"), int(port)
