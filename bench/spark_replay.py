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
  and feeds its rows to the endpoint's processor in batches (``--batch``, 32; 0: one at a
  time). The clock covers the whole call: the driver's check of the endpoint, the shuffle
  by aggregate id, the sort, the tasks;
* ``consume loop`` — the endpoint itself (``Endpoint.start``, one consumer thread, batches
  of the same size) taking the same kind of messages from its RabbitMQ queue, where they
  wait beforehand; the clock runs from ``start()`` to the last ``handled`` signal;
* ``cluster 1w`` / ``2w`` — the same ``replay`` on a Spark standalone cluster on this
  machine (:class:`bench.spark_cluster.StandaloneCluster`, workers of 1 core each) with one
  worker and one partition, and with two workers and two partitions. Both clusters run
  for the whole part; each round opens a session on one, warms its executors up with a
  replay of 400 messages per worker (each executor as warm as the lone one of the
  one-worker cluster), waits up to 10 s for the shared machine to be nearly idle, times
  a replay, closes the session, and does the same on the other. ``ratio_2w_1w`` is the
  best two-worker rate over the best one-worker rate; each round's own ratio is printed
  too. ``cpu_ratio_2w_1w`` compares the whole machine's CPU per message (Spark's JVMs and
  the services included); ``python_cpu_ratio_2w_1w`` the CPU per message of the executors'
  Python workers only, where the endpoints run (median of the rounds).

Every run also reports the cores the whole machine kept busy meanwhile (``/proc/stat``):
two workers can only be faster than one while the machine has a core to spare for the
second one, its database and broker work included.

Every run gets fresh message ids over the same 1000 aggregates, which exist beforehand (as in
:mod:`bench.postgres`); one replay of 400 messages first starts Spark's Python workers,
one loop run of 200 warms the driver's side. Variants are interleaved, ``--rounds`` times;
the best round of each is reported. At the end every counter must equal the number of
messages applied, every processed record be marked dispatched and the sink hold one event
per message.

Spark's workers build the endpoint from the run's names in the environment and import
``bench`` from the repository: in ``local[2]`` they inherit both from this process (set
before the session starts); a cluster's executors are started by its workers, so they get
them as ``spark.executorEnv.IDEMBUS_BENCH_PG`` and ``spark.executorEnv.PYTHONPATH``. Run
``python -m bench.spark_replay`` from the repository (``make bench``); about a minute and a
half for ``--parts local``, two more minutes for ``cluster`` here (2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.pg_common import ENVIRONMENT, RunNames, aggregate_of
from bench.pg_handlers import BATCH, batch_from_environment, build_endpoint
from bench.pg_idembus import create_tables, envelopes, totals
from bench.pg_procs import machine_busy_seconds, wait_for_quiet
from bench.pg_topology import Broker, Cleanup
from bench.spark_cluster import LOOPBACK, StandaloneCluster
from idembus.runtime.endpoint import Endpoint
from idembus.spark.replay import replay

FACTORY = "bench.pg_handlers:factory"
SCHEMA = ("message_id string, message_type string, body string, headers string, "
          "aggregate_id string, sequence long")
SPARK_WARMUP = 400
LOOP_WARMUP = 200
#: Longest wait for the consume loop to handle its messages.
LOOP_TIMEOUT = 300.0
REPOSITORY = Path(__file__).resolve().parents[1]
LOCAL_VARIANTS = ("spark replay 1p", "spark replay 2p", "consume loop")
CLUSTER_VARIANTS = ("cluster 1w", "cluster 2w")
#: Before each timed cluster run, the longest wait for the shared machine to calm down.
QUIET_WAIT = 10.0


@dataclass(frozen=True)
class Result:
    variant: str
    messages: int
    seconds: float
    #: Cores the whole machine kept busy meanwhile: this run, the services, anyone else.
    busy: float
    #: CPU seconds of the cluster executors' Python workers meanwhile (cluster runs only).
    python_cpu: float | None = None

    @property
    def rate(self) -> float:
        return self.messages / self.seconds

    @property
    def cpu_ms_per_message(self) -> float:
        """The machine's CPU time per message: every process, the services' included."""
        return self.busy * self.seconds * 1000 / self.messages

    @property
    def python_cpu_ms_per_message(self) -> float | None:
        """The executors' Python workers' CPU time per message (cluster runs)."""
        return None if self.python_cpu is None else self.python_cpu * 1000 / self.messages


class Stopwatch:
    """Started when made; :meth:`result` reads the time and the machine's busy cores."""

    def __init__(self) -> None:
        self._busy = machine_busy_seconds()
        self._started = time.perf_counter()

    def result(self, variant: str, messages: int) -> Result:
        seconds = time.perf_counter() - self._started
        busy = (machine_busy_seconds() - self._busy) / seconds
        return Result(variant, messages, seconds, busy)


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


def spark_run(spark: Any, names: RunNames, indexes: range, partitions: int,
              variant: str | None = None) -> Result:
    variant = variant or f"spark replay {partitions}p"
    frame = spark.createDataFrame(list(rows(names, indexes)), SCHEMA).cache()
    frame.count()  # materialised before the clock starts
    watch = Stopwatch()
    summary = replay(frame, FACTORY, partitions=partitions)
    result = watch.result(variant, len(indexes))
    frame.unpersist()
    expected = len(indexes)
    if not summary.ok or (summary.replayed, summary.handled) != (expected, expected):
        raise SystemExit(f"{variant} went wrong: {summary.line()}")
    return result


def loop_run(names: RunNames, broker: Broker, indexes: range) -> Result:
    for envelope in envelopes(names, indexes):
        broker.publish_raw(names.input_queue, envelope.body.encode(), dict(envelope.headers))
    endpoint = run_endpoint(names)
    done = HandledCount(endpoint)
    watch = Stopwatch()
    endpoint.start()
    try:
        finished = done.wait_for(len(indexes), LOOP_TIMEOUT)
        result = watch.result("consume loop", len(indexes))
    finally:
        endpoint.close()
    if not finished:
        raise SystemExit(f"the consume loop handled {done.count} of {len(indexes)} messages")
    return result


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


def declare_input(names: RunNames) -> None:
    """The endpoint's queue as the endpoint declares it (a quorum queue by default), before
    the consume loop's messages are put there."""
    endpoint = run_endpoint(names)
    try:
        endpoint.transport.declare(endpoint.name, subscriptions=endpoint.subscriptions)
    finally:
        endpoint.close()


def run_endpoint(names: RunNames) -> Endpoint:
    """The run's endpoint as its Spark workers build it (``bench.pg_handlers.factory``:
    batches of the size in the environment)."""
    return build_endpoint(names, batch=batch_from_environment())


def verify(names: RunNames, applied: int) -> None:
    """Every message applied once, every event marked dispatched and waiting in the sink
    (read on a connection of its own: the run's may have idled past the broker's
    heartbeat limit meanwhile)."""
    counted, processed, undispatched = totals(names)
    broker = Broker(names.amqp_url)
    try:
        events = broker.depth(names.sink_queue)
    finally:
        broker.close()
    if (counted, processed, undispatched, events) != (applied, applied, 0, applied):
        raise SystemExit(
            f"after {applied} messages: counters sum to {counted}, {processed} processed "
            f"records, {undispatched} undispatched, {events} events in the sink")


def start_spark(master: str, conf: Mapping[str, str] | None = None) -> Any:
    """A quiet session whose workers run this interpreter."""
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    builder = (SparkSession.builder.master(master).appName("idembus bench spark_replay")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false"))
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def cluster_conf(names: RunNames) -> dict[str, str]:
    """What a cluster's executors need to build the run's endpoint (their workers start
    them: they inherit nothing from this process), and the driver's address on loopback."""
    return {f"spark.executorEnv.{ENVIRONMENT}": names.environment()[ENVIRONMENT],
            f"spark.executorEnv.{BATCH}": os.environ.get(BATCH) or "0",
            "spark.executorEnv.PYTHONPATH": str(REPOSITORY),
            "spark.driver.host": LOOPBACK["SPARK_LOCAL_IP"]}


def measure(master: str, names: RunNames, broker: Broker, batches: Batches, *, messages: int,
            rounds: int) -> list[Result]:
    """The local variants, interleaved, on one ``master`` session."""
    spark = start_spark(master)
    try:
        spark_run(spark, names, batches.take(SPARK_WARMUP), 2)
        loop_run(names, broker, batches.take(LOOP_WARMUP))
        results = []
        for _ in range(rounds):
            results.append(spark_run(spark, names, batches.take(messages), 1))
            results.append(spark_run(spark, names, batches.take(messages), 2))
            results.append(loop_run(names, broker, batches.take(messages)))
    finally:
        spark.stop()
    return results


def measure_clusters(names: RunNames, batches: Batches, directory: Path, *, messages: int,
                     rounds: int) -> list[Result]:
    """The cluster variants: a one-worker and a two-worker cluster, a session on each in
    turn, every round."""
    with StandaloneCluster(directory / "one-worker", workers=1) as one, \
            StandaloneCluster(directory / "two-workers", workers=2) as two:
        results = []
        for _ in range(rounds):
            for variant, cluster in zip(CLUSTER_VARIANTS, (one, two), strict=True):
                spark = start_spark(cluster.master_url, cluster_conf(names))
                try:
                    workers = cluster.worker_count
                    # Each executor warms up on as many rows as the lone one of the 1-worker
                    # cluster: its JIT compiler and its Python worker are as warm.
                    spark_run(spark, names, batches.take(SPARK_WARMUP * workers), workers,
                              variant)
                    wait_for_quiet(longest=QUIET_WAIT)
                    before = cluster.python_cpu()
                    timed = spark_run(spark, names, batches.take(messages), workers, variant)
                    results.append(dataclasses.replace(
                        timed, python_cpu=cluster.python_cpu() - before))
                finally:
                    spark.stop()
                print(f"  {variant}: {results[-1].rate:.0f} msgs/s, "
                      f"{results[-1].busy:.2f} cores busy", flush=True)
    return results


def best(results: Sequence[Result], variant: str) -> Result:
    return max((r for r in results if r.variant == variant), key=lambda r: r.rate)


def report(results: Sequence[Result], master: str) -> None:
    variants = [v for v in (*LOCAL_VARIANTS, *CLUSTER_VARIANTS)
                if any(r.variant == v for r in results)]
    rounds = sum(1 for r in results if r.variant == variants[0])
    print(f"\nspark replay vs the endpoint's consume loop (PostgreSQL + RabbitMQ, "
          f"Spark {master} and standalone clusters of 1-core workers, best of {rounds} rounds)")
    print(f"{'variant':<18}{'messages':>10}{'seconds':>10}{'msgs/s':>10}{'cores busy':>12}"
          f"{'rounds (msgs/s)':>24}")
    chosen = {}
    for variant in variants:
        chosen[variant] = top = best(results, variant)
        each = " ".join(f"{r.rate:.0f}" for r in results if r.variant == variant)
        print(f"{variant:<18}{top.messages:>10}{top.seconds:>10.2f}{top.rate:>10.0f}"
              f"{top.busy:>12.2f}{each:>24}")
    fields = []
    if "consume loop" in chosen:
        loop = chosen["consume loop"].rate
        fields += [f"spark_replay_1p={chosen['spark replay 1p'].rate:.0f}",
                   f"spark_replay_2p={chosen['spark replay 2p'].rate:.0f}",
                   f"consume_loop={loop:.0f}",
                   f"ratio_2p={chosen['spark replay 2p'].rate / loop:.2f}"]
    if "cluster 2w" in chosen:
        one, two = chosen["cluster 1w"].rate, chosen["cluster 2w"].rate
        paired = [b.rate / a.rate for a, b in zip(
            [r for r in results if r.variant == "cluster 1w"],
            [r for r in results if r.variant == "cluster 2w"], strict=True)]
        print("two workers / one, each round: " + " ".join(f"{p:.2f}" for p in paired))
        cpu_one = chosen["cluster 1w"].cpu_ms_per_message
        cpu_two = chosen["cluster 2w"].cpu_ms_per_message
        fields += [f"cluster_1w={one:.0f}", f"cluster_2w={two:.0f}",
                   f"ratio_2w_1w={two / one:.2f}", f"cpu_ms_1w={cpu_one:.2f}",
                   f"cpu_ms_2w={cpu_two:.2f}", f"cpu_ratio_2w_1w={cpu_two / cpu_one:.2f}"]
        python = {variant: statistics.median(
            r.python_cpu_ms_per_message for r in results
            if r.variant == variant and r.python_cpu_ms_per_message is not None)
            for variant in CLUSTER_VARIANTS}
        fields += [f"python_cpu_ms_1w={python['cluster 1w']:.3f}",
                   f"python_cpu_ms_2w={python['cluster 2w']:.3f}",
                   f"python_cpu_ratio_2w_1w={python['cluster 2w'] / python['cluster 1w']:.2f}"]
    print("bench: " + " ".join(fields))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.spark_replay",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=3000, help="per run (3000)")
    parser.add_argument("--rounds", type=int, default=2, help="of each variant (2)")
    parser.add_argument("--master", default="local[2]",
                        help="Spark master of the local part (local[2])")
    parser.add_argument("--batch", type=int, default=32, metavar="B",
                        help="the endpoint's batches, for replay and the consume loop alike "
                             "(32, as bench.postgres' batched runs); 0: one message at a "
                             "time")
    parser.add_argument("--parts", type=_parts, default=["local", "cluster"],
                        help="local (local[2] and the consume loop), cluster (standalone "
                             "clusters of one and two workers) (local,cluster)")
    args = parser.parse_args(argv)
    names = RunNames.fresh()
    # Before the first session starts: Spark's local workers inherit the environment and
    # build the endpoint of this run from it (bench.pg_handlers.factory); the JVM, and the
    # drivers of the cluster part, stay on loopback.
    os.environ[ENVIRONMENT] = names.environment()[ENVIRONMENT]
    os.environ[BATCH] = str(max(args.batch, 0))
    os.environ.update(LOOPBACK)
    cleanup = Cleanup(names)
    broker = Broker(names.amqp_url)
    batches = Batches()
    results: list[Result] = []
    try:
        create_tables(names, cleanup)
        broker.declare_sink(names)
        declare_input(names)
        cleanup.queues.append(names.error_queue)
        if "local" in args.parts:
            results += measure(args.master, names, broker, batches, messages=args.messages,
                               rounds=args.rounds)
        if "cluster" in args.parts:
            with tempfile.TemporaryDirectory(prefix="idembus-bench-spark-") as directory:
                results += measure_clusters(names, batches, Path(directory),
                                            messages=args.messages, rounds=args.rounds)
        verify(names, batches.total)
    finally:
        broker.close()
        cleanup.tables += [f"{names.table_prefix}_{table}" for table in
                           ("scheduled", "leases", "audit", "status")]
        cleanup.run()
    report(results, args.master)
    return 0


def _parts(text: str) -> list[str]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or set(parts) - {"local", "cluster"}:
        raise argparse.ArgumentTypeError("choose from local, cluster")
    return parts


if __name__ == "__main__":
    sys.exit(main())
