"""Exactly once through a PostgreSQL failover: a primary with a synchronous standby on
loopback (:mod:`idembus.testing.pg_cluster`), the primary SIGKILLed while messages flow and
the standby promoted; the endpoints reach it through a multi-host conninfo.

The effects are counted in the surviving database, not by the endpoints' counters."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from idembus import Endpoint
from idembus.storage.memory import MemoryStorage
from idembus.storage.postgres import PostgresStorage
from idembus.testing.pg_cluster import PostgresPair, server_programs
from idembus.transports.kombu import KombuTransport
from idembus.transports.postgres import PostgresTransport
from tests.support import AccountHandler, Deposit, Ledger, eventually

pytestmark = pytest.mark.postgres

ACCOUNTS = 10


@pytest.fixture
def pair() -> Iterator[PostgresPair]:
    try:
        server_programs()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    with PostgresPair(timeout=90) as started:
        yield started


class HandledTimes:
    """The moments (monotonic) at which an endpoint handled a message, and a wait."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.times: list[float] = []
        self._condition = threading.Condition()
        endpoint.signals.handled.connect(self._on_handled, weak=False)

    def _on_handled(self, sender: object, **details: Any) -> None:
        with self._condition:
            self.times.append(time.monotonic())
            self._condition.notify_all()

    def wait_for(self, count: int, timeout: float) -> bool:
        with self._condition:
            return self._condition.wait_for(lambda: len(self.times) >= count, timeout)

    def first_after(self, moment: float) -> float:
        with self._condition:
            return min(t for t in self.times if t > moment) - moment


def deposits(count: int) -> list[Deposit]:
    return [Deposit(account=f"a{i % ACCOUNTS}", amount=1) for i in range(count)]


def applied(url: str, prefix: str) -> dict[str, tuple[int, int]]:
    """Each account's (balance, deposits) as the database that is the primary now holds
    them, and the number of processed rows under the key ``"processed"``."""
    with psycopg.connect(url) as connection:
        rows = connection.execute(
            f"SELECT aggregate_id, (state->>'balance')::int, (state->>'deposits')::int "
            f"FROM {prefix}_aggregates WHERE aggregate_type = 'Account'").fetchall()
        processed = connection.execute(
            f"SELECT count(*) FROM {prefix}_processed "
            "WHERE aggregate_type = 'Account'").fetchone()
    found = {account: (balance, count) for account, balance, count in rows}
    found["processed"] = (processed[0] if processed else 0, 0)
    return found


def exactly_once(count: int) -> dict[str, tuple[int, int]]:
    each = count // ACCOUNTS
    expected = {f"a{i}": (each, each) for i in range(ACCOUNTS)}
    expected["processed"] = (count, 0)
    return expected


@pytest.mark.timeout(240)
def test_an_endpoint_on_the_pair_applies_each_deposit_once_through_a_failover(
    pair: PostgresPair,
) -> None:
    # Given an endpoint on a broker (memory://) and on the pair through its multi-host
    # conninfo, and a downstream endpoint that records each Deposited event
    suffix = uuid.uuid4().hex[:8]
    storage = PostgresStorage(pair.url, table_prefix=f"fo_{suffix}", connect_timeout=30)
    storage.migrate()
    ledger = Ledger()
    accounts = Endpoint(f"fo-accounts-{suffix}", transport=KombuTransport("memory://"),
                        storage=storage, handlers=[AccountHandler])
    downstream = Endpoint(f"fo-ledger-{suffix}", transport=KombuTransport("memory://"),
                          storage=MemoryStorage(), handlers=[ledger])
    handled = HandledTimes(accounts)
    count = 600
    downstream.start()
    accounts.start()
    try:
        for deposit in deposits(count):
            accounts.bus.send(deposit)

        # When the primary is killed a third of the way through and the standby promoted
        assert handled.wait_for(count // 3, timeout=60)
        killed = time.monotonic()
        failover = pair.fail_over()

        # Then every deposit is applied once in the surviving database, and each event
        # it published reached the ledger once
        assert eventually(lambda: applied(pair.url, storage.table_prefix)
                          == exactly_once(count))
        assert eventually(lambda: len(ledger.entries) >= count)
        ids = [entry[0] for entry in ledger.entries]
        assert len(ids) == count and len(set(ids)) == count
        print(f"\nstorage failover: promoted after {failover.seconds_to_promoted:.2f} s, "
              f"first commit after {failover.seconds_to_first_commit:.2f} s, first message "
              f"handled again after {handled.first_after(killed):.2f} s")
    finally:
        accounts.close()
        downstream.close()
        storage.close()


@pytest.mark.timeout(240)
def test_the_postgres_transport_on_the_pair_resumes_after_a_failover(
    pair: PostgresPair,
) -> None:
    # Given an endpoint whose queue and storage are both on the pair (one transaction
    # commits the state, sends and acknowledges)
    suffix = uuid.uuid4().hex[:8]
    storage = PostgresStorage(pair.url, table_prefix=f"fq_{suffix}", connect_timeout=30)
    transport = PostgresTransport(pair.url, table_prefix=f"fq_{suffix}_q",
                                  connect_timeout=30)
    storage.migrate()
    transport.migrate()
    queue = f"fq-accounts-{suffix}"
    accounts = Endpoint(queue, transport=transport, storage=storage, handlers=[AccountHandler])
    handled = HandledTimes(accounts)
    count = 400
    accounts.start()
    try:
        for deposit in deposits(count // 2):
            accounts.bus.send(deposit)

        # When the primary is killed while the queue is consumed, and the standby promoted
        assert handled.wait_for(count // 6, timeout=60)
        killed = time.monotonic()
        failover = pair.fail_over()

        # And more deposits are sent after the failover
        for deposit in deposits(count // 2):
            send_through_outage(accounts, deposit)

        # Then every deposit is applied once, and the queue is empty (the handled signals
        # are not counted: a commit whose answer the kill cut off is applied, its message
        # acknowledged in the same transaction, and never signalled)
        assert eventually(lambda: applied(pair.url, storage.table_prefix)
                          == exactly_once(count))
        assert transport.pending(queue) == 0
        print(f"\ntransport failover: first commit after "
              f"{failover.seconds_to_first_commit:.2f} s, first message handled again after "
              f"{handled.first_after(killed):.2f} s")
    finally:
        accounts.close()
        transport.close()
        storage.close()


def send_through_outage(endpoint: Endpoint, message: Deposit) -> None:
    """Send ``message``; a pooled connection still open to the killed primary fails once
    (an outage the caller retries, as a web request would)."""
    from idembus.transports.errors import TransportUnavailable

    for _ in range(20):
        try:
            endpoint.bus.send(message)
            return
        except TransportUnavailable:
            time.sleep(0.1)
    endpoint.bus.send(message)


@pytest.mark.slow  # a soak (make soak): two failovers and a pg_rewind
@pytest.mark.timeout(300)
def test_the_old_primary_rejoins_as_the_standby_and_takes_over_again_with_every_commit(
    pair: PostgresPair,
) -> None:
    # Given a row committed before a failover, and one on the promoted standby
    def insert(value: int) -> None:
        with psycopg.connect(pair.url, autocommit=True) as connection:
            connection.execute("INSERT INTO kept VALUES (%s)", (value,))

    with psycopg.connect(pair.url, autocommit=True) as connection:
        connection.execute("CREATE TABLE kept (n int)")
    insert(1)
    first = pair.primary_port
    pair.fail_over()
    insert(2)

    # When the old primary comes back (pg_rewind) as the synchronous standby, a row is
    # committed, and the pair fails over again
    pair.rejoin()
    insert(3)
    pair.fail_over()

    # Then the first primary is the primary again, with every commit
    assert pair.primary_port == first
    with psycopg.connect(pair.url) as connection:
        rows = connection.execute("SELECT n FROM kept ORDER BY n").fetchall()
    assert rows == [(1,), (2,), (3,)]
