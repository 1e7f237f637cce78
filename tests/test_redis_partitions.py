"""Ordered processing on Redis: a process consumes a partition queue only while it holds its
lease (``transports/redis_leases.py``); a lease is taken over only once it expired, and the
message its dead holder left unacknowledged (or had just taken) is handled first; keys stay
in order under 2 workers x 4 threads with kills."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from idembus import Command
from idembus.routing import Router, partition_queue
from idembus.sending import Bus
from idembus.transports.base import Delivery
from idembus.transports.kombu import KombuTransport
from idembus.transports.redis_leases import LEASE_KEY, PartitionLeases
from tests.conftest import POSTGRES_URL, REDIS_URL, require_service
from tests.ordered_app import Step
from tests.test_ordered_processing import ORDERED_APP, SIZES, _run_killed
from tests.test_workers import ROOT, App, wait_until

pytestmark = pytest.mark.redis


class Single(Command, message_name="test.ordered.Single", ordered_by="key", partitions=1):
    key: str
    seq: int


#: A process that consumes partition 0 of a queue and never settles what it gets.
HOLDER = """
import sys, threading
from idembus.transports.kombu import KombuTransport
url, queue = sys.argv[1:3]
transport = KombuTransport(url, partition_lease=1.0)
transport.declare_partitions(queue, 1)
def on_delivery(delivery):
    print("got", delivery.body.decode(), flush=True)
    threading.Event().wait()
transport.consume_partitions(queue, [0], on_delivery, stop=threading.Event())
"""


def _lease(transport: KombuTransport, queue: str, index: int) -> tuple[str | None, int]:
    """The holder of a partition's lease and its remaining life (ms)."""
    with transport._channel() as channel:
        key = LEASE_KEY.format(queue=partition_queue(queue, index))
        holder = channel.client.get(key)
        return (holder.decode() if holder else None), int(channel.client.pttl(key))


@pytest.mark.timeout(60)
def test_a_lease_is_taken_over_once_its_dead_holder_lets_it_expire_and_its_message_is_first():
    require_service(REDIS_URL, "Redis")
    transport = KombuTransport(REDIS_URL, partition_lease=1.0)
    queue = f"lease-{uuid.uuid4().hex[:8]}"
    transport.declare(queue)
    transport.declare_partitions(queue, 1)
    bus = Bus("sender", Router({Single: queue}), transport.dispatch)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, REDIS_URL, queue],
                              env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.PIPE, text=True)
    stop = threading.Event()
    try:
        # Given a process that holds partition 0 and is in the middle of its first message
        for seq in range(3):
            bus.send(Single(key="k", seq=seq))
        assert holder.stdout is not None
        assert json.loads(holder.stdout.readline().split(" ", 1)[1]) == {"key": "k", "seq": 0}
        owner, _ = _lease(transport, queue, 0)
        assert owner is not None and f":{holder.pid}:" in owner

        # When it is killed, and this process consumes the partition too
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        killed_at = time.monotonic()
        _, remaining_ms = _lease(transport, queue, 0)
        seen: list[tuple[int, bool, float]] = []
        done = threading.Event()

        def on_delivery(delivery: Delivery) -> None:
            seen.append((json.loads(delivery.body)["seq"], delivery.redelivered,
                         time.monotonic()))
            delivery.ack()
            if len(seen) == 3:
                done.set()

        consumer = threading.Thread(target=transport.consume_partitions,
                                    args=(queue, [0], on_delivery), kwargs={"stop": stop})
        consumer.start()

        # Then it takes the partition only once the lease expired, and gets the dead
        # holder's message first, then the others in order
        assert done.wait(30), seen
        assert [(seq, redelivered) for seq, redelivered, _ in seen] == [
            (0, True), (1, False), (2, False)]
        assert seen[0][2] >= killed_at + remaining_ms / 1000 - 0.05
        owner, _ = _lease(transport, queue, 0)
        assert owner is not None and f":{os.getpid()}:" in owner
        stop.set()
        consumer.join(10)
        assert not consumer.is_alive()
        # Released on stop, and nothing left unacknowledged
        assert _lease(transport, queue, 0)[0] is None
        with transport._channel() as channel:
            assert channel.client.hlen("unacked") == 0 or not any(
                partition_queue(queue, 0) in value.decode()
                for value in channel.client.hvals("unacked"))
    finally:
        stop.set()
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
        for name in (queue, partition_queue(queue, 0)):
            transport.delete_queue(name)
        transport.close()


@pytest.mark.timeout(60)
def test_two_processes_share_the_partitions_and_one_takes_all_when_the_other_leaves():
    require_service(REDIS_URL, "Redis")
    transport = KombuTransport(REDIS_URL)
    queue = f"lease-{uuid.uuid4().hex[:8]}"
    first = PartitionLeases(transport._connect, transport._release, queue, 4, ttl=0.5)
    second = PartitionLeases(transport._connect, transport._release, queue, 4, ttl=0.5)
    every = range(4)
    try:
        # Given one process that holds all four partitions
        first.watch(every, threading.Event())
        assert wait_until(lambda: first.consumable(every) == set(every), timeout=10)

        # When a second one comes
        second.watch(every, threading.Event())
        # Then the first gives two back (once it no longer consumes them) and the second
        # takes them: two each, never one partition held by both
        assert wait_until(lambda: _giving_back(first, every) and len(
            second.consumable(every)) == 2, timeout=10)
        assert first.consumable(every) | second.consumable(every) == set(every)
        assert not first.consumable(every) & second.consumable(every)

        # And when the second one leaves, the first takes everything again
        second.release(every, unwatch=True)
        assert wait_until(lambda: first.consumable(every) == set(every), timeout=10)
    finally:
        first.release(every, unwatch=True)
        second.release(every, unwatch=True)
        transport.close()


def _giving_back(leases: PartitionLeases, partitions: range) -> bool:
    """What a consumer thread does once it stopped consuming the partitions given up."""
    leases.release([index for index in partitions
                    if index not in leases.consumable(partitions)])
    return len(leases.consumable(partitions)) == 2


def _redis_case(tmp_path, keys: int, per_key: int) -> None:
    require_service(REDIS_URL, "Redis")
    require_service(POSTGRES_URL, "PostgreSQL")
    from idembus.storage.postgres import PostgresStorage
    (tmp_path / "worker_app.py").write_text(ORDERED_APP)
    suffix = uuid.uuid4().hex[:10]
    prefix = f"ordr{suffix}"
    transport = KombuTransport(REDIS_URL)
    storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    app = App(tmp_path, f"ordered-{suffix}", f"ordered-error-{suffix}", prefix, transport)
    names = [partition_queue(app.queue, index) for index in range(16)]
    try:
        storage.migrate()
        transport.declare(app.queue)
        transport.declare(app.error_queue)
        transport.declare_partitions(app.queue, 16)
        bus = Bus("test-sender", Router({Step: app.queue}), transport.dispatch)
        _run_killed(app, keys, per_key, bus.send,
                    pending=lambda: sum(transport.pending(name) for name in names),
                    APP_TRANSPORT=REDIS_URL, APP_LEASE="3")
        # The two workers started after the kills share the partitions.
        assert app.running[0].err.wait_for("a share of 8 for 2 live process(es)", timeout=30)
    finally:
        for running in app.running:
            running.stop()
        for name in (app.queue, app.error_queue, *names):
            transport.delete_queue(name)
        transport.close()
        storage.drop_tables()
        storage.close()


# The consumers take a message by moving it (transports/redis_taking.py): the two kills lose
# nothing, wherever they hit (kombu's BRPOP lost the message it was taking).
@pytest.mark.postgres
@pytest.mark.parametrize("keys, per_key", SIZES)
def test_redis_applies_keys_in_order_under_2_workers_x_4_threads_with_kills(
        tmp_path, keys, per_key):
    _redis_case(tmp_path, keys=keys, per_key=per_key)
