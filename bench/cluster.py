"""Throughput on a three-node RabbitMQ cluster as a ratio to one node, measured in one run.

N deposits (2,000 by default) wait in Sales' queue; Sales handles each (an Account
aggregate, one commit) and publishes Deposited; a Ledger endpoint records each. The rate
is 2N handled messages over the time from the endpoints' start to the ledger's Nth entry.
The same flow runs on one node (``IDEMBUS_AMQP_URL``, queues of its own) and on
three clustered nodes started for the run (:class:`idembus.testing.cluster.RabbitCluster`,
every quorum queue replicated on all three, clients given every node's URL), alternately,
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
from pathlib import Path

from idembus import Endpoint
from idembus.envelope import Envelope
from idembus.routing import Router
from idembus.sending import Bus
from idembus.testing.cluster import RabbitCluster
from idembus.transports.kombu import KombuTransport
from idembus.transports.kombu_core import GROUP_SIZE
from tests.support import AccountHandler, Deposit, Ledger, SignalCounter

RESULTS = Path(__file__).resolve().parent / "results" / "cluster.json"


def flow_rate(urls: list[str], deposits: int) -> float:
    """Handled messages a second of the Sales -> Ledger flow over ``urls``."""
    queue = f"sales-{uuid.uuid4().hex[:8]}"
    # On the cluster every queue on every node; one node keeps its delay levels as they are
    arguments = {GROUP_SIZE: len(urls)} if len(urls) > 1 else None
    loader = KombuTransport(urls, queue_arguments=arguments)
    loader.declare(queue)
    outgoing: list[Envelope] = []
    bus = Bus("bench", Router({Deposit: queue}), outgoing.append)
    for number in range(deposits):
        bus.send(Deposit(account=f"acc-{number % 50}", amount=1))
    for failure in loader.dispatch_many(outgoing):
        if isinstance(failure, Exception):
            raise failure
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__)
    parser.add_argument("--deposits", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    single_url = os.environ.get("IDEMBUS_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
    rates: dict[str, list[float]] = {"one node": [], "three nodes": []}
    with tempfile.TemporaryDirectory(prefix="idembus-bench-cluster-") as directory:
        cluster = RabbitCluster(directory)
        try:
            cluster.start()
            flow_rate([single_url], 200)  # warm-up, untimed
            flow_rate(cluster.urls(), 200)
            for round_number in range(args.rounds):
                order = [("one node", [single_url]), ("three nodes", cluster.urls())]
                for name, urls in order if round_number % 2 == 0 else order[::-1]:
                    rates[name].append(flow_rate(urls, args.deposits))
                    print(f"round {round_number + 1}: {name} {rates[name][-1]:.0f} msg/s",
                          flush=True)
        finally:
            cluster.stop(remove=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratio = medians["three nodes"] / medians["one node"]
    print(f"one node {medians['one node']:.0f} msg/s, three nodes {medians['three nodes']:.0f}"
          f" msg/s: ratio {ratio:.2f}")
    RESULTS.write_text(json.dumps({"deposits": args.deposits, "rates": rates,
                                   "medians": medians, "ratio": round(ratio, 3),
                                   "cores": os.cpu_count()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
