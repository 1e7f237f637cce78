"""A RabbitMQ cluster whose nodes can be cut from each other: each node in a network
namespace of its own (:mod:`.netns`), so that a test can partition the cluster.

:class:`PartitionableCluster` is a :class:`~.cluster.RabbitCluster` whose node ``a`` runs
in the namespace ``<prefix>-a`` at ``10.77.0.1`` (``b`` at ``.2``...), named with a long
name (``<prefix>-a@10.77.0.1``: no ``/etc/hosts`` entry needed), its own epmd in its
namespace, AMQP on 5672 and distribution on 25672 of its own address; the caller (the
test, the endpoints) reaches every node through a bridge, as a client on another machine
would. Then::

    cluster.partition("a")   # a is cut from b and c; clients still reach a
    cluster.isolate("a")     # a is cut from everyone
    cluster.heal()           # every cut removed

A node's ``net_ticktime`` (how soon Erlang notices a silent peer: between 0.75 and 1.25
times it) is ``ticktime`` seconds, 10 by default instead of RabbitMQ's 60, so that a
partition of seconds is noticed in seconds. Needs root; :func:`.netns.unavailable` says
why not.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

from .cluster import DEFAULT_TIMEOUT, ClusterError, Node, RabbitCluster
from .netns import DEFAULT_SUBNET, Network

#: AMQP and distribution port of every node (each on its own address).
AMQP_PORT = 5672
DIST_PORT = 25672


class PartitionableCluster(RabbitCluster):
    """``size`` RabbitMQ nodes, each in a namespace of its own; see the module docstring."""

    def __init__(self, root: str | os.PathLike[str], *, size: int = 3,
                 prefix: str = "idbnet", subnet: str = DEFAULT_SUBNET,
                 ticktime: int = 10, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(root, size=size, prefix=prefix, timeout=timeout)
        self.network = Network(list(self.nodes), prefix=prefix, subnet=subnet)
        self.ticktime = ticktime
        self.nodes = {
            name: replace(node, nodename=f"{prefix}-{name}@{self.network.addresses[name]}",
                          host=self.network.addresses[name], amqp_port=AMQP_PORT,
                          dist_port=DIST_PORT)
            for name, node in self.nodes.items()}

    def start(self) -> None:
        """Make the network, then start the cluster; on a failure, remove both."""
        self.network.create()
        try:
            super().start()
        except BaseException:
            self.stop(remove=True)
            raise

    def stop(self, *, remove: bool = False) -> None:
        """Stop every node (see :meth:`RabbitCluster.stop`), then remove the network (and
        the epmd left in each namespace) even if a node did not stop."""
        try:
            super().stop(remove=remove)
        finally:
            self.network.destroy()

    def partition(self, name: str) -> None:
        """Cut node ``name`` from the other nodes; clients still reach it."""
        self.network.partition(name)

    def isolate(self, name: str) -> None:
        """Cut node ``name`` from the other nodes and from every client."""
        self.network.isolate(name)

    def heal(self) -> None:
        """Remove every cut."""
        self.network.heal()

    def cluster_status(self) -> dict[str, Any]:
        """``rabbitmqctl cluster_status`` of the first node that answers (see :meth:`ask`)."""
        parsed: dict[str, Any] = json.loads(self.ask("cluster_status", "--formatter", "json"))
        return parsed

    def leaders(self, vhost: str | None = None) -> dict[str, int]:
        """How many quorum queues each node leads (in ``vhost``, or in every vhost), in one
        ``eval``: ``list_queues`` has the other nodes answer the caller's ``rabbitmqctl``
        directly, which they cannot reach (it listens on the caller's loopback)."""
        scope = f'<<"{_erlang_string(vhost)}">>' if vhost else ""
        out = self.ask("eval", 'lists:flatten([[atom_to_list(N), " "] || '
                               f"Q <- rabbit_amqqueue:list({scope}), "
                               "amqqueue:get_type(Q) =:= rabbit_quorum_queue, "
                               "{_, N} <- [amqqueue:get_pid(Q)]]).")
        by_nodename = {spec.nodename: name for name, spec in self.nodes.items()}
        counts = dict.fromkeys(self.nodes, 0)
        for nodename in out.strip().strip('"').split():
            if nodename in by_nodename:
                counts[by_nodename[nodename]] += 1
        return counts

    def ask(self, *args: str) -> str:
        """``rabbitmqctl args`` of the first running node that answers: a node that paused
        itself, cut off from the majority (``pause_minority``), does not."""
        failures = []
        for name in self.running():
            try:
                return self.ctl(name, *args)
            except ClusterError as exc:
                failures.append(f"{name}: {exc}")
        raise ClusterError("no node of the cluster answers: " + "; ".join(failures)
                           if failures else "no node of the cluster is running")

    def _config(self, node: Node, peers: str) -> str:
        # guest may connect from the bridge, not only from the node's own loopback
        return super()._config(node, peers) + "loopback_users = none\n"

    def _command(self, node: Node, command: list[str]) -> list[str]:
        name = next(name for name, each in self.nodes.items() if each == node)
        return self.network.run_in(name, command)

    def _environment(self, node: Node | None = None) -> dict[str, str]:
        environment = super()._environment(node)
        environment["RABBITMQ_USE_LONGNAME"] = "true"
        if node is not None:
            environment["RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS"] += (
                f" -kernel net_ticktime {self.ticktime}")
        return environment


def _erlang_string(text: str) -> str:
    """``text`` inside an Erlang string literal."""
    return text.replace("\\", "\\\\").replace('"', '\\"')
