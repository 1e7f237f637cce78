"""``idembus gateway package.module:endpoint --listen 127.0.0.1:8042``: serve the event
journal of the endpoint's storage as a Server-Sent Events stream (:mod:`idembus.gateway`), until
SIGINT or SIGTERM.

Credentials come from ``$IDEMBUS_GATEWAY_AUTH`` or ``--auth-file``, never from the command
line (``--auth`` is refused: every user of the machine could read it). Without credentials
it listens on a loopback address only (anything else is refused with exit status 2 and
what to set instead: put it behind a proxy that authenticates, or give it credentials).
An endpoint whose
journal no other process can write — a process-local storage without ``--consume``, or
``--consume`` on a process-local transport nothing else can send to — is refused (exit
status 2) instead of serving an empty stream.

The signals only set a flag (:class:`~idembus.runtime.shutdown.StopSignals`) that the main thread
looks
at between short waits; it then stops the gateway and closes the endpoint within
``--shutdown-timeout`` seconds. (A handler setting a ``threading.Event`` hung when SIGINT and
SIGTERM arrived together.)
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError
from ..gateway.addresses import is_loopback
from ..gateway.extras import web_part
from ..logs import log_uncaught
from ..runtime.loading import load_endpoint, refuse_process_local
from ..runtime.shutdown import Deadline, StopSignals

if TYPE_CHECKING:
    from ..gateway.auth import Credentials
    from ..gateway.service import Gateway
    from ..runtime.endpoint import Endpoint

#: Environment variable holding ``user:password`` (kept here too for older imports).
AUTH_VARIABLE = "IDEMBUS_GATEWAY_AUTH"


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    gateway = commands.add_parser(
        "gateway", parents=[common],
        help="serve the event journal as a resumable Server-Sent Events stream",
        description="Serve GET / (text/event-stream; Last-Event-ID resumes, 0 replicates; "
                    "filters types=a,b and parents=user/42), GET /status and GET /healthz. "
                    f"Basic authentication: user:password in ${AUTH_VARIABLE} or in the file "
                    "--auth-file names.")
    gateway.add_argument("endpoint", help="package.module:endpoint whose storage holds the "
                                          "journal (Endpoint(journal=...))")
    gateway.add_argument("--listen", default="127.0.0.1:8042",
                         help="host:port to listen on (127.0.0.1:8042; port 0 picks one)")
    gateway.add_argument("--auth-file", metavar="PATH",
                         help="a file whose first line is user:password for HTTP basic "
                              f"authentication (default: ${AUTH_VARIABLE}; none if unset)")
    gateway.add_argument("--auth", help=argparse.SUPPRESS)  # refused, with the reason
    gateway.add_argument("--buffer", type=int, default=1000,
                         help="live events a client may have waiting before it is "
                              "disconnected to resume (1000)")
    gateway.add_argument("--heartbeat", type=float, default=15.0,
                         help="seconds between keep-alive comments (15)")
    gateway.add_argument("--max-clients", type=int, default=1000,
                         help="event streams open at once; more are answered 503 with "
                              "Retry-After (1000)")
    gateway.add_argument("--max-connections", type=int, default=None,
                         help="connections held at once, streams included; beyond, the one "
                              "idle the longest is closed, or, if all are busy, the new one "
                              "answered 503 (--max-clients + 100)")
    gateway.add_argument("--idle-timeout", type=float, default=10.0,
                         help="seconds a connection may take to send a request, after "
                              "opening or after its previous response, before it is closed "
                              "(10)")
    gateway.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                         help="a web origin (https://app.example.com) whose pages may read "
                              "the stream with credentials from another origin; repeat for "
                              "several; '*' alone: every origin, without credentials")
    gateway.add_argument("--consume", action="store_true",
                         help="also run the endpoint: consume its queue in this process")
    gateway.add_argument("--shutdown-timeout", type=float, default=30.0,
                         help="seconds to end the streams and, with --consume, finish the "
                              "messages in progress after SIGINT/SIGTERM (30)")
    gateway.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    log_uncaught()  # its threads' tracebacks, redacted like the log lines
    gateway_class = served_part("Gateway", args)
    credentials, host, port = serving_options(args)
    if credentials is None and not is_loopback(host):
        raise ConfigurationError(
            f"--listen {args.listen}: without credentials the gateway listens on a loopback "
            f"address only (127.0.0.1:{port}), or anyone who reaches {host} reads the "
            f"journal; put user:password in ${AUTH_VARIABLE} or a file named by --auth-file "
            f"to listen on {host} (or serve 127.0.0.1 behind a proxy that authenticates)")
    endpoint = load_endpoint(args.endpoint)
    gateway: Gateway | None = None
    with StopSignals() as signals:
        try:
            _refuse_an_unseen_journal(endpoint, consume=args.consume)
            gateway = gateway_class(endpoint, host=host, port=port, auth=credentials,
                              buffer=args.buffer, heartbeat=args.heartbeat,
                              cors_origins=args.cors_origin, max_clients=args.max_clients,
                              idle_timeout=args.idle_timeout,
                              max_connections=args.max_connections)
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


def _refuse_an_unseen_journal(endpoint: Endpoint, *, consume: bool) -> None:
    """Refuse to serve a journal nothing can write: one in a process-local storage that
    only this process could fill (and, without ``--consume``, does not), or one this
    process fills from a process-local queue that no other process can send to."""
    if consume:
        refuse_process_local(
            endpoint.transport, endpoint=endpoint.name, role="transport",
            unseen="queue, so --consume would receive nothing and the stream stay empty")
    else:
        refuse_process_local(
            endpoint.storage, endpoint=endpoint.name, role="storage",
            unseen="event journal, so the gateway would serve an empty stream (--consume "
                   "runs the endpoint in the gateway's process, on a broker)")


def served_part(name: str, args: argparse.Namespace) -> Any:
    """The class ``Gateway`` or ``Dashboard`` of the command ``args`` run, once ``--auth``
    is refused (the password would be on the command line); a ConfigurationError with the
    pip command if the web extra is missing."""
    if args.auth is not None:
        raise ConfigurationError(
            "--auth puts the password where every user of this machine can read it (the "
            f"process list): put user:password in ${AUTH_VARIABLE}, or in a file named by "
            "--auth-file")
    try:
        return web_part(f"idembus.{name.lower()}.service", name, f"idembus {args.command}")
    except ImportError as error:
        raise ConfigurationError(str(error)) from error


def serving_options(args: argparse.Namespace) -> tuple[Credentials | None, str, int]:
    """The credentials (``--auth-file`` or the environment) and the ``--listen`` address
    of a command that serves HTTP."""
    from ..gateway.auth import load_credentials

    host, port = address_of(args.listen)
    return load_credentials(args.auth_file), host, port


def address_of(listen: str) -> tuple[str, int]:
    """``host:port`` of ``--listen`` (brackets of an IPv6 host removed)."""
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ConfigurationError(f"--listen {listen!r}: give host:port, such as 127.0.0.1:8042")
    return host.strip("[]"), int(port)
