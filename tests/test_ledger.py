"""The ledger: every received delivery ends in exactly one term, so that received =
handled + duplicate + dropped + retrying + dead-lettered + interrupted + in flight, in the
endpoint's counters, in its status report and in ``idembus status`` (at most 120 columns
unless ``--wide``)."""

from __future__ import annotations

import datetime
import json
import threading

import pytest

from idembus import Command, Endpoint
from idembus import headers as h
from idembus.cli import main
from idembus.cli.status import WIDTH, render
from idembus.envelope import Envelope, format_utc, utc_now
from idembus.handlers import Handler, handles
from idembus.policies import RetryPolicy
from idembus.runtime.counters import LEDGER, ledger
from idembus.runtime.status import summarise
from idembus.storage.base import StatusReport
from idembus.storage.postgres import PostgresStorage
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL, POSTGRES_URL
from tests.support import AccountHandler, Deposit, SignalCounter
from tests.test_cli_errors import SharedMemoryStorage
from tests.test_status import exposed, wait_until  # noqa: F401 (a fixture)

NOW = datetime.datetime(2031, 5, 4, 12, 0, tzinfo=datetime.timezone.utc)


class Boom(Command, message_name="ledger.Boom"):
    reason: str


class Exploding(Handler):
    """Always fails: one delayed round, then the error queue."""

    retry_policy = RetryPolicy(immediate_retries=0, delayed=(0.05,))

    @handles
    def on(self, message: Boom) -> None:
        raise RuntimeError(message.reason)


class Audit(Handler):
    """A second handler of deposits: the signal counters count each deposit twice."""

    @handles
    def on(self, message: Deposit) -> None:
        pass


def adds_up(figures: dict[str, int]) -> bool:
    return figures["received"] == sum(figures[term] for term in LEDGER)


@pytest.mark.timeout(60)
def test_every_delivery_ends_in_one_term_and_the_ledger_adds_up_to_received(
    make_endpoint, exposed, capsys  # noqa: F811
):
    # Given an endpoint with two handlers of deposits and one handler that always fails
    storage = SharedMemoryStorage()
    service = make_endpoint("ledger", handlers=[AccountHandler, Audit, Exploding],
                            storage=storage, status_interval=0.05)
    settled = SignalCounter(service, "settled")
    service.start()

    # When it receives 3 deposits, 2 copies of one of them, an expired deposit, and a
    # message that fails, comes back once delayed, and fails again
    for account in ("a", "b"):
        service.bus.send(Deposit(account=account, amount=1))
    for _ in range(3):
        service.bus.send(Deposit(account="c", amount=1), message_id="same")
    service.transport.send(Envelope(
        headers={h.MESSAGE_ID: "late", h.MESSAGE_TYPE: "test.Deposit",
                 h.TIME_SENT: format_utc(utc_now()),
                 h.DISCARD_AFTER: format_utc(utc_now() - datetime.timedelta(hours=1))},
        body=Deposit(account="d", amount=1).model_dump_json(), destination=service.name))
    service.bus.send(Boom(reason="card declined"))
    assert settled.wait_for(8, timeout=30)

    # Then each delivery is counted once in the ledger, and its terms add up to received,
    # while the signal counters count per handler (two per deposit)
    figures = ledger(service.counters.snapshot())
    assert figures == {"received": 8, "handled": 3, "duplicate": 2, "dropped": 1,
                       "retrying": 1, "dead_lettered": 1, "interrupted": 0, "in_flight": 0}
    assert service.counters["handled"] == 6 and service.counters["duplicate"] == 4
    assert service.counters["failed"] == 2 and service.counters["dead_lettered"] == 1

    # And so does idembus status, from the process's report, in at most 120 columns
    assert wait_until(lambda: any(r.counters.get("settled") == 8
                                  for r in storage.status_reports(service.name)))
    viewer = Endpoint(service.name, storage=storage, handlers=[AccountHandler],
                      transport="memory://")
    assert main(["status", exposed(viewer), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ledger"] == figures and adds_up(summary["ledger"])
    assert summary["instances"][0]["ledger"] == figures
    assert summary["total"]["handled"] == 6  # the signal counters are kept, unchanged
    assert summary["lag_seconds"] is not None and summary["last_settled"] is not None
    assert summary["queue"]["unknown"]  # memory:// cannot be seen from another process
    assert main(["status", exposed(viewer)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert max(map(len, table)) <= WIDTH
    total = next(line for line in table if line.startswith("total (running)")).split()
    assert total[2:] == ["1", "8", "3", "2", "1", "1", "1", "0", "0"]
    assert any("received = handled + duplicate + dropped" in line for line in table)
    assert any(line.startswith("queue ") and "–" in line for line in table)

    # And --wide shows every signal counter and what each term means
    assert main(["status", exposed(viewer), "--wide"]) == 0
    wide = capsys.readouterr().out
    assert "redispatched" in wide and "outside_window" in wide
    assert all(f"  {term.replace('_', '-')}: " in wide for term in LEDGER)


def test_a_delivery_in_progress_shows_as_in_flight():
    # Given a report of a process that received 5 and settled 3 (2 handled, 1 duplicate)
    counters = {"received": 5, "settled": 3, "ledger_handled": 2, "ledger_duplicate": 1}
    summary = summarise("sales", [StatusReport("sales", "a", counters, NOW, NOW)], now=NOW,
                        stale_after=datetime.timedelta(seconds=15))
    # Then two are in flight, and the terms add up
    assert summary["ledger"]["in_flight"] == 2 and adds_up(summary["ledger"])


def test_status_fits_120_columns_with_long_names_large_counts_and_problems():
    # Given three processes on a host with a long name, with large counts and a problem
    host = "ip-10-240-17-203.eu-central-1.compute.internal"
    counters = {"received": 123456789, "settled": 123456700, "ledger_handled": 100000000,
                "ledger_duplicate": 23000000, "ledger_dropped": 456700,
                "last_settled_at_ms": int(NOW.timestamp() * 1000) - 1500, "last_lag_ms": 42}
    reports = [StatusReport("orders-fulfilment-and-invoicing", f"{host}:{pid}:a1b2c3", counters,
                            NOW, NOW, problems={"transport": "x" * 300} if pid == 1 else {})
               for pid in (1, 22, 333)]
    summary = summarise("orders-fulfilment-and-invoicing", reports, now=NOW,
                        stale_after=datetime.timedelta(seconds=15))
    summary["queue"] = {"queue": "orders-fulfilment-and-invoicing", "ready": 12,
                        "unacked": None, "delayed": None, "consumers": 3,
                        "oldest_seconds": None, "unknown": None}

    # When it is rendered
    lines = render(summary, now=NOW).splitlines()

    # Then no line is wider than 120 columns; the instances keep their distinct ends
    assert max(map(len, lines)) <= WIDTH
    assert sum(1 for line in lines if ":333:a1b2c3" in line) == 1
    assert any("ready 12, unacked –, delayed –, consumers 3" in line for line in lines)
    assert any("last settled 1.5 s ago, lag 42 ms" in line for line in lines)
    # And --wide keeps every name whole, however wide
    assert any(f"{host}:1:a1b2c3" in line for line in render(summary, wide=True,
                                                            now=NOW).splitlines())


class Slow(Handler):
    """Holds each deposit until released."""

    started = threading.Event()
    release = threading.Event()

    @handles
    def on(self, message: Deposit) -> None:
        type(self).started.set()
        assert type(self).release.wait(30)


@pytest.mark.amqp
@pytest.mark.postgres
def test_status_on_rabbitmq_and_postgresql_shows_the_queue_depth_and_what_is_in_flight(
    rabbitmq, postgres_storage, exposed, capsys  # noqa: F811
):
    # Given an endpoint on RabbitMQ whose handler holds the first of three deposits (one
    # at a time: what a consumer prefetched is neither ready nor in flight)
    transport, name = rabbitmq
    Slow.started.clear()
    Slow.release.clear()
    service = Endpoint(name("depth"), handlers=[Slow], transport=transport,
                       storage=postgres_storage, error_queue=name("error"),
                       status_interval=0.05, prefetch=1)
    try:
        service.start()
        for account in ("a", "b", "c"):
            service.bus.send(Deposit(account=account, amount=1))
        assert Slow.started.wait(15)
        assert wait_until(lambda: any(ledger(r.counters)["in_flight"] == 1
                                      for r in postgres_storage.status_reports(service.name)))
        assert wait_until(lambda: transport.depth(service.name).ready == 2)

        # When idembus status looks (its own endpoint object, as another process would)
        def viewer() -> Endpoint:  # idembus status closes the endpoint it loaded
            return Endpoint(service.name, handlers=[Slow], transport=KombuTransport(
                AMQP_URL, exchange=transport.exchange_name), storage=PostgresStorage(
                POSTGRES_URL, table_prefix=postgres_storage.table_prefix))

        assert main(["status", exposed(viewer()), "--json"]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert main(["status", exposed(viewer())]) == 0
        table = capsys.readouterr().out
    finally:
        Slow.release.set()
        service.close()

    # Then it shows the broker's figures, the one held message in flight, and fits
    assert summary["queue"]["ready"] == 2 and summary["queue"]["consumers"] == 1
    assert summary["queue"]["unacked"] is None and summary["queue"]["unknown"] is None
    assert summary["ledger"]["in_flight"] == 1 and adds_up(summary["ledger"])
    assert f"queue {service.name}: ready 2, unacked –, delayed –, consumers 1" in table
    assert max(map(len, table.splitlines())) <= WIDTH
