"""The ``idembus`` command.

    idembus run package.module:endpoint [--workers N] [--concurrency N] [--shutdown-timeout S]
                [--metrics-port N [--metrics-host HOST]] [--on-worker-start package.module:fn]
                [--log-per-message] [--strict-routes] [--no-gc-tuning]
    idembus migrate package.module:endpoint

``endpoint`` names an :class:`~idembus.Endpoint`, or a function returning one, in an
importable module. ``run`` consumes until SIGINT or SIGTERM, then finishes the messages in
progress and exits; with ``--workers N`` it supervises N processes of the endpoint
(:mod:`idembus.cli.supervisor`), which never builds the endpoint itself: each worker runs the
``--on-worker-start`` hook, then the factory (:mod:`idembus.cli.worker`); with
``--metrics-port`` the supervisor serves one ``/metrics`` for all its workers
(:mod:`idembus.observability.metrics_group`).
Exit status: 0 after a clean stop; 1 if messages in progress had to be abandoned (they are
redelivered) or the broker or database cannot be reached (try again); 2 for a configuration
error, including a broker or database refusing this endpoint's login
or privileges (trying again would not help); 3 when the process stopped to be recycled,
with more handler threads stuck past their time limits than it tolerates
(:mod:`idembus.runtime.recoverability.time_limits`; start it again).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .. import logs
from ..errors import BusError, ConfigurationError, EndpointBlocked
from ..observability.metrics_snapshots import METRICS_FILE
from ..redaction import redact
from ..runtime.loading import load_endpoint
from ..runtime.recoverability.time_limits import EXIT_RECYCLE
from ..storage.errors import StorageUnavailable
from ..transports.errors import TransportUnavailable
from . import dashboard, errors, gateway, outbox, sagas, schedules, spark, status, worker
from .supervisor import EXIT_CONFIGURATION, Supervisor, stop_when_orphaned

#: Exit status when the broker or database cannot be reached: worth trying again later.
EXIT_UNAVAILABLE = 1


#: Modules adding subcommands: each has ``register(commands, common_options)``.
_TOOLS: list[Callable[[Any, argparse.ArgumentParser], None]] = [
    status.register, errors.register, outbox.register, gateway.register,
    spark.register, schedules.register, dashboard.register, sagas.register,
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="idembus", description="Run idembus endpoints.")
    parser.add_argument("--version", action="version",
                        version=f"idembus {importlib.metadata.version('idembus')}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="INFO", help="logging level (INFO)")
    common.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="text lines, or one JSON object per line (text)")
    common.add_argument("--app-dir", default=None, metavar="DIR",
                        help="look for the endpoint's module in DIR first (by default: the "
                             "current directory, after the installed packages)")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", parents=[common],
                              help="run one endpoint until SIGINT/SIGTERM")
    run.add_argument("endpoint", help="package.module:endpoint")
    run.add_argument("--workers", type=int, default=1,
                     help="processes consuming the endpoint's queue (1)")
    run.add_argument("--concurrency", type=int,
                     help="consumer threads per process (the endpoint's own setting)")
    run.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds to finish messages in progress after SIGTERM (30)")
    run.add_argument("--on-worker-start", metavar="package.module:function",
                     help="call this function in each process before the endpoint is built "
                          "(with which worker it is): where to set up an SDK such as "
                          "OpenTelemetry's; the --workers supervisor itself builds nothing")
    run.add_argument("--log-per-message", action="store_true",
                     help="one INFO line per processed message: its outcome, type, id and "
                          "duration (without it: at DEBUG on idembus.per_message)")
    run.add_argument("--no-gc-tuning", action="store_true",
                     help="leave Python's garbage collector as it is (by default, before "
                          "consuming, what start-up made is frozen, gc.freeze, and the "
                          "youngest generation is collected every 5000 objects, not 700)")
    run.add_argument("--strict-routes", action="store_true",
                     help="fail the start when a command a handler sends has no route, or "
                          "a handler that declares no `sends` sends what idembus cannot "
                          "name (by default: a WARNING at start)")
    _add_metrics_options(run)
    run.set_defaults(handler=_run)
    migrate = commands.add_parser(
        "migrate", parents=[common],
        help="create the endpoint's storage schema (tables, indexes), and its transport's "
             "when the queues are in a database, and exit")
    migrate.add_argument("endpoint", help="package.module:endpoint")
    migrate.set_defaults(handler=lambda args: _migrate(args.endpoint))
    for register in _TOOLS:
        register(commands, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logs.configure(args.log_level, args.log_format)
    logs.log_uncaught()
    if getattr(args, "log_per_message", False):
        logs.log_per_message()
    if getattr(args, "app_dir", None):
        sys.path.insert(0, os.path.abspath(args.app_dir))
    try:
        status: int = args.handler(args)
        return status
    except EndpointBlocked as exc:  # a refused login or privilege: no retry cures it
        print(f"idembus: {redact(str(exc))}", file=sys.stderr)
        return EXIT_CONFIGURATION
    except (StorageUnavailable, TransportUnavailable) as exc:
        print(f"idembus: {redact(str(exc))}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except BusError as exc:
        print(f"idembus: {redact(str(exc))}", file=sys.stderr)
        return EXIT_CONFIGURATION


def _add_metrics_options(run: argparse.ArgumentParser) -> None:
    """``--metrics-port`` and ``--metrics-host`` of ``run``
    (:mod:`idembus.observability.prometheus`)."""
    run.add_argument("--metrics-port", type=int, metavar="N",
                     help="serve the endpoint's metrics to Prometheus at "
                          "http://HOST:N/metrics (needs idembus[prometheus]; 0: a free port, "
                          "logged); with --workers, the supervisor serves the sum of its "
                          "workers' there")
    run.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                     help="the address --metrics-port listens on (127.0.0.1: this machine "
                          "only; 0.0.0.0 or an interface's address for a Prometheus "
                          "elsewhere)")


def _migrate(reference: str) -> int:
    endpoint = load_endpoint(reference)
    try:
        endpoint.storage.migrate()
        print(f"{endpoint.name}: {type(endpoint.storage).__name__} schema is in place")
        if endpoint.transport.migrate():
            print(f"{endpoint.name}: {type(endpoint.transport).__name__} schema is in place")
    finally:
        endpoint.close()
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ConfigurationError("--workers must be at least 1")
    if args.concurrency is not None and args.concurrency < 1:
        raise ConfigurationError("--concurrency must be at least 1")
    if args.workers == 1:
        return _run_one(args)
    worker.check_reference(args.endpoint)
    if args.on_worker_start:
        worker.check_reference(args.on_worker_start, "--on-worker-start")
    worker_arguments = ["--log-level", args.log_level, "--log-format", args.log_format,
                        "--shutdown-timeout", str(args.shutdown_timeout)]
    if args.log_per_message:
        worker_arguments.append("--log-per-message")
    if args.concurrency is not None:
        worker_arguments += ["--concurrency", str(args.concurrency)]
    if args.strict_routes:
        worker_arguments.append("--strict-routes")
    if args.no_gc_tuning:
        worker_arguments.append("--no-gc-tuning")
    if args.app_dir:
        worker_arguments += ["--app-dir", os.path.abspath(args.app_dir)]
    if args.on_worker_start:
        worker_arguments += ["--on-worker-start", args.on_worker_start]
    metrics = None
    if args.metrics_port is not None:  # one /metrics for the group, before any worker
        from ..observability.metrics_group import GroupMetricsServer

        metrics = GroupMetricsServer(args.metrics_port, args.metrics_host)
    try:
        supervisor = Supervisor(args.endpoint, workers=args.workers,
                                worker_arguments=worker_arguments,
                                shutdown_timeout=args.shutdown_timeout + 5.0,
                                observer=metrics)
        return supervisor.run()
    finally:
        if metrics is not None:
            metrics.stop()


def _run_one(args: argparse.Namespace) -> int:
    """``idembus run`` in this process: alone, or as a worker of a supervisor."""
    supervised = worker.current()
    if args.on_worker_start:
        worker.load_hook(args.on_worker_start)(supervised or worker.WorkerProcess(0, 1))
    endpoint = load_endpoint(args.endpoint)
    if args.strict_routes:
        endpoint.strict_routes = True
    metrics: _Stoppable | None = None
    try:
        if supervised is not None:
            _refuse_process_local(endpoint, supervised.count)
            worker.set_title(supervised.title(endpoint.name), supervised.name)
        if args.concurrency is not None:
            endpoint.concurrency = args.concurrency
        metrics = _measure(args, endpoint, supervised)
        stop_when_orphaned(endpoint.request_stop)
        if not args.no_gc_tuning:
            worker.tune_garbage_collector()
        stopped = endpoint.run(shutdown_timeout=args.shutdown_timeout)
        if endpoint.recycle_requested:
            return EXIT_RECYCLE
        return 0 if stopped else 1
    finally:
        endpoint.close(timeout=0)  # run() has waited its shutdown timeout already
        if metrics is not None:
            metrics.stop()


class _Stoppable(Protocol):
    def stop(self) -> None: ...


def _measure(args: argparse.Namespace, endpoint: Any,
             supervised: worker.WorkerProcess | None) -> _Stoppable | None:
    """Serve the endpoint's metrics (``--metrics-port``), or, in a worker of a supervisor
    that serves them, write them where it reads them; ``None``: neither."""
    if args.metrics_port is not None:
        from ..observability.prometheus import serve_endpoint_metrics

        return serve_endpoint_metrics(endpoint, args.metrics_port, args.metrics_host)
    if supervised is not None and os.environ.get(METRICS_FILE):
        from ..observability.metrics_snapshots import write_endpoint_metrics

        return write_endpoint_metrics(endpoint, os.environ[METRICS_FILE])
    return None


def _refuse_process_local(endpoint: Any, workers: int) -> None:
    """Refuse, in a worker, an endpoint that several processes cannot share."""
    if endpoint.process_local:
        raise ConfigurationError(
            f"--workers {workers} needs a broker and a database that several "
            f"processes can share; {endpoint.name!r} uses "
            f"{type(endpoint.transport).__name__} and {type(endpoint.storage).__name__}, "
            "and memory://, MemoryStorage and mongomock live inside one process. Use "
            "RabbitMQ, Redis or a postgresql:// transport and PostgreSQL or MongoDB, or "
            "--concurrency for threads."
        )


if __name__ == "__main__":
    sys.exit(main())
