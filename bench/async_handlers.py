"""Throughput of an ``async def`` handler against the same handler as ``def``.

What is measured
================
N PlaceOrder commands wait in one endpoint's queue (one consumer thread, prefetch 16, as
:mod:`bench.idembus_flow`); its aggregate handler changes the Order and publishes one
OrderPlaced (nobody subscribes: the broker drops it after confirming it). The rate is N
handled messages over the time from the first delivery to the Nth handled message.

The variants differ only in how the handling method is written; the body is one function:

* ``sync``: ``def place(...)``.
* ``async``: ``async def place(...)`` with the same body: it runs to completion on the
  consumer thread's event loop (:mod:`idembus.runtime.aio`). ``ratio_async`` = async / sync is the
  price of the loop; the goal is at least 0.9.
* ``async_await``: the same, awaiting ``asyncio.sleep(0)`` first: one real suspension and
  resumption through the loop per message, as a handler awaiting I/O has (informative).

Transports as in :mod:`bench.throughput` (memory:// and RabbitMQ at ``IDEMBUS_AMQP_URL``,
skipped when unreachable); storage MemoryStorage by default, where the bus' own overhead
shows most (``--storages memory,postgres`` adds PostgreSQL at ``IDEMBUS_POSTGRES_URL``, as
in a deployment; ``mongomock`` too). Each round runs every variant once, in a
rotating order, after an untimed warm-up; the table shows the median rate of each variant
and, as ``x sync``/``ratio_*``, the median over rounds of the variant's rate over the sync
rate of the same round (pairs run back to back share the machine's load of the moment).

Run ``python -m bench.async_handlers`` (``--messages 500 --rounds 2`` for a quick look);
results also go to ``bench/results/async_handlers.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import logging
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import idembus_flow
from bench.common import (
    MEMORY_POLLING_INTERVAL,
    PREFETCH,
    TRANSPORT_URLS,
    FlowClock,
    Measurement,
    display_url,
    orders,
    timeout_for,
    unique_suffix,
    unreachable_reason,
)
from bench.throughput import write_json
from idembus.handlers import AggregateHandler, handles
from idembus.runtime.endpoint import Endpoint
from idembus.transports.kombu import KombuTransport
from samples.ordering.messages import OrderPlaced, PlaceOrder
from samples.ordering.sales import Order

RESULTS = Path(__file__).resolve().parent / "results" / "async_handlers.json"
WARM_UP_ORDERS = 100
#: Storages measured: those of :mod:`bench.idembus_flow` (PostgreSQL at
#: ``IDEMBUS_POSTGRES_URL``, tables of their own per run, dropped afterwards).
STORAGES = list(idembus_flow.STORAGES)


def place(handler: AggregateHandler[Order], message: PlaceOrder) -> None:
    """The one body every variant runs (that of ``samples.ordering.sales.OrderHandler``)."""
    handler.state.status = "placed"
    handler.state.customer = message.customer
    handler.state.amount_cents = message.amount_cents
    handler.state.times_placed += 1
    handler.bus.publish(OrderPlaced(order_id=message.order_id, customer=message.customer,
                                    amount_cents=message.amount_cents))


class SyncOrders(AggregateHandler[Order]):
    def aggregate_id(self, message: PlaceOrder) -> str:
        return message.order_id

    @handles
    def place(self, message: PlaceOrder) -> None:
        place(self, message)


class AsyncOrders(AggregateHandler[Order]):
    def aggregate_id(self, message: PlaceOrder) -> str:
        return message.order_id

    @handles
    async def place(self, message: PlaceOrder) -> None:
        place(self, message)


class AwaitingOrders(AggregateHandler[Order]):
    def aggregate_id(self, message: PlaceOrder) -> str:
        return message.order_id

    @handles
    async def place(self, message: PlaceOrder) -> None:
        await asyncio.sleep(0)
        place(self, message)


#: variant key -> (label in the table, handler class)
VARIANTS: dict[str, tuple[str, type[AggregateHandler[Order]]]] = {
    "sync": ("def handler", SyncOrders),
    "async": ("async def handler", AsyncOrders),
    "async_await": ("async def + await sleep(0)", AwaitingOrders),
}


@dataclass
class Orders:
    """One run's endpoint, its transport (kept with its kombu type for the clean-up), its
    storage kind and the clock watching it."""

    endpoint: Endpoint
    transport: KombuTransport
    storage: str
    clock: FlowClock


def build(url: str, storage: str, handler: type[AggregateHandler[Order]],
          count: int) -> Orders:
    """The endpoint of one run on fresh queues (and tables), declared, with its clock."""
    suffix = unique_suffix()
    polling = MEMORY_POLLING_INTERVAL if url.startswith("memory://") else None
    transport = KombuTransport(url, exchange=f"bench.events.{suffix}", polling_interval=polling)
    endpoint = Endpoint(f"bench-orders-{suffix}", transport=transport,
                        storage=idembus_flow.STORAGES[storage](f"bench-orders-{suffix}"),
                        handlers=[handler], error_queue=f"bench-error-{suffix}",
                        concurrency=1, prefetch=PREFETCH)
    clock = FlowClock(count)
    endpoint.signals.received.connect(lambda sender, **_: clock.start(), weak=False)
    endpoint.signals.handled.connect(lambda sender, **_: clock.finish_one(), weak=False)
    transport.declare(endpoint.name, subscriptions=endpoint.subscriptions)
    return Orders(endpoint, transport, storage, clock)


def preload(orders_run: Orders, count: int) -> None:
    """Queue ``count`` PlaceOrder commands while the endpoint does not consume."""
    for command in orders(count):
        orders_run.endpoint.bus.send(command)


def cleanup(orders_run: Orders) -> None:
    """Close the endpoint; delete the run's queues, exchange and tables."""
    endpoint, transport = orders_run.endpoint, orders_run.transport
    endpoint.close()
    for queue in (endpoint.name, endpoint.error_queue):
        transport.delete_queue(queue)
    with contextlib.suppress(KeyError):  # memory:// never made one nothing was published to
        transport.delete_exchange()
    idembus_flow.drop_storage(orders_run.storage, endpoint.name)


def run(url: str, storage: str, handler: type[AggregateHandler[Order]], count: int, *,
        timeout: float | None = None) -> float:
    """One timed run; returns the seconds taken for ``count`` handled messages. It fails
    after ``timeout`` seconds (by default :func:`~bench.common.timeout_for` the messages)."""
    orders_run = build(url, storage, handler, count)
    endpoint = orders_run.endpoint
    try:
        preload(orders_run, count)
        endpoint.start()
        seconds = orders_run.clock.wait(timeout_for(count) if timeout is None else timeout)
    finally:
        cleanup(orders_run)
    counts = endpoint.counters.snapshot()
    if counts["handled"] != count or counts["dead_lettered"] or counts["duplicate"]:
        raise RuntimeError(f"{endpoint.name} did not handle {count} messages cleanly: {counts}")
    return seconds


def measure(url: str, storage: str, count: int, rounds: int) -> dict[str, Measurement]:
    """Warm up, then run every variant ``rounds`` times in rotating order."""
    for _, handler in VARIANTS.values():
        run(url, storage, handler, min(WARM_UP_ORDERS, count))
    results = {key: Measurement(key, count) for key in VARIANTS}
    keys = list(VARIANTS)
    for round_index in range(rounds):
        shift = round_index % len(keys)
        for key in keys[shift:] + keys[:shift]:
            label, handler = VARIANTS[key]
            results[key].seconds.append(run(url, storage, handler, count))
            print(f"  round {round_index + 1}: {label:<27} {results[key].rates[-1]:>9.0f} "
                  "msgs/s", flush=True)
    return results


def paired_ratios(results: dict[str, Measurement]) -> dict[str, float]:
    """Per variant, the median over rounds of its rate / the sync rate *of the same round*:
    a round runs every variant back to back, so a pair shares the machine's load of the
    moment, and the ratio stays steady where the rates themselves drift."""
    sync = results["sync"].rates
    return {key: statistics.median(rate / base for rate, base in zip(m.rates, sync,
                                                                     strict=True))
            for key, m in results.items() if key != "sync"}


def print_table(name: str, storage: str, count: int, results: dict[str, Measurement]) -> None:
    ratios = paired_ratios(results)
    print(f"\n{name} + {storage} storage: {count} messages per run, median of "
          f"{len(results['sync'].seconds)} rounds; x sync = median of the rounds' ratios")
    print(f"{'variant':<28} {'msgs/s':>9} {'x sync':>7}  rounds (msgs/s)")
    for key, measurement in results.items():
        rounds = " ".join(f"{rate:.0f}" for rate in measurement.rates)
        print(f"{VARIANTS[key][0]:<28} {measurement.median:>9.0f} "
              f"{ratios.get(key, 1.0):>7.3f}  {rounds}")


def summary(name: str, storage: str, results: dict[str, Measurement]) -> str:
    """``async_handlers: memory+memory sync=... async=... ratio_async=... ...``"""
    fields = [f"{key}={m.median:.0f}" for key, m in results.items()]
    ratios = [f"ratio_{key}={ratio:.3f}" for key, ratio in paired_ratios(results).items()]
    return f"async_handlers: {name}+{storage} " + " ".join(fields + ratios)


def bench(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    report: dict[str, Any] = {
        "generated": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(), "messages_per_run": args.messages,
        "rounds": args.rounds, "statistic": "median", "runs": [],
    }
    lines: list[str] = []
    for name in args.transports:
        url = TRANSPORT_URLS[name]
        reason = unreachable_reason(url)
        if reason:
            print(f"\n{name}: skipped: {reason}")
            report["runs"].append({"transport": name, "skipped": reason})
            continue
        for storage in args.storages:
            print(f"\n{name}: {display_url(url)}, storage {storage}")
            results = measure(url, storage, args.messages, args.rounds)
            print_table(name, storage, args.messages, results)
            lines.append(summary(name, storage, results))
            report["runs"].append({
                "transport": name, "url": display_url(url), "storage": storage,
                "variants": {key: m.as_json() for key, m in results.items()},
                "ratios": {key: round(ratio, 4)
                           for key, ratio in paired_ratios(results).items()},
            })
    return report, lines


def _names(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = sorted(set(names) - set(choices))
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}")
        return names

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.async_handlers",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=2000, metavar="N",
                        help="PlaceOrder commands per run (2000)")
    parser.add_argument("--rounds", type=int, default=9, help="timed runs per variant (9)")
    parser.add_argument("--transports", type=_names(list(TRANSPORT_URLS)),
                        default=list(TRANSPORT_URLS), help="memory,amqp (both)")
    parser.add_argument("--storages", type=_names(STORAGES), default=["memory"],
                        help="default,memory,mongomock,postgres (memory)")
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"results file ({RESULTS})")
    args = parser.parse_args(argv)
    if args.messages < 1 or args.rounds < 1:
        parser.error("--messages and --rounds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Every run says that MemoryStorage is process-local; the table says it once.
    endpoint_log = logging.getLogger("idembus.runtime.endpoint")
    level = endpoint_log.level
    endpoint_log.setLevel(logging.ERROR)
    try:
        report, lines = bench(args)
    finally:  # main() also runs inside the tests: leave the logger as it was
        endpoint_log.setLevel(level)
    print()
    for line in lines:
        print(line)
    write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
