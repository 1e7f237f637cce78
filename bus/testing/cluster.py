"""A RabbitMQ cluster of three nodes on loopback, started by the project for tests, the
cluster torture run and anyone who wants to see failover happen::

    python -m idembus.testing.cluster start            # three nodes, clustered
    python -m idembus.testing.cluster status           # running nodes, queue leaders
    python -m idembus.testing.cluster kill a           # SIGKILL node a's Erlang VM
    python -m idembus.testing.cluster restart a        # start it again; it rejoins
    python -m idembus.testing.cluster stop             # every node, gracefully; files removed

In Python, :class:`RabbitCluster` does the same (``with RabbitCluster(path) as cluster:``)
and answers :meth:`RabbitCluster.urls` (one URL a node, for kombu's failover syntax) and
:meth:`RabbitCluster.busiest_leader` (the node leading the most quorum queues).

Each node has its own node name (``idembus-a@localhost``), AMQP and Erlang distribution
ports, configuration, data and log directories under one directory, and the same Erlang
cookie (a ``.erlang.cookie`` in the ``HOME`` every node and ``rabbitmqctl`` call is given).
The machine's own node (``rabbit@…`` on 5672) is never touched: nothing here reads
``/etc/rabbitmq`` (``RABBITMQ_CONF_ENV_FILE`` points at an empty file of the cluster's)
and nothing runs through Debian's ``su rabbitmq`` wrappers, so the nodes run as the
caller. Nodes find each other through ``classic_config`` peer discovery: the first node
starts alone, the others join it as they boot, and a node that was killed rejoins when it
is started again. Small footprints for small machines: one Erlang scheduler, a 512 MiB
memory watermark, no plugins.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..redaction import redact
from .processes import alive

#: Where Debian and RabbitMQ's own packages put the scripts that do not switch user.
_SCRIPT_DIRS = ("/usr/lib/rabbitmq/bin", "/usr/local/lib/rabbitmq/bin")
#: First AMQP port and first distribution port: node ``i`` listens on ``port + i``.
DEFAULT_AMQP_PORT = 5691
DEFAULT_DIST_PORT = 25691
#: Seconds a node gets to boot, to stop, or for a ``rabbitmqctl`` call.
DEFAULT_TIMEOUT = 180.0
_STATE = "cluster.json"


@dataclass(frozen=True)
class Node:
    """One node of the cluster."""

    #: Its short name in this cluster: ``a``, ``b``, ``c``.
    name: str
    #: Erlang node name, ``idembus-a@localhost``.
    nodename: str
    amqp_port: int
    dist_port: int
    #: Its own directory (configuration, data, logs, pid file).
    home: str
    #: The address it listens on (AMQP and distribution).
    host: str = "127.0.0.1"

    @property
    def pid_file(self) -> Path:
        return Path(self.home) / "node.pid"

    @property
    def log_file(self) -> Path:
        return Path(self.home) / "log" / "node.log"

    def url(self, vhost: str = "/", user: str = "guest", password: str = "guest") -> str:
        """This node's AMQP URL."""
        path = "/" if vhost == "/" else "/" + vhost
        return f"amqp://{user}:{password}@{self.host}:{self.amqp_port}{path}"


class ClusterError(RuntimeError):
    """A node did not start, stop or answer as asked (the message names its log file)."""


class RabbitCluster:
    """Three (``size``) RabbitMQ nodes under ``root``, clustered; see the module docstring.

    ``prefix`` names the nodes (``<prefix>-a@localhost``): two clusters on one machine need
    other prefixes and ports."""

    def __init__(self, root: str | os.PathLike[str], *, size: int = 3,
                 amqp_port: int = DEFAULT_AMQP_PORT, dist_port: int = DEFAULT_DIST_PORT,
                 prefix: str = "idembus", timeout: float = DEFAULT_TIMEOUT) -> None:
        if not 1 <= size <= 26:
            raise ValueError(f"a cluster has 1 to 26 nodes, not {size}")
        self.root = Path(root).resolve()
        self.timeout = timeout
        self.prefix = prefix
        names = [chr(ord("a") + index) for index in range(size)]
        self.nodes = {name: Node(name, f"{prefix}-{name}@localhost", amqp_port + index,
                                 dist_port + index, str(self.root / name))
                      for index, name in enumerate(names)}
        self._processes: dict[str, subprocess.Popen[bytes]] = {}

    @classmethod
    def load(cls, root: str | os.PathLike[str]) -> RabbitCluster:
        """The cluster that :meth:`start` recorded under ``root``."""
        state = json.loads((Path(root) / _STATE).read_text())
        return cls(root, size=state["size"], amqp_port=state["amqp_port"],
                   dist_port=state["dist_port"], prefix=state["prefix"],
                   timeout=state["timeout"])

    def __enter__(self) -> RabbitCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(remove=True)

    # -- the whole cluster ------------------------------------------------------------

    def start(self) -> None:
        """Write every node's files, start the first node, then the others, which join
        it; return once every node runs the broker and sees the others."""
        self._prepare()
        first, *others = self.nodes
        self.start_node(first)
        for name in others:
            self._launch(name)
        for name in others:
            self._await(name)
        self.await_members()

    def stop(self, *, remove: bool = False) -> None:
        """Stop every running node gracefully, the first one last (the one that must boot
        first next time); ``remove``: delete their files too."""
        for name in reversed(list(self.nodes)):
            if self.pid(name) is not None:
                self.stop_node(name)
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)

    def urls(self, vhost: str = "/", user: str = "guest", password: str = "guest") -> list[str]:
        """One AMQP URL a node, first node first."""
        return [node.url(vhost, user, password) for node in self.nodes.values()]

    def failover_url(self, vhost: str = "/", user: str = "guest",
                     password: str = "guest") -> str:
        """kombu's failover syntax: the node URLs joined by ``;``."""
        return ";".join(self.urls(vhost, user, password))

    def running(self) -> list[str]:
        """The nodes whose Erlang VM is alive."""
        return [name for name in self.nodes if self.pid(name) is not None]

    def add_vhost(self, vhost: str) -> None:
        """Create ``vhost`` (idempotent) with every permission for ``guest``."""
        node = self._any_running()
        self.ctl(node, "add_vhost", vhost, check=False)
        self.ctl(node, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")

    def await_members(self, expected: Sequence[str] | None = None) -> None:
        """Wait until the cluster reports ``expected`` (default: every live node) as
        running members."""
        wanted = {self.nodes[name].nodename for name in (expected or self.running())}
        deadline = time.monotonic() + self.timeout
        while True:
            running = set(self.cluster_status().get("running_nodes", []))
            if wanted <= running:
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"the cluster runs {sorted(running)}, not {sorted(wanted)}")
            time.sleep(1.0)  # polling rabbitmqctl, which takes a second of CPU anyway

    def cluster_status(self) -> dict[str, Any]:
        """``rabbitmqctl cluster_status`` as JSON, asked of a running node."""
        out = self.ctl(self._any_running(), "cluster_status", "--formatter", "json")
        parsed: dict[str, Any] = json.loads(out)
        return parsed

    def leaders(self, vhost: str | None = None) -> dict[str, int]:
        """How many quorum queues each node leads (in ``vhost``, or in every vhost)."""
        node = self._any_running()
        vhosts = [vhost] if vhost else self.ctl(node, "list_vhosts", "name", "--silent",
                                                "--no-table-headers").split()
        by_nodename = {spec.nodename: name for name, spec in self.nodes.items()}
        counts = dict.fromkeys(self.nodes, 0)
        for each in vhosts:
            out = self.ctl(node, "list_queues", "-p", each, "name", "type", "leader",
                           "--formatter", "json")
            for queue in json.loads(out or "[]"):
                leader = by_nodename.get(str(queue.get("leader", "")))
                if queue.get("type") == "quorum" and leader is not None:
                    counts[leader] += 1
        return counts

    def busiest_leader(self, vhost: str | None = None) -> str:
        """The node that leads the most quorum queues (the first node if none leads any)."""
        counts = self.leaders(vhost)
        return max(counts, key=lambda name: (counts[name], -ord(name[0])))

    # -- one node ---------------------------------------------------------------------

    def start_node(self, name: str) -> None:
        """Start node ``name`` (again) and wait until its broker runs."""
        self._launch(name)
        self._await(name)

    def stop_node(self, name: str) -> None:
        """Stop node ``name`` gracefully (SIGTERM: RabbitMQ closes its connections and hands
        its queue leaderships over) and wait until its VM has exited."""
        self._signal(name, signal.SIGTERM)

    def kill_node(self, name: str) -> None:
        """SIGKILL node ``name``'s Erlang VM (``beam.smp``) and wait until it is gone."""
        self._signal(name, signal.SIGKILL)

    def restart_node(self, name: str) -> None:
        """Stop node ``name`` if it runs, start it and wait until it is a member again."""
        if self.pid(name) is not None:
            self.stop_node(name)
        self.start_node(name)
        self.await_members()

    def pid(self, name: str) -> int | None:
        """The process id of node ``name``'s Erlang VM, if it is alive."""
        try:
            pid = int(self.nodes[name].pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if alive(pid) else None

    def ctl(self, name: str, *args: str, check: bool = True) -> str:
        """Run ``rabbitmqctl -n <node> args`` with the cluster's cookie; its output."""
        return self._run("rabbitmqctl", "-n", self.nodes[name].nodename, *args, check=check)

    # -- inside -----------------------------------------------------------------------

    def _prepare(self) -> None:
        home = self.root / "home"
        home.mkdir(parents=True, exist_ok=True)
        cookie = home / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(secrets.token_hex(16).upper())
            cookie.chmod(0o400)
        peers = "\n".join(f"cluster_formation.classic_config.nodes.{index} = {node.nodename}"
                          for index, node in enumerate(self.nodes.values(), start=1))
        for node in self.nodes.values():
            directory = Path(node.home)
            (directory / "log").mkdir(parents=True, exist_ok=True)
            (directory / "rabbitmq.conf").write_text(self._config(node, peers))
            (directory / "enabled_plugins").write_text("[].\n")
            (directory / "rabbitmq-env.conf").write_text("")
        (self.root / _STATE).write_text(json.dumps({
            "size": len(self.nodes), "amqp_port": next(iter(self.nodes.values())).amqp_port,
            "dist_port": next(iter(self.nodes.values())).dist_port,
            "prefix": self.prefix,
            "timeout": self.timeout, "nodes": [asdict(node) for node in self.nodes.values()],
        }, indent=2))

    def _config(self, node: Node, peers: str) -> str:
        """The text of ``node``'s rabbitmq.conf (``peers``: the classic_config lines)."""
        return _CONFIG.format(host=node.host, port=node.amqp_port, peers=peers)

    def _command(self, node: Node, command: list[str]) -> list[str]:
        """How ``command`` (the node's ``rabbitmq-server``) is run."""
        return command

    def _environment(self, node: Node | None = None) -> dict[str, str]:
        environment = {**os.environ, "HOME": str(self.root / "home"),
                       "RABBITMQ_CONF_ENV_FILE": str(self.root / "a" / "rabbitmq-env.conf")}
        if node is None:
            return environment
        directory = Path(node.home)
        interface = ",".join(node.host.split("."))  # Erlang's {127,0,0,1}
        environment.update({
            "RABBITMQ_NODENAME": node.nodename,
            "RABBITMQ_NODE_IP_ADDRESS": node.host,
            "RABBITMQ_NODE_PORT": str(node.amqp_port),
            "RABBITMQ_DIST_PORT": str(node.dist_port),
            "RABBITMQ_CONFIG_FILE": str(directory / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(directory / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(directory / "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(directory / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(directory / "data"),
            "RABBITMQ_LOG_BASE": str(directory / "log"),
            "RABBITMQ_LOGS": str(node.log_file),
            "RABBITMQ_PID_FILE": str(node.pid_file),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS":
                f"+S 1:1 +A 4 -kernel inet_dist_use_interface {{{interface}}}",
        })
        return environment

    def _launch(self, name: str) -> None:
        node = self.nodes[name]
        if self.pid(name) is not None:
            return
        for port in (node.amqp_port, node.dist_port):
            if _listening(node.host, port):
                raise ClusterError(f"port {port} of node {name} is taken by another process")
        node.pid_file.unlink(missing_ok=True)
        with open(Path(node.home) / "log" / "console.log", "ab") as console:
            # A session of its own: a signal to the caller's process group must not reach
            # the nodes; the node raises its own descriptor limit as far as allowed.
            self._processes[name] = subprocess.Popen(
                self._command(node, ["sh", "-c", 'ulimit -n 20000 2>/dev/null; exec "$0"',
                                     os.path.join(_script_dir(), "rabbitmq-server")]),
                env=self._environment(node), stdin=subprocess.DEVNULL, stdout=console,
                stderr=subprocess.STDOUT, start_new_session=True, cwd=node.home)

    def _await(self, name: str) -> None:
        node = self.nodes[name]
        try:
            self.ctl(name, "wait", str(node.pid_file), "--timeout", str(int(self.timeout)))
        except ClusterError as exc:
            raise ClusterError(f"node {name} did not start: {exc} (see {node.log_file})") from exc

    def _signal(self, name: str, signum: signal.Signals) -> None:
        pid = self.pid(name)
        if pid is None:
            return
        os.kill(pid, signum)
        deadline = time.monotonic() + self.timeout
        process = self._processes.pop(name, None)
        if process is not None:  # started here: its shell exits once the VM has
            try:
                process.wait(self.timeout)
            except subprocess.TimeoutExpired:
                pass
        while alive(pid):
            if time.monotonic() > deadline:
                raise ClusterError(f"node {name} (pid {pid}) is still running after "
                                   f"{self.timeout:.0f}s (see {self.nodes[name].log_file})")
            time.sleep(0.1)  # another process's exit cannot be waited on
        self.nodes[name].pid_file.unlink(missing_ok=True)

    def _any_running(self) -> str:
        for name in self.nodes:
            if self.pid(name) is not None:
                return name
        raise ClusterError("no node of the cluster is running")

    def _run(self, tool: str, *args: str, check: bool = True) -> str:
        command = [os.path.join(_script_dir(), tool), *args]
        try:
            done = subprocess.run(command, env=self._environment(), capture_output=True,
                                  text=True, timeout=self.timeout + 30, cwd=self.root,
                                  start_new_session=True)
        except subprocess.TimeoutExpired as exc:
            raise ClusterError(f"{' '.join(command)} took more than {exc.timeout:.0f}s") from exc
        if check and done.returncode != 0:
            raise ClusterError(f"{' '.join(command)} failed ({done.returncode}): "
                               f"{(done.stderr or done.stdout).strip()[-800:]}")
        return done.stdout


#: Each node's rabbitmq.conf.
_CONFIG = """\
listeners.tcp.1 = {host}:{port}
vm_memory_high_watermark.absolute = 512MiB
disk_free_limit.absolute = 50MB
cluster_partition_handling = pause_minority
cluster_formation.peer_discovery_backend = classic_config
{peers}
heartbeat = 30
log.console = false
log.file.level = info
"""


def _script_dir() -> str:
    """The directory of ``rabbitmq-server`` and ``rabbitmqctl`` that run as the caller."""
    configured = os.environ.get("IDEMBUS_RABBITMQ_SCRIPTS")
    for directory in ([configured] if configured else list(_SCRIPT_DIRS)):
        if os.path.exists(os.path.join(directory, "rabbitmq-server")):
            return directory
    found = shutil.which("rabbitmq-server")
    if found is None:
        raise ClusterError("rabbitmq-server is not installed (apt-get install rabbitmq-server, "
                           "or set IDEMBUS_RABBITMQ_SCRIPTS to its directory)")
    return os.path.dirname(found)


def _listening(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1.0)
        return probe.connect_ex((host, port)) == 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m idembus.testing.cluster``: see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m idembus.testing.cluster",
                                     description="A three-node RabbitMQ cluster on loopback.")
    parser.add_argument("--dir", default=os.environ.get("IDEMBUS_CLUSTER_DIR",
                                                        "/tmp/idembus-cluster"),
                        help="the cluster's files (%(default)s)")
    parser.add_argument("--amqp-port", type=int, default=DEFAULT_AMQP_PORT,
                        help="AMQP port of the first node; the others follow (%(default)s)")
    parser.add_argument("--dist-port", type=int, default=DEFAULT_DIST_PORT,
                        help="distribution port of the first node (%(default)s)")
    parser.add_argument("action", choices=("start", "stop", "status", "kill", "stop-node",
                                           "restart", "leader"))
    parser.add_argument("node", nargs="?", help="the node of kill, stop-node and restart")
    args = parser.parse_args(argv)
    if args.action == "start":
        cluster = RabbitCluster(args.dir, amqp_port=args.amqp_port, dist_port=args.dist_port)
        cluster.start()
        print(redact(cluster.failover_url()))
        return 0
    try:
        cluster = RabbitCluster.load(args.dir)
    except OSError:
        print(f"no cluster in {args.dir} (start one first)", file=sys.stderr)
        return 1
    if args.action in ("kill", "stop-node", "restart"):
        if args.node not in cluster.nodes:
            parser.error(f"{args.action} needs a node: one of {', '.join(cluster.nodes)}")
        {"kill": cluster.kill_node, "stop-node": cluster.stop_node,
         "restart": cluster.restart_node}[args.action](args.node)
    elif args.action == "stop":
        cluster.stop(remove=True)
    elif args.action == "leader":
        print(cluster.busiest_leader())
    else:
        running = cluster.running()
        for name, node in cluster.nodes.items():
            state = "running" if name in running else "down"
            print(f"{name} {node.nodename} amqp={node.amqp_port} {state}")
        if running:
            print("quorum queue leaders:", cluster.leaders())
    return 0


if __name__ == "__main__":
    sys.exit(main())
