"""Throughput on a three-node RabbitMQ cluster as a ratio to one node, measured in one run.

``--flow ordering`` (the default): N orders (300 by default) wait in Sales' queue as
PlaceOrder commands; the ordering sample's three endpoints (:mod:`samples.ordering.system`:
Sales, Billing with its payment gateway, Shipping) take each through three handlers, so
an order is three handled messages. The rate is orders a second, from the endpoints'
start to Shipping's Nth handled message.

``--flow deposits``: N deposits (2,000 by default) wait in Sales' queue; Sales handles each
(an Account aggregate, one commit) and publishes Deposited; a Ledger endpoint records
each. The rate is 2N handled messages over the time from the endpoints' start to the
ledger's Nth entry.

The same flow runs on one node (``IDEMBUS_AMQP_URL``, queues of its own) and on three
clustered nodes started for the run (:class:`idembus.testing.cluster.RabbitCluster`, every
quorum queue replicated on all three, clients given every node's URL), alternately,
``--rounds`` times; the median of each and their ratio are printed and written to
``bench/results/cluster.json``. Storage is the endpoints' default (in memory): the
figure is the broker's share.

Run ``python -m bench.cluster``; ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from idembus import Endpoint
from idembus.envelope import Envelope
from idembus.routing import Router
from idembus.sending import Bus
from idembus.testing.cluster import RabbitCluster
from idembus.transports.kombu import KombuTransport
from idembus.transports.kombu_core import GROUP_SIZE
from samples.ordering.messages import PlaceOrder
from samples.ordering.system import build, order_commands
from tests.support import AccountHandler, Deposit, Ledger, SignalCounter

RESULTS = Path(__file__).resolve().parent / "results" / "cluster.json"
#: The flows, by ``--flow``: what one unit is, and how many of them a round sends.
UNITS = {"ordering": ("orders", 300), "deposits": ("handled messages", 2000)}


def _queue_arguments(urls: list[str]) -> dict[str, Any] | None:
    """On the cluster every queue on every node; one node keeps its delay levels as they
    are."""
    return {GROUP_SIZE: len(urls)} if len(urls) > 1 else None


def _preload(loader: KombuTransport, queue: str, send: Callable[[Bus], None]) -> None:
    """Declare ``queue`` and fill it with what ``send`` sends, confirmed by the broker."""
    loader.declare(queue)
    outgoing: list[Envelope] = []
    send(Bus("bench", Router({PlaceOrder: queue, Deposit: queue}), outgoing.append))
    for failure in loader.dispatch_many(outgoing):
        if isinstance(failure, Exception):
            raise failure


def flow_rate(urls: list[str], deposits: int) -> float:
    """Handled messages a second of the Sales -> Ledger flow over ``urls``."""
    queue = f"sales-{uuid.uuid4().hex[:8]}"
    arguments = _queue_arguments(urls)
    loader = KombuTransport(urls, queue_arguments=arguments)

    def send(bus: Bus) -> None:
        for number in range(deposits):
            bus.send(Deposit(account=f"acc-{number % 50}", amount=1))

    _preload(loader, queue, send)
    ledger = Ledger()
    sales = Endpoint(queue, handlers=[AccountHandler], status_interval=0,
                     error_queue=f"error-{queue}",
                     transport=KombuTransport(urls, queue_arguments=arguments))
    billing = Endpoint(f"ledger-{queue}", handlers=[ledger], status_interval=0,
                       error_queue=f"error-{queue}",
                       transport=KombuTransport(urls, queue_arguments=arguments))
    recorded = SignalCounter(billing, "handled")
    try:
        billing.start()
        began = time.monotonic()
        sales.start()
        if not recorded.wait_for(deposits, timeout=600):
            raise RuntimeError(f"{recorded.count} of {deposits} deposits recorded in 600 s")
        return 2 * deposits / (time.monotonic() - began)
    finally:
        sales.close()
        billing.close()
        for name in (queue, f"ledger-{queue}", f"error-{queue}"):
            loader.delete_queue(name)
        loader.close()


def ordering_rate(urls: list[str], orders: int) -> float:
    """Orders a second through the ordering sample's Sales, Billing and Shipping over
    ``urls`` (events on an exchange of their own, deleted afterwards)."""
    namespace = uuid.uuid4().hex[:8]
    exchange = f"idembus.events-bench-{namespace}"
    arguments = _queue_arguments(urls)

    def transport() -> KombuTransport:
        return KombuTransport(urls, queue_arguments=arguments, exchange=exchange)

    loader = transport()
    system = build(transport, namespace=namespace)
    queues = [endpoint.name for endpoint in system.endpoints] + [system.sales.error_queue]

    def send(bus: Bus) -> None:
        for command, message_id, _ in order_commands(orders, 0):
            bus.send(command, message_id=message_id)

    shipped = SignalCounter(system.shipping, "handled")
    try:
        _preload(loader, system.sales.name, send)
        system.shipping.start()
        system.billing.start()
        began = time.monotonic()
        system.sales.start()
        if not shipped.wait_for(orders, timeout=600):
            raise RuntimeError(f"{shipped.count} of {orders} orders shipped in 600 s")
        return orders / (time.monotonic() - began)
    finally:
        system.close()
        for name in queues:
            loader.delete_queue(name)
        loader.delete_exchange()
        loader.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flow", choices=sorted(UNITS), default="ordering",
                        help="the ordering sample (default) or the deposits flow")
    parser.add_argument("--count", type=int, default=None,
                        help="orders, or deposits, a round (300 orders; 2,000 deposits)")
    parser.add_argument("--deposits", type=int, default=None,
                        help="the deposits flow with this many deposits a round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.deposits is not None:
        args.flow, args.count = "deposits", args.deposits
    unit, default_count = UNITS[args.flow]
    count = args.count if args.count is not None else default_count
    rate = ordering_rate if args.flow == "ordering" else flow_rate
    single_url = os.environ.get("IDEMBUS_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
    rates: dict[str, list[float]] = {"one node": [], "three nodes": []}
    with tempfile.TemporaryDirectory(prefix="idembus-bench-cluster-") as directory:
        cluster = RabbitCluster(directory)
        try:
            cluster.start()
            rate([single_url], max(1, count // 10))  # warm-up, untimed
            rate(cluster.urls(), max(1, count // 10))
            for round_number in range(args.rounds):
                order = [("one node", [single_url]), ("three nodes", cluster.urls())]
                for name, urls in order if round_number % 2 == 0 else order[::-1]:
                    rates[name].append(rate(urls, count))
                    print(f"round {round_number + 1}: {name} {rates[name][-1]:.1f} {unit}/s",
                          flush=True)
        finally:
            cluster.stop(remove=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratio = medians["three nodes"] / medians["one node"]
    per_round = [round(three / one, 3)
                 for one, three in zip(rates["one node"], rates["three nodes"], strict=True)]
    print(f"{args.flow}: one node {medians['one node']:.1f} {unit}/s, three nodes "
          f"{medians['three nodes']:.1f} {unit}/s: ratio {ratio:.2f} (per round "
          f"{', '.join(f'{value:.2f}' for value in per_round)})")
    RESULTS.write_text(json.dumps({"flow": args.flow, "unit": f"{unit} a second",
                                   "count": count, "rounds": args.rounds, "rates": rates,
                                   "medians": medians, "ratio": round(ratio, 3),
                                   "ratio_per_round": per_round,
                                   "cores": os.cpu_count()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
