"""Run the ordering sample end to end and print one line computed from the stores.

    python -m samples.ordering                       # memory:// and MemoryStorage
    python -m samples.ordering --transport amqp://guest:guest@127.0.0.1:5672// --orders 1000
"""

from __future__ import annotations

import argparse
import logging
import sys
import uuid

from idembus.faults import RandomCrashes
from idembus.transports.kombu import KombuTransport
from samples.ordering.system import build, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m samples.ordering", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", default="memory://", help="kombu URL (memory://)")
    parser.add_argument("--orders", type=int, default=200, help="orders to place (200)")
    parser.add_argument("--duplicates", type=float, default=0.2,
                        help="share of orders sent twice with the same id (0.2)")
    parser.add_argument("--crash-rate", type=float, default=0.05,
                        help="chance of a simulated crash at each crash point (0.05)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--concurrency", type=int, default=2, help="threads per endpoint (2)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    duplicates = max(1, int(args.orders * args.duplicates)) if args.duplicates > 0 else 0
    namespace = uuid.uuid4().hex[:8]
    transports: list[KombuTransport] = []

    def transport() -> KombuTransport:
        transports.append(KombuTransport(args.transport))
        return transports[-1]

    system = build(transport, namespace=namespace, concurrency=args.concurrency,
                   middleware=[RandomCrashes(args.crash_rate, seed=args.seed)])
    try:
        result = run(system, args.orders, duplicates, seed=args.seed)
    finally:
        system.close()
        if not args.transport.startswith("memory"):
            cleaner = KombuTransport(args.transport)
            for endpoint in system.endpoints:
                cleaner.delete_queue(endpoint.name)
            cleaner.delete_queue(system.sales.error_queue)
            cleaner.close()
    print(result.line())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
