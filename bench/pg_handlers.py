"""The idembus endpoint ``bench.postgres`` runs: ``idembus run bench.pg_handlers:factory``.

Per message, :class:`CounterHandler` does the same work as the peers (:mod:`bench.pg_work`)
the idembus way: the endpoint loads the aggregate named by the message (one query that also
looks for the message's processed record), the handler increments its counter and publishes
one ``CounterIncremented``, and the endpoint commits the new state with the processed record
and the outgoing event in one transaction (PostgresStorage), publishes the event with
publisher confirms, acknowledges the message and, in batches from a background thread,
marks the event dispatched. Everything is idembus' defaults (prefetch 16, compaction on)
except the names, which the driver passes in :data:`bench.pg_common.ENVIRONMENT`.

With ``IDEMBUS_BENCH_PG_PROBE=<directory>`` the factory also starts :func:`start_probe`, a
thread writing the endpoint's ``handled`` and ``duplicate`` counters to a file every 10 ms:
the driver's clock for the duplicate path and the memory run (:class:`bench.pg_clock.Probe`).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from pydantic import BaseModel

from bench.pg_common import AGGREGATE_TYPE, COMMAND_NAME, EVENT_NAME, PREFETCH, RunNames
from idembus import Batching, Command, Endpoint, Event
from idembus.handlers import AggregateHandler, handles
from idembus.storage.postgres import PostgresStorage
from idembus.transports.kombu import KombuTransport

PROBE = "IDEMBUS_BENCH_PG_PROBE"
#: The batch size of a batched run (absent or 0: one message at a time).
BATCH = "IDEMBUS_BENCH_PG_BATCH"
PROBE_INTERVAL = 0.01


class IncrementCounter(Command, message_name=COMMAND_NAME):
    aggregate: str


class CounterIncremented(Event, message_name=EVENT_NAME):
    aggregate: str
    n: int


class Counter(BaseModel):
    n: int = 0


class CounterHandler(AggregateHandler[Counter]):
    aggregate_type = AGGREGATE_TYPE

    def aggregate_id(self, message: IncrementCounter) -> str:
        return message.aggregate

    @handles
    def increment(self, message: IncrementCounter) -> None:
        self.state.n += 1
        self.bus.publish(CounterIncremented(aggregate=message.aggregate, n=self.state.n))


def build_endpoint(names: RunNames, *, transport: KombuTransport | None = None,
                   concurrency: int = 1, batch: int = 0) -> Endpoint:
    """The benchmark's endpoint for the run ``names``; ``batch``: batches of at most that
    many messages (the broker's prefetch raised to it)."""
    return Endpoint(
        names.input_queue,
        # The driver declares the input queue as the peers' are: classic.
        transport=transport or KombuTransport(names.amqp_url, exchange=names.exchange,
                                              queue_type="classic"),
        storage=PostgresStorage(names.postgres_url, table_prefix=names.table_prefix),
        handlers=[CounterHandler],
        error_queue=names.error_queue,
        concurrency=concurrency,
        prefetch=max(PREFETCH, batch),
        batching=Batching(size=batch) if batch else None,
    )


def factory() -> Endpoint:
    """``idembus run bench.pg_handlers:factory``: the endpoint of the run in the environment."""
    endpoint = build_endpoint(RunNames.from_environment(), batch=batch_from_environment())
    directory = os.environ.get(PROBE)
    if directory:
        start_probe(endpoint, Path(directory))
    return endpoint


def batch_from_environment() -> int:
    """The batch size the driver put in :data:`BATCH` (0: one message at a time)."""
    return int(os.environ.get(BATCH) or 0)


def start_probe(endpoint: Endpoint, directory: Path) -> threading.Thread:
    """Write ``handled duplicate`` to ``<directory>/<pid>.count`` whenever they change."""
    target = directory / f"{os.getpid()}.count"
    scratch = directory / f"{os.getpid()}.tmp"

    def write() -> None:
        written = None
        while True:
            counts = endpoint.counters.snapshot()
            current = f"{counts['handled']} {counts['duplicate']}"
            if current != written:
                scratch.write_text(current)
                scratch.replace(target)
                written = current
            time.sleep(PROBE_INTERVAL)

    thread = threading.Thread(target=write, name="bench-probe", daemon=True)
    thread.start()
    return thread
