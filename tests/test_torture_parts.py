"""The parts of the torture test that need no broker, database or worker process: the plan
of sends, the driver's retries and the report."""

from __future__ import annotations

from collections import Counter
from typing import Any

from idembus import Backoff
from idembus import headers as h
from idembus.transports.errors import TransportUnavailable
from idembus.transports.kombu import KombuTransport
from samples.ordering.deployment import Deployment
from samples.torture.cluster import ClusterChaos
from samples.torture.driver import Driver, Plan
from samples.torture.options import parse
from samples.torture.report import TortureReport

NO_WAIT = Backoff((0.0,))


def test_the_plan_sends_every_order_once_and_the_duplicates_twice_with_the_same_id():
    plan = Plan.make(500, 100, seed=4)

    assert plan.order_ids == [f"order-{index}" for index in range(500)]
    per_id = Counter(send.message_id for send in plan.sends)
    assert len(per_id) == 500 and sorted(Counter(per_id.values()).items()) == [(1, 400), (2, 100)]
    orders_of = {send.message_id: send.command.order_id for send in plan.sends}
    assert len(set(orders_of.values())) == 500  # one message id per order
    assert plan == Plan.make(500, 100, seed=4)  # the same seed, the same run
    assert plan.commands() == orders_of  # what the history checker takes as sent


def test_some_duplicates_follow_their_first_copy_at_once_and_some_later():
    sends = Plan.make(1000, 200, seed=1).sends
    first_seen: dict[str, int] = {}
    gaps = []
    for position, send in enumerate(sends):
        if send.message_id in first_seen:
            gaps.append(position - first_seen[send.message_id])
        first_seen.setdefault(send.message_id, position)
    assert 50 < sum(gap == 1 for gap in gaps) < 150
    assert sum(gap > 1 for gap in gaps) > 50


class FailingTransport(KombuTransport):
    """memory:// whose first dispatches fail, like a broker that is down, or like a
    transport that fails with an error it should have wrapped."""

    created: list[FailingTransport] = []

    def __init__(self, *, failures: list[Exception]) -> None:
        super().__init__("memory://")
        self.failures = failures
        self.attempts: list[str] = []
        FailingTransport.created.append(self)

    def dispatch(self, envelope: Any) -> None:
        self.attempts.append(envelope.message_id)
        if self.failures:
            raise self.failures.pop(0)
        super().dispatch(envelope)


def declared(queue: str) -> str:
    """``queue``, declared on memory:// (a send to an undeclared queue is refused)."""
    KombuTransport("memory://").declare(queue)
    return queue


def received_ids(queue: str) -> list[str]:
    reader = KombuTransport("memory://")
    ids = []
    while (delivery := reader.get(queue)) is not None:
        ids.append(delivery.headers[h.MESSAGE_ID])
    return ids


def test_the_driver_retries_a_publish_with_the_same_id_while_the_broker_is_down():
    # Given a transport whose first two publishes fail as outages
    transport = FailingTransport(failures=[TransportUnavailable("down"),
                                           TransportUnavailable("still down")])
    plan = Plan.make(3, 0, seed=2)
    halfway = []
    driver = Driver(lambda: transport, declared("sales-test"), plan.sends,
                    halfway=lambda: halfway.append(True), backoff=NO_WAIT)

    # When the driver sends the plan
    stats = driver.run()

    # Then the first message was tried three times with one id, and every message arrived
    first = plan.sends[0].message_id
    assert transport.attempts[:3] == [first, first, first]
    assert received_ids("sales-test") == [send.message_id for send in plan.sends]
    assert (stats.sent, stats.retries, stats.unexpected_errors) == (3, 2, [])
    assert halfway == [True]


def test_the_driver_reports_an_error_the_transport_did_not_wrap_and_carries_on():
    # Given transports of which the first fails with an error that is not an outage
    FailingTransport.created.clear()
    failures = [[AttributeError("'NoneType' object has no attribute 'x'")], []]
    plan = Plan.make(2, 0, seed=3)
    driver = Driver(lambda: FailingTransport(failures=failures.pop(0)), declared("sales-test"),
                    plan.sends, backoff=NO_WAIT)

    # When the driver sends
    stats = driver.run()

    # Then it says so, and sends everything through a new transport
    assert stats.unexpected_errors == ["builtins.AttributeError: 'NoneType' object has no "
                                       "attribute 'x'"]
    assert len(FailingTransport.created) == 2
    assert received_ids("sales-test") == [send.message_id for send in plan.sends]


def report(**changes: int) -> TortureReport:
    figures = dict(orders=10, placed=10, billed=10, shipped=10, charges=10, kills=3,
                   broker_restarts=1, error_queue=0, lost=0, double_effects=0)
    figures.update(changes)
    return TortureReport(**figures)


def test_the_report_line_lists_the_figures_in_the_order_of_the_issue():
    assert report().line() == ("orders=10 placed=10 billed=10 shipped=10 charges=10 kills=3 "
                               "broker_restarts=1 error_queue=0 lost=0 double_effects=0 "
                               "history_violations=0")
    assert report().failures(broker_restart_expected=True, kills_expected=True) == []


def test_the_report_names_every_figure_that_is_off():
    bad = report(shipped=9, charges=11, error_queue=1, lost=1, double_effects=1, kills=0,
                 broker_restarts=0, history_violations=2)
    assert bad.failures(broker_restart_expected=True, kills_expected=True) == [
        "shipped=9, expected 10", "charges=11, expected 10", "error_queue=1, expected 0",
        "lost=1, expected 0", "double_effects=1, expected 0", "history_violations=2, expected 0",
        "broker_restarts=0, expected 1", "no worker was killed",
    ]
    assert report(kills=0, broker_restarts=0).failures(
        broker_restart_expected=False, kills_expected=False) == []


def test_a_cluster_run_lists_its_node_kills_and_stops_after_the_broker_restarts():
    cluster = TortureReport(**{**vars(report(broker_restarts=0)),
                               "cluster": (("node_kills", 1), ("node_stops", 1))})

    assert cluster.line() == ("orders=10 placed=10 billed=10 shipped=10 charges=10 kills=3 "
                              "broker_restarts=0 node_kills=1 node_stops=1 error_queue=0 "
                              "lost=0 double_effects=0 history_violations=0")
    assert cluster.failures(broker_restart_expected=False, kills_expected=True) == []
    stalled = TortureReport(**{**vars(cluster), "cluster": (("node_kills", 0),)})
    assert stalled.failures(broker_restart_expected=False, kills_expected=True) == [
        "node_kills=0, expected at least 1"]


class FakeCluster:
    """The nodes of a cluster as :class:`ClusterChaos` drives them, in a journal."""

    nodes = ("a", "b", "c")

    def __init__(self) -> None:
        self.journal: list[str] = []
        self.down: set[str] = set()

    def busiest_leader(self) -> str:
        return "b"

    def kill_node(self, name: str) -> None:
        self.down.add(name)
        self.journal.append(f"kill {name}")

    def stop_node(self, name: str) -> None:
        self.down.add(name)
        self.journal.append(f"stop {name}")

    def start_node(self, name: str) -> None:
        self.down.discard(name)
        self.journal.append(f"start {name}")

    def await_members(self) -> None:
        self.journal.append("members")


def test_the_cluster_chaos_fails_postgresql_over_while_the_killed_node_is_down():
    cluster = FakeCluster()
    chaos = ClusterChaos(cluster, extra_steps=[  # type: ignore[arg-type]
        ("pg_failovers", lambda: cluster.journal.append(f"failover, down: {cluster.down}"))])

    chaos.begin()
    assert chaos.join(10)

    assert chaos.error is None
    assert cluster.journal == ["kill b", "failover, down: {'b'}", "start b", "members",
                               "stop b", "start b", "members"]
    assert chaos.figures() == (("node_kills", 1), ("node_stops", 1), ("pg_failovers", 1))


def test_the_deployment_derives_every_name_from_its_namespace():
    deployment = Deployment.from_environment({"ORDERING_NAMESPACE": "shop1",
                                              "ORDERING_TRANSPORT": "memory://"})
    assert deployment.queues == ["sales-shop1", "billing-shop1", "shipping-shop1",
                                 "error-shop1"]
    assert deployment.exchange == "idembus.events-shop1"
    assert Deployment.from_environment(deployment.environment()) == deployment


def test_the_command_line_defaults_are_the_issues():
    options = parse(["--orders", "100"])
    assert (options.orders, options.duplicates, options.workers, options.kill_interval,
            options.broker_restart) == (100, 0.2, 3, 2.0, True)
    assert options.duplicate_count == 20
    assert parse(["--no-broker-restart"]).broker_restart is False
