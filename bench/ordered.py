"""What ordering by key costs: ordered against unordered throughput, in one run.

What is measured
================
One endpoint (``tests.ordered_app:make``: each command appends its ``seq`` to its key's
aggregate, on PostgreSQL storage) run by ``idembus run --workers 2 --concurrency 4``,
with its queues in RabbitMQ and in PostgreSQL (the database queues). Each round sends
``--keys`` keys x ``--per-key`` messages twice, in the same order: once as ``Step`` (a
command type with ``ordered_by="key"``) and once as ``Loose`` (the same command,
unordered), each round to fresh keys, and times from the first send to the last message
applied (read from the aggregates). Unordered messages of one key race for its aggregate
and some lose (a conflict, run again): that is the unordered side of the same workload.

The figure per variant is the median of the rounds; the ratio (ordered / unordered) is the
median of the per-round ratios, the two sides of a round run back to back with the order
alternating between rounds. Run ``python -m bench.ordered``; results go to
``bench/results/ordered.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import psycopg

from bench.common import AMQP_URL
from bench.pg_common import POSTGRES_URL
from idembus.envelope import Envelope
from idembus.routing import Router, partition_queue
from idembus.sending import Bus
from idembus.storage.postgres import PostgresStorage
from idembus.transports.base import Transport
from idembus.transports.kombu import KombuTransport
from idembus.transports.postgres import PostgresTransport
from tests.ordered_app import Loose, Step

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "ordered.json"


def applied(prefix: str, keys: str) -> int:
    """How many messages the aggregates of keys starting with ``keys`` hold."""
    with psycopg.connect(POSTGRES_URL) as connection:
        row = connection.execute(
            f"SELECT coalesce(sum(json_array_length((state->'seqs')::json)), 0) FROM "
            f"{prefix}_aggregates WHERE aggregate_id LIKE %s", (keys + "%",)).fetchone()
    return int(row[0]) if row else 0


def timed(transport: Transport, queue: str, prefix: str, kind: type[Step] | type[Loose],
          keys: int, per_key: int, tag: str) -> float:
    """Messages per second for ``keys`` x ``per_key`` of ``kind``, from the first send to
    the last applied; sent in chunks of 500 with one wait for their confirms."""
    envelopes: list[Envelope] = []
    bus = Bus("bench-sender", Router({Step: queue, Loose: queue}), envelopes.append)
    for seq in range(per_key):
        for key in range(keys):
            bus.send(kind(key=f"{tag}-{key}", seq=seq))
    total = len(envelopes)
    started = time.perf_counter()
    for start in range(0, total, 500):
        for outcome in transport.dispatch_many(envelopes[start:start + 500]):
            if isinstance(outcome, Exception):
                raise outcome
    deadline = time.monotonic() + 600
    while applied(prefix, f"{tag}-") < total:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{tag}: {applied(prefix, tag + '-')} of {total} applied")
        time.sleep(0.05)
    return total / (time.perf_counter() - started)


def variant(name: str, url: str, rounds: int, keys: int, per_key: int,
            log: Callable[[str], None]) -> dict[str, Any]:
    """Rounds of ordered and unordered on the transport ``url``."""
    suffix = uuid.uuid4().hex[:8]
    queue, error_queue, prefix = f"ordbench-{suffix}", f"ordbench-error-{suffix}", f"ob{suffix}"
    storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    storage.migrate()
    transport: Transport
    if url.startswith("postgresql://"):
        transport = PostgresTransport(url, table_prefix=prefix + "q")
        transport.migrate()
    else:
        transport = KombuTransport(url)
        transport.declare_partitions(queue, 16)
    transport.declare(queue)
    transport.declare(error_queue)
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "APP_QUEUE": queue,
                   "APP_ERROR_QUEUE": error_queue, "APP_PREFIX": prefix,
                   "APP_TRANSPORT": url, "APP_POSTGRES": POSTGRES_URL}
    workers = subprocess.Popen(
        [sys.executable, "-m", "idembus", "run", "tests.ordered_app:make", "--workers", "2",
         "--concurrency", "4", "--log-level", "WARNING"], env=environment, cwd=ROOT)
    ordered: list[float] = []
    unordered: list[float] = []
    try:
        time.sleep(5)  # the workers' start-up, outside every measured round
        timed(transport, queue, prefix, Loose, 10, 5, "warm")
        for number in range(rounds):
            sides = [(Step, ordered), (Loose, unordered)]
            for kind, rates in sides if number % 2 == 0 else reversed(sides):
                rate = timed(transport, queue, prefix, kind, keys, per_key,
                             f"r{number}{kind.__name__}")
                rates.append(rate)
                log(f"{name} round {number + 1} {kind.__name__}: {rate:.0f} msg/s")
    finally:
        workers.terminate()
        workers.wait(timeout=60)
        if isinstance(transport, PostgresTransport):
            transport.drop_tables()
        else:
            for name_ in [queue, error_queue, *(partition_queue(queue, i) for i in range(16))]:
                transport.delete_queue(name_)
        transport.close()
        storage.drop_tables()
        storage.close()
    return {"ordered": round(statistics.median(ordered)),
            "unordered": round(statistics.median(unordered)),
            "ratio": round(statistics.median(o / u for o, u in zip(ordered, unordered,
                                                                     strict=True)), 2),
            "rounds_ordered": [round(r) for r in ordered],
            "rounds_unordered": [round(r) for r in unordered]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--per-key", type=int, default=50)
    parser.add_argument("--transports", default="rabbitmq,postgresql")
    options = parser.parse_args(argv)
    urls = {"rabbitmq": AMQP_URL, "postgresql": POSTGRES_URL}
    results = {name: variant(name, urls[name], options.rounds, options.keys,
                             options.per_key, print)
               for name in options.transports.split(",")}
    print("| queues | ordered | unordered | ratio |\n|---|---|---|---|")
    for name, result in results.items():
        print(f"| {name} | {result['ordered']} msg/s | {result['unordered']} msg/s | "
              f"{result['ratio']} |")
    print("bench: " + " ".join(f"{name}_{field}={result[field]}" for name, result in
                               results.items() for field in ("ordered", "unordered", "ratio")))
    RESULTS.write_text(json.dumps({"command": " ".join(["python -m bench.ordered",
                                                         *(argv or sys.argv[1:])]),
                                   "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
