"""The network of namespaces that the partition tests cut (idembus.testing.netns): who
reaches whom after partition, isolate and heal, and that nothing is left behind.

Needs root; skipped otherwise (IDEMBUS_REQUIRE_NETNS=1: failed instead)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from idembus.testing.netns import Network, unavailable
from idembus.testing.processes import alive

PORT = 7777
LISTEN = ("import socket, sys\n"
          "server = socket.socket(); server.bind((sys.argv[1], int(sys.argv[2])))\n"
          "server.listen(16); print('ready', flush=True)\n"
          "while True: server.accept()[0].close()\n")
CONNECT = ("import socket, sys\n"
           "socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.0).close()\n")


@pytest.fixture
def network() -> Iterator[Network]:
    """Three hosts (a subnet and prefix of this process: xdist workers run in parallel)
    with a listener on each, and on the caller's side of the bridge; all removed after."""
    reason = unavailable()
    if reason is not None:
        if os.environ.get("IDEMBUS_REQUIRE_NETNS") == "1":
            pytest.fail(f"{reason}; IDEMBUS_REQUIRE_NETNS=1 says they must work here")
        pytest.skip(reason)
    number = os.getpid() % 200 + 20
    made = Network(["a", "b", "c"], prefix=f"idbt{number}", subnet=f"10.79.{number}.0/24")
    listeners: list[subprocess.Popen[str]] = []
    try:
        made.create()
        for host, address in made.addresses.items():
            listeners.append(subprocess.Popen(
                made.run_in(host, [sys.executable, "-c", LISTEN, address, str(PORT)]),
                stdout=subprocess.PIPE, text=True))
            assert listeners[-1].stdout is not None
            assert listeners[-1].stdout.readline() == "ready\n"
        with socket.socket() as server:
            server.bind((made.gateway, PORT))
            server.listen(16)
            yield made
    finally:
        made.destroy()  # ends the listeners too
        for listener in listeners:
            listener.wait(timeout=30)
            if listener.stdout is not None:
                listener.stdout.close()


def reaches(network: Network, source: str | None, target: str) -> bool:
    """Whether host ``source`` (None: the caller) opens a connection to host ``target``
    (``caller``: the caller's address on the bridge) within a second."""
    address = network.gateway if target == "caller" else network.addresses[target]
    if source is None:
        try:
            socket.create_connection((address, PORT), timeout=1.0).close()
            return True
        except OSError:
            return False
    done = subprocess.run(network.run_in(source, [sys.executable, "-c", CONNECT, address,
                                                  str(PORT)]), capture_output=True, timeout=30)
    return done.returncode == 0


def reachable(network: Network) -> set[tuple[str, str]]:
    """Every (source, target) pair that connects; the caller is ``caller``."""
    hosts = list(network.addresses)
    pairs = {(source, target) for source in hosts for target in [*hosts, "caller"]
             if source != target}
    pairs |= {("caller", target) for target in hosts}
    return {(source, target) for source, target in pairs
            if reaches(network, None if source == "caller" else source, target)}


EVERYONE = {("a", "b"), ("a", "c"), ("b", "a"), ("b", "c"), ("c", "a"), ("c", "b"),
            ("a", "caller"), ("b", "caller"), ("c", "caller"),
            ("caller", "a"), ("caller", "b"), ("caller", "c")}


def test_a_partition_cuts_a_host_from_its_peers_only_and_heal_undoes_it(network):
    assert reachable(network) == EVERYONE

    network.partition("a")
    assert reachable(network) == EVERYONE - {("a", "b"), ("a", "c"), ("b", "a"), ("c", "a")}

    network.heal()
    assert reachable(network) == EVERYONE


def test_isolate_cuts_a_host_from_everyone_the_caller_too(network):
    network.isolate("b")
    assert reachable(network) == {("a", "c"), ("c", "a"), ("a", "caller"), ("c", "caller"),
                                  ("caller", "a"), ("caller", "c")}

    network.heal()
    assert reachable(network) == EVERYONE


def test_destroy_ends_what_runs_in_the_namespaces_and_removes_them(network):
    pids = {namespace: subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                                      text=True, check=True).stdout.split()
            for namespace in map(network.namespace, network.addresses)}
    assert all(len(each) == 1 for each in pids.values()), pids  # the listeners

    network.destroy()

    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(namespace in names for namespace in pids)
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert network.bridge not in links
    assert not any(alive(int(pid)) for each in pids.values() for pid in each)


def test_a_network_refuses_a_prefix_too_long_for_interface_names_or_a_small_subnet():
    with pytest.raises(ValueError, match="1 to 10 characters"):
        Network(["a"], prefix="much-too-long")
    with pytest.raises(ValueError, match="no room for 3 hosts"):
        Network(["a", "b", "c"], subnet="10.77.0.0/30")


def test_without_root_namespaces_are_reported_unavailable(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert unavailable() == "network namespaces need root (CAP_NET_ADMIN)"
