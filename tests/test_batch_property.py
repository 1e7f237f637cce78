"""The property of :mod:`tests.test_property` with batches (issue 15, point 5).

The same deposits and duplicate schedules are taken in batches of drawn sizes, so that a
batch holds duplicates of each other and several messages of one account; a delivery may
crash at a drawn point. A crash is the process dying: none of its batch is acknowledged
and every delivery of the batch comes back later, at drawn positions. The run must end as
one clean run, one message at a time, ends — and, the messages of one account in a batch
being applied in delivery order, without a single optimistic conflict.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from idembus import Batching, Endpoint
from idembus.policies import OutboxPolicy
from idembus.runtime.batch_runner import BatchRunner
from idembus.storage.base import Storage
from idembus.storage.postgres import PostgresStorage
from idembus.testing.faults import CrashPoint, FaultInjector, SimulatedCrash
from idembus.transports.base import Delivery, Transport
from tests.support import AccountHandler, SignalCounter
from tests.test_property import (
    CRASH_POINTS,
    ERROR_QUEUE,
    MAX_CRASHES,
    QUEUE,
    STORAGES,
    DepositMessage,
    RecordingDelivery,
    RecordingTransport,
    RunResult,
    assert_sent_as_clean,
    messages,
    run,
    schedules,
    summed,
)

BATCH = 6


class BatchCrash(FaultInjector):
    """Crashes each armed message id once, at its armed point, if reached."""

    def __init__(self) -> None:
        self.armed: dict[str, CrashPoint] = {}
        self.fired: list[str] = []

    def arm(self, points: dict[str, CrashPoint]) -> None:
        self.armed, self.fired = points, []

    def reached(self, point: CrashPoint, message_id: str) -> None:
        if self.armed.get(message_id) is point and message_id not in self.fired:
            self.fired.append(message_id)
            raise SimulatedCrash(f"simulated crash {point.value} of {message_id}")


def run_in_batches(sent: list[DepositMessage], order: list[int], *,
                   make_storage: Callable[[], Storage], compact: bool,
                   data: st.DataObject) -> tuple[RunResult, int]:
    """Deliver ``sent[i]`` for each i of ``order`` in batches of drawn sizes until all are
    acknowledged; return the result and the conflicts signalled."""
    transport = RecordingTransport()
    injector = BatchCrash()
    endpoint = Endpoint(QUEUE, transport=transport, storage=make_storage(),
                        handlers=[AccountHandler], error_queue=ERROR_QUEUE,
                        outbox=OutboxPolicy(compact_after_dispatch=compact),
                        middleware=[injector], batching=Batching(size=BATCH))
    conflicts = SignalCounter(endpoint, "conflict")
    runner = BatchRunner(endpoint._processor, size=BATCH)
    queue: list[tuple[DepositMessage, bool]] = [(sent[index], False) for index in order]
    result = RunResult(states={}, dispatched=transport.dispatched)
    try:
        while queue:
            size = data.draw(st.integers(1, BATCH), label="batch size")
            batch, queue = queue[:size], queue[size:]
            deliveries: list[Delivery] = [RecordingDelivery(message, redelivered=again)
                                          for message, again in batch]
            points: dict[str, CrashPoint] = {}
            if result.crashes < MAX_CRASHES:
                for message, _ in batch:
                    point = data.draw(CRASH_POINTS, label=f"crash of {message.message_id}")
                    if point is not None:
                        points.setdefault(message.message_id, point)
            injector.arm(points)
            result.deliveries += len(batch)

            Transport.deliver_batch(deliveries, lambda taken: runner.run(taken, transport))

            if injector.fired:
                # The process died: nothing of the batch was acknowledged.
                result.crashes += 1
                for message, _ in batch:
                    position = data.draw(st.integers(0, len(queue)),
                                         label=f"redelivery of {message.message_id}")
                    queue.insert(position, (message, True))
            else:
                assert all(isinstance(d, RecordingDelivery) and d.acked and not d.requeued
                           for d in deliveries)
        assert transport.dead_letters == []
        result.states = {
            record.aggregate_id: dict(record.state or {})
            for record in endpoint.storage.records(AccountHandler.storage_name())
        }
    finally:
        if isinstance(endpoint.storage, PostgresStorage):
            endpoint.storage.drop_tables()
        endpoint.close()
    return result, conflicts.count


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "keep-bodies"])
@pytest.mark.parametrize("make_storage", STORAGES)
@settings(max_examples=40, deadline=None)
@given(sent=messages(), data=st.data())
def test_batches_with_duplicates_crashes_and_one_account_many_times_end_as_one_clean_run(
    make_storage: Callable[[], Storage], compact: bool, sent: list[DepositMessage],
    data: st.DataObject,
) -> None:
    # Given deposits over one to three accounts, each arriving one to three times in any
    # order, taken in batches of one to six (so batches hold copies of one message and
    # several deposits of one account), any of them possibly crashing the process;
    order = data.draw(schedules(sent), label="delivery order")

    # When one endpoint processes them cleanly one at a time and another, on fresh storage,
    # processes the schedule in batches,
    clean = run(sent, list(range(len(sent))), make_storage=make_storage, compact=compact)
    batched, conflicts = run_in_batches(sent, order, make_storage=make_storage,
                                        compact=compact, data=data)
    event(f"crashes: {batched.crashes}")

    # Then the accounts end in the same state, the sum of their deposits, without a
    # conflict between messages of one batch,
    assert clean.states == summed(sent)
    assert batched.states == clean.states
    assert conflicts == 0

    # and the same messages went out: the clean run's ids, each with its one body.
    assert_sent_as_clean(sent, clean, batched)
