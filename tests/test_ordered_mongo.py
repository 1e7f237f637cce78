"""Ordered processing per key on the MongoDB queue (mongomock, one process): a claim skips a
document while an older one of its key is still in the queue, so keys are applied one at a
time and in order by competing endpoints and their threads, a message redelivered after its
consumer died still comes first, other keys go on meanwhile, and settling an ordered message
wakes the consumers waiting for its key."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator

import mongomock
import pytest

import idembus.transports.mongo as mongo_module
from idembus import Endpoint
from idembus.handlers import Handler, handles
from idembus.routing import Router
from idembus.sending import Bus
from idembus.storage.memory import MemoryStorage
from idembus.testing import wait_until_idle
from idembus.transports.mongo import MongoTransport
from tests.ordered_app import Loose, Sequences, Step


class Recorder(Handler):
    """Records the order in which steps are handled, and any step started while another of
    its key was still being handled (``overlaps``)."""

    def __init__(self, jitter: float = 0.0) -> None:
        self.lock = threading.Lock()
        self.handled: list[tuple[str, int]] = []
        self.busy: set[str] = set()
        self.overlaps: list[tuple[str, int]] = []
        self.jitter = jitter
        self.random = random.Random(7)

    @handles
    def step(self, message: Step) -> None:
        with self.lock:
            if message.key in self.busy:
                self.overlaps.append((message.key, message.seq))
            self.busy.add(message.key)
            pause = self.random.random() * self.jitter
        time.sleep(pause)  # widens the races ordering must close; not a synchronisation
        with self.lock:
            self.busy.discard(message.key)
            self.handled.append((message.key, message.seq))

    def of(self, key: str) -> list[int]:
        with self.lock:
            return [seq for handled_key, seq in self.handled if handled_key == key]


@pytest.fixture
def client() -> Iterator[mongomock.MongoClient]:
    yield mongomock.MongoClient()


def _transport(client: mongomock.MongoClient, **options: float) -> MongoTransport:
    return MongoTransport(client, database="ordered", **options)


def _sender(client: mongomock.MongoClient, queue: str) -> Bus:
    transport = _transport(client)
    transport.declare(queue)
    return Bus("sender", Router({Step: queue, Loose: queue}), transport.dispatch)


@pytest.mark.timeout(120)
def test_keys_are_applied_one_at_a_time_in_order_by_competing_endpoints_and_threads(client):
    # Given three endpoints of one queue, 4 threads and a prefetch of 8 each
    queue = f"steps-{uuid.uuid4().hex[:8]}"
    recorder = Recorder(jitter=0.002)
    endpoints = [Endpoint(queue, transport=_transport(client), storage=MemoryStorage(),
                          handlers=[recorder], concurrency=4, prefetch=8, batching=None)
                 for _ in range(3)]
    sender = _sender(client, queue)
    for endpoint in endpoints:
        endpoint.start()
    try:
        # When 12 keys get 15 steps each, interleaved
        for seq in range(15):
            for key in range(12):
                sender.send(Step(key=f"k{key}", seq=seq))
        wait_until_idle(endpoints, timeout=90)
    finally:
        for endpoint in endpoints:
            endpoint.stop()
    # Then every key saw its steps in order, each once, never two at a time
    assert {f"k{key}": recorder.of(f"k{key}") for key in range(12)} == {
        f"k{key}": list(range(15)) for key in range(12)}
    assert recorder.overlaps == []
    assert sum(endpoint.counters.snapshot()["handled"] for endpoint in endpoints) == 180


def test_the_key_is_stored_on_the_document_and_only_for_ordered_commands(client):
    queue = f"steps-{uuid.uuid4().hex[:8]}"
    sender = _sender(client, queue)
    sender.send(Step(key="k", seq=0))
    sender.send(Loose(key="k", seq=0))
    documents = list(_transport(client).messages.find({"queue": queue}).sort("order", 1))
    assert [document.get("ordering_key") for document in documents] == ["k", None]
    indexes = _transport(client).messages.index_information()
    assert indexes["idembus_ordering"]["key"] == [("queue", 1), ("ordering_key", 1),
                                                   ("order", 1)]


def test_a_claim_takes_the_oldest_message_of_every_key_not_in_flight(client):
    # Given k: 0, 1, 2 and j: 0, 1 and an unordered message, in this order
    queue = f"steps-{uuid.uuid4().hex[:8]}"
    sender = _sender(client, queue)
    for seq in range(3):
        sender.send(Step(key="k", seq=seq))
    sender.send(Loose(key="k", seq=9))
    for seq in range(2):
        sender.send(Step(key="j", seq=seq))
    first, second = _transport(client), _transport(client)
    try:
        # When one consumer claims up to 10, then another claims up to 10
        taken = first._claim(None, queue, 10).deliveries
        then = second._claim(None, queue, 10).deliveries
        # Then the first got the head of each key and the unordered one; the second none
        assert [(d.headers["idembus.ordering.key"] if "idembus.ordering.key" in d.headers
                 else None, d.redelivered) for d in taken] == [
            ("k", False), (None, False), ("j", False)]
        assert then == []
        # And a document passed over keeps its delivery count and its place
        assert {d["deliveries"] for d in first.messages.find(
            {"queue": queue, "lease": None})} == {0}
        # When the head of k is acknowledged, the next claim gets k's second, not its third
        taken[0].ack()
        (next_of_k,) = second._claim(None, queue, 10).deliveries
        assert next_of_k.headers["idembus.ordering.key"] == "k"
        assert Step.model_validate_json(next_of_k.body).seq == 1
    finally:
        first.close()
        second.close()


@pytest.mark.timeout(60)
def test_a_message_whose_consumer_died_comes_first_and_other_keys_go_on_meanwhile(client):
    # Given k: 0..4 and j: 0..4, and a consumer that claims k's first message and dies
    queue = f"steps-{uuid.uuid4().hex[:8]}"
    sender = _sender(client, queue)
    for seq in range(5):
        sender.send(Step(key="k", seq=seq))
    for seq in range(5):
        sender.send(Step(key="j", seq=seq))
    dead = _transport(client, visibility_timeout=3.0)
    (held,) = dead._claim(None, queue, 1).deliveries
    assert held.headers["idembus.ordering.key"] == "k"
    dead.close()  # renews no lease any more: the message comes back when its lease ends
    # When another endpoint consumes the queue
    storage = MemoryStorage()
    recorder = Recorder()
    endpoint = Endpoint(queue, transport=_transport(client), storage=storage,
                        handlers=[recorder], concurrency=2, prefetch=4, batching=None)
    with endpoint:
        wait_until_idle([endpoint], timeout=30)
    # Then j went on while k waited for its first message, redelivered, then k in order
    assert recorder.of("k") == list(range(5))
    assert recorder.of("j") == list(range(5))
    assert recorder.handled[:5] == [("j", seq) for seq in range(5)]
    assert endpoint.counters.snapshot()["handled"] == 10


class Blocking(Handler):
    """Holds the first step of key ``slow`` until released."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.fast_done = threading.Event()
        self.recorder = Recorder()

    @handles
    def step(self, message: Step) -> None:
        if message.key == "slow" and message.seq == 0:
            self.started.set()
            assert self.release.wait(20)
        self.recorder.step(message)
        if message.key == "fast" and message.seq == 4:
            self.fast_done.set()


@pytest.mark.timeout(60)
def test_different_keys_proceed_in_parallel_while_one_key_is_held(client):
    # Given an endpoint of two threads whose handler holds the first message of "slow"
    queue = f"steps-{uuid.uuid4().hex[:8]}"
    handler = Blocking()
    endpoint = Endpoint(queue, transport=_transport(client), storage=MemoryStorage(),
                        handlers=[handler], concurrency=2, prefetch=1, batching=None)
    sender = _sender(client, queue)
    with endpoint:
        # When slow: 0, 1 are sent, then fast: 0..4
        sender.send(Step(key="slow", seq=0))
        sender.send(Step(key="slow", seq=1))
        assert handler.started.wait(20)
        for seq in range(5):
            sender.send(Step(key="fast", seq=seq))
        # Then fast is handled entirely while slow's first is held, and slow's second waits
        assert handler.fast_done.wait(20)
        assert handler.recorder.of("fast") == list(range(5))
        assert handler.recorder.of("slow") == []
        handler.release.set()
        wait_until_idle([endpoint], timeout=30)
    assert handler.recorder.of("slow") == [0, 1]


@pytest.mark.timeout(60)
def test_settling_an_ordered_message_wakes_the_consumers_waiting_for_its_key(
        client, monkeypatch):
    # Given a consumer that looks only every 30 s when idle (from its first wait on), and a
    # tool holding the first of three messages of one key
    monkeypatch.setattr("idembus.transports.mongo_watch._FIRST_POLL", 30.0)
    queue = f"steps-{uuid.uuid4().hex[:8]}"
    sender = _sender(client, queue)
    for seq in range(3):
        sender.send(Step(key="k", seq=seq))
    tool = _transport(client)
    consumer = _transport(client, max_idle_wait=30, poll_interval=30)
    looked = threading.Event()
    claim = consumer._claim

    def watched(session, name, limit):  # type: ignore[no-untyped-def]
        found = claim(session, name, limit)
        if not found.deliveries:
            looked.set()
        return found

    consumer._claim = watched  # type: ignore[method-assign]
    storage = MemoryStorage()
    endpoint = Endpoint(queue, transport=consumer, storage=storage, handlers=[Sequences],
                        concurrency=1, batching=None)
    try:
        with tool.inspect(queue, limit=1) as (held,):
            with endpoint:
                # (the consumer found the key in flight and waits)
                assert looked.wait(20)
                # When the tool settles the first message
                held.ack()
                # Then the consumer is woken for the next of its key, far sooner than 30 s
                wait_until_idle([endpoint], timeout=10)
                assert {r.aggregate_id: r.state["seqs"] for r in storage.records("Seen")} == {
                    "k": [1, 2]}
    finally:
        tool.close()


def test_a_message_whose_elder_is_settled_while_it_is_passed_over_is_taken(
        client, monkeypatch):
    # Given k: 0, 1, and a tool holding k's first
    queue = f"steps-{uuid.uuid4().hex[:8]}"
    sender = _sender(client, queue)
    for seq in range(2):
        sender.send(Step(key="k", seq=seq))
    tool, consumer = _transport(client), _transport(client)
    try:
        with tool.inspect(queue, limit=1) as (held,):
            passed_over = mongo_module.pass_over

            def settled_meanwhile(messages, document, lease):  # type: ignore[no-untyped-def]
                # (on a server, another consumer settles the elder between the look and
                # the give-back; and its own next claim found k's second leased here)
                passed_over(messages, document, lease)
                if not held.settled:
                    held.ack()

            monkeypatch.setattr(mongo_module, "pass_over", settled_meanwhile)
            # When a consumer claims: it passes k's second over, its elder then settled
            (taken,) = consumer._claim(None, queue, 5).deliveries
        # Then it looks again and takes it, rather than leaving it to the next poll
        assert Step.model_validate_json(taken.body).seq == 1
    finally:
        tool.close()
        consumer.close()


@pytest.mark.timeout(90)
def test_commands_ordered_by_a_handler_are_applied_in_order_by_competing_endpoints(client):
    from tests.test_ordered_handlers import Balance, Ledger, Post

    # Given two endpoints of three threads each hosting a ledger ordered by its aggregate id
    queue = f"ledger-{uuid.uuid4().hex[:8]}"
    storage = MemoryStorage()
    endpoints = [Endpoint(queue, transport=_transport(client), storage=storage,
                          handlers=[Ledger()], concurrency=3, prefetch=4, batching=None)
                 for _ in range(2)]
    for endpoint in endpoints:
        endpoint.start()
    try:
        # When posts of six accounts are sent interleaved through one endpoint's bus
        for amount in range(12):
            for account in range(6):
                endpoints[0].bus.send(Post(account=f"acc{account}", amount=amount))
        keys = {document.get("ordering_key")
                for document in _transport(client).messages.find({"queue": queue})}
        assert None not in keys  # each stored with its key
        wait_until_idle(endpoints, timeout=60)
    finally:
        for endpoint in endpoints:
            endpoint.stop()
    # Then every account saw them in order, and none came without its key
    assert {record.aggregate_id: Balance.model_validate(record.state).amounts
            for record in storage.records("Balance")} == {
        f"acc{account}": list(range(12)) for account in range(6)}
    assert sum(endpoint.counters.snapshot()["unordered"] for endpoint in endpoints) == 0
