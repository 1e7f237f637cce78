"""The event journal and the gateway on PostgreSQL: what journaling costs a publisher, and
how fast the stream reaches its clients.

What is measured
================
* **journal cost** — units of work on PostgreSQL, each committing one aggregate and
  publishing one event (on memory://, so the broker is not what is timed), with
  ``journal=False`` and ``journal=True`` in the same run, interleaved, best of ``--rounds``.
  The ratio with/without is the price of appending to the journal (one more transaction
  under the journal's advisory lock);
* **stream delivery** — ``--clients`` httpx clients read the gateway's stream (over
  loopback, one thread each) while ``--events`` events are appended to the journal at full
  speed; the rate is events per second that every client received, from the first append
  to the last client's last event. The baseline is the rate at which the events were
  appended in the same run: a ratio of 1.0 means the clients kept up with the writers.

Every client must receive every position once, in order, or the run fails.

Run ``python -m bench.gateway`` (``make bench``).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid
from collections.abc import Sequence

import httpx
from pydantic import BaseModel

from bench.pg_common import POSTGRES_URL
from idembus import Endpoint, Event
from idembus.gateway import Gateway
from idembus.storage.base import JournalEntry
from idembus.storage.postgres import PostgresStorage


class Account(BaseModel):
    balance: int = 0


class Deposited(Event, message_name="bench.Deposited"):
    account: str
    amount: int


def unit_of_work_rate(journal: bool, count: int) -> float:
    """Units of work per second on a fresh table prefix."""
    storage = PostgresStorage(POSTGRES_URL, table_prefix=f"bg{uuid.uuid4().hex[:10]}")
    endpoint = Endpoint(f"bench-{uuid.uuid4().hex[:6]}", storage=storage, journal=journal)
    try:
        storage.verify()
        started = time.perf_counter()
        for n in range(count):
            with endpoint.unit_of_work(Account, f"a{n % 1000}") as work:
                work.state.balance += 1
                work.bus.publish(Deposited(account=f"a{n % 1000}", amount=1))
        return count / (time.perf_counter() - started)
    finally:
        storage.drop_tables()
        endpoint.close()


def stream_rates(clients: int, count: int) -> tuple[float, float]:
    """(append rate, delivery rate to every client) in events per second."""
    storage = PostgresStorage(POSTGRES_URL, table_prefix=f"bg{uuid.uuid4().hex[:10]}")
    endpoint = Endpoint(f"bench-{uuid.uuid4().hex[:6]}", storage=storage, journal=True)
    gateway = Gateway(endpoint, port=0, buffer=5000)
    storage.verify()
    gateway.start()
    ready = threading.Barrier(clients + 1)
    finished: list[float] = []
    failures: list[str] = []

    def read() -> None:
        with httpx.Client(timeout=60.0) as client, client.stream(
                "GET", gateway.url + "/", headers={"Accept": "text/event-stream"}) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("retry:"))  # subscribed
            ready.wait()
            expected = 1
            for line in lines:
                if not line.startswith("id: "):
                    continue
                if int(line[4:]) != expected:
                    failures.append(f"expected {expected}, got {line[4:]}")
                    return
                if expected == count:
                    finished.append(time.perf_counter())
                    return
                expected += 1

    readers = [threading.Thread(target=read) for _ in range(clients)]
    try:
        for reader in readers:
            reader.start()
        ready.wait()
        started = time.perf_counter()
        body = '{"account": "a", "amount": 1}'
        for first in range(0, count, 50):
            storage.append_journal([
                JournalEntry(message_id=str(uuid.uuid4()), message_type="bench.Deposited",
                             headers={}, body=body, aggregate_type="Account",
                             aggregate_id="a")
                for _ in range(first, min(count, first + 50))])
        appended = time.perf_counter()
        for reader in readers:
            reader.join(120)
        if failures or len(finished) != clients:
            raise SystemExit(f"stream failed: {failures or 'a client did not finish'}")
        return count / (appended - started), count / (max(finished) - started)
    finally:
        gateway.stop()
        storage.drop_tables()
        endpoint.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--units", type=int, default=2000, help="units of work per run (2000)")
    parser.add_argument("--events", type=int, default=20000, help="events streamed (20000)")
    parser.add_argument("--clients", type=int, default=10, help="stream clients (10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each (3)")
    args = parser.parse_args(argv)
    unit_of_work_rate(True, 200)  # warm-up: pool, schema creation
    without: list[float] = []
    with_journal: list[float] = []
    for _ in range(args.rounds):
        without.append(unit_of_work_rate(False, args.units))
        with_journal.append(unit_of_work_rate(True, args.units))
    appended, delivered = max((stream_rates(args.clients, args.events)
                               for _ in range(args.rounds)), key=lambda rates: rates[1])
    print(f"units of work on PostgreSQL, best of {args.rounds}: without journal "
          f"{max(without):.0f}/s, with journal {max(with_journal):.0f}/s")
    print(f"stream: {args.events} events appended at {appended:.0f}/s, received by each of "
          f"{args.clients} clients at {delivered:.0f}/s")
    print(f"bench: uow_plain={max(without):.0f} uow_journal={max(with_journal):.0f} "
          f"journal_ratio={max(with_journal) / max(without):.2f} append={appended:.0f} "
          f"delivered_{args.clients}_clients={delivered:.0f} "
          f"delivery_ratio={delivered / appended:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
