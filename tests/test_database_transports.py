"""What the database transports (PostgreSQL, MongoDB on mongomock) promise beyond the
transport contract: idle consumers that wake at once without polling, leases that bring a
dead consumer's messages back and are renewed while a handler works, native delayed
delivery, events routed by their types, loud sends, their failure taxonomy, their URLs, and
``idembus migrate``.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import statistics
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from idembus import Endpoint
from idembus import headers as h
from idembus.cli import main
from idembus.envelope import Envelope, format_utc
from idembus.errors import ConfigurationError
from idembus.transports.base import Delivery
from idembus.transports.errors import (
    BrokerAccessDenied,
    DestinationRefused,
    TransportUnavailable,
)
from idembus.transports.kombu import KombuTransport
from idembus.transports.mongo import MongoTransport, _MongoDelivery
from idembus.transports.postgres import PostgresTransport, _PostgresDelivery
from tests.conftest import (
    DATABASE_TRANSPORT_URLS,
    POSTGRES_URL,
    require_service,
    required_transport,
)
from tests.contract.test_transport_contract import Consumer, ack_and_stop, envelope, event
from tests.proxy import TcpProxy

MakeTransport = Callable[..., Any]
QueueName = Callable[[str], str]
ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Upper bound on any wait for a delivery; a failing test fails, it does not hang.
TIMEOUT = 10.0


@pytest.fixture(params=DATABASE_TRANSPORT_URLS)
def transport_url(request: pytest.FixtureRequest) -> str:
    return required_transport(request.param)


@pytest.fixture
def postgres_url() -> str:
    require_service(POSTGRES_URL, "PostgreSQL")
    return POSTGRES_URL


def thread_cpu_seconds(thread: threading.Thread) -> float:
    """CPU time (user + system) a thread of this process has used, from /proc."""
    stat = pathlib.Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()  # fields 3.. of proc(5): utime, stime are 14, 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def deferred(queue: str, seconds: float) -> Envelope:
    due = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=seconds)
    return envelope(destination=queue).with_headers({h.DELIVER_AT: format_utc(due)})


# -- idle consumers --------------------------------------------------------------------------


def test_an_idle_consumer_wakes_for_a_new_message_at_once_and_burns_no_cpu_while_waiting(
    make_transport: MakeTransport, queue_name: QueueName, transport_url: str,
) -> None:
    # Given a consumer that has drained its queue and waits
    transport = make_transport()
    queue = queue_name("idle")
    transport.declare(queue)
    arrivals: list[float] = []
    received = threading.Semaphore(0)

    def record(consumer: Consumer, delivery: Delivery) -> None:
        arrivals.append(time.monotonic())
        delivery.ack()
        received.release()

    consumer = Consumer(transport, queue, record)
    try:
        transport.send(envelope(destination=queue))
        assert received.acquire(timeout=TIMEOUT)

        # When it has nothing to do for two seconds
        before = thread_cpu_seconds(consumer._thread)
        time.sleep(2.0)  # the idleness being measured
        idle_cpu = thread_cpu_seconds(consumer._thread) - before

        # And then messages arrive one at a time
        latencies = []
        for _ in range(15):
            sent = time.monotonic()
            transport.send(envelope(destination=queue))
            assert received.acquire(timeout=TIMEOUT)
            latencies.append(arrivals[-1] - sent)
            time.sleep(0.05)
    finally:
        consumer.finish()

    # Then it used almost no CPU while it waited (it listens; it does not poll a table) ...
    assert idle_cpu < 0.1, f"{idle_cpu:.2f}s of CPU in 2s of idleness"
    # ... and it picked each message up at once: on PostgreSQL its notification wakes it
    # (the issue asks for 50 ms), on mongomock it polls every 100 ms at most
    bound = 0.05 if isinstance(transport, PostgresTransport) else 0.2
    assert statistics.median(latencies) < bound, [round(x * 1000) for x in latencies]


def test_a_delayed_message_is_held_back_until_its_due_time_and_then_delivered(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    # Given an idle consumer
    transport = make_transport()
    queue = queue_name("delayed")
    transport.declare(queue)
    assert transport.native_delay
    arrived = threading.Event()
    consumer = Consumer(transport, queue, lambda c, d: (d.ack(), arrived.set()))
    try:
        # When a message due in 1.5 s is sent
        sent = time.monotonic()
        transport.send(deferred(queue, 1.5))

        # Then it is not waiting yet (and nobody may take it) ...
        assert transport.pending(queue) == 0 and transport.get(queue) is None
        # ... and it is delivered once due, without any other message to wake the consumer
        assert arrived.wait(TIMEOUT)
        took = time.monotonic() - sent
    finally:
        consumer.finish()
    assert 1.4 <= took < 3.0, took


# -- leases ---------------------------------------------------------------------------------


def test_a_claim_nobody_renews_comes_back_after_the_visibility_timeout(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    # Given a message claimed by a consumer that then died (its leases are never renewed)
    dead = make_transport(visibility_timeout=1.0)
    queue = queue_name("dead")
    dead.declare(queue)
    sent = envelope(destination=queue)
    dead.send(sent)
    with dead.inspect(queue) as taken:
        assert [d.headers[h.MESSAGE_ID] for d in taken] == [sent.message_id]
        dead._leases.close()  # the process is gone: nothing renews, nothing gives back
        for delivery in taken:
            delivery.settled = True  # ... and nothing settles at the end of the block
    claimed_at = time.monotonic()
    assert dead.pending(queue) == 0

    # When another consumer waits on the queue
    alive = make_transport(visibility_timeout=1.0)
    consumer = Consumer(alive, queue, ack_and_stop)
    try:
        # Then it receives the message once the lease ran out, marked redelivered
        assert consumer.first.wait(TIMEOUT)
    finally:
        consumer.finish()
    assert time.monotonic() - claimed_at >= 0.9
    [again] = consumer.seen
    assert again.headers[h.MESSAGE_ID] == sent.message_id and again.redelivered


@pytest.mark.postgres
def test_a_consumer_killed_with_sigkill_loses_nothing(
    postgres_url: str, unique: str,
) -> None:
    # Given a consumer process holding a message, killed with SIGKILL while it handles it
    prefix = f"k{unique}"
    transport = PostgresTransport(postgres_url, table_prefix=prefix, visibility_timeout=1.0)
    queue = f"killed-{unique}"
    transport.declare(queue)
    sent = envelope(destination=queue)
    transport.send(sent)
    script = textwrap.dedent(f"""
        import sys, threading
        from idembus.transports.postgres import PostgresTransport

        transport = PostgresTransport({postgres_url!r}, table_prefix={prefix!r},
                                      visibility_timeout=1.0)

        def hold(delivery):
            print("holding", flush=True)
            threading.Event().wait()  # handles it forever

        transport.consume({queue!r}, hold, stop=threading.Event())
    """)
    process = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None and process.stdout.readline() == "holding\n"
        assert transport.pending(queue) == 0
        process.kill()
        process.wait(timeout=TIMEOUT)
        killed_at = time.monotonic()

        # When a consumer of this process waits on the queue
        consumer = Consumer(transport, queue, ack_and_stop)
        try:
            # Then the message comes back once the lease ran out, and is handled here
            assert consumer.first.wait(TIMEOUT)
        finally:
            consumer.finish()
        assert time.monotonic() - killed_at < 5
        [again] = consumer.seen
        assert again.headers[h.MESSAGE_ID] == sent.message_id and again.redelivered
        assert transport.pending(queue) == 0
    finally:
        process.kill()
        process.wait()
        assert process.stdout is not None
        process.stdout.close()
        transport.drop_tables()
        transport.close()


def test_leases_are_renewed_while_a_slow_handler_works(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    # Given a consumer whose handler takes three times the visibility timeout
    transport = make_transport(visibility_timeout=0.6)
    queue = queue_name("slow")
    transport.declare(queue)
    transport.send(envelope(destination=queue))
    release = threading.Event()

    def slow(consumer: Consumer, delivery: Delivery) -> None:
        release.wait(TIMEOUT)
        delivery.ack()

    working = Consumer(transport, queue, slow)
    assert working.first.wait(TIMEOUT)

    # When another consumer of the queue watches meanwhile
    other = Consumer(make_transport(visibility_timeout=0.6), queue, ack_and_stop)
    time.sleep(1.8)  # three visibility timeouts of the slow handler's work
    release.set()

    # Then the other one never received it: its lease was renewed while it was handled
    working.finish()
    other.finish()
    assert other.seen == []
    assert transport.pending(queue) == 0


def test_a_stopped_consumer_gives_back_what_it_had_claimed_at_once(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    # Given five messages and a consumer that claims them all and stops after the first
    transport = make_transport()
    queue = queue_name("prefetched")
    transport.declare(queue)
    for _ in range(5):
        transport.send(envelope(destination=queue))
    stop = threading.Event()

    def first_only(delivery: Delivery) -> None:
        delivery.ack()
        stop.set()

    # When it returns
    transport.consume(queue, first_only, stop=stop, prefetch=5)

    # Then the four it had not handled are due again at once, for anybody
    assert transport.pending(queue) == 4


# -- routing --------------------------------------------------------------------------------


def test_an_event_reaches_each_queue_subscribed_to_its_type_or_a_base_once(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    # Given queues subscribed to a derived event, to its base, to both, and to neither
    transport = make_transport()
    derived, base = "shop.OrderPlaced", "shop.OrderEvent"
    queues = {name: queue_name(name) for name in ("derived", "base", "both", "neither")}
    transport.declare(queues["derived"], subscriptions=[derived])
    transport.declare(queues["base"], subscriptions=[base])
    transport.declare(queues["both"], subscriptions=[derived, base])
    transport.declare(queues["neither"], subscriptions=["shop.Other"])

    # When an OrderPlaced, enclosing both types, is published
    placed = event(derived).with_headers({h.ENCLOSED_TYPES: f"{derived},{base}"})
    routed = transport.publish(placed)

    # Then every subscriber of either type has one copy, the other queue none
    assert routed is True
    assert {name: transport.pending(queue) for name, queue in queues.items()} == {
        "derived": 1, "base": 1, "both": 1, "neither": 0}
    # And an event nobody subscribes to is reported unrouted
    assert transport.publish(event("shop.Nobody")) is False


def test_a_send_to_a_queue_nobody_declared_is_refused_and_stored_nowhere(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    transport = make_transport()
    declared, missing = queue_name("declared"), queue_name("missing")
    transport.declare(declared)
    with pytest.raises(DestinationRefused, match="no endpoint declared it"):
        transport.send(envelope(destination=missing))
    transport.declare(missing)
    assert transport.pending(missing) == 0


def test_browse_reads_a_long_queue_a_page_at_a_time_and_takes_nothing(
    make_transport: MakeTransport, queue_name: QueueName, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given 25 messages
    transport = make_transport()
    queue = queue_name("long")
    transport.declare(queue)
    sent = [envelope(destination=queue) for _ in range(25)]
    for message in sent:
        transport.send(message)
    created = [0]
    delivery_class = (_PostgresDelivery if isinstance(transport, PostgresTransport)
                      else _MongoDelivery)
    original = delivery_class.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        created[0] += 1
        original(self, *args, **kwargs)

    monkeypatch.setattr(delivery_class, "__init__", counted)
    with transport.inspect(queue, limit=1) as claimed:
        # When it is browsed ten at a time, while one message is claimed
        with transport.browse(queue, page=10) as messages:
            read = []
            for delivery in messages:
                read.append(delivery.headers[h.MESSAGE_ID])
                # Then at most a page is read ahead of what was handed out
                assert created[0] <= len(read) + 10 + len(claimed)
                assert delivery.settled
    # And every message stored was read once, the claimed one too, in the order sent
    assert read == [message.message_id for message in sent]
    assert transport.pending(queue) == 25


# -- MongoDB's deduplicating insert ------------------------------------------------------------


@pytest.mark.parametrize("transport_url", [pytest.param("mongomock://", id="mongomock")],
                         indirect=True)
def test_mongodb_stores_a_resend_of_a_queued_message_once_and_keeps_others_with_its_id(
    make_transport: MakeTransport, queue_name: QueueName,
) -> None:
    # Given a message still queued, and an error queue
    transport = make_transport()
    queue, errors = queue_name("target"), queue_name("errors")
    transport.declare(queue)
    transport.declare(errors)
    sent = envelope(destination=queue)
    transport.send(sent)

    # When the outbox sends the very same message again
    transport.send(sent)

    # Then the queue holds it once
    assert transport.pending(queue) == 1

    # When two different messages with that id arrive: a retry due later, and two error
    # copies that failed in different queues
    transport.send(sent.with_headers({h.DELIVER_AT: format_utc(
        datetime.datetime.now(datetime.timezone.utc))}))
    for failed_in in ("one", "two"):
        transport.send(Envelope({**sent.headers, h.FAILED_QUEUE: failed_in}, sent.body, errors))

    # Then all of them are kept
    assert transport.pending(queue) == 2
    with transport.inspect(errors) as copies:
        assert sorted(c.headers[h.FAILED_QUEUE] for c in copies) == ["one", "two"]


# -- URLs, taxonomy, migrate -------------------------------------------------------------------


def test_endpoint_urls_choose_the_transport_and_hide_the_password() -> None:
    endpoints = {url: Endpoint("urls", transport=url) for url in (
        "postgresql://shop:s3cret@127.0.0.1:5432/shop", "postgres://127.0.0.1/shop",
        "mongodb://shop:s3cret@127.0.0.1:27017/shop", "memory://")}
    try:
        kinds = {url: type(endpoint.transport) for url, endpoint in endpoints.items()}
        assert list(kinds.values()) == [PostgresTransport, PostgresTransport, MongoTransport,
                                        KombuTransport]
        for endpoint in endpoints.values():
            safe = getattr(endpoint.transport, "safe_url", "")
            assert "s3cret" not in safe
        mongo = endpoints["mongodb://shop:s3cret@127.0.0.1:27017/shop"].transport
        assert isinstance(mongo, MongoTransport) and mongo.database.name == "shop"
    finally:
        for endpoint in endpoints.values():
            endpoint.close()


@pytest.mark.postgres
def test_a_refused_login_fails_the_start_in_one_line_without_the_password(
    postgres_url: str,
) -> None:
    url = postgres_url.replace("postgres@", "nobody_here:s3cret@")
    transport = PostgresTransport(url, table_prefix="refused", connect_timeout=2)
    try:
        with pytest.raises(ConfigurationError) as refused:
            transport.declare("anything")
    finally:
        transport.close()
    assert "s3cret" not in str(refused.value) and "\n" not in str(refused.value)
    assert "nobody_here" in str(refused.value)


@pytest.mark.postgres
def test_an_unreachable_database_is_an_outage_a_consumer_waits_out(
    postgres_url: str, unique: str,
) -> None:
    # Given a transport whose connections go through a proxy, and a consumer on it
    require_service(postgres_url, "PostgreSQL")
    prefix = f"o{unique}"
    direct = PostgresTransport(postgres_url, table_prefix=prefix)
    queue = f"outage-{unique}"
    direct.declare(queue)
    target = psycopg.conninfo.conninfo_to_dict(postgres_url)
    with TcpProxy(str(target.get("host") or "127.0.0.1"), int(target.get("port") or 5432)
                  ) as proxy:
        proxied = psycopg.conninfo.make_conninfo(postgres_url, host="127.0.0.1",
                                                 port=str(proxy.port))
        transport = PostgresTransport(proxied, table_prefix=prefix, connect_timeout=1)
        seen = threading.Semaphore(0)
        consumer = Consumer(transport, queue, lambda c, d: (d.ack(), seen.release()))
        try:
            direct.send(envelope(destination=queue))
            assert seen.acquire(timeout=TIMEOUT)

            # When the database becomes unreachable
            proxy.cut()
            # Then sends fail as an outage, not as the message's fault ...
            with pytest.raises(TransportUnavailable):
                transport.send(envelope(destination=queue))
            # ... and a message sent meanwhile by another process is delivered once the
            # database is back: the consumer reconnected by itself
            direct.send(envelope(destination=queue))
            time.sleep(0.5)  # the outage lasts a while
            proxy.restore()
            # (within its reconnection backoff and max_idle_wait, however loaded the machine)
            assert seen.acquire(timeout=3 * TIMEOUT)
        finally:
            consumer.finish()
            transport.close()
    direct.drop_tables()
    direct.close()


@pytest.mark.postgres
def test_a_transport_first_used_while_the_database_is_unreachable_works_once_it_is_back(
    postgres_url: str, unique: str,
) -> None:
    # Given a transport whose first connection finds nothing listening (a failover, a
    # database still starting)
    require_service(postgres_url, "PostgreSQL")
    target = psycopg.conninfo.conninfo_to_dict(postgres_url)
    proxy = TcpProxy(str(target.get("host") or "127.0.0.1"), int(target.get("port") or 5432))
    proxied = psycopg.conninfo.make_conninfo(postgres_url, host="127.0.0.1",
                                             port=str(proxy.port))
    transport = PostgresTransport(proxied, table_prefix=f"b{unique}", connect_timeout=1)
    queue = f"back-{unique}"
    try:
        with pytest.raises(TransportUnavailable) as first:
            transport.declare(queue)
        assert "cannot be reused" not in str(first.value)
        # When the database answers again
        proxy.restore()
        # Then the same transport works (its pool was not closed for good)
        transport.declare(queue)
        transport.send(envelope(destination=queue))
        assert transport.pending(queue) == 1
    finally:
        try:
            transport.drop_tables()
        finally:
            transport.close()
            proxy.cut()


def test_what_the_database_refuses_of_one_message_is_that_messages_own_failure(
    make_transport: MakeTransport, queue_name: QueueName, transport_url: str,
) -> None:
    if not transport_url.startswith("postgres"):
        pytest.skip("mongomock refuses nothing a server would")
    transport = make_transport()
    queue = queue_name("refusals")
    transport.declare(queue)
    with pytest.raises(DestinationRefused):
        transport.send(Envelope({h.MESSAGE_ID: "m", h.MESSAGE_TYPE: "t"}, "{}", queue,
                                content_type="application/json\x00"))
    assert transport.pending(queue) == 0


@pytest.mark.postgres
def test_missing_tables_while_running_block_the_endpoint_not_one_message(
    postgres_url: str, unique: str,
) -> None:
    # Given a running transport whose tables an operator dropped
    transport = PostgresTransport(postgres_url, table_prefix=f"m{unique}")
    transport.declare("blocked")
    PostgresTransport(postgres_url, table_prefix=f"m{unique}").drop_tables()
    # Then consuming and sending are refused as the endpoint's problem, with the reason
    try:
        with pytest.raises(BrokerAccessDenied, match="does not exist"):
            transport.consume("blocked", lambda delivery: None, stop=threading.Event())
        with pytest.raises(BrokerAccessDenied):
            transport.send(envelope(destination="blocked"))
    finally:
        transport.close()


@pytest.mark.postgres
def test_idembus_migrate_creates_the_transport_tables(
    postgres_url: str, unique: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given an endpoint on the PostgreSQL transport whose tables do not exist
    prefix = f"mig{unique}"
    module = types.ModuleType(f"migrate_app_{unique}")
    module.endpoint = lambda: Endpoint(  # type: ignore[attr-defined]
        f"migrated-{unique}", transport=PostgresTransport(postgres_url, table_prefix=prefix))
    monkeypatch.setitem(sys.modules, module.__name__, module)

    # When idembus migrate runs
    status = main(["migrate", f"{module.__name__}:endpoint"])

    # Then it says so, and the tables are there
    out = capsys.readouterr().out
    transport = PostgresTransport(postgres_url, table_prefix=prefix)
    try:
        assert status == 0 and "PostgresTransport schema is in place" in out
        with psycopg.connect(postgres_url) as connection:
            assert transport.schema.missing(connection) == []
    finally:
        transport.drop_tables()
        transport.close()


def test_a_consumer_listens_under_a_name_operators_can_see(
    make_transport: MakeTransport, queue_name: QueueName, transport_url: str,
) -> None:
    if not transport_url.startswith("postgres"):
        pytest.skip("pg_stat_activity is PostgreSQL's")
    transport = make_transport()
    queue = queue_name("seen")
    transport.declare(queue)
    consumer = Consumer(transport, queue, ack_and_stop)
    try:
        def consumers() -> int:
            with psycopg.connect(transport_url) as connection:
                row = connection.execute("SELECT count(*) FROM pg_stat_activity WHERE "
                                         "application_name = %s", (f"idembus consume {queue}",)
                                         ).fetchone()
            return int(row[0]) if row else 0

        deadline = time.monotonic() + TIMEOUT
        while consumers() != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert consumers() == 1
    finally:
        consumer.finish()

