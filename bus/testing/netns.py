"""A small network of Linux network namespaces, one a host, that tests can cut.

Each host (``a``, ``b``, ``c``...) gets a namespace of its own (``<prefix>-a``) with a
loopback and one interface, the end of a veth pair whose other end is plugged into a
bridge (``<prefix>-br``) in the caller's namespace, which has the subnet's ``.254``: the
hosts reach each other through the bridge, and the caller reaches every host as a client
would. Cuts are routes, so that no packet filter (iptables, nftables) is needed:

- :meth:`Network.partition` cuts one host from the other hosts only, both ways (a
  ``blackhole`` route to each peer's address in the host's namespace, and to the host's
  address in each peer's): the caller still reaches it;
- :meth:`Network.isolate` cuts it from everyone, the caller included;
- :meth:`Network.heal` removes every cut.

A blackhole route drops what a host sends: a connection being opened fails (``EINVAL``) or
times out, an open one stops receiving what the other side sends, without a reset or an
ICMP message to tell either side, as when a cable or a switch fails.

Everything needs root (``CAP_NET_ADMIN``) and iproute2's ``ip``; :func:`unavailable` says
why not, for a test to skip with that reason.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

from .processes import alive

#: The subnet of the hosts (``.1``, ``.2``...; the caller's bridge is ``.254``).
DEFAULT_SUBNET = "10.77.0.0/24"


class NetworkError(RuntimeError):
    """An ``ip`` command failed (the message has its output)."""


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``, no ``ip netns``), or None."""
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    probe = f"idbprobe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except NetworkError as exc:
        return f"ip netns add fails here: {exc}"
    try:
        _ip("netns", "del", probe)
    except NetworkError:
        pass
    return None


class Network:
    """``hosts`` namespaces on a bridge; see the module docstring.

    ``prefix`` (at most 10 characters: interface names have 15) names the namespaces and
    links; two networks on one machine need other prefixes and subnets."""

    def __init__(self, hosts: Sequence[str], *, prefix: str = "idbnet",
                 subnet: str = DEFAULT_SUBNET) -> None:
        if not 1 <= len(prefix) <= 10:
            raise ValueError(f"a network prefix has 1 to 10 characters, not {prefix!r}")
        network = ipaddress.ip_network(subnet)
        if network.version != 4 or network.num_addresses < len(hosts) + 2:
            raise ValueError(f"{subnet} has no room for {len(hosts)} hosts and a bridge")
        addresses = list(network.hosts())
        self.prefix = prefix
        self.prefixlen = network.prefixlen
        self.bridge = f"{prefix}-br"
        self.gateway = str(addresses[-1])
        self.addresses = {name: str(addresses[index]) for index, name in enumerate(hosts)}

    def namespace(self, host: str) -> str:
        """The name of ``host``'s namespace (and of its veth's end on the bridge)."""
        return f"{self.prefix}-{host}"

    def run_in(self, host: str, command: list[str]) -> list[str]:
        """``command`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *command]

    def create(self) -> None:
        """Make the bridge and every host's namespace (what is left of an earlier network of
        the same prefix is removed first); on a failure, remove what was made."""
        self.destroy()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/{self.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for host, address in self.addresses.items():
                namespace = self.namespace(host)
                _ip("netns", "add", namespace)
                _ip("-n", namespace, "link", "set", "lo", "up")
                _ip("link", "add", namespace, "type", "veth", "peer", "name", "eth0",
                    "netns", namespace)
                _ip("link", "set", namespace, "master", self.bridge, "up")
                _ip("-n", namespace, "addr", "add", f"{address}/{self.prefixlen}",
                    "dev", "eth0")
                _ip("-n", namespace, "link", "set", "eth0", "up")
        except BaseException:
            self.destroy()
            raise

    def destroy(self) -> None:
        """End every process left in the namespaces (an epmd, a node), remove them and the
        bridge; what does not exist is skipped."""
        existing = set(_ip("netns", "list", check=False).split())
        for host in self.addresses:
            namespace = self.namespace(host)
            if namespace in existing:
                _end(_ip("netns", "pids", namespace, check=False).split())
                _ip("netns", "del", namespace, check=False)
            _ip("link", "del", namespace, check=False)  # the bridge's end, if left
        _ip("link", "del", self.bridge, check=False)

    def partition(self, host: str) -> None:
        """Cut ``host`` from the other hosts, both ways; the caller still reaches it."""
        for peer in self.addresses:
            if peer != host:
                self._cut(self.namespace(host), self.addresses[peer])
                self._cut(self.namespace(peer), self.addresses[host])

    def isolate(self, host: str) -> None:
        """Cut ``host`` from everyone: the other hosts and the caller."""
        self.partition(host)
        self._cut(self.namespace(host), self.gateway)
        self._cut(None, self.addresses[host])

    def heal(self) -> None:
        """Remove every cut: each host reaches every other and the caller again."""
        for namespace in [None, *map(self.namespace, self.addresses)]:
            where = ["-n", namespace] if namespace else []
            for line in _ip(*where, "route", "show", "type", "blackhole").splitlines():
                address = line.split()[1] if line.startswith("blackhole ") else ""
                if address.split("/")[0] in [*self.addresses.values(), self.gateway]:
                    _ip(*where, "route", "del", "blackhole", address)

    def _cut(self, namespace: str | None, address: str) -> None:
        where = ["-n", namespace] if namespace else []
        _ip(*where, "route", "replace", "blackhole", f"{address}/32")


def _ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)} failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()}")
    return done.stdout


def _end(pids: Sequence[str], timeout: float = 10.0) -> None:
    """SIGTERM the processes ``pids`` (left in a namespace of ours), SIGKILL what is left."""
    numbers = [int(pid) for pid in pids if pid.isdigit()]
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for pid in numbers:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while any(alive(pid) for pid in numbers) and time.monotonic() < deadline:
            time.sleep(0.1)  # another process's exit cannot be waited on
        numbers = [pid for pid in numbers if alive(pid)]
        if not numbers:
            return
