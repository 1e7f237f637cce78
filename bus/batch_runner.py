"""Processing a batch of deliveries: each message on its own path, their round trips shared.

Each delivery of a batch is processed by the ordinary per-message code
(:class:`idembus.processing.MessageProcessor`: its handlers, deduplication, retries and
failure path) on a thread of its own, but only one of them runs at a time: a message runs
until it needs the database or the broker — a load, a commit, a dispatch — and **parks**
there (:func:`load`, :func:`commit`, :func:`dispatch`; outside a batch they simply do the
work). When every message of the batch is parked or done, the runner does the parked work
of all of them at once: their commits in one ``commit_many`` of the storage (each still its
own conditional write), their dispatches in one ``dispatch_many`` of the transport (one wait
for the publisher confirms), their loads in one ``load_many``. Each message then goes on
with its own answer: a result, or the very error it would have met alone — a conflict, a
duplicate, a refusal, an outage. One message's failure never fails another.

Several messages of one aggregate in one batch are applied in delivery order: a message
does not load an aggregate that an earlier message of the batch loaded and has not
committed yet; it loads it in a later round, after that commit, so the two never conflict.

When every message is done, the deliveries they acknowledged — each only after its
dispatches were confirmed, as ever — are acknowledged together
(:meth:`~idembus.transports.base.Transport.ack_many`); a delivery requeued by its message
goes back at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .aio import close_thread_loop
from .envelope import Envelope
from .storage.base import AggregateRecord, PendingCommit
from .transports.base import Delivery, Transport

#: What a message parks on.
LOAD, COMMIT, DISPATCH = "load", "commit", "dispatch"

_current = threading.local()


def load(storage: Any, aggregate_type: str, aggregate_id: str,
         key: str | None) -> AggregateRecord:
    """``storage.load(...)``; in a batch, with the batch's other loads."""
    member: _Member | None = getattr(_current, "member", None)
    if member is None:
        record: AggregateRecord = storage.load(aggregate_type, aggregate_id, key)
        return record
    result: AggregateRecord = member.park(_Parked(
        LOAD, storage, (aggregate_type, aggregate_id, key), (aggregate_type, aggregate_id)))
    return result


def commit(storage: Any, loaded: AggregateRecord, *, key: str, state: Any,
           outgoing: Sequence[Envelope], **options: Any) -> None:
    """``storage.commit(...)``; in a batch, with the batch's other commits."""
    member: _Member | None = getattr(_current, "member", None)
    if member is None:
        storage.commit(loaded, key=key, state=state, outgoing=outgoing, **options)
        return
    member.park(_Parked(COMMIT, storage, PendingCommit(loaded, key, state, tuple(outgoing),
                                                      dict(options))))


def dispatch(transport: Transport, envelope: Envelope) -> bool | None:
    """``transport.dispatch(envelope)``; in a batch, with the batch's other dispatches."""
    member: _Member | None = getattr(_current, "member", None)
    if member is None:
        return transport.dispatch(envelope)
    result: bool | None = member.park(_Parked(DISPATCH, transport, envelope))
    return result


@dataclass
class _Parked:
    """One piece of work a message waits for."""

    kind: str
    #: The storage or transport that does it.
    target: Any
    request: Any
    #: The aggregate a load reads.
    aggregate: tuple[str, str] | None = None
    outcome: Any = None
    error: BaseException | None = None


class _HeldDelivery(Delivery):
    """A delivery of a batch as its message sees it: acknowledging it only notes that it
    may be acknowledged with the batch; requeueing it gives it back at once."""

    def __init__(self, original: Delivery) -> None:
        super().__init__(queue=original.queue, headers=original.headers, body=original.body,
                         content_type=original.content_type,
                         redelivered=original.redelivered, wire_error=original.wire_error,
                         content_encoding=original.content_encoding)
        self.original = original
        self.settled = original.settled
        self.acked = False

    def _ack(self) -> None:
        self.acked = True

    def _requeue(self) -> None:
        self.original.requeue()


class _Member:
    """One message of the batch, and the thread it runs on."""

    def __init__(self, index: int, delivery: Delivery, worker: _Worker,
                 yielded: threading.Semaphore) -> None:
        self.index = index
        self.delivery = _HeldDelivery(delivery)
        self.worker = worker
        self._yielded = yielded
        self.parked: _Parked | None = None
        #: The aggregate this message loaded and has not committed yet.
        self.holds: tuple[str, str] | None = None
        self.done = False
        #: What escaped the message's processing (an outage of its delivery's connection,
        #: an interrupt): raised by the runner once the batch is settled.
        self.escaped: BaseException | None = None

    def park(self, parked: _Parked) -> Any:
        """Wait (on the message's thread) until the runner did ``parked``."""
        if parked.kind != COMMIT:
            self.holds = None
        self.parked = parked
        self._yielded.release()
        self.worker.resume.acquire()
        if parked.error is not None:
            raise parked.error
        return parked.outcome


class _Worker(threading.Thread):
    """A thread that runs the messages of one position in the batches."""

    def __init__(self, name: str, process: Callable[[_Member], None]) -> None:
        super().__init__(name=name, daemon=True)
        self.resume = threading.Semaphore(0)
        self.member: _Member | None = None
        self.stopping = False
        self._process = process

    def run(self) -> None:
        try:
            while True:
                self.resume.acquire()
                member = self.member
                if self.stopping or member is None:
                    return
                self._process(member)
        finally:
            close_thread_loop()  # this thread's event loop, if async handlers made one


class BatchRunner:
    """Processes batches of deliveries with ``process`` (one delivery's whole processing,
    acknowledgement included), at most ``size`` a batch; one runner per consumer thread."""

    def __init__(self, process: Callable[[Delivery], None], *, size: int,
                 name: str = "idembus-batch") -> None:
        if size < 1:
            raise ValueError(f"batch size must be at least 1, got {size}")
        self.size = size
        self._process = process
        self._name = name
        self._yielded = threading.Semaphore(0)
        self._workers: list[_Worker] = []

    def run(self, deliveries: Sequence[Delivery], transport: Transport) -> None:
        """Process ``deliveries`` (at most ``size``), then acknowledge together those their
        messages acknowledged; raise what escaped a message (see :class:`_Member`)."""
        if len(deliveries) > self.size:
            raise ValueError(f"a batch of {len(deliveries)} deliveries, more than {self.size}")
        members = [_Member(index, delivery, self._worker(index), self._yielded)
                   for index, delivery in enumerate(deliveries)]
        for member in members:
            member.worker.member = member
            self._step(member)
        while True:
            parked = [member for member in members if member.parked is not None]
            if not parked:
                break
            for member in _do_parked(parked):
                self._step(member)
        acked = [member.delivery.original for member in members if member.delivery.acked]
        if acked:
            transport.ack_many(acked)
        for member in members:
            if member.escaped is not None:
                raise member.escaped

    def close(self) -> None:
        """End the worker threads (none is running a message between batches)."""
        for worker in self._workers:
            worker.stopping = True
            worker.resume.release()
        for worker in self._workers:
            worker.join()
        self._workers.clear()

    def _worker(self, index: int) -> _Worker:
        while len(self._workers) <= index:
            worker = _Worker(f"{self._name}-{len(self._workers)}", self._run_member)
            worker.start()
            self._workers.append(worker)
        return self._workers[index]

    def _step(self, member: _Member) -> None:
        """Let ``member`` run until it parks again or is done."""
        member.worker.resume.release()
        self._yielded.acquire()

    def _run_member(self, member: _Member) -> None:
        """On the member's thread: its whole processing."""
        _current.member = member
        try:
            Transport.deliver(member.delivery, self._process)
        except BaseException as escaped:  # reported by the runner, after the batch
            member.escaped = escaped
        finally:
            _current.member = None
            member.done = True
            member.holds = None
            member.parked = None
            member.worker.member = None
            self._yielded.release()


def _do_parked(parked: list[_Member]) -> list[_Member]:
    """Do the work the ``parked`` members (in delivery order) wait for, as one call per
    kind and target, except loads of an aggregate an earlier member holds or loads now;
    return the members whose work is done, in delivery order."""
    blocked: set[tuple[str, str]] = set()
    chosen: dict[str, list[_Member]] = {COMMIT: [], DISPATCH: [], LOAD: []}
    for member in parked:
        work = member.parked
        assert work is not None
        if work.kind == LOAD:
            assert work.aggregate is not None
            if work.aggregate in blocked:
                continue  # after the earlier member's commit
            blocked.add(work.aggregate)
        if member.holds is not None:
            blocked.add(member.holds)
        chosen[work.kind].append(member)
    if not any(chosen.values()):
        raise RuntimeError("a batch's messages wait for each other")  # cannot happen
    for kind in (COMMIT, DISPATCH, LOAD):  # commits first: a load sees them
        members = chosen[kind]
        by_target: dict[int, list[_Member]] = {}
        for member in members:
            assert member.parked is not None
            by_target.setdefault(id(member.parked.target), []).append(member)
        for group in by_target.values():
            _do_group(kind, group)
    done = sorted((member for members in chosen.values() for member in members),
                  key=lambda member: member.index)
    for member in done:
        work = member.parked
        assert work is not None
        member.parked = None
        if work.kind == COMMIT:
            member.holds = None
        elif work.kind == LOAD and work.error is None:
            member.holds = work.aggregate
    return done


def _do_group(kind: str, group: list[_Member]) -> None:
    """One call of the target's ``commit_many``, ``dispatch_many`` or ``load_many``."""
    works = [member.parked for member in group if member.parked is not None]
    target = works[0].target
    requests = [work.request for work in works]
    try:
        if kind == COMMIT:
            outcomes: Sequence[Any] = target.commit_many(requests)
        elif kind == DISPATCH:
            outcomes = target.dispatch_many(requests)
        else:
            outcomes = target.load_many(requests)
        if len(outcomes) != len(requests):
            raise RuntimeError(f"{type(target).__name__}.{kind}_many answered "
                               f"{len(outcomes)} of {len(requests)} requests")
    except Exception as error:  # the whole call failed: each message meets the error
        outcomes = [error] * len(requests)
    for work, outcome in zip(works, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            work.error = outcome
        else:
            work.outcome = outcome
