"""Deposits flowing through a RabbitMQ cluster while its busiest node fails: the flow that
tests/test_rabbitmq_cluster.py (nodes killed and stopped) and
tests/test_rabbitmq_partitions.py (nodes cut off the network) run, and what it checks:
every deposit took effect exactly once, nothing left in a queue."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import pytest

from idembus import Endpoint
from idembus.routing import Router
from idembus.sending import Bus
from idembus.testing.cluster import RabbitCluster
from idembus.transports.errors import TransportUnavailable
from idembus.transports.kombu import KombuTransport
from idembus.transports.kombu_core import GROUP_SIZE
from tests.conftest import IN_CI, require_marked
from tests.support import Account, AccountHandler, Deposit, Ledger, SignalCounter

log = logging.getLogger(__name__)
ACCOUNTS = 10


@dataclass(frozen=True)
class Fault:
    """What happens to the node leading the most queues while deposits flow: ``cause``
    (given the node's name), then, once a deposit sent after it was handled, ``repair``,
    which returns once the node is a member of the cluster again."""

    name: str
    cause: Callable[[str], None]
    repair: Callable[[str], None]


def require_rabbitmq_server() -> None:
    """Skip the test (fail it under CI=true) if RabbitMQ is not installed."""
    if shutil.which("rabbitmq-server") is None and not os.path.exists(
            "/usr/lib/rabbitmq/bin/rabbitmq-server"):
        if IN_CI:
            pytest.fail("rabbitmq-server is not installed; under CI=true it must be")
        pytest.skip("rabbitmq-server is not installed")


Started = TypeVar("Started", bound=RabbitCluster)


def started(cluster: Started) -> Iterator[Started]:
    """Start ``cluster``, yield it, then stop it and remove its files, whatever happened:
    the body of a ``cluster`` fixture."""
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop(remove=True)


def open_vhost(cluster: RabbitCluster) -> Iterator[str]:
    """A virtual host of one test on ``cluster`` (its queues go with it), every node
    running first: the body of a ``vhost`` fixture."""
    for node in cluster.nodes:  # what an earlier test that failed midway left down
        if cluster.pid(node) is None:
            cluster.start_node(node)
    name = f"test-{uuid.uuid4().hex[:8]}"
    cluster.add_vhost(name)
    require_marked(cluster.urls(name)[0], "the RabbitMQ cluster")
    yield name
    if cluster.running():
        cluster.ctl(cluster.running()[0], "delete_vhost", name, check=False)


def replicated(cluster: RabbitCluster, vhost: str, query: str = "") -> KombuTransport:
    """A transport to every node (``query`` added to each URL: ``?heartbeat=5``), its
    quorum queues on all three."""
    return KombuTransport([url + query for url in cluster.urls(vhost)],
                          queue_arguments={GROUP_SIZE: 3})


@dataclass
class Sender:
    """Sends deposits from a thread, each again with the same id until the cluster takes it
    (an outage is waited out, as a sender of a real system would): at least ``count``, and
    on until ``stop`` is set."""

    bus: Bus
    count: int
    #: Deposits a second at most: a steady flow, not a burst that is over before the kill.
    rate: float = 100.0
    stop: threading.Event = field(default_factory=threading.Event)
    ids: list[str] = field(default_factory=list)
    retries: int = 0
    error: BaseException | None = None
    progress: threading.Condition = field(default_factory=threading.Condition)

    def wait_for(self, sent: int, timeout: float) -> bool:
        """True once ``sent`` deposits were sent (or the sender ended)."""
        with self.progress:
            return self.progress.wait_for(
                lambda: len(self.ids) >= sent or self.error is not None, timeout)

    def run(self) -> None:
        try:
            number = 0
            started = time.monotonic()
            while number < self.count or not self.stop.is_set():
                ahead = started + number / self.rate - time.monotonic()
                if ahead > 0:
                    self.stop.wait(ahead)  # the pace of the flow, not a synchronisation
                message_id = str(uuid.uuid4())
                deposit = Deposit(account=f"acc-{number % ACCOUNTS}", amount=1)
                deadline = time.monotonic() + 120
                while True:
                    try:
                        self.bus.send(deposit, message_id=message_id)
                        break
                    except TransportUnavailable:
                        if time.monotonic() > deadline:
                            raise
                        self.retries += 1
                        time.sleep(0.2)  # the backoff of a sender waiting out an outage
                with self.progress:
                    self.ids.append(message_id)
                    self.progress.notify_all()
                number += 1
        except BaseException as exc:  # reported by the test
            with self.progress:
                self.error = exc
                self.progress.notify_all()


class HandledAt:
    """When an endpoint first handled each message (time.monotonic)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._at: dict[str, float] = {}
        self._condition = threading.Condition()
        endpoint.signals.handled.connect(self._on_handled, weak=False)

    def _on_handled(self, sender: object, message_id: str, **details: object) -> None:
        with self._condition:
            self._at.setdefault(message_id, time.monotonic())
            self._condition.notify_all()

    def wait_for(self, message_id: str, timeout: float) -> float | None:
        """When ``message_id`` was handled; None if it was not within ``timeout``."""
        with self._condition:
            self._condition.wait_for(lambda: message_id in self._at, timeout)
            return self._at.get(message_id)


def run_through_faults(cluster: RabbitCluster, vhost: str, deposits: int,
                       chaos: Sequence[Fault], query: str = "") -> dict[str, float]:
    """Deposits flowing from a sender through Sales (AccountHandler) to a Ledger while
    each fault of ``chaos`` happens to the node leading the most queues, and is repaired;
    checks that every deposit took effect once and returns the seconds from each fault
    to the first deposit sent after it being handled. ``query`` is added to every URL."""
    ledger = Ledger()
    sales = Endpoint("sales", transport=replicated(cluster, vhost, query),
                     handlers=[AccountHandler], error_queue="error", status_interval=0)
    billing = Endpoint("billing", transport=replicated(cluster, vhost, query),
                       handlers=[ledger], error_queue="error", status_interval=0)
    recorded = SignalCounter(billing, "handled")
    handled = HandledAt(sales)
    sending = KombuTransport([url + query for url in cluster.urls(vhost)])
    sender = Sender(Bus("test-sender", Router({Deposit: "sales"}), sending.dispatch),
                    deposits)
    thread = threading.Thread(target=sender.run, name="sender", daemon=True)
    recovery: dict[str, float] = {}
    try:
        sales.start()
        billing.start()
        thread.start()
        step = deposits // (len(chaos) + 1)
        for number, fault in enumerate(chaos, start=1):
            # Given deposits flowing through the node that leads the queues
            assert sender.wait_for(step * number, timeout=180), "the sender is stuck"
            victim = cluster.busiest_leader(vhost)
            # When that node fails ...
            lost_at = time.monotonic()
            fault.cause(victim)
            sent_before = len(sender.ids)
            # ... then a deposit sent after that is handled through the surviving nodes
            assert sender.wait_for(sent_before + 1, timeout=180), "nothing sent after it"
            first_after = sender.ids[sent_before]
            handled_again = handled.wait_for(first_after, timeout=180)
            assert handled_again is not None, f"nothing handled after the {fault.name}"
            recovery[f"{fault.name} {victim}"] = handled_again - lost_at
            if number == len(chaos):
                sender.stop.set()  # the last deposits flow while the node restarts
            # ... and the node, repaired, rejoins the cluster
            fault.repair(victim)
        thread.join(timeout=300)
        assert not thread.is_alive() and sender.error is None, sender.error
        sent = len(sender.ids)
        # Then every deposit took effect exactly once, downstream too
        assert recorded.wait_for(sent, timeout=180), (
            f"{recorded.count} of {sent} deposits reached the ledger")
        for number in range(ACCOUNTS):
            expected = len(range(number, sent, ACCOUNTS))
            state = Account.model_validate(sales.storage.load("Account", f"acc-{number}").state)
            assert (state.balance, state.deposits) == (expected, expected)
        outgoing = [entry[0] for entry in ledger.entries]
        assert len(outgoing) == len(set(outgoing)) == sent
        assert sales.transport.pending("sales") == 0
        assert sales.transport.pending("error") == 0
    finally:
        sender.count = 0  # a test that failed midway stops sending at once
        sender.stop.set()
        thread.join(timeout=60)
        sending.close()
        sales.close()
        billing.close()
    log.warning("failover: %s (deposits: %d, sender retries: %d)", recovery,
                len(sender.ids), sender.retries)
    return recovery
