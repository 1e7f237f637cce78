"""``python -m bench.postgres --profile``: where one idembus worker spends its time per message.

The worker is the benchmark's endpoint in one process (``python -m bench.pg_profile``,
built by :func:`bench.pg_handlers.build_endpoint`) whose consumer threads run under
cProfile (:class:`bench.profiling.ProfiledKombuTransport`); it writes the merged profile when
SIGTERM stops it. It runs twice on the same input as a timed run:

* **wall clock, one consumer thread**: with nothing running beside it, the wall time of each
  stage is what one message waits for — PostgreSQL's round trips and its commit, the
  broker's confirm — and what it computes;
* **thread CPU, the given threads**: what each stage costs in CPU, the resource the workers,
  PostgreSQL and RabbitMQ share on this machine's two cores.

Both divide by every message handled (warm-up included). Threads outside the consumers
(the dispatch-mark batcher, the pool's workers) are not in the profile; the process' whole
CPU per message, read from ``/proc`` over the timed part, is printed beside it. cProfile
slows call-heavy code down: read the proportions, and compare the absolute figures with an
unprofiled run's CPU per message.
"""

from __future__ import annotations

import pstats
import sys
import tempfile
import time
from pathlib import Path

from bench.pg_clock import time_window
from bench.pg_common import RunNames
from bench.pg_handlers import build_endpoint
from bench.pg_idembus import IdembusVariant
from bench.pg_procs import CpuSnapshot, Workers
from bench.pg_runner import ROOT, STALL_TIMEOUT
from bench.pg_topology import Broker, Cleanup
from bench.profiling import (
    STAGES,
    ProfileSet,
    StatsTable,
    format_rows,
    profiled_factory,
)

#: Stages of the PostgreSQL storage and the drivers, beyond bench.profiling's.
POSTGRES_STAGES: tuple[tuple[str, str, str], ...] = (
    ("      PostgresStorage._connection (pool get + put)", "storage/postgres.py",
     "_connection"),
    ("      psycopg Connection.execute (all)", "psycopg/connection.py", "execute"),
    ("      psycopg Transaction enter/exit (BEGIN, COMMIT)", "psycopg/transaction.py",
     "__exit__"),
    ("      kombu Producer.publish (incl. confirm)", "kombu/messaging.py", "publish"),
    ("      pydantic BaseModel.model_validate (state in)", "pydantic/main.py",
     "model_validate"),
    ("      pydantic BaseModel.model_dump (state out)", "pydantic/main.py", "model_dump"),
    ("      pydantic BaseModel.model_dump_json (event)", "pydantic/main.py",
     "model_dump_json"),
)
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def worker(argv: list[str]) -> int:
    """``python -m bench.pg_profile CLOCK THREADS STATS_FILE``: run until SIGTERM."""
    clock, threads, stats_file = argv[0], int(argv[1]), Path(argv[2])
    names = RunNames.from_environment()
    profiles = ProfileSet(CLOCKS[clock])
    transport = profiled_factory(profiles)(names.amqp_url, exchange=names.exchange)
    endpoint = build_endpoint(names, transport=transport, concurrency=threads)
    try:
        endpoint.run()
    finally:
        endpoint.close()
        profiles.merged().dump_stats(str(stats_file))
    return 0


def profile(clock: str, threads: int, *, warmup: int, count: int, logs: Path) -> None:
    """Run the profiled worker once and print where the time went."""
    names = RunNames.fresh()
    total = warmup + count
    cleanup = Cleanup(names)
    broker = Broker(names.amqp_url)
    stats_file = Path(tempfile.mkdtemp(prefix="profile-", dir=logs)) / f"{clock}.pstats"
    try:
        broker.declare_sink(names)
        IdembusVariant().prepare(names, broker, cleanup, total)
        snapshots: list[CpuSnapshot] = []
        command = [sys.executable, "-m", "bench.pg_profile", clock, str(threads),
                   str(stats_file)]
        with Workers(command, environment=names.environment(), log=logs / f"profile-{clock}.log",
                     cwd=ROOT, stop_timeout=30.0) as process:
            window = time_window(
                lambda: broker.depth(names.sink_queue), warmup=warmup, count=count,
                timeout=STALL_TIMEOUT, alive=process.alive,
                on_start=lambda: snapshots.append(CpuSnapshot.take([process.pid])),
                on_end=lambda: snapshots.append(CpuSnapshot.take([process.pid])))
    finally:
        broker.close()
        cleanup.run()
    cpu = snapshots[0].per_message(snapshots[1], count)
    table: StatsTable = pstats.Stats(str(stats_file)).stats  # type: ignore[attr-defined]
    print(f"\nprofile ({clock} clock): idembus, 1 process x {threads} thread(s), {total} "
          f"messages; timed part under cProfile {window.rate:.0f} msgs/s "
          f"({1e6 / window.rate:.0f} us wall/msg); whole worker process "
          f"{cpu['workers']:.0f} us CPU/msg, PostgreSQL {cpu['postgresql']:.0f}, "
          f"RabbitMQ {cpu['rabbitmq']:.0f}")
    print(f"{clock + ' us/msg':>12}  stage (consumer threads only)")
    for label, where, function in STAGES + POSTGRES_STAGES:
        print(f"{cumulative(table, where, function) / total * 1e6:>12.1f}  {label}")
    print(f"\ntop 25 by cumulative {clock} time:")
    print(f"{'calls':>9} {'own s':>8} {'cum s':>8} {'cum us/msg':>10}  function")
    for line in format_rows(sorted(table.items(), key=lambda row: row[1][3],
                                   reverse=True)[:25], total):
        print(line)
    if clock == "cpu":
        print(f"\ntop 25 by own {clock} time:")
        print(f"{'calls':>9} {'own s':>8} {'cum s':>8} {'cum us/msg':>10}  function")
        for line in format_rows(sorted(table.items(), key=lambda row: row[1][2],
                                       reverse=True)[:25], total):
            print(line)


def cumulative(table: StatsTable, where: str, function: str) -> float:
    """Cumulative time of the functions named ``function`` in files matching ``where``."""
    return sum(entry[3] for (filename, _, name), entry in table.items()
               if name == function and where in filename.replace("\\", "/"))


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
