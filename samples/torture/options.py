"""The command line of ``python -m samples.torture``."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

from samples.ordering.deployment import DEFAULT_POSTGRES, DEFAULT_TRANSPORT


@dataclass(frozen=True)
class Options:
    """What one torture run does."""

    orders: int = 10_000
    #: Share of the orders sent twice with the same message id.
    duplicates: float = 0.2
    #: Worker processes per endpoint.
    workers: int = 3
    #: Mean seconds between two SIGKILLs of a random worker (0: no kills).
    kill_interval: float = 2.0
    broker_restart: bool = True
    transport: str = DEFAULT_TRANSPORT
    postgres: str = DEFAULT_POSTGRES
    seed: int = 1
    #: Seconds the whole run may take before it reports what it has.
    timeout: float = 1800.0
    #: Where the workers' logs go; ``None``: a temporary directory, removed after a
    #: successful run.
    log_dir: str | None = None
    #: Leave the queues and tables in place for a post-mortem.
    keep: bool = False
    rabbitmqctl: str = "rabbitmqctl"
    #: The PostgreSQL cluster to restart when the queues are in PostgreSQL ("15 main");
    #: ``None``: the one listening on the transport URL's port.
    pg_cluster: str | None = None
    #: Seconds before a killed worker's messages are due again on PostgreSQL's queues.
    visibility_timeout: float = 5.0
    #: ``Endpoint(defer_fresh_redispatch=...)`` of the workers (0: re-send at once).
    defer_fresh_redispatch: float = 0.0
    #: Run on a three-node RabbitMQ cluster and a PostgreSQL primary and standby started
    #: for the run (``--transport`` and ``--postgres`` unused): the busiest node killed,
    #: PostgreSQL failed over, then a node stopped, instead of the broker restart.
    cluster: bool = False

    @property
    def duplicate_count(self) -> int:
        return round(self.orders * self.duplicates)


def parse(argv: Sequence[str] | None = None) -> Options:
    """Options from the command line (``IDEMBUS_AMQP_URL`` / ``IDEMBUS_POSTGRES_URL`` are
    the defaults of ``--transport`` / ``--postgres`` when set)."""
    parser = argparse.ArgumentParser(
        prog="python -m samples.torture",
        description="The ordering sample on RabbitMQ (or the PostgreSQL transport) and "
                    "PostgreSQL with worker processes killed and the broker restarted; prints "
                    "one line read from the stores and exits 0 only if every order took "
                    "effect exactly once.",
    )
    parser.add_argument("--orders", type=int, default=Options.orders,
                        help="orders to place (%(default)s)")
    parser.add_argument("--duplicates", type=float, default=Options.duplicates,
                        help="share of orders sent twice with the same id (%(default)s)")
    parser.add_argument("--workers", type=int, default=Options.workers,
                        help="worker processes per endpoint (%(default)s)")
    parser.add_argument("--kill-interval", type=float, default=Options.kill_interval,
                        help="mean seconds between SIGKILLs of a random worker; 0: none "
                             "(%(default)s)")
    parser.add_argument("--broker-restart", action=argparse.BooleanOptionalAction,
                        default=Options.broker_restart,
                        help="restart the broker once mid-run: RabbitMQ with rabbitmqctl, or "
                             "PostgreSQL with pg_ctlcluster when the queues are in it (on)")
    parser.add_argument("--transport",
                        default=os.environ.get("IDEMBUS_AMQP_URL", Options.transport),
                        help="RabbitMQ URL, or a postgresql:// URL for the PostgreSQL "
                             "transport (%(default)s)")
    parser.add_argument("--pg-cluster", default=Options.pg_cluster, metavar="'VERSION NAME'",
                        help="the PostgreSQL cluster pg_ctlcluster restarts (default: the one "
                             "on the --transport URL's port, from pg_lsclusters)")
    parser.add_argument("--visibility-timeout", type=float,
                        default=Options.visibility_timeout, metavar="SECONDS",
                        help="leases of the PostgreSQL transport: a killed worker's messages "
                             "are due again after this (%(default)s)")
    parser.add_argument("--postgres",
                        default=os.environ.get("IDEMBUS_POSTGRES_URL", Options.postgres),
                        help="PostgreSQL URL (%(default)s)")
    parser.add_argument("--seed", type=int, default=Options.seed,
                        help="seed of the orders, duplicates and kills (%(default)s)")
    parser.add_argument("--timeout", type=float, default=Options.timeout,
                        help="seconds before the run gives up waiting and reports "
                             "(%(default)s)")
    parser.add_argument("--log-dir", help="keep the workers' logs here (default: a "
                                          "temporary directory, removed after a clean run)")
    parser.add_argument("--keep", action="store_true",
                        help="leave the queues and tables in place afterwards")
    parser.add_argument("--rabbitmqctl", default=Options.rabbitmqctl,
                        help="the rabbitmqctl command of the broker's node (%(default)s)")
    parser.add_argument("--defer-fresh-redispatch", type=float,
                        default=Options.defer_fresh_redispatch, metavar="SECONDS",
                        help="a duplicate leaves an entry committed less than SECONDS ago to "
                             "its committer and the outbox (%(default)s: re-sends at once)")
    parser.add_argument("--cluster", action="store_true",
                        help="start three RabbitMQ nodes on loopback (ports 5691-5693) and a "
                             "PostgreSQL primary and synchronous standby (free ports) and run "
                             "on them: halfway, the node leading the most queues is killed, "
                             "PostgreSQL fails over (primary killed, standby promoted), the "
                             "node is started again, then one is stopped gracefully and "
                             "started again")
    args = parser.parse_args(argv)
    if args.orders < 1:
        parser.error("--orders must be at least 1")
    if not 0 <= args.duplicates <= 1:
        parser.error("--duplicates must be between 0 and 1")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.kill_interval < 0:
        parser.error("--kill-interval cannot be negative")
    return Options(
        orders=args.orders, duplicates=args.duplicates, workers=args.workers,
        kill_interval=args.kill_interval, broker_restart=args.broker_restart,
        transport=args.transport, postgres=args.postgres, seed=args.seed,
        timeout=args.timeout, log_dir=args.log_dir, keep=args.keep,
        rabbitmqctl=args.rabbitmqctl, defer_fresh_redispatch=args.defer_fresh_redispatch,
        pg_cluster=args.pg_cluster, visibility_timeout=args.visibility_timeout,
        cluster=args.cluster,
    )
