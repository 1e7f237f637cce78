"""The three kinds of transport on the ordering flow, measured in one run.

What is measured
================
* **Throughput of the ordering flow as it is deployed** (``samples.ordering.deployment``:
  Sales handles PlaceOrder and publishes OrderPlaced, Billing charges through a gateway
  table and publishes OrderBilled, Shipping publishes OrderShipped), each endpoint run by
  ``idembus run --workers W --concurrency C``, every endpoint on PostgreSQL storage, with
  the queues

  - ``rabbitmq``: in RabbitMQ (quorum queues, publisher confirms, the outbox's marks);
  - ``postgresql``: in the storage's PostgreSQL database (the PostgreSQL transport):
    commit, send and acknowledgement in one transaction (``idembus.runtime.shared_transaction``);
  - ``postgresql-outbox``: the same tables, ``shared_transactions=False``: commit, then
    insert, mark and delete, as with a broker.

  Orders per second from the first PlaceOrder sent (by this process) to the last order
  shipped (its Shipment row), after a warm-up, on workers started beforehand.
* **The same flow in one process** (``samples.ordering.system``: every endpoint a set of
  threads of this process), on RabbitMQ, the PostgreSQL transport and the MongoDB
  transport on mongomock — the only way mongomock can run (no MongoDB server can be
  installed here: not a server's figure). In one process the GIL puts the threads of all
  three endpoints in one line, and the transport that makes more round trips per message
  pays more for it than it would in processes.
* **Idle pick-up latency**: a consumer that has waited idle for a while, a message sent to
  it, the time until its callback runs — p50 and p95 of ``--samples`` sends, 50 ms
  apart — and the CPU time the consumer's thread used during two seconds of idleness.

Rounds interleave the variants, the order rotating, so that a disturbance of the machine
does not hit one only; the figure is the median of the rounds, and a ratio to RabbitMQ is
the median of the per-round ratios. Run ``python -m bench.database_queues`` (``make
bench``); results also go to ``bench/results/database_queues.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import psycopg

from bench.common import AMQP_URL
from bench.pg_common import POSTGRES_URL
from idembus import headers as h
from idembus.envelope import Envelope
from idembus.storage.base import Storage
from idembus.storage.postgres import PostgresStorage
from idembus.transports.base import Delivery, Transport
from samples.ordering.brokers import Broker
from samples.ordering.deployment import Deployment
from samples.ordering.messages import PlaceOrder
from samples.ordering.system import OrderingSystem, build
from samples.torture.workers import Supervisors

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "database_queues.json"
#: A variant: name, transport URL, mongomock, shared transactions.
Variant = tuple[str, str, bool, bool]
#: The variants run as deployed (worker processes).
DEPLOYED: list[Variant] = [
    ("rabbitmq", AMQP_URL, False, True),
    ("postgresql", POSTGRES_URL, False, True),
    ("postgresql-outbox", POSTGRES_URL, False, False),
]
#: The variants run in one process (mongomock can only run so).
IN_PROCESS: list[Variant] = [
    ("rabbitmq", AMQP_URL, False, True),
    ("postgresql", POSTGRES_URL, False, True),
    ("mongodb-mongomock", "mongodb://127.0.0.1:27017/bench", True, True),
]
WARMUP = 40


@dataclass(frozen=True)
class Round:
    """One timed run of one variant."""

    variant: str
    orders: int
    seconds: float

    @property
    def per_second(self) -> float:
        return self.orders / self.seconds


def flow(name: str, url: str, mongomock: bool, shared: bool, *, orders: int,
         concurrency: int) -> Round:
    """Time ``orders`` orders through the ordering flow on one variant (fresh namespace)."""
    namespace = f"bq{uuid.uuid4().hex[:8]}"
    options: dict[str, Any] = {} if shared else {"shared_transactions": False}
    broker = Broker(url, namespace, mongomock=mongomock, exchange=f"bench.events.{namespace}",
                    **options)
    storages: list[PostgresStorage] = []

    def storage(endpoint: str) -> Storage:
        storages.append(PostgresStorage(POSTGRES_URL, table_prefix=f"{namespace}_"
                                        f"{endpoint.split('-', 1)[0]}"))
        return storages[-1]

    system = build(broker.transport, namespace=namespace, storage=storage,
                   concurrency=concurrency)
    shipped = _Counter(system)
    try:
        system.start()
        _place(system, "warm", WARMUP)
        shipped.wait(WARMUP)
        started = time.perf_counter()
        _place(system, "timed", orders)
        shipped.wait(WARMUP + orders)
        seconds = time.perf_counter() - started
    finally:
        system.close()
        broker.clean([endpoint.name for endpoint in system.endpoints]
                     + [system.sales.error_queue])
        for made in storages:
            dropper = PostgresStorage(made.conninfo, table_prefix=made.table_prefix)
            dropper.drop_tables()
            dropper.close()
    return Round(name, orders, seconds)


class _Counter:
    """Counts the orders Shipping handled."""

    def __init__(self, system: OrderingSystem) -> None:
        self.count = 0
        self._changed = threading.Condition()
        system.shipping.signals.handled.connect(self._handled, weak=False)

    def _handled(self, sender: object, **details: Any) -> None:
        with self._changed:
            self.count += 1
            self._changed.notify_all()

    def wait(self, count: int, timeout: float = 600.0) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: self.count >= count, timeout):
                raise TimeoutError(f"{self.count} of {count} orders shipped in {timeout}s")


def _place(system: OrderingSystem, prefix: str, orders: int) -> None:
    for index in range(orders):
        system.sales.bus.send(PlaceOrder(order_id=f"{prefix}-{index}",
                                         customer=f"c-{index % 17}", amount_cents=100 + index))


# -- the same flow in worker processes ----------------------------------------------------------


def deployed_flow(name: str, url: str, *, orders: int, workers: int, concurrency: int,
                  log_dir: pathlib.Path, shared: bool = True) -> Round:
    """Time ``orders`` orders through ``samples.ordering.deployment`` run as it is deployed:
    ``idembus run --workers`` per endpoint, on PostgreSQL storage, the queues in ``url``
    (RabbitMQ, or the same PostgreSQL database); the orders sent from this process."""
    deployment = Deployment(url, POSTGRES_URL, namespace=f"bd{uuid.uuid4().hex[:8]}",
                            concurrency=concurrency, status_interval=60.0,
                            shared_transactions=shared)
    supervisors = Supervisors(deployment, workers=workers, log_dir=log_dir)
    deployment.migrate()
    try:
        supervisors.start()
        if not supervisors.wait_started(120):
            raise RuntimeError(f"the workers of {name} did not start")
        _drive(deployment, "warm", WARMUP)
        started = time.perf_counter()
        _drive(deployment, "timed", orders)
        seconds = time.perf_counter() - started
    finally:
        supervisors.stop()
        deployment.drop()
    return Round(name, orders, seconds)


def _drive(deployment: Deployment, prefix: str, orders: int) -> None:
    """Send ``orders`` PlaceOrder to the deployment; return once all are shipped."""
    transport = deployment.transport()
    try:
        for index in range(orders):
            transport.send(Envelope({h.MESSAGE_ID: str(uuid.uuid4()),
                                     h.MESSAGE_TYPE: "sales.PlaceOrder",
                                     h.INTENT: h.Intent.SEND.value},
                                    PlaceOrder(order_id=f"{prefix}-{index}",
                                               customer=f"c-{index % 17}",
                                               amount_cents=100 + index).model_dump_json(),
                                    deployment.queue("sales")))
    finally:
        transport.close()
    table = f"{deployment.namespace}_shipping_aggregates"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            row = connection.execute(f"SELECT count(*) FROM {table} WHERE aggregate_id LIKE %s",
                                     (f"{prefix}-%",)).fetchone()
            if row and row[0] >= orders:
                return
            time.sleep(0.01)  # polling other processes' work: no event to wait on
    raise TimeoutError(f"{prefix}: not every order was shipped in 600s")


# -- idle pick-up latency ----------------------------------------------------------------------


def latency(name: str, url: str, mongomock: bool, *, samples: int) -> dict[str, float]:
    """Idle pick-up latency (ms) and the idle consumer's CPU, on one transport."""
    namespace = f"bl{uuid.uuid4().hex[:8]}"
    broker = Broker(url, namespace, mongomock=mongomock, exchange=f"bench.events.{namespace}")
    transport = broker.transport()
    queue = f"latency-{namespace}"
    arrived: list[float] = []
    got = threading.Semaphore(0)

    def record(delivery: Delivery) -> None:
        arrived.append(time.perf_counter())
        delivery.ack()
        got.release()

    stop = threading.Event()
    consumer = threading.Thread(target=transport.consume, args=(queue, record),
                                kwargs={"stop": stop, "prefetch": 16}, daemon=True)
    try:
        transport.declare(queue)
        consumer.start()
        _send(transport, queue)
        got.acquire(timeout=30)
        before = _thread_cpu(consumer)
        time.sleep(2.0)  # idleness measured
        idle_cpu = _thread_cpu(consumer) - before
        waits = []
        for _ in range(samples):
            sent = time.perf_counter()
            _send(transport, queue)
            got.acquire(timeout=30)
            waits.append((arrived[-1] - sent) * 1000)
            time.sleep(0.05)
    finally:
        stop.set()
        consumer.join(10)
        transport.close()
        broker.clean([queue])
    waits.sort()
    return {"p50_ms": statistics.median(waits), "p95_ms": waits[int(len(waits) * 0.95) - 1],
            "idle_cpu_s_per_s": idle_cpu / 2.0}


def _send(transport: Transport, queue: str) -> None:
    transport.send(Envelope({h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "bench.Ping"},
                            "{}", queue))


def _thread_cpu(thread: threading.Thread) -> float:
    stat = pathlib.Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the run ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.database_queues",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", type=int, default=500,
                        help="timed orders per deployed run (500)")
    parser.add_argument("--in-process-orders", type=int, default=300,
                        help="timed orders per run in one process (300)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each variant (3)")
    parser.add_argument("--workers", type=int, default=1,
                        help="worker processes per endpoint (1)")
    parser.add_argument("--concurrency", type=int, default=2,
                        help="consumer threads per endpoint process (2)")
    parser.add_argument("--samples", type=int, default=40,
                        help="messages of the latency measure (40)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="idembus-bench-queues-"))
    deployed: list[Round] = []
    in_process: list[Round] = []
    for number in range(args.rounds):
        for name, url, _, shared in _rotated(DEPLOYED, number):
            done = deployed_flow(name, url, orders=args.orders, workers=args.workers,
                                 concurrency=args.concurrency, log_dir=log_dir, shared=shared)
            deployed.append(done)
            _said("deployed", number, done)
        for name, url, mongomock, shared in _rotated(IN_PROCESS, number):
            done = flow(name, url, mongomock, shared, orders=args.in_process_orders,
                        concurrency=args.concurrency)
            in_process.append(done)
            _said("in one process", number, done)
    latencies = {name: latency(name, url, mongomock, samples=args.samples)
                 for name, url, mongomock, _ in IN_PROCESS}
    summary = {"deployed": _summary(deployed), "in_one_process": _summary(in_process),
               "idle_pickup": {name: {key: round(value, 3) for key, value in found.items()}
                               for name, found in latencies.items()},
               "settings": vars(args)}
    print(json.dumps(summary, indent=2))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"summary": summary, "deployed": [asdict(r) for r in deployed],
                                   "in_one_process": [asdict(r) for r in in_process]},
                                  indent=2))
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def _rotated(variants: list[Variant], number: int) -> list[Variant]:
    shift = number % len(variants)
    return variants[shift:] + variants[:shift]


def _said(kind: str, number: int, done: Round) -> None:
    print(f"round {number + 1} {kind}: {done.variant:<18} {done.per_second:7.1f} orders/s "
          f"({done.orders} in {done.seconds:.2f}s)", file=sys.stderr, flush=True)


def _summary(rounds: list[Round]) -> dict[str, Any]:
    names = list(dict.fromkeys(r.variant for r in rounds))
    by = {name: [r for r in rounds if r.variant == name] for name in names}
    summary: dict[str, Any] = {"orders_per_second": {
        name: round(statistics.median(r.per_second for r in found), 1)
        for name, found in by.items()}}
    baseline = by.get("rabbitmq") or []
    summary["ratio_to_rabbitmq"] = {
        name: round(statistics.median(r.per_second / b.per_second
                                      for r, b in zip(found, baseline, strict=False)), 2)
        for name, found in by.items() if baseline and name != "rabbitmq"}
    return summary


if __name__ == "__main__":
    sys.exit(main())
