"""Run the ordering sample end to end and print one line computed from the stores.

    python -m samples.ordering                       # memory:// and embedded mongomock
    python -m samples.ordering --transport amqp://guest:guest@127.0.0.1:5672// --orders 1000
    python -m samples.ordering --transport postgresql://postgres@127.0.0.1:5432/test \\
        --storage postgresql://postgres@127.0.0.1:5432/test    # no broker: one transaction
    python -m samples.ordering --transport mongodb://127.0.0.1:27017/shop --mongomock
"""

from __future__ import annotations

import argparse
import logging
import sys
import uuid
from collections.abc import Callable

from idembus import Endpoint
from idembus.redaction import redact
from idembus.storage.base import Storage
from idembus.storage.mongo import MongoStorage
from idembus.testing.faults import RandomCrashes
from samples.ordering.brokers import Broker
from samples.ordering.system import build, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m samples.ordering", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", default="memory://",
                        help="where the queues are: a kombu URL (memory://, amqp://, "
                             "redis://), postgresql://... or mongodb://... (memory://)")
    parser.add_argument("--storage", default="mongomock",
                        help="mongomock (embedded), or a postgresql:// URL; the same database "
                             "as a postgresql:// transport makes commit, send and ack one "
                             "transaction (mongomock)")
    parser.add_argument("--mongomock", action="store_true",
                        help="serve a mongodb:// transport with mongomock in this process")
    parser.add_argument("--orders", type=int, default=200, help="orders to place (200)")
    parser.add_argument("--duplicates", type=float, default=0.2,
                        help="share of orders sent twice with the same id (0.2)")
    parser.add_argument("--crash-rate", type=float, default=0.05,
                        help="chance of a simulated crash at each crash point (0.05)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--concurrency", type=int, default=2, help="threads per endpoint (2)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    said_above = _SaidAbove()
    logging.getLogger("idembus.runtime.endpoint").addFilter(said_above)
    try:
        return _run(args)
    finally:  # main() also runs inside tests: leave the logger as it was
        logging.getLogger("idembus.runtime.endpoint").removeFilter(said_above)


def _run(args: argparse.Namespace) -> int:

    duplicates = max(1, int(args.orders * args.duplicates)) if args.duplicates > 0 else 0
    namespace = uuid.uuid4().hex[:8]
    broker = Broker(args.transport, f"ordering_{namespace}", mongomock=args.mongomock)
    storages: list[Storage] = []
    system = build(broker.transport, namespace=namespace, concurrency=args.concurrency,
                   storage=_storages(args.storage, namespace, storages),
                   middleware=[RandomCrashes(args.crash_rate, seed=args.seed)])
    print(runs_on(system.sales), file=sys.stderr, flush=True)
    try:
        result = run(system, args.orders, duplicates, seed=args.seed)
    finally:
        system.close()
        broker.clean([endpoint.name for endpoint in system.endpoints]
                     + [system.sales.error_queue])
        for storage in storages:
            _drop(storage)
    print(result.line())
    for line in result.violations:
        print(line, file=sys.stderr)
    return 0 if result.ok else 1


def runs_on(endpoint: Endpoint) -> str:
    """What the sample's endpoints run on, truthfully: where the queues and the stores are,
    and whether they outlive this process."""
    transport, storage = endpoint.transport, endpoint.storage
    queues = getattr(transport, "safe_url", None) or type(transport).__name__
    if isinstance(storage, MongoStorage) and storage.process_local:
        stores = "mongomock, an in-memory MongoDB double"
    else:
        stores = f"{type(storage).__name__} ({redact(str(getattr(storage, 'conninfo', '')))})"
    local = [part for part, there in (("queues", transport.process_local),
                                      ("stores", storage.process_local)) if there]
    kept = (f"; the {' and '.join(local)} live in this process only and end with it (a trial: "
            "--transport and --storage name real services)" if local else "")
    return f"ordering sample: queues on {redact(queues)}, stores on {stores}{kept}"


class _SaidAbove(logging.Filter):
    """Drops the endpoints' warning that they run inside this process: the sample says it
    itself, once, before it starts (:func:`runs_on`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "process-local and not durable" not in str(record.msg)


def _drop(storage: Storage) -> None:
    """Drop a PostgreSQL storage's tables (its endpoint closed it: through a new one)."""
    from idembus.storage.postgres import PostgresStorage

    if isinstance(storage, PostgresStorage):
        dropper = PostgresStorage(storage.conninfo, table_prefix=storage.table_prefix)
        try:
            dropper.drop_tables()
        finally:
            dropper.close()


def _storages(option: str, namespace: str, made: list[Storage]) -> Callable[[str], Storage]:
    """The storage of each endpoint: embedded mongomock, or tables of its own in the
    PostgreSQL database ``option`` names (kept in ``made``, dropped at the end)."""
    if option == "mongomock":
        return MongoStorage.embedded

    def postgres(name: str) -> Storage:
        from idembus.storage.postgres import PostgresStorage

        endpoint = name.split("-", 1)[0]
        made.append(PostgresStorage(option, table_prefix=f"ordering_{namespace}_{endpoint}"))
        return made[-1]

    return postgres


if __name__ == "__main__":
    sys.exit(main())
