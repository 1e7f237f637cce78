"""An unreachable database or broker costs time, never a message or a retry."""

from __future__ import annotations

import shutil
import subprocess
import threading
import uuid
from typing import Any

import psycopg
import pytest
from kombu.utils.url import parse_url

from idembus import Backoff, RetryPolicy
from idembus.runtime.recoverability.policy import Recoverability
from idembus.storage.errors import StorageUnavailable
from idembus.storage.memory import MemoryStorage
from idembus.storage.postgres import PostgresStorage
from idembus.transports.errors import TransportUnavailable
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL, POSTGRES_URL, require_service
from tests.support import Account, AccountHandler, Deposit, Ledger, SignalCounter

NO_WAIT = Backoff((0.0,))


class DownForAWhile(MemoryStorage):
    """Storage whose loads fail ``outages`` times, as if the database were down."""

    def __init__(self, outages: int) -> None:
        super().__init__()
        self.outages = outages
        self.refused = 0
        self.refusing = threading.Event()

    def load(self, *args: Any, **kwargs: Any) -> Any:
        if self.refused < self.outages:
            self.refused += 1
            self.refusing.set()
            raise StorageUnavailable("the database is down (simulated)")
        return super().load(*args, **kwargs)


class PublishFailsFirst(KombuTransport):
    """A transport whose first ``failures`` publishes fail, as if the broker went away."""

    def __init__(self, *args: Any, failures: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failures = failures

    def publish(self, envelope: Any) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise TransportUnavailable("the broker is gone (simulated)")
        super().publish(envelope)


def test_a_database_outage_delays_the_message_without_using_its_retries(make_endpoint):
    # Given an endpoint whose database refuses the first 4 loads, and no immediate retries
    storage = DownForAWhile(outages=4)
    accounts = make_endpoint("accounts", handlers=[AccountHandler], storage=storage,
                             recoverability=Recoverability(
                                 outage_backoff=NO_WAIT,
                                 retries=RetryPolicy(immediate_retries=0)))
    handled = SignalCounter(accounts, "handled")
    accounts.start()

    # When a deposit arrives during the outage
    accounts.bus.send(Deposit(account="a", amount=5))

    # Then it is applied once the database is back: not failed, not dead-lettered
    assert handled.wait_for(1)
    assert storage.refused == 4
    assert accounts.counters["failed"] == 0
    assert accounts.counters["dead_lettered"] == 0
    assert Account.model_validate(storage.load("Account", "a").state).balance == 5


def test_a_broker_outage_after_commit_dispatches_the_stored_messages_once_it_is_back(
    make_endpoint, make_transport, transport_url
):
    # Given an endpoint whose first two publishes fail after the commit
    flaky = PublishFailsFirst(transport_url, exchange=make_transport().exchange_name,
                              failures=2)
    ledger = Ledger()
    accounts = make_endpoint("accounts", handlers=[AccountHandler], transport=flaky,
                             recoverability=Recoverability(outage_backoff=NO_WAIT))
    downstream = make_endpoint("ledger", handlers=[ledger])
    recorded = SignalCounter(downstream, "handled")
    accounts.start()
    downstream.start()

    # When a deposit arrives
    accounts.bus.send(Deposit(account="a", amount=5))

    # Then it was committed once, and its Deposited reached the ledger once
    assert recorded.wait_for(1)
    assert accounts.counters["handled"] == 1
    # And the attempts after the commit only dispatched: no duplicate, no redispatch
    assert accounts.counters["duplicate"] == 0
    assert accounts.counters["redispatched"] == 0
    assert accounts.counters["failed"] == 0
    assert [entry[1:] for entry in ledger.entries] == [("a", 5)]


def test_stopping_during_an_outage_gives_the_message_back_to_the_broker(make_endpoint):
    # Given an endpoint whose database stays down
    storage = DownForAWhile(outages=10**9)
    accounts = make_endpoint("accounts", handlers=[AccountHandler], storage=storage,
                             recoverability=Recoverability(outage_backoff=Backoff((0.05,))))
    accounts.start()
    accounts.bus.send(Deposit(account="a", amount=5))
    assert storage.refusing.wait(10)

    # When the endpoint is stopped
    assert accounts.stop(timeout=10)

    # Then the message is back in its queue, untouched and not dead-lettered
    assert accounts.transport.pending(accounts.name) == 1
    assert accounts.counters["dead_lettered"] == 0


@pytest.mark.postgres
def test_postgres_connections_killed_by_the_server_are_replaced(make_endpoint):
    # Given an endpoint on PostgreSQL that has processed one deposit
    require_service(POSTGRES_URL, "PostgreSQL")
    application = f"idembus-outage-{uuid.uuid4().hex[:8]}"
    prefix = f"out{uuid.uuid4().hex[:10]}"
    storage = PostgresStorage(f"{POSTGRES_URL}?application_name={application}",
                              table_prefix=prefix)
    accounts = make_endpoint("accounts", handlers=[AccountHandler], storage=storage,
                             recoverability=Recoverability(outage_backoff=NO_WAIT))
    handled = SignalCounter(accounts, "handled")
    accounts.start()
    try:
        accounts.bus.send(Deposit(account="a", amount=1))
        assert handled.wait_for(1)

        # When the server terminates every connection of the endpoint's pool
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            killed = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = %s", (application,)).fetchone()
        assert killed is not None and killed[0] >= 1

        # Then the next deposits are applied once each, with no failure counted
        accounts.bus.send(Deposit(account="a", amount=2))
        accounts.bus.send(Deposit(account="a", amount=3))
        assert handled.wait_for(3)
        assert accounts.counters["failed"] == 0
        record = storage.load("Account", "a")
        assert record.state == {"balance": 6, "deposits": 3}
    finally:
        accounts.stop()
        storage.drop_tables()


@pytest.mark.amqp
def test_rabbitmq_closing_every_connection_loses_nothing(make_endpoint, make_transport,
                                                          transport_url, caplog):
    # Given accounts and ledger endpoints on RabbitMQ that have processed one deposit
    if not transport_url.startswith("amqp"):
        pytest.skip("closes RabbitMQ connections")
    require_service(AMQP_URL, "RabbitMQ")
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not installed here")
    ledger = Ledger()
    accounts = make_endpoint("accounts", handlers=[AccountHandler],
                             recoverability=Recoverability(outage_backoff=NO_WAIT))
    downstream = make_endpoint("ledger", handlers=[ledger])
    recorded = SignalCounter(downstream, "handled")
    accounts.start()
    downstream.start()
    accounts.bus.send(Deposit(account="a", amount=1))
    assert recorded.wait_for(1)

    # When the broker closes every client connection of the tests' virtual host (only
    # those: another run on another vhost of the same broker keeps its connections)
    vhost = parse_url(AMQP_URL)["virtual_host"] or "/"
    subprocess.run(["rabbitmqctl", "-q", "close_all_connections", "--vhost", vhost, "test"],
                   check=True, capture_output=True, timeout=60)

    # Then the consumers and publishers reconnect and the next deposits flow once each
    accounts.bus.send(Deposit(account="a", amount=2))
    accounts.bus.send(Deposit(account="a", amount=3))
    assert recorded.wait_for(3, timeout=60)
    assert sorted(entry[2] for entry in ledger.entries) == [1, 2, 3]
    record = accounts.storage.load("Account", "a")
    assert record.state == {"balance": 6, "deposits": 3}
    assert any("reconnecting" in entry.getMessage() for entry in caplog.records
               if entry.name == "idembus.transports.kombu"), "no consumer lost its connection"
