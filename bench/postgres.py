"""idembus on RabbitMQ with PostgreSQL storage, against the peers doing the same work.

What is measured
================
Messages per second, through separate worker processes started by each framework's own
command line, of this work per message: **one SQL transaction** that updates the row of
one of 1000 aggregates and records the message id, **one message published with publisher
confirms** (to a topic exchange routing it to a sink queue), **one ack**:

* idembus — ``idembus run bench.pg_handlers:factory --workers 1|2 --concurrency 1..4``:
  an ``AggregateHandler[Counter]`` increments a counter and publishes one event; idembus
  loads the aggregate, commits state + processed record + event in one transaction,
  publishes, acks, and marks the event dispatched in batches (its default compaction);
* raw kombu — ``python -m bench.pg_raw``, 1 and 2 processes of a bare
  consume -> SQL -> publish -> ack loop (:mod:`bench.pg_raw`);
* Celery — ``celery worker``, prefork pool, ``acks_late``, concurrency 1-2 x prefetch
  multiplier 1-4 (:mod:`bench.pg_celery`);
* Dramatiq — ``dramatiq``, RabbitMQ broker, 1-2 processes x 1-4 threads
  (:mod:`bench.pg_dramatiq`).

The peers' SQL and publish are one shared piece of code (:mod:`bench.pg_work`).

Why the comparison is fair
==========================
Every run gets fresh queues and tables; its ``warmup + N`` input messages (message ``i``
for aggregate ``i % 1000``, every aggregate row existing beforehand) wait in a durable
queue before any worker starts; the workers run in their own processes on the same cores as
RabbitMQ and PostgreSQL; completion is counted the same way for all — the sink queue's
depth, one event per finished message — and the clock runs from the end of the warm-up to
the last message's event (:mod:`bench.pg_clock`); after each run the counters, the
processed records and the events are checked to be exactly one per message. Each
framework's best configuration is compared with idembus' best. The runs of the variants
are interleaved so that a disturbance of the machine does not hit one variant only, each
run waits (30 s at most) for the machine to be nearly idle, and a run that fails or finds
a problem (someone restarting RabbitMQ) is run again once. The CPU each run cost the
workers, PostgreSQL, RabbitMQ and everything else on the machine is printed beside it, per
message (``other`` shows a disturbed run).

Defaults: 4000 timed messages per run after 400 of warm-up, 26 configurations, the
duplicate path on idembus' best configuration, and the memory run up to 200,000 messages
(the issue's figure; ``--memory-messages 100000`` saves 1.5 minutes); about 8 minutes on
this workplace's 2-core machine.

Also measured: idembus' duplicate path against its fresh path (:mod:`bench.pg_duplicates`),
one worker's resident memory over a long run (:mod:`bench.pg_memory`) and one message's
latency end to end at 10 % and 80 % of the best one-worker rate, batching on and off
(:mod:`bench.pg_latency`), and what a second worker process costs per message against a
loop that coordinates nothing (:mod:`bench.pg_scaling`);
``--profile`` shows where an idembus worker's time goes (:mod:`bench.pg_profile`).

Run ``python -m bench.postgres`` (``make bench``); ``--help`` lists the options. Results go
to ``bench/results/postgres.json`` too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from bench import pg_costs, pg_duplicates, pg_latency, pg_memory, pg_profile, pg_scaling
from bench.common import display_url, postgres_unreachable_reason, unreachable_reason
from bench.pg_common import AMQP_URL, POSTGRES_URL
from bench.pg_idembus import DEFAULT_BATCH, IdembusVariant, configuration
from bench.pg_raw import RawVariant
from bench.pg_runner import (
    Config,
    RunResult,
    Variant,
    best,
    run_configuration,
    wait_for_broker,
)

RESULTS = Path(__file__).resolve().parent / "results" / "postgres.json"
PARTS = ("grid", "duplicates", "memory", "latency", "scaling")


def variants() -> list[Variant]:
    # The peers come with the bench extra only: imported when a grid runs.
    from bench.pg_celery import CeleryVariant
    from bench.pg_dramatiq import DramatiqVariant

    return [IdembusVariant(), RawVariant(), CeleryVariant(), DramatiqVariant()]


def interleaved(chosen: Sequence[Variant], quick: bool) -> list[tuple[Variant, Config]]:
    """Every configuration of every variant, taking one of each variant in turn."""
    queues = [[(variant, config) for config in variant.configurations(quick)]
              for variant in chosen]
    order: list[tuple[Variant, Config]] = []
    while any(queues):
        for queue in queues:
            if queue:
                order.append(queue.pop(0))
    return order


def run_grid(args: argparse.Namespace, logs: Path) -> dict[str, list[RunResult]]:
    chosen = variants()
    results: dict[str, list[RunResult]] = {variant.name: [] for variant in chosen}
    order = interleaved(chosen, args.quick)
    for index, (variant, config) in enumerate(order, 1):
        result = run_configuration(variant, config, warmup=args.warmup, count=args.messages,
                                   logs=logs)
        results[variant.name].append(result)
        figure = f"{result.rate:6.0f} msgs/s" if result.rate else "failed: " + "; ".join(
            result.problems)
        print(f"  [{index:2}/{len(order)}] {variant.name:<9} {config.label:<36} {figure}",
              flush=True)
    for variant in chosen:
        print_table(variant, results[variant.name])
    return results


def print_table(variant: Variant, results: Sequence[RunResult]) -> None:
    top = best(results)
    print(f"\n{variant.title}")
    print(f"  {'configuration':<36} {'msgs/s':>7}   CPU us/msg: {'workers':>7} "
          f"{'postgres':>8} {'rabbitmq':>8} {'other':>6}")
    for result in results:
        cpu = result.cpu_us_per_msg
        rate = f"{result.rate:7.0f}" if result.rate else f"{'failed':>7}"
        mark = " <- best" if result is top else ""
        print(f"  {result.config.label:<36} {rate}   {'':11} {cpu.get('workers', 0):>7.0f} "
              f"{cpu.get('postgresql', 0):>8.0f} {cpu.get('rabbitmq', 0):>8.0f} "
              f"{cpu.get('other', 0):>6.0f}{mark}")
        for problem in result.problems:
            print(f"    problem: {problem}")
        for problem in result.earlier_problems:
            print(f"    (run again after {problem})")


def best_idembus(results: dict[str, list[RunResult]], workers: int | None = None,
                 batched: bool | None = None) -> RunResult | None:
    """idembus' best run (of ``workers`` processes; batched or not when said)."""
    return best([result for result in results.get("idembus", [])
                 if (workers is None or result.config.settings["workers"] == workers)
                 and (batched is None
                      or bool(result.config.settings.get("batch")) == batched)])


def summary(results: dict[str, list[RunResult]]) -> tuple[str, dict[str, float | None]]:
    """The final ``bench: ...`` line and its figures."""
    def rate(result: RunResult | None) -> float | None:
        return None if result is None else result.rate

    one, two, overall = (rate(best_idembus(results, w)) for w in (1, 2, None))
    figures: dict[str, float | None] = {
        "idembus_1w": one, "idembus_2w": two,
        "idembus_per_message": rate(best_idembus(results, batched=False)),
        "idembus_batched": rate(best_idembus(results, batched=True)),
        "raw_kombu": rate(best(results.get("raw_kombu", []))),
        "celery": rate(best(results.get("celery", []))),
        "dramatiq": rate(best(results.get("dramatiq", []))),
    }
    for peer, key in (("raw_kombu", "ratio_raw"), ("celery", "ratio_celery"),
                      ("dramatiq", "ratio_dramatiq")):
        figures[key] = _ratio(overall, figures[peer])
    figures["scaling_2w"] = _ratio(two, one)
    top = best_idembus(results)
    for part, key in (("workers", "cpu_worker"), ("postgresql", "cpu_postgres"),
                      ("rabbitmq", "cpu_rabbitmq")):
        figures[key] = top.cpu_us_per_msg.get(part) if top else None
    # Adding a worker should add no coordination cost: the workers' CPU per message with two
    # processes against one, each at its fastest run (on two cores the wall-clock scaling
    # cannot show it once one worker keeps more than a core busy).
    for workers in (1, 2):
        run = best_idembus(results, workers)
        figures[f"cpu_worker_{workers}w"] = run.cpu_us_per_msg.get("workers") if run else None
    figures["cpu_scaling_2w"] = _ratio(figures["cpu_worker_2w"], figures["cpu_worker_1w"])
    fields = [f"{key}={_format(value, '.0f' if key in _RATES else '.2f')}"
              for key, value in figures.items()]
    best_label = f" (idembus best: {top.config.label}; CPU in us a message)" if top else ""
    return "bench: " + " ".join(fields) + best_label, figures


_RATES = ("idembus_1w", "idembus_2w", "idembus_per_message", "idembus_batched", "raw_kombu",
          "celery", "dramatiq", "cpu_worker", "cpu_postgres", "cpu_rabbitmq", "cpu_worker_1w",
          "cpu_worker_2w")


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if not numerator or not denominator else numerator / denominator


def _format(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def duplicates_line(result: pg_duplicates.DuplicateResult) -> str:
    fresh = _format(result.fresh.rate if result.fresh else None, ".0f")
    duplicate = _format(result.duplicate.rate if result.duplicate else None, ".0f")
    return (f"duplicates: fresh={fresh} duplicate={duplicate} "
            f"ratio={_format(result.ratio, '.2f')} ({result.config.label}, msgs/s)")


def memory_line(result: pg_memory.MemoryResult) -> str:
    parts = [f"rss_{count}={_format(kib / 1024 if kib else None, '.1f')}MiB"
             for count, kib in ((c, result.at_checkpoints.get(c)) for c in result.checkpoints)]
    growth = None if result.growth is None else result.growth * 100
    batch = f", batch {result.batch}" if result.batch else ""
    return (f"memory: {' '.join(parts)} growth={_format(growth, '+.1f')}% "
            f"(1 process x {result.threads} threads{batch})")


Measured = TypeVar("Measured", pg_duplicates.DuplicateResult, pg_memory.MemoryResult)


def twice(measure: Callable[[], Measured]) -> Measured:
    """Measure again once if the first attempt had problems (RabbitMQ may have been
    restarted by someone else meanwhile); the second attempt's result stands."""
    first = measure()
    if not first.problems:
        return first
    print(f"  run again after: {'; '.join(first.problems)}", flush=True)
    wait_for_broker()
    return measure()


def check_services() -> str | None:
    return unreachable_reason(AMQP_URL) or postgres_unreachable_reason(POSTGRES_URL)


def bench(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    report: dict[str, Any] = {
        "generated": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(), "amqp": display_url(AMQP_URL),
        "postgres": display_url(POSTGRES_URL), "timed_messages": args.messages,
        "warmup_messages": args.warmup, "quick": args.quick,
    }
    print(f"PostgreSQL benchmark: {args.messages} timed messages per run after "
          f"{args.warmup} warm-up; RabbitMQ {display_url(AMQP_URL)}, "
          f"PostgreSQL {display_url(POSTGRES_URL)}; worker logs in {logs}", flush=True)
    results: dict[str, list[RunResult]] = {}
    if "grid" in args.parts:
        results = run_grid(args, logs)
        report["variants"] = {name: [r.as_json() for r in runs]
                              for name, runs in results.items()}
    lines = []
    if "duplicates" in args.parts:
        top = best_idembus(results)
        config = top.config if top else configuration(2, 4)
        print(f"\nduplicate path: {config.label}, fresh then the same messages again",
              flush=True)
        duplicates = twice(lambda: pg_duplicates.measure(
            config, warmup=args.warmup, count=args.messages, logs=logs))
        report["duplicates"] = duplicates.as_json()
        lines.append(duplicates_line(duplicates))
        lines += [f"  problem: {problem}" for problem in duplicates.problems]
    if "memory" in args.parts:
        checkpoints = (args.memory_first, args.memory_messages)
        print(f"\nmemory: one worker, 1 process x {args.memory_threads} threads, batch "
              f"{args.memory_batch or 'none'}, "
              f"{args.memory_messages} messages", flush=True)
        memory = twice(lambda: pg_memory.measure(checkpoints, threads=args.memory_threads,
                                                 logs=logs, batch=args.memory_batch))
        report["memory"] = memory.as_json()
        lines.append(memory_line(memory))
        lines += [f"  problem: {problem}" for problem in memory.problems]
    if "latency" in args.parts:
        top = best_idembus(results, 1, batched=True)
        if top is None and not args.latency_rate:
            # No grid in this run: measure the reference here, the latency's own worker
            # (one process, its threads, batched) at full speed, rather than assume one.
            config = configuration(1, pg_latency.THREADS, pg_latency.BATCH)
            print(f"\nlatency: the reference rate, {config.label} at full speed", flush=True)
            top = run_configuration(IdembusVariant(), config, warmup=args.warmup,
                                    count=args.messages, logs=logs)
            results.setdefault("idembus", []).append(top)
        reference = args.latency_rate or (top.rate if top else None)
        if reference is None:
            raise SystemExit("latency: the reference run failed: "
                             + "; ".join(top.problems if top else []))
        print(f"\nlatency: one worker, sent at 10 % and 80 % of {reference:.0f} msg/s, "
              f"batch {pg_latency.BATCH} and none", flush=True)
        latency = pg_latency.run_latency(reference, count=args.latency_messages,
                                         warmup=args.latency_warmup, logs=logs)
        report["latency"] = latency
        lines.append(pg_latency.latency_line(latency))
    if "scaling" in args.parts:
        print(f"\nscaling: idembus and the raw kombu loop with one and two processes, "
              f"{args.scaling_rounds} rounds of {args.scaling_messages} messages", flush=True)
        scaling = pg_scaling.measure(rounds=args.scaling_rounds, warmup=args.warmup,
                                     count=args.scaling_messages, logs=logs)
        report["scaling"] = scaling.as_json()
        lines.append(scaling.line())
        lines += [f"  problem: {problem}" for problem in scaling.problems]
    line, figures = summary(results)
    report["summary"] = {key: None if value is None else round(value, 3)
                         for key, value in figures.items()}
    report["line"] = line
    print()
    for each in lines:
        print(each)
    report["lines"] = lines
    return report


def had_problems(report: dict[str, Any]) -> bool:
    runs = [run for each in report.get("variants", {}).values() for run in each]
    parts = [report.get(part, {}) for part in ("duplicates", "memory", "scaling")]
    return any(entry.get("problems") for entry in runs + parts)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.postgres",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=4000, metavar="N",
                        help="timed messages per run (4000)")
    parser.add_argument("--warmup", type=int, default=400, metavar="W",
                        help="untimed messages before them (400)")
    parser.add_argument("--quick", action="store_true",
                        help="a sample of the configurations instead of all of them")
    parser.add_argument("--parts", type=_parts, default=list(PARTS),
                        help="grid,duplicates,memory,latency,scaling (all)")
    parser.add_argument("--latency-messages", type=int, default=1000, metavar="N",
                        help="timed messages of each latency run (1000)")
    parser.add_argument("--latency-warmup", type=int, default=100, metavar="W",
                        help="untimed messages before them (100)")
    parser.add_argument("--latency-rate", type=float, default=None, metavar="R",
                        help="the rate the loads are fractions of (default: this run's best "
                             "one-worker batched rate; without the grid, that worker "
                             "measured at full speed first)")
    parser.add_argument("--memory-messages", type=int, default=200_000, metavar="M",
                        help="messages of the memory run; RSS is compared with the RSS after "
                             "--memory-first (200000, the issue's figure: ~3 min of the run)")
    parser.add_argument("--memory-first", type=int, default=20_000, metavar="M",
                        help="messages after which the reference RSS is read (20000)")
    parser.add_argument("--memory-threads", type=int, default=4,
                        help="consumer threads of the memory run's worker (4)")
    parser.add_argument("--memory-batch", type=int, default=DEFAULT_BATCH,
                        help=f"batch size of the memory run's worker, 0: one message at a "
                             f"time ({DEFAULT_BATCH})")
    parser.add_argument("--scaling-rounds", type=int, default=3, metavar="R",
                        help="rounds of the scaling part; medians are reported (3)")
    parser.add_argument("--scaling-messages", type=int, default=10_000, metavar="N",
                        help="timed messages of each scaling run (10000)")
    parser.add_argument("--profile", action="store_true",
                        help="instead: profile one idembus worker (wall clock with 1 thread, "
                             "then thread CPU with --profile-threads)")
    parser.add_argument("--profile-threads", type=int, default=4,
                        help="consumer threads of the CPU profile (4)")
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"results file ({RESULTS})")
    args = parser.parse_args(argv)
    if min(args.messages, args.warmup, args.memory_first, args.memory_threads,
           args.scaling_rounds, args.scaling_messages) < 1:
        parser.error("counts must be at least 1")
    if args.memory_messages <= args.memory_first:
        parser.error("--memory-messages must be larger than --memory-first")
    return args


def _parts(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names or set(names) - set(PARTS):
        raise argparse.ArgumentTypeError(f"choose from {', '.join(PARTS)}")
    return names


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through every clean-up


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _terminate)
    reason = check_services()
    if reason:
        print(f"bench.postgres skipped: {reason}")
        print(summary({})[0])
        return 0
    logs = Path(tempfile.mkdtemp(prefix="bench-postgres-"))
    if args.profile:
        pg_costs.print_costs(min(args.messages, 2000))
        pg_profile.profile("wall", 1, warmup=args.warmup, count=args.messages, logs=logs)
        pg_profile.profile("cpu", args.profile_threads, warmup=args.warmup,
                           count=args.messages, logs=logs)
        print(f"\nthe profiles (pstats) and worker logs are in {logs}")
        return 0
    report = bench(args, logs)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"results written to {args.json}")
    if had_problems(report):
        print(f"worker logs kept in {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
    print(report["line"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
