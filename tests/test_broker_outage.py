"""A broker that is unreachable for a few seconds, as during a RabbitMQ restart: publishers
and worker processes come back by themselves once it is reachable again.

Found by the torture test (``samples/torture``, ``rabbitmqctl stop_app`` / ``start_app``);
reproduced here for one client at a time through a TCP proxy that a test cuts and
restores, which leaves everybody else's connections to the broker alone.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import uuid
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest

from idembus.routing import Router
from idembus.sending import Bus
from idembus.storage.postgres import PostgresStorage
from idembus.transports.errors import TransportUnavailable
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL, POSTGRES_URL, require_service
from tests.proxy import TcpProxy
from tests.support import Deposit
from tests.test_workers import APP, App, Running, children, wait_until

pytestmark = pytest.mark.amqp


@pytest.fixture
def proxy() -> Iterator[TcpProxy]:
    """A proxy to the test RabbitMQ; ``proxy_url(proxy)`` reaches the broker through it."""
    require_service(AMQP_URL, "RabbitMQ")
    parsed = urlparse(AMQP_URL)
    with TcpProxy(parsed.hostname or "127.0.0.1", parsed.port or 5672) as made:
        yield made


def proxy_url(proxy: TcpProxy) -> str:
    parsed = urlparse(AMQP_URL)
    credentials = parsed.netloc.rpartition("@")[0]
    return parsed._replace(netloc=f"{credentials}@127.0.0.1:{proxy.port}").geturl()


def test_a_publisher_cut_off_from_the_broker_publishes_again_once_it_is_back(proxy, unique):
    # Given a bus sending through a transport whose broker connection runs through a proxy
    queue = f"outage-{unique}"
    direct = KombuTransport(AMQP_URL)
    direct.declare(queue)
    cut_off = KombuTransport(proxy_url(proxy))
    sender = Bus("test-sender", Router({Deposit: queue}), cut_off.dispatch)
    try:
        sender.send(Deposit(account="a", amount=1))

        # When the broker is unreachable, the publish fails as an outage
        proxy.cut()
        with pytest.raises(TransportUnavailable):
            sender.send(Deposit(account="a", amount=2))

        # Then once the broker is reachable again, publishing works again
        proxy.restore()
        sender.send(Deposit(account="a", amount=3))
        assert direct.pending(queue) == 2
    finally:
        cut_off.close()
        direct.delete_queue(queue)
        direct.close()


@pytest.fixture
def app(tmp_path: pathlib.Path, proxy: TcpProxy) -> Iterator[App]:
    """The worker app of tests/test_workers.py, its broker reached through ``proxy``."""
    require_service(POSTGRES_URL, "PostgreSQL")
    (tmp_path / "worker_app.py").write_text(APP)
    suffix = uuid.uuid4().hex[:10]
    transport = KombuTransport(AMQP_URL)
    made = App(tmp_path, f"outage-{suffix}", f"outage-error-{suffix}", f"ou{suffix}",
               transport)
    storage = PostgresStorage(POSTGRES_URL, table_prefix=made.prefix)
    storage.migrate()
    transport.declare(made.queue)
    yield made
    for running in made.running:
        stop_gracefully(running)
    for queue in (made.queue, made.error_queue):
        transport.delete_queue(queue)
    transport.close()
    storage.drop_tables()
    storage.close()


def stop_gracefully(running: Running) -> None:
    """SIGTERM first: a SIGKILLed supervisor leaves its workers running, orphaned."""
    if running.process.poll() is None:
        running.process.send_signal(signal.SIGTERM)
        try:
            running.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    running.stop()


@pytest.mark.postgres
def test_a_worker_restarted_while_the_broker_is_unreachable_does_not_stop_its_endpoint(
    app, proxy
):
    # Given two worker processes whose broker connections run through a proxy
    supervisor = app.start("--workers", "2", APP_TRANSPORT=proxy_url(proxy))
    log = supervisor.err
    assert log.wait_for(", 1 consumer(s), ", count=2), log.lines[-20:]

    # When the broker becomes unreachable and a worker dies meanwhile
    proxy.cut()
    os.kill(children(supervisor.process.pid)[0], signal.SIGKILL)
    assert log.wait_for("started: pid", count=3), log.lines[-20:]  # its replacement
    gave_up = wait_until(lambda: supervisor.process.poll() is not None, timeout=10)

    # Then the supervisor does not give up on the endpoint, and once the broker is back
    # the workers process messages again
    proxy.restore()
    assert not gave_up, log.lines[-20:]
    app.send(Deposit(account="a", amount=5))
    assert wait_until(lambda: app.accounts() == {"a": {"balance": 5, "deposits": 1}}), \
        log.lines[-20:]
    supervisor.process.send_signal(signal.SIGTERM)
    assert supervisor.process.wait(timeout=60) == 0, log.lines[-20:]
