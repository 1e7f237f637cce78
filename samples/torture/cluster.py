"""The torture run on a three-node RabbitMQ cluster (``--cluster``): the nodes, started for
the run on loopback ports of their own (:class:`idembus.testing.cluster.RabbitCluster`),
and the chaos that happens to them halfway through the orders.

The storage runs on a PostgreSQL primary with a synchronous standby started for the run
(:class:`idembus.testing.pg_cluster.PostgresPair`), reached through its multi-host URL
(``target_session_attrs=read-write``).

The chaos, in a thread of its own: SIGKILL the node that leads the most quorum queues;
while it is down, each extra step given (:class:`PostgresFailover`: the primary SIGKILLed,
the standby promoted), so that it meets the orders still flowing; start the node again
and wait until it is a member; then stop the node leading the most queues then,
gracefully, and start it again. The workers and the driver connect with the failover URL
of the three nodes throughout.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence

from idembus.testing.cluster import DEFAULT_AMQP_PORT, DEFAULT_DIST_PORT, RabbitCluster
from idembus.testing.pg_cluster import Failover, PostgresPair
from samples.torture.chaos import Disruption

log = logging.getLogger(__name__)


def start_cluster() -> RabbitCluster:
    """Three clustered nodes in a temporary directory (removed by ``stop(remove=True)``),
    on the ports ``IDEMBUS_CLUSTER_AMQP_PORT`` and ``IDEMBUS_CLUSTER_DIST_PORT`` and the two
    after each (5691 and 25691 by default)."""
    cluster = RabbitCluster(
        tempfile.mkdtemp(prefix="idembus-torture-cluster-"),
        amqp_port=int(os.environ.get("IDEMBUS_CLUSTER_AMQP_PORT", DEFAULT_AMQP_PORT)),
        dist_port=int(os.environ.get("IDEMBUS_CLUSTER_DIST_PORT", DEFAULT_DIST_PORT)))
    log.info("starting a RabbitMQ cluster of 3 nodes in %s", cluster.root)
    try:
        cluster.start()
    except BaseException:
        cluster.stop(remove=True)
        raise
    return cluster


#: Seconds each step of the PostgreSQL pair may take (a server up, a promotion, the first
#: commit after it) on a busy two-core machine.
PG_STEP_TIMEOUT = 120.0


def start_pair() -> PostgresPair:
    """A PostgreSQL primary and synchronous standby on free loopback ports, running (stop
    it with ``stop()``, which removes its files)."""
    pair = PostgresPair(database="torture", timeout=PG_STEP_TIMEOUT)
    log.info("starting a PostgreSQL primary and synchronous standby")
    pair.start()
    log.info("PostgreSQL pair up on ports %s", pair.ports)
    return pair


class PostgresFailover:
    """The chaos's PostgreSQL step: :meth:`PostgresPair.fail_over` (primary SIGKILLed,
    standby promoted), its times kept for the run's notes."""

    def __init__(self, pair: PostgresPair) -> None:
        self.pair = pair
        self.done: list[Failover] = []

    def __call__(self) -> None:
        failover = self.pair.fail_over()
        self.done.append(failover)
        log.warning("PostgreSQL failed over: standby promoted %.1fs after the kill, first "
                    "commit on it after %.1fs", failover.seconds_to_promoted,
                    failover.seconds_to_first_commit)

    def notes(self) -> list[str]:
        """One line per failover, for the run's notes."""
        return [f"postgres: primary killed; standby promoted after "
                f"{f.seconds_to_promoted:.1f}s, first commit on it after "
                f"{f.seconds_to_first_commit:.1f}s" for f in self.done]


class ClusterChaos(Disruption):
    """Kills, then stops, the busiest node, each started again (see the module docstring);
    ``extra_steps`` run while the killed node is down, each a named callable
    (``("pg_failovers", PostgresFailover(pair))``; the name is the figure of the line).
    :meth:`begin` returns once the first node is dead; like
    :class:`~samples.torture.chaos.BrokerRestart` it has :meth:`ensure_up`, ``restarts``
    and ``outage``."""

    def __init__(self, cluster: RabbitCluster, *,
                 extra_steps: Sequence[tuple[str, Callable[[], None]]] = ()) -> None:
        super().__init__("cluster-chaos")
        self.cluster = cluster
        self.node_kills = 0
        self.node_stops = 0
        #: How many times each extra step ran.
        self.extra: dict[str, int] = {name: 0 for name, _ in extra_steps}
        #: Seconds from the kill until the killed node was a member again.
        self.outage = 0.0
        self._steps = list(extra_steps)

    @property
    def restarts(self) -> int:
        """The single broker's restarts: none on a cluster (see ``node_kills``)."""
        return 0

    def ensure_up(self) -> None:
        """Start every node that is down (after an interrupted run)."""
        for name in self.cluster.nodes:
            if self.cluster.pid(name) is None:
                log.warning("node %s is down; starting it", name)
                self.cluster.start_node(name)

    def figures(self) -> tuple[tuple[str, int], ...]:
        """The line's figures of the chaos: node kills and stops, then the extra steps."""
        return (("node_kills", self.node_kills), ("node_stops", self.node_stops),
                *self.extra.items())

    def unreplicated(self, queues: Sequence[str]) -> list[str]:
        """The queues among ``queues`` that are not held by every node."""
        out = self.cluster.ctl(self.cluster.running()[0], "list_queues", "name", "members",
                               "--formatter", "json")
        members = {queue["name"]: len(queue["members"]) for queue in json.loads(out or "[]")}
        return [f"{queue} on {members.get(queue, 0)} nodes" for queue in queues
                if members.get(queue, 0) != len(self.cluster.nodes)]

    def _run(self) -> None:
        try:
            victim = self.cluster.busiest_leader()
            log.warning("killing node %s, which leads the most queues", victim)
            began = time.monotonic()
            self.cluster.kill_node(victim)
            self.node_kills += 1
            self._down.set()
            # the orders still flow while the node is down (it takes 30 to 90 s to boot on
            # a busy machine): the extra steps meet them there
            for name, step in self._steps:
                log.warning("chaos: %s", name)
                step()
                self.extra[name] += 1
            self.cluster.start_node(victim)
            self.cluster.await_members()
            self.outage = time.monotonic() - began
            log.warning("node %s is back after %.1fs", victim, self.outage)
            victim = self.cluster.busiest_leader()
            log.warning("stopping node %s gracefully", victim)
            self.cluster.stop_node(victim)
            self.node_stops += 1
            self.cluster.start_node(victim)
            self.cluster.await_members()
        except BaseException as error:
            self.error = error
            log.error("the cluster chaos failed: %s", error)
        finally:
            self._down.set()
            self._finished.set()
