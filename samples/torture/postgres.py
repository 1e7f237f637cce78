"""PostgreSQL as the torture run's broker, seen from outside: the queues of the PostgreSQL
transport (their rows and their consumers), and ``pg_ctlcluster`` to restart the cluster.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Sequence

import psycopg
from psycopg.conninfo import conninfo_to_dict

from samples.torture.rabbitmq import QueueStatus

log = logging.getLogger(__name__)


class TableProbe:
    """Asks the database about the PostgreSQL transport's queues (tables ``prefix``), on
    a fresh connection per question (the database may have been restarted since)."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.messages = f"{prefix}_messages"

    def status(self, queues: list[str]) -> dict[str, QueueStatus]:
        """Every message stored in each queue (due, delayed or leased: a leased one may be
        a dead worker's) and its consumers, named ``idembus consume <queue>`` in
        ``pg_stat_activity``. Raises the driver's error when the database is down."""
        with psycopg.connect(self.url, connect_timeout=5) as connection:
            rows = connection.execute(
                f"SELECT q.name, (SELECT count(*) FROM {self.messages} m WHERE m.queue = q.name),"
                " (SELECT count(*) FROM pg_stat_activity a WHERE a.application_name = "
                "left('idembus consume ' || q.name, 63)) FROM unnest(%s::text[]) AS q(name)",
                (queues,)).fetchall()
        return {name: QueueStatus(int(messages), int(consumers))
                for name, messages, consumers in rows}


class PgCtlcluster:
    """Stops and starts one PostgreSQL cluster with ``pg_ctlcluster VERSION NAME`` (root or
    the postgres user), with the method names :class:`~samples.torture.chaos.BrokerRestart`
    calls. ``cluster``: ``"15 main"``; ``None``: the cluster listening on ``url``'s port,
    as ``pg_lsclusters`` lists it."""

    def __init__(self, url: str, cluster: str | None = None, *, timeout: float = 120.0) -> None:
        self.url = url
        self.cluster = cluster
        self.timeout = timeout

    def _which(self) -> Sequence[str]:
        if self.cluster:
            return self.cluster.split()
        port = str(conninfo_to_dict(self.url).get("port") or 5432)
        listed = subprocess.run(["pg_lsclusters", "--no-header"], capture_output=True,
                                text=True, timeout=30, check=True).stdout
        for line in listed.splitlines():
            version, name, cluster_port, *_ = line.split()
            if cluster_port == port:
                self.cluster = f"{version} {name}"
                return [version, name]
        raise LookupError(f"pg_lsclusters lists no cluster on port {port}")

    def stop_app(self) -> None:
        """Stop the cluster (fast: open sessions are ended)."""
        self._run("stop", "-m", "fast")

    def start_app(self) -> None:
        """Start the cluster (nothing happens if it runs)."""
        self._run("start")

    def await_startup(self) -> None:
        """Wait until the cluster accepts connections."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def usable(self) -> bool:
        """True if ``pg_ctlcluster`` can act on the cluster here."""
        try:
            self._run("status")
        except (OSError, LookupError, subprocess.SubprocessError):
            return False
        return True

    def _run(self, action: str, *options: str) -> None:
        # A session of its own: a signal to the caller's group must not stop it halfway.
        done = subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", *self._which(),
                               action, *options],
                              capture_output=True, text=True, timeout=self.timeout,
                              start_new_session=True)
        already = 2 if action == "start" else 0  # 2: "Cluster is already running"
        if done.returncode not in (0, already):
            raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout,
                                                done.stderr)
        log.log(logging.DEBUG if action == "status" else logging.INFO,
                "pg_ctlcluster %s %s done", self.cluster, action)
