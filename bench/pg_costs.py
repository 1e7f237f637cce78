"""``--profile``, first table: the CPU of each step of a message, idembus against the peers.

Each step runs ``count`` times in this process, in one thread, against the real PostgreSQL
and RabbitMQ, and is timed with the thread's CPU clock (and the wall clock beside it): no
profiler distorts it and a busy machine hardly does. idembus' calls are its public ones
(``PostgresStorage.load``/``commit``/``mark_dispatched``, ``KombuTransport.publish``); the
peers' are what :mod:`bench.pg_work` does. The last row is the bus alone — decode, load,
handler, commit, dispatch, ack and signals on MemoryStorage and a transport that does
nothing — i.e. what idembus computes per message besides the drivers.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import kombu
import psycopg
from psycopg_pool import ConnectionPool

from bench.pg_common import AGGREGATE_TYPE, EVENT_NAME, RunNames, aggregate_of
from bench.pg_handlers import CounterHandler, CounterIncremented
from bench.pg_idembus import create_tables, envelopes
from bench.pg_procs import CpuSnapshot
from bench.pg_topology import Broker, Cleanup, create_peer_tables
from idembus.envelope import Envelope
from idembus.routing import Router
from idembus.runtime.endpoint import Endpoint
from idembus.sending import Bus
from idembus.storage.memory import MemoryStorage
from idembus.storage.postgres import PostgresStorage
from idembus.transports.base import Delivery, OnDelivery, Transport
from idembus.transports.kombu import KombuTransport

WARM_UP = 100
KEY = "CounterHandler/{}"


@dataclass
class Cost:
    label: str
    cpu_us: float
    wall_us: float
    #: CPU of PostgreSQL's and RabbitMQ's processes per step, over the whole loop.
    services_us: dict[str, float]


class Timer:
    """Accumulates CPU (this thread's, or with ``process`` all of this process') and wall
    time over the timed parts of a loop."""

    def __init__(self, *, process: bool = False) -> None:
        self.clock = time.process_time if process else time.thread_time
        self.cpu = self.wall = 0.0

    @contextmanager
    def timed(self) -> Iterator[None]:
        cpu, wall = self.clock(), time.perf_counter()
        yield
        self.cpu += self.clock() - cpu
        self.wall += time.perf_counter() - wall


def measure(label: str, step: Callable[[int, Timer], None], count: int, *,
            process: bool = False) -> Cost:
    """Run ``step(i, timer)`` for a warm-up and then ``count`` times; ``step`` times the
    part that counts with ``timer.timed()``."""
    for index in range(WARM_UP):
        step(10_000_000 + index, Timer())
    timer = Timer(process=process)
    before = CpuSnapshot.take([])
    for index in range(count):
        step(index, timer)
    services = before.per_message(CpuSnapshot.take([]), count)
    return Cost(label, timer.cpu / count * 1e6, timer.wall / count * 1e6,
                {name: services[name] for name in ("postgresql", "rabbitmq")})


def event(index: int) -> Envelope:
    captured: list[Envelope] = []
    Bus("bench-costs", Router(), captured.append).publish(
        CounterIncremented(aggregate=aggregate_of(index), n=index))
    return captured[0]


def storage_costs(names: RunNames, count: int) -> list[Cost]:
    storage = PostgresStorage(names.postgres_url, table_prefix=names.table_prefix)
    direct = psycopg.connect(names.postgres_url, autocommit=True)
    pool = ConnectionPool(names.postgres_url, min_size=1, max_size=2,
                          kwargs={"autocommit": True})
    update = f"UPDATE {names.counters_table} SET n = n + 1 WHERE id = %s RETURNING n"
    insert = f"INSERT INTO {names.processed_table} (message_id) VALUES (%s)"

    def load(index: int, timer: Timer) -> None:
        with timer.timed():
            storage.load(AGGREGATE_TYPE, aggregate_of(index), KEY.format(index))

    def load_and_commit(index: int, timer: Timer) -> None:
        outgoing = [events[index % len(events)]]
        with timer.timed():
            loaded = storage.load(AGGREGATE_TYPE, aggregate_of(index), KEY.format(index))
            state = {"n": (loaded.state or {}).get("n", 0) + 1}
            storage.commit(loaded, key=KEY.format(index), state=state, outgoing=outgoing)

    def peer(connection: psycopg.Connection[tuple[object, ...]], prefix: str
             ) -> Callable[[int, Timer], None]:
        def transaction(index: int, timer: Timer) -> None:
            with timer.timed(), connection.transaction():
                connection.execute(update, (aggregate_of(index),)).fetchone()
                connection.execute(insert, (f"{prefix}{index}",))
        return transaction

    def pooled(index: int, timer: Timer) -> None:
        with timer.timed(), pool.connection() as connection:
            peer(connection, "p")(index, Timer())

    def marks(index: int, timer: Timer) -> None:
        with timer.timed():
            storage.mark_dispatched(AGGREGATE_TYPE, aggregate_of(index), KEY.format(index))
            if index % 50 == 49:  # about the batches a worker at ~1000 msgs/s writes
                storage.flush()

    events = [event(index) for index in range(count)]
    try:
        return [
            measure("idembus PostgresStorage.load + commit: SELECT; BEGIN, INSERT, "
                    "UPDATE, COMMIT", load_and_commit, count),
            measure("  of which PostgresStorage.load (SELECT)", load, count),
            measure("  peers: BEGIN, UPDATE .. RETURNING, INSERT, COMMIT", peer(direct, "d"),
                    count),
            measure("  peers' transaction through a psycopg_pool", pooled, count),
            measure("idembus mark_dispatched, batches of 50 (all threads)", marks, count,
                    process=True),
        ]
    finally:
        pool.close()
        direct.close()
        storage.close()


def publish_costs(names: RunNames, count: int) -> list[Cost]:
    transport = KombuTransport(names.amqp_url, exchange=names.exchange)
    connection = kombu.Connection(names.amqp_url, transport_options={"confirm_publish": True})
    producer = kombu.Producer(connection.default_channel)
    events = [event(index) for index in range(count)]

    def idembus(index: int, timer: Timer) -> None:
        with timer.timed():
            transport.publish(events[index % count])

    def raw(small: bool) -> Callable[[int, Timer], None]:
        def publish(index: int, timer: Timer) -> None:
            envelope = events[index % count]
            body = (json.dumps({"aggregate": aggregate_of(index), "n": index}).encode()
                    if small else envelope.body.encode())
            headers = ({"message_id": f"{index}/0", "causation_id": str(index)} if small
                       else dict(envelope.headers))
            with timer.timed():
                producer.publish(body, exchange=names.exchange, routing_key=EVENT_NAME,
                                 headers=headers, content_type="application/json",
                                 content_encoding="utf-8", delivery_mode=2)
        return publish

    try:
        return [
            measure("idembus KombuTransport.publish (confirm)", idembus, count),
            measure("  peers: Producer.publish (confirm)", raw(True), count),
            measure("  Producer.publish of idembus' event (its 9 headers)", raw(False), count),
        ]
    finally:
        connection.close()
        transport.close()


class _NullDelivery(Delivery):
    def _ack(self) -> None:
        return None

    def _requeue(self) -> None:
        return None


class _NullTransport(Transport):
    """Keeps the endpoint's delivery callback and publishes nowhere."""

    def __init__(self) -> None:
        self.on_delivery: OnDelivery | None = None
        self.ready = threading.Event()

    def declare(self, queue: str, *, subscriptions: Collection[str] = ()) -> None:
        return None

    def send(self, envelope: Envelope) -> None:
        return None

    def publish(self, envelope: Envelope) -> None:
        return None

    def consume(self, queue: str, on_delivery: OnDelivery, *, stop: threading.Event,
                prefetch: int = 1) -> None:
        self.on_delivery = on_delivery
        self.ready.set()
        stop.wait()

    def get(self, queue: str) -> Delivery | None:
        return None

    def pending(self, queue: str) -> int:
        return 0


def bus_cost(names: RunNames, count: int) -> Cost:
    transport = _NullTransport()
    endpoint = Endpoint(names.input_queue, transport=transport, storage=MemoryStorage(),
                        handlers=[CounterHandler], error_queue=names.error_queue)
    messages = list(envelopes(names, range(count + WARM_UP)))
    endpoint.start()
    try:
        transport.ready.wait(10)
        assert transport.on_delivery is not None
        deliver = transport.on_delivery

        def handle(index: int, timer: Timer) -> None:
            envelope = messages[index % len(messages)]
            delivery = _NullDelivery(queue=names.input_queue, headers=dict(envelope.headers),
                                     body=envelope.body.encode(),
                                     content_type="application/json", redelivered=False)
            with timer.timed():
                deliver(delivery)

        return measure("idembus bus alone: MemoryStorage, no broker", handle, count)
    finally:
        endpoint.close()


def costs(count: int) -> list[Cost]:
    """Every row of the table, on fresh tables and an exchange of their own."""
    names = RunNames.fresh()
    cleanup = Cleanup(names)
    broker = Broker(names.amqp_url)
    try:
        broker.declare_sink(names)
        create_tables(names, cleanup)
        cleanup.tables += [names.counters_table, names.processed_table]
        create_peer_tables(names)
        return (storage_costs(names, count) + publish_costs(names, count)
                + [bus_cost(names, count)])
    finally:
        broker.close()
        cleanup.run()


def print_costs(count: int) -> list[Cost]:
    rows = costs(count)
    print(f"\nCPU per step, one thread in this process, {count} times each (this "
          "thread's CPU, wall time, and the CPU PostgreSQL and RabbitMQ spent meanwhile):")
    print(f"  {'step':<72} {'CPU us':>7} {'wall us':>8} {'postgres':>8} {'rabbitmq':>8}")
    for row in rows:
        print(f"  {row.label:<72} {row.cpu_us:>7.1f} {row.wall_us:>8.1f} "
              f"{row.services_us['postgresql']:>8.0f} {row.services_us['rabbitmq']:>8.0f}")
    return rows
