"""Property: whatever the processed window (1–3), a retention of zero, and wherever a process
dies between commit and dispatch, every committed outgoing message is eventually dispatched
by the outbox dispatcher, once, with its id, exactly as stored — neither the window nor
retention ever forgets what was not sent.

The outbox here is the real one (:class:`~idembus.runtime.outbox.OutboxRelay` with its lease,
endpoint filter, compaction and housekeeping), sending through a transport that records the
bytes it is given; the storages are the real backends (PostgreSQL and a real MongoDB where
they run), so "as stored" is a round trip through each.
"""

from __future__ import annotations

import copy
import datetime
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from idembus import headers as h
from idembus.envelope import Envelope, utc_now
from idembus.storage.memory import MemoryStorage
from idembus.storage.mongo import MongoStorage
from idembus.transports.kombu import KombuTransport
from tests.conftest import MONGODB_URL, POSTGRES_URL, require_service
from tests.support import outbox_relay

ENDPOINT = "sales"
RETAIN_NOTHING = datetime.timedelta(0)

#: One committed message: which aggregate, how many outgoing messages, whether the process
#: died before marking them dispatched, and whether the outbox runs a round afterwards.
steps = st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 2), st.booleans(),
                           st.booleans()), min_size=1, max_size=25)


class Recording(KombuTransport):
    """memory:// that records every envelope it is given, as given."""

    def __init__(self) -> None:
        super().__init__("memory://")
        self.sent: list[Envelope] = []

    def dispatch(self, envelope: Envelope) -> None:
        self.sent.append(copy.deepcopy(envelope))


def outgoing(count: int) -> list[Envelope]:
    envelopes = []
    for _ in range(count):
        message_id = str(uuid.uuid4())
        envelopes.append(Envelope(
            {h.MESSAGE_ID: message_id, h.MESSAGE_TYPE: "test.Deposited", h.INTENT: "publish",
             h.ORIGINATING_ENDPOINT: ENDPOINT, "odd": "ünï\u2028code"},
            f'{{"id": "{message_id}", "note": "\\u0000 and €"}}'))
    return envelopes


def as_sent(envelope: Envelope) -> tuple[Any, ...]:
    return (envelope.message_id, sorted(envelope.headers.items()), envelope.body,
            envelope.destination, envelope.content_type)


StorageMaker = Callable[[int], Any]


@pytest.fixture(params=["memory", "mongomock", pytest.param("mongodb", marks=pytest.mark.mongodb),
                        pytest.param("postgres", marks=pytest.mark.postgres)])
def make_storage(request: pytest.FixtureRequest) -> Iterator[StorageMaker]:
    """``make_storage(window)``: a storage that retains nothing dispatched and, where the
    backend has one, keeps a processed window of ``window`` entries per aggregate."""
    kind: str = request.param
    closing: list[Any] = []
    if kind == "postgres":
        require_service(POSTGRES_URL, "PostgreSQL")
        from idembus.storage.postgres import PostgresStorage

        shared = PostgresStorage(POSTGRES_URL, table_prefix=f"w{uuid.uuid4().hex[:12]}",
                                 retention=RETAIN_NOTHING)
        shared.verify()
        closing.append(shared)
    if kind == "mongodb":
        if not MONGODB_URL:
            pytest.skip("set IDEMBUS_MONGODB_URL to run the storage contract on a real MongoDB")
        require_service(MONGODB_URL, "MongoDB")

    def make(window: int) -> Any:
        if kind == "memory":
            return MemoryStorage(processed_window=window, retention=RETAIN_NOTHING)
        if kind == "mongomock":
            return MongoStorage.embedded(f"window-{uuid.uuid4().hex}", processed_window=window,
                                         retention=RETAIN_NOTHING)
        if kind == "mongodb":
            storage = MongoStorage(MONGODB_URL, database=f"idembus-window-{uuid.uuid4().hex}",
                                   processed_window=window, retention=RETAIN_NOTHING)
            closing.append(storage)
            return storage
        return shared  # one row per processed message: no window; aggregates are unique

    yield make
    for storage in closing:
        storage.close()


def outbox_round(storage: Any, transport: Recording) -> None:
    """One round of a fresh outbox dispatcher (another process, say), lease given back."""
    dispatcher = outbox_relay(ENDPOINT, transport, storage, grace=0)
    try:
        dispatcher.run_once()
    finally:
        dispatcher.stop()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                             HealthCheck.function_scoped_fixture])
@given(window=st.integers(1, 3), plan=steps)
def test_every_committed_message_is_dispatched_once_as_stored_whatever_the_window(
    make_storage: StorageMaker, window: int, plan: list[tuple[str, int, bool, bool]],
) -> None:
    storage = make_storage(window)
    transport = Recording()
    run = uuid.uuid4().hex[:8]  # aggregates of this example alone on a shared storage
    committed: list[Envelope] = []
    for number, (aggregate, count, dies, outbox_runs) in enumerate(plan):
        messages = outgoing(count)
        aggregate_id, key = f"{aggregate}-{run}", f"H/{run}/m{number}"
        loaded = storage.load("Account", aggregate_id)
        storage.commit(loaded, key=key, state={"n": number}, outgoing=messages)
        committed.extend(copy.deepcopy(messages))
        if not dies:  # the committer dispatches and marks
            for envelope in messages:
                transport.dispatch(envelope)
            storage.mark_dispatched("Account", aggregate_id, key)
            # PostgreSQL writes marks in batches; the outbox's grace (10 s by default, 0
            # here) is what keeps it from sending a batch not yet written.
            storage.flush()
        if outbox_runs:
            outbox_round(storage, transport)
    # MongoDB keeps times in milliseconds (mongomock rounds them): let the clock pass the
    # last commit's, so that the outbox's "committed before now" (grace 0) includes it.
    time.sleep(0.002)
    later = utc_now() + datetime.timedelta(minutes=1)
    for _ in range(3):  # until no entry of this example waits (clocks may tie at "now")
        if not any(entry.key.startswith(f"H/{run}/")
                   for entry in storage.undispatched(committed_before=later, limit=10_000)):
            break
        outbox_round(storage, transport)

    assert sorted(map(as_sent, transport.sent)) == sorted(map(as_sent, committed))
