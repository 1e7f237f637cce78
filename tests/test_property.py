"""The whole guarantee as a property, at the processing level (no broker, no threads).

Any interleaving of deliveries, duplicates and crashes ends with the same aggregate states
and the same sent messages (same ids, same bodies) as one clean run.

The endpoint's real processor (``Endpoint._processor``, a ``MessageProcessor``) is driven
directly by a test loop that plays the broker: a queue of deliveries, each settled by the
processor; a crash (``SimulatedCrash`` raised by a fault injector) leaves the delivery
unsettled, ``Transport.deliver`` requeues it, and the loop puts it back at a later position
of the queue, as a broker redelivers a message whose consumer died.

On the database transports (PostgreSQL, with and without the shared transaction, and
MongoDB on mongomock) the queue is the transport's own: the loop sends the schedule into it
and takes any waiting message next (``inspect``), so requeues, leases and the shared
transaction's removal of the message are the real ones.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from idembus import Endpoint
from idembus import headers as h
from idembus.envelope import Envelope
from idembus.messages import message_name
from idembus.policies import OutboxPolicy
from idembus.storage.base import Storage
from idembus.storage.memory import MemoryStorage
from idembus.storage.mongo import MongoStorage
from idembus.storage.postgres import PostgresStorage
from idembus.testing.faults import CrashPoint, FaultInjector, SimulatedCrash
from idembus.transports.base import Transport
from tests.conftest import POSTGRES_URL, require_service
from tests.support import (
    Account,
    AccountHandler,
    Deposit,
    Deposited,
    DrivenTransport,
    RecordedDelivery,
)

QUEUE = "accounts"
ERROR_QUEUE = "accounts-error"
#: Crashes injected per chaotic run at most, so that every run terminates.
MAX_CRASHES = 12


class RecordingDelivery(RecordedDelivery):
    """A delivery of one Deposit whose settlement is only recorded."""

    def __init__(self, message: DepositMessage, *, redelivered: bool) -> None:
        super().__init__(QUEUE, dict(message.headers), message.body, redelivered=redelivered)
        self.message = message


class RecordingTransport(DrivenTransport):
    """Records what the endpoint dispatches; the test loop plays the broker's queue."""

    def __init__(self) -> None:
        self.dispatched: list[Envelope] = []
        self.dead_letters: list[Envelope] = []

    def send(self, envelope: Envelope) -> None:
        if envelope.destination == ERROR_QUEUE:
            self.dead_letters.append(envelope)
        else:
            self.dispatched.append(envelope)

    def publish(self, envelope: Envelope) -> None:
        self.dispatched.append(envelope)



class ArmedCrash(FaultInjector):
    """Crashes at the one point it was armed with for the current delivery, if reached."""

    def __init__(self) -> None:
        self.armed: CrashPoint | None = None
        self.fired = False

    def arm(self, point: CrashPoint | None) -> None:
        self.armed, self.fired = point, False

    def reached(self, point: CrashPoint, message_id: str) -> None:
        if point is self.armed and not self.fired:
            self.fired = True
            raise SimulatedCrash(f"simulated crash {point.value} of {message_id}")


@dataclass(frozen=True)
class DepositMessage:
    """One incoming Deposit as it sits on the wire: every copy has the same id and body."""

    message_id: str
    account: str
    amount: int

    @property
    def headers(self) -> Mapping[str, str]:
        return {h.MESSAGE_ID: self.message_id, h.MESSAGE_TYPE: message_name(Deposit),
                h.INTENT: h.Intent.SEND.value}

    @property
    def body(self) -> bytes:
        return Deposit(account=self.account, amount=self.amount).model_dump_json().encode()


@dataclass
class RunResult:
    states: dict[str, dict[str, object]]
    dispatched: list[Envelope]
    crashes: int = 0
    deliveries: int = 0


@st.composite
def messages(draw: st.DrawFn) -> list[DepositMessage]:
    accounts = [f"acc-{index}" for index in range(draw(st.integers(1, 3)))]
    count = draw(st.integers(1, 8))
    return [
        DepositMessage(f"deposit-{index}", draw(st.sampled_from(accounts)),
                       draw(st.integers(1, 20)))
        for index in range(count)
    ]


@st.composite
def schedules(draw: st.DrawFn, sent: list[DepositMessage]) -> list[int]:
    """Indexes into ``sent``: each message 1..3 times (duplicates), in any order."""
    copies = [index for index, _ in enumerate(sent) for _ in range(draw(st.integers(1, 3)))]
    return list(draw(st.permutations(copies)))


def postgres_storage() -> Storage:
    """Tables of their own for one run; ``run`` drops them afterwards."""
    require_service(POSTGRES_URL, "PostgreSQL")
    storage = PostgresStorage(POSTGRES_URL, table_prefix=f"prop{uuid.uuid4().hex[:12]}")
    storage.verify()
    return storage


STORAGES: list[object] = [
    pytest.param(lambda: MemoryStorage(), id="memory"),
    pytest.param(lambda: MongoStorage.embedded(f"property-{uuid.uuid4().hex}"), id="mongomock"),
    pytest.param(postgres_storage, id="postgres", marks=pytest.mark.postgres),
]

CRASH_POINTS = st.none() | st.sampled_from(list(CrashPoint))


def run(
    sent: list[DepositMessage],
    order: list[int],
    *,
    make_storage: Callable[[], Storage],
    compact: bool,
    data: st.DataObject | None = None,
) -> RunResult:
    """Deliver ``sent[i]`` for each i of ``order`` to a fresh endpoint until all are acked.

    With ``data``, each delivery may crash at a drawn point; the crashed delivery goes
    back into the queue at a drawn later position, as the broker's redelivery.
    """
    transport = RecordingTransport()
    injector = ArmedCrash()
    endpoint = Endpoint(QUEUE, transport=transport, storage=make_storage(),
                        handlers=[AccountHandler], error_queue=ERROR_QUEUE,
                        outbox=OutboxPolicy(compact_after_dispatch=compact), middleware=[injector])
    queue: list[tuple[DepositMessage, bool]] = [(sent[index], False) for index in order]
    result = RunResult(states={}, dispatched=transport.dispatched)
    try:
        while queue:
            message, redelivered = queue.pop(0)
            delivery = RecordingDelivery(message, redelivered=redelivered)
            crash_at = None
            if data is not None and result.crashes < MAX_CRASHES:
                crash_at = data.draw(CRASH_POINTS, label=f"crash point of {message.message_id}")
            injector.arm(crash_at)
            result.deliveries += 1

            Transport.deliver(delivery, endpoint._processor)

            if injector.fired:
                # Died mid-way: never acknowledged, handed back to the broker.
                assert not delivery.acked, f"{message.message_id} was acked, then crashed"
                assert delivery.requeued
                assert data is not None
                result.crashes += 1
                position = data.draw(st.integers(0, len(queue)),
                                     label=f"redelivery position of {message.message_id}")
                queue.insert(position, (message, True))
            else:
                assert delivery.acked and not delivery.requeued, (
                    f"{message.message_id} was not acked although nothing crashed")
        assert transport.dead_letters == []
        result.states = {
            record.aggregate_id: dict(record.state or {})
            for record in endpoint.storage.records(AccountHandler.storage_name())
        }
    finally:
        if isinstance(endpoint.storage, PostgresStorage):
            endpoint.storage.drop_tables()
        endpoint.close()
    return result


def summed(sent: list[DepositMessage]) -> dict[str, dict[str, object]]:
    """Each account's state after its deposits, each applied once."""
    totals: dict[str, Account] = defaultdict(Account)
    for message in sent:
        totals[message.account].balance += message.amount
        totals[message.account].deposits += 1
    return {account: state.model_dump() for account, state in totals.items()}


def bodies_by_id(envelopes: list[Envelope]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = defaultdict(set)
    for envelope in envelopes:
        found[envelope.message_id].add(envelope.body)
    return dict(found)


def assert_sent_as_clean(sent: list[DepositMessage], clean: RunResult,
                         other: RunResult) -> None:
    """``other`` sent the messages of the ``clean`` run of ``sent``: every id of the clean
    run at least once (crashes and duplicates may send one again, always with that id), no
    other id, and under each id the one body of the clean run, one event a deposit."""
    clean_bodies = bodies_by_id(clean.dispatched)
    other_bodies = bodies_by_id(other.dispatched)
    assert len(clean.dispatched) == len(sent) == len(clean_bodies)
    assert set(other_bodies) == set(clean_bodies)
    for message_id, bodies in other_bodies.items():
        assert bodies == clean_bodies[message_id], message_id
    assert all(envelope.intent is h.Intent.PUBLISH for envelope in other.dispatched)
    events = {(e.account, e.amount) for e in map(Deposited.model_validate_json,
                                                 (envelope.body for envelope in clean.dispatched))}
    assert events == {(message.account, message.amount) for message in sent}


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "keep-bodies"])
@pytest.mark.parametrize("make_storage", STORAGES)
@pytest.mark.timeout(300)  # 60 examples on PostgreSQL: 40 s when the machine is busy
@settings(max_examples=60, deadline=None)
@given(sent=messages(), data=st.data())
def test_any_interleaving_of_duplicates_and_crashes_ends_as_one_clean_run(
    make_storage: Callable[[], Storage], compact: bool, sent: list[DepositMessage],
    data: st.DataObject,
) -> None:
    # Given distinct deposits over a few accounts, and a delivery schedule in which each
    # deposit arrives one to three times, in any order, any delivery possibly crashing
    # before commit, after commit or after dispatch (and then redelivered later);
    order = data.draw(schedules(sent), label="delivery order")

    # When one endpoint processes them cleanly (each once, no crash) and another, on fresh
    # storage, processes the chaotic schedule,
    clean = run(sent, list(range(len(sent))), make_storage=make_storage, compact=compact)
    chaotic = run(sent, order, make_storage=make_storage, compact=compact, data=data)
    event(f"crashes: {chaotic.crashes}")  # shown by --hypothesis-show-statistics
    event(f"duplicate deliveries: {len(order) - len(sent)}")

    # Then the accounts end in the same state, which is the sum of their deposits,
    assert clean.states == summed(sent)
    assert chaotic.states == clean.states

    # and the same messages were sent: every id of the clean run at least once (crashes
    # and duplicates may send one again, always with that id), no other id, and under
    # each id the one body of the clean run.
    assert_sent_as_clean(sent, clean, chaotic)

    # Every delivery of the schedule was processed to its ack, plus one per crash.
    assert chaotic.deliveries == len(order) + chaotic.crashes


# -- the same property through the database transports' own queues ---------------------------


@dataclass(frozen=True)
class QueuesAndStorage:
    """A database transport and a storage for one run, and how to drop them after."""

    name: str
    make: Callable[[str], tuple[Transport, Storage]]
    #: A handler's commit removes the incoming message and sends its events (crashes
    #: after it deliver nothing again).
    shared: bool = False


def _postgres_pair(shared: bool) -> Callable[[str], tuple[Transport, Storage]]:
    def make(unique: str) -> tuple[Transport, Storage]:
        require_service(POSTGRES_URL, "PostgreSQL")
        from idembus.transports.postgres import PostgresTransport

        storage = PostgresStorage(POSTGRES_URL, table_prefix=f"prop{unique}")
        storage.verify()
        return (PostgresTransport(POSTGRES_URL, table_prefix=f"propq{unique}",
                                  shared_transactions=shared), storage)

    return make


def _mongomock_pair(unique: str) -> tuple[Transport, Storage]:
    import mongomock

    from idembus.transports.mongo import MongoTransport

    return (MongoTransport(mongomock.MongoClient(), database=f"queues-{unique}"),
            MongoStorage.embedded(f"property-{unique}"))


QUEUE_PAIRS = [
    pytest.param(QueuesAndStorage("postgres-shared", _postgres_pair(True), shared=True),
                 id="postgresql-transport-shared-transaction", marks=pytest.mark.postgres),
    pytest.param(QueuesAndStorage("postgres-outbox", _postgres_pair(False)),
                 id="postgresql-transport-outbox", marks=pytest.mark.postgres),
    pytest.param(QueuesAndStorage("mongomock", _mongomock_pair), id="mongomock-transport"),
]


class RecordingCrash(ArmedCrash):
    """:class:`ArmedCrash` that remembers where it fired."""

    def __init__(self) -> None:
        super().__init__()
        self.points: list[CrashPoint] = []

    def reached(self, point: CrashPoint, message_id: str) -> None:
        if point is self.armed and not self.fired:
            self.points.append(point)
        super().reached(point, message_id)


def run_on_queues(sent: list[DepositMessage], order: list[int], *, pair: QueuesAndStorage,
                  compact: bool, data: st.DataObject | None = None) -> RunResult:
    """Send ``sent[i]`` for each i of ``order`` into the endpoint's queue of a database
    transport, then take its messages one at a time — with ``data``, any waiting one, and
    crash at a drawn point — until the queue is empty; the events it published are read
    from a subscriber's queue."""
    unique = uuid.uuid4().hex[:10]
    transport, storage = pair.make(unique)
    queue, downstream, errors = f"accounts-{unique}", f"ledger-{unique}", f"errors-{unique}"
    injector = RecordingCrash()
    endpoint = Endpoint(queue, transport=transport, storage=storage, handlers=[AccountHandler],
                        error_queue=errors, outbox=OutboxPolicy(compact_after_dispatch=compact),
                        middleware=[injector])
    result = RunResult(states={}, dispatched=[])
    came_back = 0
    try:
        transport.declare(queue)
        transport.declare(errors)
        transport.declare(downstream, subscriptions=[message_name(Deposited)])
        for copy, index in enumerate(order):
            # Copies differ in a header of their own, as a publisher's retries do (MongoDB
            # would store byte-identical ones once)
            message = sent[index]
            transport.send(Envelope({**message.headers, "test.copy": str(copy)},
                                    message.body.decode(), queue))
        while True:
            with transport.inspect(queue) as waiting:
                if not waiting:
                    break
                pick = 0 if data is None else data.draw(st.integers(0, len(waiting) - 1),
                                                        label="message taken next")
                delivery = waiting[pick]
                crash_at = None
                if data is not None and result.crashes < MAX_CRASHES:
                    crash_at = data.draw(CRASH_POINTS, label="crash point")
                injector.arm(crash_at)
                result.deliveries += 1
                Transport.deliver(delivery, endpoint._processor)
                if injector.fired:
                    result.crashes += 1
                    # Back in the queue (the others wait leased): unless the shared
                    # transaction's commit took it, after which nothing comes again
                    back = transport.pending(queue)
                    assert back == 1 or pair.shared and injector.points[-1] is not (
                        CrashPoint.BEFORE_COMMIT)
                    came_back += back
                else:
                    assert delivery.settled, "processed without a crash, but not settled"
        assert transport.pending(errors) == 0
        while (event_delivery := transport.get(downstream)) is not None:
            result.dispatched.append(Envelope(dict(event_delivery.headers),
                                              event_delivery.body.decode(), None))
        result.states = {record.aggregate_id: dict(record.state or {})
                         for record in storage.records(AccountHandler.storage_name())}
        assert result.deliveries == len(order) + came_back
    finally:
        drop = getattr(transport, "drop_tables", None)
        if isinstance(storage, PostgresStorage):
            storage.drop_tables()
        endpoint.close()
        if drop is not None:
            drop()
    return result


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "keep-bodies"])
@pytest.mark.parametrize("pair", QUEUE_PAIRS)
@pytest.mark.timeout(300)  # 20 examples on PostgreSQL: 40 s when the machine is busy
@settings(max_examples=20, deadline=None)
@given(sent=messages(), data=st.data())
def test_on_a_database_transport_any_interleaving_ends_as_one_clean_run(
    pair: QueuesAndStorage, compact: bool, sent: list[DepositMessage], data: st.DataObject,
) -> None:
    # Given deposits sent one to three times each into the endpoint's queue, then taken in
    # any order and possibly crashed at any point (a crashed message comes back unless the
    # commit that removed it happened)
    order = data.draw(schedules(sent), label="send order")

    # When one endpoint processes them cleanly and another, on fresh tables, chaotically
    clean = run_on_queues(sent, list(range(len(sent))), pair=pair, compact=compact)
    chaotic = run_on_queues(sent, order, pair=pair, compact=compact, data=data)
    event(f"crashes: {chaotic.crashes}")

    # Then the accounts end the same, the sum of their deposits
    assert clean.states == summed(sent)
    assert chaotic.states == clean.states
    # And the subscriber got every event of the clean run, under its id with its body, and
    # nothing else
    clean_bodies, chaotic_bodies = bodies_by_id(clean.dispatched), bodies_by_id(chaotic.dispatched)
    assert len(clean.dispatched) == len(sent) == len(clean_bodies)
    assert chaotic_bodies == clean_bodies
