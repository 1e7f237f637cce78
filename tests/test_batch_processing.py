"""Batched processing (issue 15, points 1-4) at the processing level: the endpoint's real
processor run by a :class:`~idembus.runtime.batch_runner.BatchRunner` over deliveries whose
settlement is recorded, on a MemoryStorage and a transport that record every call.

Each message of a batch keeps its own handlers, deduplication, retries and failure path;
the batch shares one call for its loads, one for its commits, one for its dispatches (one
confirm wait) and one for its acknowledgements.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from pydantic import BaseModel

from idembus import Backoff, Batching, BreakerPolicy, Endpoint, RetryPolicy
from idembus import headers as h
from idembus.envelope import Envelope
from idembus.handlers import AggregateHandler, handles
from idembus.messages import Command, Event, message_name
from idembus.runtime import batch_runner
from idembus.runtime.batch_runner import BatchRunner
from idembus.runtime.recoverability.policy import Recoverability
from idembus.storage.base import AggregateRecord, PendingCommit
from idembus.storage.errors import ConcurrencyConflict
from idembus.storage.memory import MemoryStorage
from idembus.testing.faults import CrashPoint, FaultInjector, SimulatedCrash
from idembus.transports.base import Delivery
from idembus.transports.errors import TransportUnavailable
from tests.support import DrivenTransport, RecordedDelivery, SignalCounter

QUEUE = "ledger"
ERROR_QUEUE = "ledger-error"
#: No retries of failing handlers (straight to the error queue), short outage waits.
QUICK = Recoverability(retries=RetryPolicy(immediate_retries=0, delayed=()),
                       outage_backoff=Backoff((0.0,)))


class Post(Command, message_name="batch.Post"):
    account: str
    amount: int


class Posted(Event, message_name="batch.Posted"):
    account: str
    amount: int


class Book(BaseModel):
    amounts: list[int] = []


class BookHandler(AggregateHandler[Book]):
    """Appends each amount (so the order of application shows) and publishes Posted; a
    negative amount is refused."""

    def aggregate_id(self, message: Post) -> str:
        return message.account

    @handles
    def post(self, message: Post) -> None:
        if message.amount < 0:
            raise ValueError(f"negative amount {message.amount}")
        self.state.amounts.append(message.amount)
        self.bus.publish(Posted(account=message.account, amount=message.amount))


def received(message_id: str, account: str, amount: int) -> RecordedDelivery:
    """A Post delivered, its settlement recorded."""
    return RecordedDelivery(
        QUEUE, {h.MESSAGE_ID: message_id, h.MESSAGE_TYPE: message_name(Post),
                h.INTENT: h.Intent.SEND.value},
        Post(account=account, amount=amount).model_dump_json().encode())


class Journal:
    """The order in which the storage and the transport were called."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.lock = threading.Lock()

    def note(self, what: str, detail: Any = None) -> None:
        with self.lock:
            self.calls.append((what, detail))

    def count(self, what: str) -> int:
        return sum(1 for name, _ in self.calls if name == what)

    def details(self, what: str) -> list[Any]:
        return [detail for name, detail in self.calls if name == what]


class SpyStorage(MemoryStorage):
    """MemoryStorage noting its group calls and marks; ``conflict_once`` makes the named
    keys' first commit lose a race with a competing writer."""

    def __init__(self, journal: Journal) -> None:
        super().__init__()
        self.journal = journal
        self.conflict_once: set[str] = set()

    def load_many(self, requests: Sequence[tuple[str, str, str | None]]
                  ) -> list[AggregateRecord | Exception]:
        self.journal.note("load_many", [request[1] for request in requests])
        return super().load_many(requests)

    def commit_many(self, commits: Sequence[PendingCommit]) -> list[Exception | None]:
        self.journal.note("commit_many", [pending.key for pending in commits])
        return super().commit_many(commits)

    def commit(self, loaded: AggregateRecord, **fields: Any) -> None:
        key = fields["key"]
        if key in self.conflict_once:
            self.conflict_once.discard(key)
            raise ConcurrencyConflict(f"a competing writer moved {loaded.aggregate_id}")
        self.journal.note("commit", key)
        super().commit(loaded, **fields)

    def mark_dispatched(self, aggregate_type: str, aggregate_id: str, key: str,
                        **options: Any) -> None:
        self.journal.note("mark", key)
        super().mark_dispatched(aggregate_type, aggregate_id, key, **options)


class SpyTransport(DrivenTransport):
    """Records dispatches and acknowledgements; ``nack_once`` refuses the named message
    ids' first publish as a broker's ``basic.nack`` does."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.published: list[Envelope] = []
        self.dead_letters: list[Envelope] = []
        self.nack_once: set[str] = set()

    def send(self, envelope: Envelope) -> None:
        assert envelope.destination == ERROR_QUEUE, envelope.destination
        self.dead_letters.append(envelope)

    def publish(self, envelope: Envelope) -> bool | None:
        if envelope.message_id in self.nack_once:
            self.nack_once.discard(envelope.message_id)
            raise TransportUnavailable(f"the broker refused {envelope.message_id} (nack)")
        self.published.append(envelope)
        return True

    def dispatch_many(self, envelopes: Sequence[Envelope]) -> list[bool | None | Exception]:
        self.journal.note("dispatch_many", [envelope.message_id for envelope in envelopes])
        return super().dispatch_many(envelopes)

    def ack_many(self, deliveries: Sequence[Delivery]) -> None:
        self.journal.note("ack_many", [delivery.headers[h.MESSAGE_ID]
                                       for delivery in deliveries])
        super().ack_many(deliveries)



class CrashAfterCommit(FaultInjector):
    """The process dies right after the first commit of one message id."""

    def __init__(self, message_id: str) -> None:
        self.message_id = message_id
        self.fired = False

    def reached(self, point: CrashPoint, message_id: str) -> None:
        if (point is CrashPoint.AFTER_COMMIT and message_id == self.message_id
                and not self.fired):
            self.fired = True
            raise SimulatedCrash(f"crash after the commit of {message_id}")


class Rig:
    """An endpoint (not started) with the spies, and a batch runner on its processor."""

    def __init__(self, **options: Any) -> None:
        self.journal = Journal()
        self.storage = SpyStorage(self.journal)
        self.transport = SpyTransport(self.journal)
        self.endpoint = Endpoint(
            QUEUE, transport=self.transport, storage=self.storage, handlers=[BookHandler],
            error_queue=ERROR_QUEUE, outbox=False, status_interval=0,
            batching=Batching(size=16), recoverability=QUICK, **options)
        self.signals: dict[str, int] = {}
        for name in ("handled", "duplicate", "redispatched", "conflict", "dead_lettered"):
            getattr(self.endpoint.signals, name).connect(self._count(name), weak=False)
        self.runner = BatchRunner(self.endpoint._processor, size=16)

    def _count(self, name: str) -> Any:
        def count(sender: object, **details: Any) -> None:
            self.signals[name] = self.signals.get(name, 0) + 1
        return count

    def run(self, deliveries: Sequence[RecordedDelivery]) -> None:
        self.runner.run(deliveries, self.transport)

    def amounts(self, account: str) -> list[int]:
        record = self.storage.load(BookHandler.storage_name(), account)
        return list((record.state or {}).get("amounts", []))

    def close(self) -> None:
        self.endpoint.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = Rig()
    yield made
    made.close()


def ids(count: int) -> list[str]:
    return [str(uuid.uuid4()) for _ in range(count)]


def test_a_batch_loads_commits_dispatches_and_acknowledges_with_one_call_each(rig: Rig):
    deliveries = [received(message_id, f"account-{n}", n + 1)
                  for n, message_id in enumerate(ids(5))]

    rig.run(deliveries)

    assert rig.journal.count("load_many") == 1
    assert rig.journal.details("commit_many") == [
        [f"BookHandler/{d.headers[h.MESSAGE_ID]}" for d in deliveries]]
    assert rig.journal.count("dispatch_many") == 1
    assert len(rig.journal.details("dispatch_many")[0]) == 5
    assert rig.journal.details("ack_many") == [[d.headers[h.MESSAGE_ID] for d in deliveries]]
    assert all(d.acked and not d.requeued for d in deliveries)
    assert [rig.amounts(f"account-{n}") for n in range(5)] == [[1], [2], [3], [4], [5]]
    assert rig.signals["handled"] == 5


def test_marks_come_after_the_confirmed_dispatch_and_acknowledgements_after_the_marks(rig: Rig):
    deliveries = [received(message_id, f"account-{n}", 1) for n, message_id in enumerate(ids(3))]

    rig.run(deliveries)

    order = [name for name, _ in rig.journal.calls]
    dispatched = order.index("dispatch_many")
    assert order.index("commit_many") < dispatched
    assert [index for index, name in enumerate(order) if name == "mark"] != []
    assert all(index > dispatched for index, name in enumerate(order) if name == "mark")
    assert order[-1] == "ack_many"


def test_one_failing_message_goes_to_the_error_queue_and_the_others_are_handled(rig: Rig):
    first, bad, last = ids(3)
    deliveries = [received(first, "a", 1), received(bad, "b", -5), received(last, "c", 3)]

    rig.run(deliveries)

    assert [envelope.message_id for envelope in rig.transport.dead_letters] == [bad]
    assert rig.amounts("a") == [1] and rig.amounts("b") == [] and rig.amounts("c") == [3]
    assert all(d.acked and not d.requeued for d in deliveries)
    assert rig.signals["handled"] == 2 and rig.signals["dead_lettered"] == 1


def test_later_batches_run_in_the_greenlets_of_the_earlier_ones_whatever_became_of_those(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a runner whose member greenlets are counted as they are made, and a process
    # that dies after one message's commit (the message's crash escapes its greenlet)
    made: list[object] = []
    original = batch_runner._MemberGreenlet.__init__

    def counted(self: Any) -> None:
        made.append(self)
        original(self)

    monkeypatch.setattr(batch_runner._MemberGreenlet, "__init__", counted)
    first, bad, crash, last = ids(4)
    rig = Rig(middleware=[CrashAfterCommit(crash)])
    try:
        # When three batches of four run: one with a message that fails for good and one
        # that crashes, then two clean ones
        batches = [[received(first, "a", 1), received(bad, "b", -5), received(crash, "c", 3),
                    received(last, "d", 4)]]
        batches += [[received(message_id, f"e{n}", n + 1) for n, message_id in
                     enumerate(ids(4))] for _ in range(2)]
        for batch in batches:
            try:
                rig.run(batch)
            except SimulatedCrash:
                pass
        # Then four greenlets served all twelve members, and each message met its own fate
        assert len(made) == 4
        assert [envelope.message_id for envelope in rig.transport.dead_letters] == [bad]
        assert [d.requeued for d in batches[0]] == [False, False, True, False]
        assert all(d.acked for batch in batches[1:] for d in batch)
        assert rig.amounts("a") == [1] and rig.amounts("d") == [4]
        assert [rig.amounts(f"e{n}") for n in range(4)] == [[1, 1], [2, 2], [3, 3], [4, 4]]
    finally:
        rig.close()


@pytest.fixture
def crashing() -> Iterator[tuple[Rig, list[tuple[str, str, int]]]]:
    """A rig whose process dies right after committing the second of three Posts (a, b,
    c), and those three."""
    plan = [(message_id, account, amount) for message_id, account, amount
            in zip(ids(3), "abc", (1, 2, 3), strict=True)]
    made = Rig(middleware=[CrashAfterCommit(plan[1][0])])
    yield made, plan
    made.close()


def test_a_crash_in_one_message_requeues_it_alone(crashing):
    rig, plan = crashing
    deliveries = [received(*entry) for entry in plan]

    rig.run(deliveries)

    assert deliveries[1].requeued and not deliveries[1].acked
    assert deliveries[0].acked and deliveries[2].acked
    assert rig.journal.details("ack_many") == [[plan[0][0], plan[2][0]]]
    # Redelivered, the crashed message is a duplicate that sends what it stored.
    again = received(*plan[1])
    rig.run([again])
    assert again.acked and rig.amounts("b") == [2]
    assert rig.signals["duplicate"] == 1
    posted_b = [e for e in rig.transport.published if '"account":"b"' in e.body]
    assert len(posted_b) == 1  # the crash came before its dispatch


def test_process_batch_shares_the_round_trips_of_up_to_a_batch_of_deliveries(rig: Rig):
    deliveries = [received(message_id, f"account-{n % 20}", n + 1)
                  for n, message_id in enumerate(ids(20))]

    rig.endpoint.process_batch(deliveries)

    # Batches of 16 (the endpoint's size): the first sixteen, then the last four.
    assert [len(group) for group in rig.journal.details("ack_many")] == [16, 4]
    assert rig.journal.count("load_many") == 2
    assert all(d.acked and not d.requeued for d in deliveries)
    assert [rig.amounts(f"account-{n}") for n in range(20)] == [[n + 1] for n in range(20)]


def test_process_batch_raises_a_crash_once_the_others_of_its_batch_are_done(crashing):
    """Nothing gives a replay's row back: a crash is raised, as ``process`` raises it, for
    the caller to run the rows again (Spark: the task); the others are acknowledged."""
    rig, plan = crashing
    deliveries = [received(*entry) for entry in plan]

    with pytest.raises(SimulatedCrash):
        rig.endpoint.process_batch(deliveries)

    assert not deliveries[1].acked and not deliveries[1].requeued
    assert deliveries[0].acked and deliveries[2].acked
    again = [received(*entry) for entry in plan]
    rig.endpoint.process_batch(again)
    assert all(d.acked for d in again)
    assert [rig.amounts(account) for account in "abc"] == [[1], [2], [3]]
    assert rig.signals["duplicate"] == 3 and rig.signals["redispatched"] == 1


def test_process_batch_without_batching_processes_one_at_a_time():
    rig = Rig()
    rig.endpoint.batching = None
    try:
        deliveries = [received(message_id, f"account-{n}", n) for n, message_id in
                      enumerate(ids(3))]

        rig.endpoint.process_batch(deliveries)

        assert rig.journal.count("load_many") == 0 and rig.journal.count("ack_many") == 0
        assert all(d.acked for d in deliveries)
        assert [rig.amounts(f"account-{n}") for n in range(3)] == [[0], [1], [2]]
    finally:
        rig.close()


def test_duplicates_of_each_other_in_one_batch_apply_once_and_resend_the_same_ids(rig: Rig):
    one, two = ids(2)
    deliveries = [received(one, "a", 5), received(one, "a", 5), received(two, "b", 7),
                  received(one, "a", 5)]

    rig.run(deliveries)

    assert rig.amounts("a") == [5] and rig.amounts("b") == [7]
    assert all(d.acked for d in deliveries)
    assert rig.signals["handled"] == 2 and rig.signals["duplicate"] == 2
    assert rig.signals.get("conflict", 0) == 0
    # A copy waits until the first is done with its aggregate (committed, sent, marked):
    # it finds the event sent and sends nothing again.
    assert [e.body for e in rig.transport.published].count(
        Posted(account="a", amount=5).model_dump_json()) == 1
    assert rig.signals.get("redispatched", 0) == 0


def test_messages_of_one_aggregate_in_one_batch_apply_in_delivery_order_without_conflict(
        rig: Rig):
    amounts = [3, 1, 4, 1, 5, 9, 2, 6]
    deliveries = [received(message_id, "same", amount)
                  for message_id, amount in zip(ids(len(amounts)), amounts, strict=True)]
    deliveries.insert(2, received(str(uuid.uuid4()), "other", 100))

    rig.run(deliveries)

    assert rig.amounts("same") == amounts
    assert rig.amounts("other") == [100]
    assert rig.signals.get("conflict", 0) == 0
    assert rig.signals["handled"] == len(deliveries)
    # One aggregate's messages go one per round: the first round has "same" and "other".
    assert rig.journal.details("commit_many")[0].__len__() == 2
    assert all(d.acked for d in deliveries)


def test_a_conflict_with_a_competing_writer_retries_that_message_only(rig: Rig):
    first, racing, last = ids(3)
    rig.storage.conflict_once.add(f"BookHandler/{racing}")
    deliveries = [received(first, "a", 1), received(racing, "b", 2), received(last, "c", 3)]

    rig.run(deliveries)

    assert rig.signals["conflict"] == 1
    assert rig.journal.details("commit") == [
        f"BookHandler/{key}" for key in (first, last, racing)]  # the loser came back
    assert rig.amounts("b") == [2]
    assert all(d.acked for d in deliveries)


def test_a_nacked_outgoing_message_is_published_again_with_the_same_id_before_the_ack(
        rig: Rig):
    first, second = ids(2)
    deliveries = [received(first, "a", 1), received(second, "b", 2)]
    # The outgoing id is derived from the incoming one: learn it from a dry run elsewhere.
    probe = Rig()
    try:
        probe.run([received(second, "b", 2)])
        refused = probe.transport.published[0].message_id
    finally:
        probe.close()
    rig.transport.nack_once.add(refused)

    rig.run(deliveries)

    assert [e.message_id for e in rig.transport.published].count(refused) == 1
    dispatch_calls = rig.journal.details("dispatch_many")
    assert sum(call.count(refused) for call in dispatch_calls) == 2  # refused, then again
    assert rig.journal.details("mark").count(f"BookHandler/{second}") == 1
    order = [name for name, detail in rig.journal.calls]
    assert order[-1] == "ack_many" and all(d.acked for d in deliveries)


def test_retries_of_a_failing_handler_stay_with_its_message():
    flaky_id = str(uuid.uuid4())
    attempts: list[str] = []

    class Flaky(BookHandler):
        @handles
        def post(self, message: Post) -> None:
            if self.context.message_id == flaky_id and len(attempts) < 2:
                attempts.append(self.context.message_id)
                raise RuntimeError("not yet")
            super().post(message)

    Flaky.retry_policy = RetryPolicy(immediate_retries=3, delayed=())
    journal = Journal()
    storage, transport = SpyStorage(journal), SpyTransport(journal)
    endpoint = Endpoint(QUEUE, transport=transport, storage=storage, handlers=[Flaky],
                        error_queue=ERROR_QUEUE, outbox=False, status_interval=0)
    runner = BatchRunner(endpoint._processor, size=4)
    try:
        deliveries = [received(str(uuid.uuid4()), "a", 1), received(flaky_id, "b", 2)]
        runner.run(deliveries, transport)
        assert attempts == [flaky_id, flaky_id]
        assert all(d.acked for d in deliveries) and not transport.dead_letters
        assert len(journal.details("commit")) == 2
    finally:
        endpoint.close()


def always_failing(journal: Journal, on_call: Callable[[], None], *, threshold: int,
                   pause: float) -> tuple[Endpoint, SpyTransport]:
    """An endpoint whose handler calls ``on_call`` and fails, without retries, its breaker
    opening after ``threshold`` failures and pausing ``pause`` seconds."""

    class Failing(BookHandler):
        @handles
        def post(self, message: Post) -> None:
            on_call()
            raise RuntimeError("the service behind it is down")

    transport = SpyTransport(journal)
    endpoint = Endpoint(QUEUE, transport=transport, storage=SpyStorage(journal),
                        handlers=[Failing], error_queue=ERROR_QUEUE, outbox=False,
                        status_interval=0, recoverability=Recoverability(
                            retries=RetryPolicy(immediate_retries=0, delayed=()),
                            breaker=BreakerPolicy(threshold=threshold,
                                                  backoff=Backoff((pause,)))))
    return endpoint, transport


def test_an_open_circuit_breaker_holds_the_consumer_back_after_the_batch_it_opened_in():
    # Given a handler that always fails, and a breaker that opens after two failures
    calls: list[float] = []
    endpoint, transport = always_failing(Journal(), lambda: calls.append(time.monotonic()),
                                         threshold=2, pause=0.3)
    paused = SignalCounter(endpoint, "paused")
    runner = BatchRunner(endpoint._processor, size=8)
    try:
        # When five messages come in one batch
        deliveries = [received(str(uuid.uuid4()), f"acc-{n}", 1) for n in range(5)]
        started = time.monotonic()
        runner.run(deliveries, transport)
        took = time.monotonic() - started

        # Then all go to the error queue; their handlers ran in one round, before the
        # breaker opened, and the pauses of the four failures from the second on hold the
        # consumer back before its next batch (one message at a time, they come before
        # each next message instead)
        assert len(transport.dead_letters) == 5 and all(d.acked for d in deliveries)
        assert calls[-1] - calls[0] < 0.3
        assert paused.count == 4 and all(d["seconds"] == 0.3 for d in paused.details)
        assert took >= 4 * 0.3
    finally:
        endpoint.close()


def test_while_the_circuit_breaker_is_open_a_batch_goes_one_message_at_a_time():
    # Given an endpoint whose breaker opened at its first failure, on a handler that fails
    calls: list[tuple[float, list[bool]]] = []
    deliveries: list[RecordedDelivery] = []
    journal = Journal()
    endpoint, transport = always_failing(
        journal, lambda: calls.append((time.monotonic(), [d.acked for d in deliveries])),
        threshold=1, pause=0.2)
    runner = BatchRunner(endpoint._processor, size=8)
    try:
        runner.run([received(str(uuid.uuid4()), "first", 1)], transport)
        breaker = endpoint._recovery.breaker
        assert breaker.open

        # When the next batch of three comes while it is open
        deliveries.extend(received(str(uuid.uuid4()), f"acc-{n}", 1) for n in range(3))
        runner.run(deliveries, transport, one_at_a_time=breaker.open)

        # Then each message was handled and acknowledged, and the pause waited out, before
        # the next one's handler ran — as one message at a time — and none was left to a
        # batch acknowledgement
        assert [acked for _, acked in calls[1:]] == [
            [False, False, False], [True, False, False], [True, True, False]]
        starts = [at for at, _ in calls[1:]]
        gaps = [later - earlier for earlier, later in zip(starts, starts[1:], strict=False)]
        assert all(gap >= 0.2 for gap in gaps), gaps
        assert all(d.acked for d in deliveries) and len(transport.dead_letters) == 4
        batch_acked = {message_id for ids in journal.details("ack_many") for message_id in ids}
        assert not batch_acked & {d.headers[h.MESSAGE_ID] for d in deliveries}
    finally:
        endpoint.close()


def test_batching_rejects_a_size_below_one():
    with pytest.raises(ValueError, match="batch size must be at least 1"):
        Batching(size=0)
    with pytest.raises(ValueError, match="linger"):
        Batching(linger=-1)
    assert Batching().size_for(16) == 16 and Batching(size=4).size_for(16) == 4


def batching_frames() -> list[str]:
    """The modules of the batching machinery (the batch runner, the batching ports) on the
    caller's stack."""
    found = []
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(("idembus.runtime.batch_runner", "idembus.runtime.batching_ports")):
            found.append(module)
        frame = frame.f_back
    return found


class StackNotingStorage(SpyStorage):
    """SpyStorage noting, at each plain ``load`` and ``commit``, the batching machinery on
    the stack."""

    def load(self, aggregate_type: str, aggregate_id: str,
             key: str | None = None) -> AggregateRecord:
        self.journal.note("load reached through", batching_frames())
        return super().load(aggregate_type, aggregate_id, key)

    def commit(self, loaded: AggregateRecord, **fields: Any) -> None:
        self.journal.note("commit reached through", batching_frames())
        super().commit(loaded, **fields)


class StackNotingTransport(SpyTransport):
    """SpyTransport noting, at each ``publish``, the batching machinery on the stack."""

    def publish(self, envelope: Envelope) -> bool | None:
        self.journal.note("publish reached through", batching_frames())
        return super().publish(envelope)


def noting_endpoint(journal: Journal, batching: Batching | None) -> Endpoint:
    return Endpoint(QUEUE, transport=StackNotingTransport(journal),
                    storage=StackNotingStorage(journal), handlers=[BookHandler],
                    error_queue=ERROR_QUEUE, outbox=False, status_interval=0,
                    batching=batching)


def test_without_batching_the_ports_are_called_directly_not_through_the_batch_runner():
    """Before the batching ports, every load, commit and dispatch went through the batch
    runner's functions even with ``batching=None`` (the stacks held
    ``idembus.runtime.batch_runner``)."""
    journal = Journal()
    endpoint = noting_endpoint(journal, batching=None)
    try:
        # When three messages are processed by an endpoint that does not batch
        deliveries = [received(message_id, f"account-{n}", n + 1)
                      for n, message_id in enumerate(ids(3))]
        endpoint.process_batch(deliveries)

        # Then each was loaded, committed and published by a plain call of the port, with
        # no batching machinery on the stack, and no group call was made
        assert journal.details("load reached through") == [[], [], []]
        assert journal.details("commit reached through") == [[], [], []]
        assert journal.details("publish reached through") == [[], [], []]
        assert [journal.count(name) for name in (
            "load_many", "commit_many", "dispatch_many", "ack_many")] == [0, 0, 0, 0]
        assert all(d.acked for d in deliveries)
    finally:
        endpoint.close()


def test_with_batching_the_assembled_ports_group_a_batch_in_one_call_each():
    """A regression guard of the assembly: it passed before the batching ports too, and
    fails if the assembly leaves the ports of a batching endpoint unwrapped."""
    journal = Journal()
    endpoint = noting_endpoint(journal, batching=Batching(size=8))
    try:
        # When five messages of five aggregates come in one batch
        deliveries = [received(message_id, f"account-{n}", n + 1)
                      for n, message_id in enumerate(ids(5))]
        endpoint.process_batch(deliveries)

        # Then the batch loaded, committed and dispatched in one call each, acknowledged
        # together
        assert journal.details("load_many") == [[f"account-{n}" for n in range(5)]]
        assert [len(keys) for keys in journal.details("commit_many")] == [5]
        assert [len(sent) for sent in journal.details("dispatch_many")] == [5]
        assert [len(acked) for acked in journal.details("ack_many")] == [5]
        assert all(d.acked and not d.requeued for d in deliveries)
    finally:
        endpoint.close()


class InProcessNotingTransport(StackNotingTransport):
    """StackNotingTransport as a broker living in this process (memory://)."""

    process_local = True


def test_with_storage_and_transport_in_the_process_a_batch_runs_message_after_message():
    """Parking shares round trips; memory:// with MemoryStorage has none, so its batches
    run each message to its end in turn (no greenlet, no group call) and still acknowledge
    together."""
    journal = Journal()
    endpoint = Endpoint(QUEUE, transport=InProcessNotingTransport(journal),
                        storage=StackNotingStorage(journal), handlers=[BookHandler],
                        error_queue=ERROR_QUEUE, outbox=False, status_interval=0,
                        batching=Batching(size=8))
    try:
        # When five messages, three of one aggregate, come in one batch
        accounts = ["account-a", "account-b", "account-a", "account-c", "account-a"]
        deliveries = [received(message_id, account, n + 1)
                      for n, (message_id, account) in enumerate(zip(ids(5), accounts,
                                                                    strict=True))]
        endpoint.process_batch(deliveries)

        # Then each message was loaded, committed and published by plain calls, one
        # message after the other, in delivery order, and the batch acknowledged together
        assert [journal.count(name) for name in (
            "load_many", "commit_many", "dispatch_many")] == [0, 0, 0]
        assert all("idembus.runtime.batching_ports" not in frames
                   for frames in journal.details("commit reached through"))
        assert journal.count("commit") == 5
        assert [len(acked) for acked in journal.details("ack_many")] == [5]
        assert all(d.acked and not d.requeued for d in deliveries)
        record = endpoint.storage.load(BookHandler.storage_name(), "account-a")
        assert (record.state or {})["amounts"] == [1, 3, 5]
    finally:
        endpoint.close()
