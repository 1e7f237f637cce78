"""Replay on Spark against the endpoint's own consume loop, on the same PostgreSQL storage.

What is measured
================
Messages per second of the same work per message as :mod:`bench.postgres` (the endpoint
``bench.pg_handlers:factory``: load the counter aggregate, increment it, commit state,
processed record and one event in one transaction, publish the event with publisher
confirms to a sink queue, mark it dispatched in batches), applied to messages that are all
available before the clock starts:

* ``spark replay 1p`` / ``2p`` — :func:`idembus.spark.replay.replay` of a cached DataFrame of the
  messages with 1 and 2 partitions on ``local[2]``: each partition builds the endpoint once
  and feeds its rows to the endpoint's processor. The clock covers the whole call: the
  driver's check of the endpoint, the shuffle by aggregate id, the sort, the tasks;
* ``consume loop`` — the endpoint itself (``Endpoint.start``, one consumer thread, prefetch
  16) taking the same kind of messages from its RabbitMQ queue, where they wait beforehand;
  the clock runs from ``start()`` to the last ``handled`` signal.

Every run gets fresh message ids over the same 1000 aggregates, which exist beforehand (as in
:mod:`bench.postgres`); one replay of 400 messages first starts Spark's Python workers,
one loop run of 200 warms the driver's side. Variants are interleaved, ``--rounds`` times;
the best round of each is reported. At the end every counter must equal the number of
messages applied, every processed record be marked dispatched and the sink hold one event
per message.

Spark's workers build the endpoint from the run's names in the environment, set before the
session starts (they inherit it), and import ``bench`` from the working directory: run
``python -m bench.spark_replay`` from the repository (``make bench``); about a minute and a
half here (2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from bench.pg_common import ENVIRONMENT, RunNames, aggregate_of
from bench.pg_handlers import build_endpoint
from bench.pg_idembus import create_tables, envelopes, totals
from bench.pg_topology import Broker, Cleanup
from idembus.endpoint import Endpoint
from idembus.spark.replay import replay

FACTORY = "bench.pg_handlers:factory"
SCHEMA = ("message_id string, message_type string, body string, headers string, "
          "aggregate_id string, sequence long")
SPARK_WARMUP = 400
LOOP_WARMUP = 200
#: Longest wait for the consume loop to handle its messages.
LOOP_TIMEOUT = 300.0


@dataclass(frozen=True)
class Result:
    variant: str
    messages: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.messages / self.seconds


class Batches:
    """Consecutive ranges of message indexes: every run gets messages never seen before."""

    def __init__(self) -> None:
        self._next = 0

    def take(self, count: int) -> range:
        taken = range(self._next, self._next + count)
        self._next += count
        return taken

    @property
    def total(self) -> int:
        return self._next


def rows(names: RunNames, indexes: range) -> Iterator[tuple[str, str, str, str, str, int]]:
    """Message ``i`` as an input row, body and headers exactly as idembus sends it."""
    for index, envelope in zip(indexes, envelopes(names, indexes), strict=True):
        yield (envelope.message_id, envelope.message_type, envelope.body,
               json.dumps(dict(envelope.headers)), aggregate_of(index), index)


def spark_run(spark: Any, names: RunNames, indexes: range, partitions: int) -> Result:
    frame = spark.createDataFrame(list(rows(names, indexes)), SCHEMA).cache()
    frame.count()  # materialised before the clock starts
    started = time.perf_counter()
    summary = replay(frame, FACTORY, partitions=partitions)
    seconds = time.perf_counter() - started
    frame.unpersist()
    expected = len(indexes)
    if not summary.ok or (summary.replayed, summary.handled) != (expected, expected):
        raise SystemExit(f"spark replay {partitions}p went wrong: {summary.line()}")
    return Result(f"spark replay {partitions}p", len(indexes), seconds)


def loop_run(names: RunNames, broker: Broker, indexes: range) -> Result:
    for envelope in envelopes(names, indexes):
        broker.publish_raw(names.input_queue, envelope.body.encode(), dict(envelope.headers))
    endpoint = build_endpoint(names)
    done = HandledCount(endpoint)
    started = time.perf_counter()
    endpoint.start()
    try:
        finished = done.wait_for(len(indexes), LOOP_TIMEOUT)
        seconds = time.perf_counter() - started
    finally:
        endpoint.close()
    if not finished:
        raise SystemExit(f"the consume loop handled {done.count} of {len(indexes)} messages")
    return Result("consume loop", len(indexes), seconds)


class HandledCount:
    """The endpoint's ``handled`` signals, counted; :meth:`wait_for` a number of them."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.count = 0
        self._condition = threading.Condition()
        endpoint.signals.handled.connect(self._on_handled, weak=False)

    def _on_handled(self, sender: object, **details: Any) -> None:
        with self._condition:
            self.count += 1
            self._condition.notify_all()

    def wait_for(self, count: int, timeout: float) -> bool:
        with self._condition:
            return self._condition.wait_for(lambda: self.count >= count, timeout)


def verify(names: RunNames, broker: Broker, applied: int) -> None:
    """Every message applied once, every event marked dispatched and waiting in the sink."""
    counted, processed, undispatched = totals(names)
    events = broker.depth(names.sink_queue)
    if (counted, processed, undispatched, events) != (applied, applied, 0, applied):
        raise SystemExit(
            f"after {applied} messages: counters sum to {counted}, {processed} processed "
            f"records, {undispatched} undispatched, {events} events in the sink")


def start_spark(master: str) -> Any:
    """A quiet session whose workers run this interpreter."""
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    spark = (SparkSession.builder.master(master).appName("idembus bench spark_replay")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def measure(spark: Any, names: RunNames, broker: Broker, *, messages: int,
            rounds: int) -> list[Result]:
    batches = Batches()
    spark_run(spark, names, batches.take(SPARK_WARMUP), 2)
    loop_run(names, broker, batches.take(LOOP_WARMUP))
    results = []
    for _ in range(rounds):
        results.append(spark_run(spark, names, batches.take(messages), 1))
        results.append(spark_run(spark, names, batches.take(messages), 2))
        results.append(loop_run(names, broker, batches.take(messages)))
    verify(names, broker, batches.total)
    return results


def best(results: Sequence[Result], variant: str) -> Result:
    return max((r for r in results if r.variant == variant), key=lambda r: r.rate)


def report(results: Sequence[Result], master: str) -> None:
    print(f"\nspark replay vs the endpoint's consume loop (PostgreSQL + RabbitMQ, "
          f"Spark {master}, best of {len(results) // 3} rounds)")
    print(f"{'variant':<18}{'messages':>10}{'seconds':>10}{'msgs/s':>10}{'rounds (msgs/s)':>24}")
    chosen = {}
    for variant in ("spark replay 1p", "spark replay 2p", "consume loop"):
        chosen[variant] = top = best(results, variant)
        rounds = " ".join(f"{r.rate:.0f}" for r in results if r.variant == variant)
        print(f"{variant:<18}{top.messages:>10}{top.seconds:>10.2f}{top.rate:>10.0f}"
              f"{rounds:>24}")
    loop = chosen["consume loop"].rate
    print(f"bench: spark_replay_1p={chosen['spark replay 1p'].rate:.0f} "
          f"spark_replay_2p={chosen['spark replay 2p'].rate:.0f} consume_loop={loop:.0f} "
          f"ratio_2p={chosen['spark replay 2p'].rate / loop:.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.spark_replay",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=3000, help="per run (3000)")
    parser.add_argument("--rounds", type=int, default=2, help="of each variant (2)")
    parser.add_argument("--master", default="local[2]", help="Spark master (local[2])")
    args = parser.parse_args(argv)
    names = RunNames.fresh()
    # Before the session starts: Spark's workers inherit the environment and build the
    # endpoint of this run from it (bench.pg_handlers.factory).
    os.environ[ENVIRONMENT] = names.environment()[ENVIRONMENT]
    cleanup = Cleanup(names)
    broker = Broker(names.amqp_url)
    spark = None
    try:
        create_tables(names, cleanup)
        broker.declare_sink(names)
        broker.declare_queue(names.input_queue)
        cleanup.queues.append(names.error_queue)
        spark = start_spark(args.master)
        results = measure(spark, names, broker, messages=args.messages, rounds=args.rounds)
    finally:
        if spark is not None:
            spark.stop()
        broker.close()
        cleanup.tables += [f"{names.table_prefix}_{table}" for table in
                           ("scheduled", "leases", "audit", "status")]
        cleanup.run()
    report(results, args.master)
    return 0


if __name__ == "__main__":
    sys.exit(main())
