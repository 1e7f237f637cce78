"""Each journal event is encoded once, whatever the number of clients that receive it: the
hub encodes what it fans out live, clients catching up find it in the shared cache, and the
bytes sent are the same object for every client."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from idembus import Endpoint
from idembus.gateway import Gateway
from idembus.gateway.encoded import EventCache
from idembus.storage.base import JournalEntry
from idembus.storage.memory import MemoryStorage
from tests.sse_client import events, take

STREAM = {"Accept": "text/event-stream"}
CLIENTS = 10
EVENTS = 120


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    endpoint = Endpoint(f"enc-{uuid.uuid4().hex[:8]}", storage=MemoryStorage(), journal=True)
    gateway = Gateway(endpoint, port=0, poll_interval=0.02)
    gateway.start()
    yield gateway
    gateway.stop()
    endpoint.close()


def append(storage: MemoryStorage, count: int) -> None:
    storage.append_journal([
        JournalEntry(message_id=str(uuid.uuid4()), message_type="test.Noted", headers={},
                     body=f'{{"n": {n}}}', aggregate_type="Note", aggregate_id=str(n % 7))
        for n in range(count)])


def test_ten_live_clients_cost_one_encoding_per_event(gateway: Gateway) -> None:
    storage = gateway.endpoint.storage
    assert isinstance(storage, MemoryStorage)
    with httpx.Client(timeout=15.0) as client, ExitStack() as streams:
        readers = []
        for _ in range(CLIENTS):
            response = streams.enter_context(
                client.stream("GET", gateway.url + "/", headers=STREAM))
            readers.append(events(response))
            assert next(readers[-1]).kind == "retry"  # subscribed
        append(storage, EVENTS)
        received = [take(reader, EVENTS) for reader in readers]
    assert all([int(event.id or 0) for event in got] == list(range(1, EVENTS + 1))
               for got in received)
    assert gateway.hub.cache.encoded == EVENTS
    assert gateway.status()["events_sent"] == CLIENTS * EVENTS


def test_clients_catching_up_from_the_storage_share_the_encoded_events(
    gateway: Gateway,
) -> None:
    storage = gateway.endpoint.storage
    assert isinstance(storage, MemoryStorage)
    append(storage, EVENTS)
    # The hub has read them with nobody listening (so it encoded none): a client that
    # subscribed before that read would get 1-10 encoded for its live stream too.
    assert gateway.hub.wait_for_position(EVENTS, timeout=10)
    assert gateway.hub.cache.encoded == 0
    with httpx.Client(timeout=15.0) as client:
        for _ in range(CLIENTS):
            with client.stream("GET", gateway.url + "/",
                               headers={**STREAM, "Last-Event-ID": "10"}) as response:
                got = take(events(response), EVENTS - 10)
            assert [int(event.id or 0) for event in got] == list(range(11, EVENTS + 1))
    assert gateway.hub.cache.encoded == EVENTS - 10


def test_the_cache_hands_out_one_bytes_object_per_event_and_stays_within_its_budget() -> None:
    entries = [JournalEntry(message_id=f"m{n}", message_type="t", headers={}, body="x" * 100,
                            position=n) for n in range(1, 101)]
    cache = EventCache(budget=5_000)  # some twenty of these events
    first = cache.batch(entries[:10])
    again = cache.batch(entries[:10])
    assert all(a.data is b.data for a, b in zip(first.events, again.events, strict=True))
    assert first.joined is first.joined  # joined once for all the clients taking it whole
    assert cache.encoded == 10
    cache.batch(entries)
    assert cache.encoded == 100
    cache.batch(entries[-5:])  # the newest are kept
    assert cache.encoded == 100
    cache.batch(entries[:1])  # the oldest went, to stay within the budget
    assert cache.encoded == 101
