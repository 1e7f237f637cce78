"""What a PostgreSQL failover costs and loses, with a synchronous standby and without.

What is measured
================
For each replication mode (``synchronous``: the standby in ``synchronous_standby_names``,
``synchronous_commit = on``; ``asynchronous``: no synchronous standby and
``synchronous_commit = off``), on a fresh primary/standby pair
(:mod:`idembus.testing.pg_cluster`), two runs; in each the primary is SIGKILLed while
deposits are being handled and the standby promoted:

* ``storage``: an accounts endpoint on memory:// with its storage on the pair (multi-host
  conninfo), a ledger endpoint on memory:// that notes each Deposited event's cause.
  Reported: deposits sent, applied in the surviving database, lost (acknowledged by the
  broker, no commit on the survivor), applied twice, and ledger entries whose deposit has
  no commit on the survivor (sent by a commit the failover lost).
* ``transport``: queue and storage on the pair (one transaction commits the state, the
  sends and the acknowledgement); half the deposits sent before the kill, half after.
  Reported: deposits whose send returned, applied, lost, applied twice.

And for each: seconds from the kill to ``pg_ctl promote`` returning, to the first commit
through the multi-host conninfo, and to the first message handled on the promoted standby.

Run::

    python -m bench.pg_failover [--deposits 1200] [--out bench/results/<date>-pg-failover.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import threading
import time
import uuid
from typing import Any

import psycopg
from pydantic import BaseModel

from idembus import Command, Endpoint, Event
from idembus import headers as h
from idembus.handlers import AggregateHandler, Handler, handles
from idembus.storage.memory import MemoryStorage
from idembus.storage.postgres import PostgresStorage
from idembus.testing import wait_until_idle
from idembus.testing.pg_cluster import Failover, PostgresPair
from idembus.transports.errors import TransportUnavailable
from idembus.transports.kombu import KombuTransport
from idembus.transports.postgres import PostgresTransport

ACCOUNTS = 20


class Pay(Command, message_name="bench.failover.Pay"):
    account: str


class Paid(Event, message_name="bench.failover.Paid"):
    account: str


class Balance(BaseModel):
    payments: int = 0


class Accounts(AggregateHandler[Balance]):
    def aggregate_id(self, message: Pay) -> str:
        return message.account

    @handles
    def pay(self, message: Pay) -> None:
        self.state.payments += 1
        self.bus.publish(Paid(account=message.account))


class Causes(Handler):
    """Notes the cause (the Pay's id) of each Paid it handles."""

    def __init__(self) -> None:
        self.causes: list[str] = []
        self._lock = threading.Lock()

    @handles
    def paid(self, message: Paid) -> None:
        with self._lock:
            self.causes.append(self.context.headers.get(h.CAUSATION_ID, ""))


class Moments:
    def __init__(self, endpoint: Endpoint) -> None:
        self.times: list[float] = []
        endpoint.signals.handled.connect(self._on, weak=False)

    def _on(self, sender: object, **details: Any) -> None:
        self.times.append(time.monotonic())

    def first_after(self, killed: float, promoted: float) -> float | None:
        """Seconds from ``killed`` to the first message handled once the standby was
        promoted (one handled in between was committed by the old primary)."""
        later = [t for t in list(self.times) if t > killed + promoted]
        return round(min(later) - killed, 3) if later else None


def survivors(pair: PostgresPair, prefix: str) -> tuple[dict[str, int], dict[str, int]]:
    """Each processed Pay id on the survivor, and each account's applied payments."""
    with psycopg.connect(pair.url) as connection:
        keys = connection.execute(f"SELECT key, aggregate_id FROM {prefix}_processed "
                                  "WHERE aggregate_type = 'Balance'").fetchall()
        states = connection.execute(f"SELECT aggregate_id, (state->>'payments')::int FROM "
                                    f"{prefix}_aggregates WHERE aggregate_type = "
                                    "'Balance'").fetchall()
    processed: dict[str, int] = {}
    per_account: dict[str, int] = {}
    for key, account in keys:
        processed[key.split("/", 1)[1]] = 1
        per_account[account] = per_account.get(account, 0) + 1
    applied = {account: payments for account, payments in states}
    doubled = {account: applied[account] - per_account.get(account, 0) for account in applied}
    return processed, doubled


def timings(failover: Failover, moments: Moments, killed: float) -> dict[str, Any]:
    """The seconds a failover took (see the module docstring)."""
    return {"seconds_to_promoted": round(failover.seconds_to_promoted, 3),
            "seconds_to_first_commit": round(failover.seconds_to_first_commit, 3),
            "seconds_to_first_handled": moments.first_after(
                killed, failover.seconds_to_promoted)}


def send(endpoint: Endpoint, account: str) -> str:
    """Send a Pay; a pooled connection to the killed primary fails once (retried)."""
    for _ in range(50):
        try:
            return endpoint.bus.send(Pay(account=account))
        except TransportUnavailable:
            time.sleep(0.1)
    return endpoint.bus.send(Pay(account=account))


def run_storage(pair: PostgresPair, deposits: int) -> dict[str, Any]:
    suffix = uuid.uuid4().hex[:8]
    storage = PostgresStorage(pair.url, table_prefix=f"fs_{suffix}", connect_timeout=30)
    storage.migrate()
    causes = Causes()
    accounts = Endpoint(f"fs-accounts-{suffix}", transport=KombuTransport("memory://"),
                        storage=storage, handlers=[Accounts])
    ledger = Endpoint(f"fs-ledger-{suffix}", transport=KombuTransport("memory://"),
                      storage=MemoryStorage(), handlers=[causes])
    moments = Moments(accounts)
    ledger.start()
    accounts.start()
    try:
        sent = [accounts.bus.send(Pay(account=f"a{i % ACCOUNTS}")) for i in range(deposits)]
        while len(moments.times) < deposits // 3:
            time.sleep(0.01)
        killed = time.monotonic()
        failover = pair.fail_over()
        wait_until_idle([accounts, ledger], timeout=300)
        processed, doubled = survivors(pair, storage.table_prefix)
        lost = [message for message in sent if message not in processed]
        orphaned = [cause for cause in causes.causes if cause not in processed]
        return {"sent": len(sent), "applied": len(processed), "lost": len(lost),
                "applied_twice": sum(doubled.values()),
                "ledger_entries": len(causes.causes),
                "ledger_entries_of_lost_commits": len(orphaned),
                **timings(failover, moments, killed)}
    finally:
        accounts.close()
        ledger.close()
        storage.close()


def run_transport(pair: PostgresPair, deposits: int) -> dict[str, Any]:
    suffix = uuid.uuid4().hex[:8]
    storage = PostgresStorage(pair.url, table_prefix=f"ft_{suffix}", connect_timeout=30)
    transport = PostgresTransport(pair.url, table_prefix=f"ft_{suffix}_q", connect_timeout=30)
    storage.migrate()
    transport.migrate()
    queue = f"ft-accounts-{suffix}"
    accounts = Endpoint(queue, transport=transport, storage=storage, handlers=[Accounts])
    moments = Moments(accounts)
    accounts.start()
    try:
        sent = [send(accounts, f"a{i % ACCOUNTS}") for i in range(deposits // 2)]
        while len(moments.times) < deposits // 6:
            time.sleep(0.01)
        killed = time.monotonic()
        failover = pair.fail_over()
        sent += [send(accounts, f"a{i % ACCOUNTS}") for i in range(deposits // 2)]
        wait_until_idle([accounts], timeout=300)
        processed, doubled = survivors(pair, storage.table_prefix)
        lost = [message for message in sent if message not in processed]
        return {"sent": len(sent), "applied": len(processed), "lost": len(lost),
                "applied_twice": sum(doubled.values()),
                "left_in_queue": transport.pending(queue),
                **timings(failover, moments, killed)}
    finally:
        accounts.close()
        transport.close()
        storage.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--deposits", type=int, default=1200)
    parser.add_argument("--out", default=None)
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    results: dict[str, Any] = {"date": datetime.date.today().isoformat(),
                               "deposits": options.deposits}
    for mode, synchronous in (("synchronous", True), ("asynchronous", False)):
        for name, run in (("storage", run_storage), ("transport", run_transport)):
            with PostgresPair(synchronous=synchronous, timeout=120) as pair:
                result = run(pair, options.deposits)
            results[f"{mode}/{name}"] = result
            print(f"{mode:12} {name:9} {json.dumps(result)}", flush=True)
    if options.out:
        with open(options.out, "w", encoding="utf-8") as out:
            json.dump(results, out, indent=2)
            out.write("\n")


if __name__ == "__main__":
    main()
