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
* **load** (:func:`run_load`) — ``idembus gateway`` in a process of its own holds
  ``--idle`` idle connections (half never send a request, half are keep-alive connections
  after an answer) and ``--streams`` streaming clients on loopback while ``--load-events``
  events are appended: events delivered per client against events appended, and the
  gateway process's resident memory before the connections, with them open, and at its
  peak. ``tests/test_gateway_load.py`` runs it reduced in ``make test`` (full size with
  ``IDEMBUS_GATEWAY_LOAD=full``).

Every client must receive every position once, in order, or the run fails.

Run ``python -m bench.gateway`` (``make bench``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import pathlib
import resource
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Sequence

import httpx
from pydantic import BaseModel

from bench.pg_common import POSTGRES_URL
from bench.pg_procs import resident_kib
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


#: The endpoint the load's gateway process serves: the journal of a PostgreSQL prefix.
LOAD_APP = textwrap.dedent('''
    import os

    from idembus import Endpoint
    from idembus.storage.postgres import PostgresStorage


    def endpoint() -> Endpoint:
        storage = PostgresStorage(os.environ["LOAD_POSTGRES"],
                                  table_prefix=os.environ["LOAD_PREFIX"])
        return Endpoint("gateway-load", storage=storage, journal=True)
''')

#: Root of the repository (the load's gateway process imports idembus from it).
ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What one load run measured."""

    idle: int
    streams: int
    appended: int
    #: Events each streaming client received (every position once, in order).
    delivered: list[int]
    #: Times clients reconnected with Last-Event-ID (after falling behind).
    reconnects: int
    #: Connections the gateway held open once every client was in.
    open_connections: int
    append_rate: float
    delivery_rate: float
    rss_start_mib: float
    rss_connected_mib: float
    rss_peak_mib: float

    @property
    def delivery_ratio(self) -> float:
        """The fewest events a client received, over the events appended."""
        return min(self.delivered) / self.appended if self.delivered else 0.0

    def line(self) -> str:
        return (f"load: idle={self.idle} streams={self.streams} appended={self.appended} "
                f"delivered_per_client={min(self.delivered)}..{max(self.delivered)} "
                f"delivery_ratio={self.delivery_ratio:.2f} reconnects={self.reconnects} "
                f"open_connections={self.open_connections} append={self.append_rate:.0f}/s "
                f"delivered={self.delivery_rate:.0f}/s rss_start={self.rss_start_mib:.1f}MiB "
                f"rss_connected={self.rss_connected_mib:.1f}MiB "
                f"rss_peak={self.rss_peak_mib:.1f}MiB")


def raise_open_files_limit(needed: int) -> bool:
    """Raise this process's limit of open files (inherited by the processes it starts) up
    to its hard limit; False if even that is below ``needed``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        return False
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return True


def run_load(postgres_url: str, *, idle: int, streams: int, events: int,
             timeout: float = 300.0) -> LoadReport:
    """``idembus gateway`` as a process of its own on a fresh PostgreSQL prefix, loaded with
    ``idle`` idle connections and ``streams`` streams while ``events`` are appended."""
    prefix = f"gl{uuid.uuid4().hex[:10]}"
    storage = PostgresStorage(postgres_url, table_prefix=prefix)
    storage.verify()
    with tempfile.TemporaryDirectory() as directory:
        pathlib.Path(directory, "gateway_load_app.py").write_text(LOAD_APP)
        process = subprocess.Popen(
            [sys.executable, "-m", "idembus", "gateway", "gateway_load_app:endpoint",
             "--listen", "127.0.0.1:0", "--max-clients", str(streams + 10),
             "--max-connections", str(idle + streams + 50),
             "--idle-timeout", str(timeout), "--buffer", "5000", "--log-level", "WARNING"],
            cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), "LOAD_POSTGRES": postgres_url,
                 "LOAD_PREFIX": prefix})
        try:
            assert process.stdout is not None
            banner = process.stdout.readline()
            if " on http://" not in banner:
                raise RuntimeError(f"the gateway did not start: {process.communicate()[1]}")
            url = banner.rsplit(" on ", 1)[1].strip()
            return asyncio.run(asyncio.wait_for(
                _load(url, process.pid, storage, idle=idle, streams=streams, events=events),
                timeout))
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
            storage.drop_tables()
            storage.close()


async def _load(url: str, pid: int, storage: PostgresStorage, *, idle: int, streams: int,
                events: int) -> LoadReport:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=0)) as client:
        assert (await client.get("/healthz")).status_code == 200
        rss_start = resident_kib(pid) / 1024
        writers = await _idle_connections(host, int(port), idle)
        subscribed = asyncio.Semaphore(0)
        readers = [_Reader(client, events, subscribed) for _ in range(streams)]
        tasks = [asyncio.create_task(reader.read()) for reader in readers]
        try:
            for _ in readers:
                await subscribed.acquire()
            status = (await client.get("/status")).json()
            rss_connected = resident_kib(pid) / 1024
            started = time.perf_counter()
            await asyncio.to_thread(_append, storage, events)
            appended = time.perf_counter()
            await asyncio.gather(*tasks)
            finished = time.perf_counter()
        finally:
            for task in tasks:
                task.cancel()
            for writer in writers:
                writer.close()
        rss_peak = resident_kib(pid, "VmHWM") / 1024
    return LoadReport(
        idle=idle, streams=streams, appended=events,
        delivered=[reader.received for reader in readers],
        reconnects=sum(reader.connections - 1 for reader in readers),
        open_connections=status["open_connections"],
        append_rate=events / (appended - started),
        delivery_rate=events / (finished - started),
        rss_start_mib=rss_start, rss_connected_mib=rss_connected, rss_peak_mib=rss_peak)


async def _idle_connections(host: str, port: int, count: int) -> list[asyncio.StreamWriter]:
    """``count`` open connections: even ones never send a request, odd ones had one
    answered and stay open (keep-alive). Opened 200 at a time."""
    async def connect(number: int) -> asyncio.StreamWriter:
        reader, writer = await asyncio.open_connection(host, port)
        if number % 2:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"/healthz answered {head[:40]!r}")
        return writer

    writers: list[asyncio.StreamWriter] = []
    for first in range(0, count, 200):
        writers += await asyncio.gather(*(connect(n) for n in range(first,
                                                                    min(count, first + 200))))
    return writers


class _Reader:
    """One streaming client: reads positions 1..``expected`` once each, in order,
    reconnecting with the last id if the gateway cuts it off."""

    def __init__(self, client: httpx.AsyncClient, expected: int,
                 subscribed: asyncio.Semaphore) -> None:
        self._client = client
        self._expected = expected
        self._subscribed = subscribed
        self.received = 0
        self.connections = 0

    async def read(self) -> None:
        while self.received < self._expected:
            self.connections += 1
            headers = {"Accept": "text/event-stream"}
            if self.connections > 1:
                headers["Last-Event-ID"] = str(self.received)
            async with self._client.stream("GET", "/", headers=headers) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"the stream answered {response.status_code}")
                async for line in response.aiter_lines():
                    if line.startswith("retry:") and self.connections == 1:
                        self._subscribed.release()
                    elif line.startswith("id: "):
                        position = int(line[4:])
                        if position != self.received + 1:
                            raise RuntimeError(f"expected position {self.received + 1}, got "
                                               f"{position}")
                        self.received = position
                        if position == self._expected:
                            return


def _append(storage: PostgresStorage, count: int) -> None:
    body = '{"account": "a", "amount": 1}'
    for first in range(0, count, 100):
        storage.append_journal([
            JournalEntry(message_id=str(uuid.uuid4()), message_type="bench.Deposited",
                         headers={}, body=body, aggregate_type="Account", aggregate_id="a")
            for _ in range(first, min(count, first + 100))])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--units", type=int, default=2000, help="units of work per run (2000)")
    parser.add_argument("--events", type=int, default=20000, help="events streamed (20000)")
    parser.add_argument("--clients", type=int, default=10, help="stream clients (10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each (3)")
    parser.add_argument("--idle", type=int, default=2000,
                        help="idle connections of the load run (2000)")
    parser.add_argument("--streams", type=int, default=100,
                        help="streaming clients of the load run (100)")
    parser.add_argument("--load-events", type=int, default=5000,
                        help="events appended during the load run (5000)")
    args = parser.parse_args(argv)
    if not raise_open_files_limit(args.idle + args.streams + 200):
        raise SystemExit(f"the hard limit of open files is below {args.idle + args.streams} "
                         "connections: raise it (ulimit -Hn) or pass a smaller --idle")
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
    report = run_load(POSTGRES_URL, idle=args.idle, streams=args.streams,
                      events=args.load_events)
    print(report.line())
    if report.delivery_ratio != 1.0:
        raise SystemExit("a client of the load run missed events")
    return 0


if __name__ == "__main__":
    sys.exit(main())
