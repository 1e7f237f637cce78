"""One torture run, from creating the tables to dropping them.

1. create the deployment's tables; start the three supervisors; wait for every worker;
2. start killing workers; send the orders (at half of them, restart the broker);
3. wait until every order is shipped; stop killing; wait until the broker is back and the
   queues are empty with every consumer connected;
4. SIGTERM the supervisors (they must exit 0); read the stores and the error queue;
5. whatever happened: stop the chaos, start the broker if its restart was interrupted, stop
   the supervisors, delete the queues and exchange and drop the tables.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from samples.ordering.deployment import ENDPOINTS, Deployment
from samples.torture.chaos import BrokerRestart, WorkerKiller
from samples.torture.cluster import ClusterChaos, PostgresFailover, start_cluster, start_pair
from samples.torture.driver import Driver, DriverStats, Plan
from samples.torture.options import Options
from samples.torture.postgres import PgCtlcluster, TableProbe
from samples.torture.quiescence import wait_until_drained, wait_until_shipped
from samples.torture.rabbitmq import QueueProbe, Rabbitmqctl
from samples.torture.report import (
    TortureReport,
    counted,
    gateway_calls,
    make_report,
    read_stores,
    shipped_orders,
)
from samples.torture.workers import Supervisors

log = logging.getLogger(__name__)

#: Seconds between the workers' status reports: a killed worker's counts since its last
#: report are lost, so the counters in the notes are at most this far behind.
STATUS_INTERVAL = 1.0
#: Seconds the workers may take to start, and to be back after the chaos stopped.
STARTUP_TIMEOUT = 120.0
RECOVERY_TIMEOUT = 120.0
#: Seconds the cluster's chaos may still take once the orders are shipped: restarting a
#: RabbitMQ node took 35 to 90 s on a busy two-core machine, and it happens twice.
CLUSTER_RECOVERY_TIMEOUT = 600.0


class CannotRun(Exception):
    """The run cannot start here (for instance, rabbitmqctl cannot reach the node)."""


@dataclass
class Outcome:
    """What a run found: the report, what is off, and notes for a post-mortem."""

    report: TortureReport
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def torture(options: Options) -> Outcome:
    """Run the torture test described by ``options``; see the module docstring. With
    ``options.cluster``, on three RabbitMQ nodes and a PostgreSQL primary and standby
    started for the run (:mod:`.cluster`), PostgreSQL failed over once."""
    if not options.cluster:
        return _torture(options, None)
    cluster = start_cluster()
    try:
        pair = start_pair()
        try:
            failover = PostgresFailover(pair)
            on_cluster = dataclasses.replace(options, transport=cluster.failover_url(),
                                             postgres=pair.url, broker_restart=False)
            outcome = _torture(on_cluster, ClusterChaos(
                cluster, extra_steps=[("pg_failovers", failover)]))
            outcome.notes += failover.notes()
            return outcome
        finally:
            pair.stop()
    finally:
        cluster.stop(remove=True)


def _torture(options: Options, chaos: ClusterChaos | None) -> Outcome:
    deployment = Deployment(options.transport, options.postgres,
                            namespace=f"torture_{uuid.uuid4().hex[:8]}",
                            defer_fresh_redispatch=options.defer_fresh_redispatch,
                            status_interval=STATUS_INTERVAL,
                            visibility_timeout=options.visibility_timeout)
    control = _broker_control(options, deployment)
    log_dir = pathlib.Path(options.log_dir or tempfile.mkdtemp(prefix="idembus-torture-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    restart: BrokerRestart | ClusterChaos | None = (
        chaos if chaos is not None else BrokerRestart(control) if options.broker_restart
        else None)
    supervisors = Supervisors(deployment, workers=options.workers, log_dir=log_dir)
    killer = WorkerKiller(supervisors.worker_pids, interval=options.kill_interval,
                          seed=options.seed)
    plan = Plan.make(options.orders, options.duplicate_count, seed=options.seed)
    began = time.monotonic()
    log.info("namespace %s, logs in %s", deployment.namespace, log_dir)
    try:
        deployment.migrate()
        outcome = _run(options, deployment, supervisors, killer, restart, plan,
                       deadline=began + options.timeout)
    finally:
        killer.stop()
        if restart is not None:
            restart.join(RECOVERY_TIMEOUT)
            restart.ensure_up()
        if supervisors.running:
            supervisors.stop()
        if not options.keep:
            _drop(deployment)
    outcome.notes.append(f"took {time.monotonic() - began:.1f}s; namespace "
                         f"{deployment.namespace}; logs in {log_dir}")
    if outcome.ok and options.log_dir is None and not options.keep:
        shutil.rmtree(log_dir, ignore_errors=True)
    return outcome


def _broker_control(options: Options, deployment: Deployment) -> Rabbitmqctl | PgCtlcluster:
    """What restarts the broker: rabbitmqctl, or pg_ctlcluster when the queues are in
    PostgreSQL. Raises :class:`CannotRun` if a restart is wanted and it cannot act."""
    if deployment.broker().kind == "postgresql":
        control: Rabbitmqctl | PgCtlcluster = PgCtlcluster(options.transport, options.pg_cluster)
        refusal = ("pg_ctlcluster cannot act on the PostgreSQL cluster of --transport: run as "
                   "root (or the postgres user), name it with --pg-cluster, or pass "
                   "--no-broker-restart")
    else:
        control = Rabbitmqctl(options.rabbitmqctl)
        refusal = (f"{options.rabbitmqctl} cannot reach the broker's node: run as root (or "
                   "the rabbitmq user) or pass --no-broker-restart")
    if options.broker_restart and not control.usable():
        raise CannotRun(refusal)
    return control


def _probe(options: Options, deployment: Deployment) -> QueueProbe | TableProbe:
    """What tells the depths and consumers of the queues."""
    broker = deployment.broker()
    if broker.kind == "postgresql":
        return TableProbe(options.transport, broker.table_prefix)
    return QueueProbe(options.transport)


def _drop(deployment: Deployment) -> None:
    """Delete the queues and exchange and drop the tables; a failure is logged, not raised
    (it must not hide what went wrong before)."""
    try:
        deployment.drop()
    except Exception:
        log.exception("cleaning up namespace %s failed; drop its queues and tables by hand",
                      deployment.namespace)


def _run(options: Options, deployment: Deployment, supervisors: Supervisors,
         killer: WorkerKiller, restart: BrokerRestart | ClusterChaos | None, plan: Plan, *,
         deadline: float) -> Outcome:
    problems: list[str] = []
    probe = _probe(options, deployment)
    endpoint_queues = [deployment.queue(name) for name in ENDPOINTS]

    supervisors.start()
    if not supervisors.wait_started(STARTUP_TIMEOUT):
        problems.append(f"the {len(ENDPOINTS) * options.workers} workers did not all start "
                        f"within {STARTUP_TIMEOUT:.0f}s")
    else:
        log.info("%d workers started", len(ENDPOINTS) * options.workers)

    killer.start()
    stats = _send(options, deployment, plan, restart, deadline)
    shipping = deployment.storage("shipping")
    try:
        if not wait_until_shipped(lambda: shipped_orders(shipping), options.orders, probe,
                                  endpoint_queues, deadline=deadline):
            problems.append("not every order was shipped")
    finally:
        shipping.close()
    kills = killer.stop()

    if restart is not None and not restart.join(
            CLUSTER_RECOVERY_TIMEOUT if isinstance(restart, ClusterChaos) else RECOVERY_TIMEOUT):
        problems.append("the broker restart did not finish")
    if isinstance(restart, ClusterChaos):
        if restart.error is not None:
            problems.append(f"the cluster chaos failed: {restart.error}")
        problems += [f"not replicated on every node: {queue}"
                     for queue in restart.unreplicated([*endpoint_queues, deployment.error_queue])]
    recovery = min(deadline, time.monotonic() + RECOVERY_TIMEOUT)
    consumers = options.workers * deployment.concurrency
    if not wait_until_drained(probe, endpoint_queues, consumers=consumers, deadline=recovery):
        problems.append(f"the queues did not settle empty with {consumers} consumers each")
    problems += supervisors.shortfall()

    logs = [supervisor.log for supervisor in supervisors.running]
    statuses = supervisors.stop()
    for endpoint, status in statuses.items():
        if status != 0:
            problems.append(f"the supervisor of {endpoint} exited with status {status}")

    error_queue = probe.status([deployment.error_queue]).get(deployment.error_queue)
    stores, history = read_stores(deployment, plan.order_ids, plan.commands())
    report = make_report(stores, orders=options.orders, kills=kills, history=history,
                         broker_restarts=restart.restarts if restart else 0,
                         error_queue=error_queue.messages if error_queue else 0,
                         cluster=restart.figures() if isinstance(restart, ClusterChaos)
                         else ())
    problems += report.failures(broker_restart_expected=options.broker_restart,
                                kills_expected=options.kill_interval > 0)
    notes = [
        f"driver: {stats.sent} publishes, {stats.retries} retried",
        f"gateway: {gateway_calls(deployment)} calls for {stores.charges} charges",
        f"workers: {sum(w.count('exited with status') for w in logs)} deaths seen by the "
        f"supervisors, {sum(w.count(' ERROR ') for w in logs)} ERROR log lines, "
        f"{sum(w.count('Traceback') for w in logs)} tracebacks",
    ]
    notes.append(f"history: {sum(history.commits.values())} commits checked ("
                 + ", ".join(f"{name} {count}" for name, count in history.commits.items())
                 + f"), {len(history.violations)} violations")
    notes.append("counters (status reports; a killed worker's last second is lost): "
                 + counted(deployment))
    if isinstance(restart, ClusterChaos):
        notes.append(f"cluster: the killed node was a member again after "
                     f"{restart.outage:.1f}s")
    elif restart is not None:
        notes.append(f"broker: down for {restart.outage:.1f}s")
    if stats.unexpected_errors:
        problems.append(f"the transport raised {len(stats.unexpected_errors)} errors other "
                        f"than TransportUnavailable, first: {stats.unexpected_errors[0]}")
    problems += [line.strip() for line in history.described()]
    if stores.lost_orders:
        notes.append(f"lost orders: {', '.join(stores.lost_orders[:20])}")
    if stores.doubled_orders:
        notes.append(f"orders with a double effect: {', '.join(stores.doubled_orders[:20])}")
    return Outcome(report, problems, notes)


def _send(options: Options, deployment: Deployment, plan: Plan,
          restart: BrokerRestart | ClusterChaos | None, deadline: float) -> DriverStats:
    driver = Driver(deployment.transport, deployment.queue("sales"), plan.sends,
                    halfway=restart.begin if restart else None,
                    give_up_after=max(60.0, deadline - time.monotonic()))
    stats = driver.run()
    log.info("sent %d PlaceOrder (%d orders, %d twice), %d publishes retried",
             stats.sent, options.orders, options.duplicate_count, stats.retries)
    return stats
