"""Redis consumers take a message by moving it (``transports/redis_taking.py``): a process
killed with SIGKILL after the move, before or during its handler, loses nothing; the message
is delivered again once the lease (or kombu's visibility timeout) expired. Foreign kombu
producers' messages, priorities included, are consumed as before."""

from __future__ import annotations

import os
import queue as queues
import signal
import subprocess
import sys
import threading
import uuid

import kombu
import pytest

from idembus import headers as h
from idembus.envelope import Envelope
from idembus.errors import ConfigurationError
from idembus.transports.base import Delivery
from idembus.transports.kombu import KombuTransport
from idembus.transports.redis_taking import LANDINGS_KEY
from tests.conftest import REDIS_URL, require_service
from tests.test_workers import ROOT

pytestmark = pytest.mark.redis

#: A consumer process killed by SIGKILL: ``record`` between the move and the unacked
#: record, ``handler`` inside its handler.
KILLED = """
import os, signal, sys, threading
from idembus.transports.kombu import KombuTransport
from idembus.transports import redis_taking
url, queue, where = sys.argv[1:4]

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

if where == "record":
    redis_taking.TakingChannel._record = die
transport = KombuTransport(url, partition_lease=1.0,
                           transport_options={"visibility_timeout": 1})
print("consuming", flush=True)
transport.consume(queue, lambda delivery: die(), stop=threading.Event())
"""


def _envelope(queue: str, body: str) -> Envelope:
    return Envelope(headers={h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Taken",
                             h.INTENT: "send"}, body=body, destination=queue)


def _transport() -> KombuTransport:
    return KombuTransport(REDIS_URL, partition_lease=1.0,
                          transport_options={"visibility_timeout": 1})


def _declared() -> tuple[KombuTransport, str]:
    """A transport (:func:`_transport`) and a new queue it declared."""
    transport = _transport()
    queue = f"taking-{uuid.uuid4().hex[:8]}"
    transport.declare(queue)
    return transport, queue


def _first_delivery(transport: KombuTransport, queue: str, timeout: float) -> Delivery:
    """The first delivery a consumer of ``queue`` gets (acknowledged) within ``timeout``."""
    got: queues.Queue[Delivery] = queues.Queue()
    stop = threading.Event()

    def on_delivery(delivery: Delivery) -> None:
        delivery.ack()
        got.put(delivery)
        stop.set()

    thread = threading.Thread(target=transport.consume, args=(queue, on_delivery),
                              kwargs={"stop": stop}, daemon=True)
    thread.start()
    try:
        return got.get(timeout=timeout)
    finally:
        stop.set()
        thread.join(5)


def _killed(queue: str, where: str, transport: KombuTransport) -> None:
    """Run a consumer of ``queue`` killed at ``where`` when a message comes; send one."""
    process = subprocess.Popen([sys.executable, "-c", KILLED, REDIS_URL, queue, where],
                               env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "consuming"
        transport.send(_envelope(queue, f"killed at {where}"))
        assert process.wait(20) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


@pytest.mark.timeout(60)
def test_a_consumer_killed_between_the_move_and_the_unacked_record_loses_nothing():
    require_service(REDIS_URL, "Redis")
    transport, queue = _declared()
    # Given a consumer killed once it moved the message, before it recorded it as unacked
    _killed(queue, "record", transport)
    with transport._channel() as channel:
        client = channel.client
        assert client.llen(queue) == 0  # taken off its queue...
        landings = [key for key, value in client.hgetall(LANDINGS_KEY).items()
                    if queue.encode() in value]
        # ... and on the dead consumer's landing list
        assert sum(client.llen(key) for key in landings) == 1
    # When another consumer runs (the dead one's lease expires after 1 s)
    delivery = _first_delivery(transport, queue, timeout=20)
    # Then it gets the message
    assert delivery.body == b"killed at record"
    with transport._channel() as channel:
        assert channel.client.llen(queue) == 0
        assert not any(queue.encode() in value
                       for value in channel.client.hgetall(LANDINGS_KEY).values())


@pytest.mark.timeout(60)
def test_a_consumer_killed_in_its_handler_loses_nothing():
    require_service(REDIS_URL, "Redis")
    transport, queue = _declared()
    # Given a consumer killed inside its handler (the message recorded as unacked)
    _killed(queue, "handler", transport)
    # When another consumer runs (kombu's visibility timeout is 1 s here)
    delivery = _first_delivery(transport, queue, timeout=30)
    # Then it gets the message again
    assert delivery.body == b"killed at handler"
    assert delivery.redelivered


@pytest.mark.timeout(60)
def test_a_sweep_lock_left_by_a_killed_process_holds_up_redelivery_a_lease_at_most():
    require_service(REDIS_URL, "Redis")
    transport, queue = _declared()  # a partition lease of 1 s
    # Given kombu's lock around the sweep of timed-out unacknowledged messages, taken as a
    # process takes it and never given back (the process was killed during a sweep)
    with transport._channel() as channel:
        assert channel.unacked_mutex_expire == 1
        assert channel.client.set(channel.unacked_mutex_key, "killed", nx=True,
                                  ex=channel.unacked_mutex_expire) or channel.client.ttl(
            channel.unacked_mutex_key) <= 1
    # And a consumer killed inside its handler (the message recorded as unacked)
    _killed(queue, "handler", transport)
    # When another consumer runs, then it gets the message again once the lock expired,
    # not after kombu's 300 s
    delivery = _first_delivery(transport, queue, timeout=20)
    assert delivery.body == b"killed at handler" and delivery.redelivered


@pytest.mark.timeout(30)
@pytest.mark.parametrize("priority", [None, 9])
def test_a_foreign_kombu_producers_message_is_consumed(priority):
    require_service(REDIS_URL, "Redis")
    transport, queue = _declared()
    # Given a message a plain kombu producer put on the queue (a priority list with 9)
    with kombu.Connection(REDIS_URL) as connection:
        producer = connection.Producer()
        producer.publish(b"from kombu", routing_key=queue, content_type="application/data",
                         content_encoding="binary", priority=priority)
    # When an idembus consumer runs, then it gets it
    assert _first_delivery(transport, queue, timeout=10).body == b"from kombu"
    with transport._channel() as channel:
        assert channel.client.hlen(channel.unacked_key) == 0 or all(
            queue.encode() not in value
            for value in channel.client.hvals(channel.unacked_key))


@pytest.mark.redis
@pytest.mark.parametrize("version", ["6.0.16", "5.0.14", ""])
def test_a_redis_server_older_than_6_2_is_refused_at_start_naming_its_version(
        monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    require_service(REDIS_URL, "Redis")
    import redis

    real_info = redis.Redis.info

    def older(client: redis.Redis, section: str | None = None, *args: object) -> dict:
        found = dict(real_info(client, section, *args))
        found["redis_version"] = version
        return found

    monkeypatch.setattr(redis.Redis, "info", older)
    transport = _transport()
    try:
        with pytest.raises(ConfigurationError,
                           match=f"version {version or 'unknown'}: idembus needs Redis 6.2"):
            transport.declare(f"old-server-{uuid.uuid4()}")
    finally:
        transport.close()


@pytest.mark.redis
@pytest.mark.parametrize("version", ["6.2.0", "7.0.15", "7.2-rc1", "10.0.0"])
def test_a_redis_server_of_6_2_or_later_is_taken(monkeypatch: pytest.MonkeyPatch,
                                                 version: str) -> None:
    require_service(REDIS_URL, "Redis")
    import redis

    real_info = redis.Redis.info
    seen: list[str] = []

    def newer(client: redis.Redis, section: str | None = None, *args: object) -> dict:
        found = dict(real_info(client, section, *args))
        found["redis_version"] = version
        seen.append(version)
        return found

    monkeypatch.setattr(redis.Redis, "info", newer)
    transport = _transport()
    queue = f"new-server-{uuid.uuid4()}"
    try:
        transport.declare(queue)
        assert seen  # the version was asked for
        transport.delete_queue(queue)
    finally:
        transport.close()
