"""The idembus variant: ``idembus run bench.pg_handlers:factory --workers W --concurrency T``.

Input: ``IncrementCounter`` commands exactly as ``endpoint.bus.send`` puts them on the wire
(body and headers built by idembus' own :class:`~idembus.sending.Bus`), with ids that are the
same when the run sends them again (the duplicate path). The storage's two tables are
created by ``PostgresStorage.migrate`` and the 1000 aggregates are inserted at version 1
before the run (as the peers' rows are), so that every timed message updates an existing
aggregate, as in the peers, instead of creating it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator

import psycopg

from bench.pg_common import AGGREGATE_TYPE, AGGREGATES, RunNames, aggregate_of, message_id_of
from bench.pg_handlers import BATCH, IncrementCounter
from bench.pg_runner import Config
from bench.pg_topology import Broker, Cleanup
from idembus.envelope import Envelope
from idembus.routing import Router
from idembus.sending import Bus
from idembus.storage.postgres import PostgresStorage

WORKERS = (1, 2)
THREADS = (1, 2, 3, 4)
QUICK = ((1, 1), (1, 4), (2, 2), (2, 4))
#: Batched configurations (``Endpoint(batching=Batching(size=B))``): workers x threads x B.
BATCHED = tuple((w, t, b) for w in WORKERS for t in (1, 2) for b in (16, 64))
QUICK_BATCHED = ((1, 1, 32), (1, 2, 32), (2, 1, 32), (2, 2, 32))
#: The batch size of the batched runs of the duplicate path and the memory run.
DEFAULT_BATCH = 32


def envelopes(names: RunNames, indexes: Iterable[int]) -> Iterator[Envelope]:
    """Message ``i`` for aggregate ``i % 1000``, with the run's id for ``i``."""
    captured: list[Envelope] = []
    bus = Bus("bench-pg-client", Router({IncrementCounter: names.input_queue}), captured.append)
    for index in indexes:
        bus.send(IncrementCounter(aggregate=aggregate_of(index)),
                 message_id=message_id_of(names, index))
        yield captured.pop()


def preload(broker: Broker, names: RunNames, indexes: Iterable[int]) -> None:
    for envelope in envelopes(names, indexes):
        broker.publish_raw(names.input_queue, envelope.body.encode(), dict(envelope.headers))


def create_tables(names: RunNames, cleanup: Cleanup) -> None:
    """idembus' schema for the run, with every aggregate at version 1 and n = 0."""
    storage = PostgresStorage(names.postgres_url, table_prefix=names.table_prefix)
    try:
        cleanup.tables += list(storage.table_names)
        storage.migrate()
    finally:
        storage.close()
    with psycopg.connect(names.postgres_url, autocommit=True) as connection:
        connection.execute(
            f"INSERT INTO {names.table_prefix}_aggregates "
            "(aggregate_type, aggregate_id, version, state) "
            f"SELECT %s, 'agg-' || lpad(g::text, 4, '0'), 1, '{{\"n\": 0}}'::jsonb "
            f"FROM generate_series(0, {AGGREGATES - 1}) g", (AGGREGATE_TYPE,))


def totals(names: RunNames) -> tuple[int, int, int]:
    """(sum of the counters, processed records, records whose event is not marked
    dispatched yet)."""
    with psycopg.connect(names.postgres_url, autocommit=True) as connection:
        row = connection.execute(
            f"SELECT (SELECT coalesce(sum((state->>'n')::bigint), 0) "
            f"        FROM {names.table_prefix}_aggregates), "
            f"(SELECT count(*) FROM {names.table_prefix}_processed), "
            f"(SELECT count(*) FROM {names.table_prefix}_processed WHERE NOT dispatched)"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def command(config: Config, *extra: str) -> list[str]:
    """The worker command of ``config`` (a batched one passes its batch size in
    :data:`bench.pg_handlers.BATCH`)."""
    batch = config.settings.get("batch", 0)
    prefix = ["env", f"{BATCH}={batch}"] if batch else []
    return [*prefix, sys.executable, "-m", "idembus", "run", "bench.pg_handlers:factory",
            "--workers", str(config.settings["workers"]),
            "--concurrency", str(config.settings["threads"]), "--log-level", "WARNING",
            *extra]


def configuration(workers: int, threads: int, batch: int = 0) -> Config:
    """``batch``: batches of at most that many messages (0: one message at a time)."""
    return Config(f"{workers}w{threads}t" + (f"b{batch}" if batch else ""),
                  f"{workers} process{'es' if workers > 1 else ''} x {threads} "
                  f"thread{'s' if threads > 1 else ''}" + (f", batch {batch}" if batch else ""),
                  {"workers": workers, "threads": threads, "batch": batch})


class IdembusVariant:
    name = "idembus"
    title = ("idembus + PostgresStorage (idembus run --workers W --concurrency T), one message "
             "at a time and in batches of B")

    def configurations(self, quick: bool) -> list[Config]:
        pairs = QUICK if quick else [(w, t) for w in WORKERS for t in THREADS]
        batched = QUICK_BATCHED if quick else BATCHED
        return ([configuration(w, t) for w, t in pairs]
                + [configuration(w, t, b) for w, t, b in batched])

    def prepare(self, names: RunNames, broker: Broker, cleanup: Cleanup, total: int) -> None:
        cleanup.queues.append(names.error_queue)
        create_tables(names, cleanup)
        broker.declare_queue(names.input_queue)
        preload(broker, names, range(total))

    def command(self, names: RunNames, config: Config) -> list[str]:
        return command(config)

    def verify(self, names: RunNames, broker: Broker, total: int) -> list[str]:
        problems = []
        counted, processed, _ = totals(names)
        if counted != total or processed != total:
            problems.append(f"counters sum to {counted} with {processed} processed records "
                            f"for {total} messages")
        failed = broker.depth(names.error_queue)
        if failed:
            problems.append(f"{failed} messages in the error queue")
        return problems
