"""Processing a batch of deliveries: each message on its own path, their round trips shared.

Each delivery of a batch is processed by the ordinary per-message code
(:class:`idembus.runtime.processing.MessageProcessor`: its handlers, deduplication, retries and
failure path) in a greenlet of its own on the consumer's thread, one at a time: a message
runs until it needs the database or the broker — a load, a commit, a dispatch — and **parks**
there (:meth:`Member.park`): when the endpoint batches, the assembly wraps the storage and
the transport of that path in :class:`~.batching_ports.BatchingStorage` and
:class:`~.batching_ports.BatchingTransport`, which park a message running in a batch (and,
outside one, where :func:`running_member` is ``None``, simply do the work). When every
message of the batch is parked or done, the runner does the parked work of all of them at
once: their commits in one ``commit_many`` of the storage (each still its own conditional
write), their dispatches in one ``dispatch_many`` of the transport (one wait for the
publisher confirms), their loads in one ``load_many``. Each message then goes on with its
own answer: a result, or the very error it would have met alone — a conflict, a
duplicate, a refusal, an outage. One message's failure never fails another.

Several messages of one aggregate in one batch are applied in delivery order: a message
does not load an aggregate that an earlier message of the batch loaded until that one is
done with it (committed, dispatched, marked); it loads it in a later round, so the two never
conflict, and a duplicate in the same batch finds its copy's messages already sent.

When every message is done, the deliveries they acknowledged — each only after its
dispatches were confirmed, as ever — are acknowledged together
(:meth:`~idembus.transports.base.Transport.ack_many`); a delivery requeued by its message
goes back at once.

Where both the storage and the transport live in the process (memory:// with
MemoryStorage or mongomock) there is no round trip to share: the assembly leaves the ports
unwrapped and the runner (``parks=False``) runs each message of the batch to its end in
turn, on the consumer's thread without a greenlet, the deliveries still acknowledged
together.

While the endpoint's circuit breaker is open, a batch is processed one message at a time
(``one_at_a_time``): each message is handled, acknowledged and followed by the breaker's
pause before the next one starts, exactly as without batching, so once the breaker has
opened no message of a later batch meets the failing dependency without a pause. (The
batch during which it opens behaves like that many concurrent consumers: its handlers ran
before their failures were counted.)

Why greenlets: a message parks three times (load, commit, dispatch); handing the one
running place between threads costs 15-30 µs of CPU a switch on CPython (a lock or a
semaphore, and the GIL), greenlets 0.5 µs; and the batch stays on the consumer's thread, as
the connection of its deliveries must. Code that holds a lock across a park deadlocks the
batch if another of its messages then waits for that lock; idembus holds none there.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import greenlet

from ..transports.base import Delivery, Transport

#: What a message parks on.
LOAD, COMMIT, DISPATCH = "load", "commit", "dispatch"


def running_member() -> Member | None:
    """The batch member running now, if any: ``None`` outside a batch (a message processed
    alone, the outbox relay, a tool), where the ports do their work at once."""
    running = greenlet.getcurrent()
    return running.member if isinstance(running, _MemberGreenlet) else None


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

    def __init__(self, original: Delivery, *, ack_at_once: bool = False) -> None:
        self._stand_for(original)  # Delivery.__init__ of original's fields
        self.original = original
        self.settled = original.settled
        #: Acknowledge the original when the message does (one message at a time), not
        #: with the batch.
        self.ack_at_once = ack_at_once
        #: Left for the batch to acknowledge.
        self.acked = False

    def _ack(self) -> None:
        if self.ack_at_once:
            self.original.ack()
        else:
            self.acked = True

    def _requeue(self) -> None:
        self.original.requeue()


class Member:
    """One message of the batch."""

    def __init__(self, index: int, delivery: Delivery, *, ack_at_once: bool = False) -> None:
        self.index = index
        self.delivery = _HeldDelivery(delivery, ack_at_once=ack_at_once)
        self.parked: _Parked | None = None
        #: The aggregate this message loaded last, until it is done with it (committed,
        #: dispatched and marked) or loads another: later messages of the batch wait.
        self.holds: tuple[str, str] | None = None
        #: What escaped the message's processing (an outage of its delivery's connection,
        #: an interrupt): raised by the runner once the batch is settled.
        self.escaped: BaseException | None = None
        self.greenlet: _MemberGreenlet | None = None

    def park(self, kind: str, target: Any, request: Any,
             aggregate: tuple[str, str] | None = None) -> Any:
        """Wait (in the message's greenlet) until the runner did ``request`` of ``kind``
        (:data:`LOAD`, :data:`COMMIT`, :data:`DISPATCH`) with ``target`` (the storage or
        transport whose ``load_many``, ``commit_many`` or ``dispatch_many`` does it; a load
        names the ``aggregate`` it reads) in one call with the batch's others; return its
        outcome, or raise the error it met."""
        parked = _Parked(kind, target, request, aggregate)
        if parked.kind == LOAD:  # a new attempt, or the next handler
            self.holds = None
        self.parked = parked
        running = greenlet.getcurrent()
        assert running.parent is not None
        running.parent.switch()
        if parked.error is not None:
            raise parked.error
        return parked.outcome


class _MemberGreenlet(greenlet.greenlet):  # type: ignore[misc]
    """The greenlet batch members run in, one member after another: a greenlet is kept for
    the thread's next batches rather than made for each message (a new greenlet gets a
    frame stack of its own, which CPython maps and unmaps, about 8 µs a message)."""

    def __init__(self) -> None:
        super().__init__(self._serve)
        #: The member running (or parked) in it now; ``None`` between members.
        self.member: Member | None = None

    def _serve(self, job: Callable[[], None]) -> None:
        while True:
            job()
            self.member = None
            job = self.parent.switch()  # done: back to the runner, until the next member


class BatchRunner:
    """Processes batches of deliveries with ``process`` (one delivery's whole processing,
    acknowledgement included), at most ``size`` a batch, on the calling thread."""

    def __init__(self, process: Callable[[Delivery], None], *, size: int,
                 requeue_escaped: bool = True, parks: bool = True) -> None:
        if size < 1:
            raise ValueError(f"batch size must be at least 1, got {size}")
        self.size = size
        self._process = process
        #: A delivery whose processing raised is requeued, as a broker would give it back
        #: (:meth:`Transport.deliver`); otherwise (deliveries nobody would give back, such
        #: as a replay's rows) what it raised is raised once the batch is settled.
        self._requeue_escaped = requeue_escaped
        #: Whether members run in greenlets that park (the ports of the batch are the
        #: batching ones); ``False``: each runs to its end in turn on the calling thread,
        #: the deliveries still acknowledged together.
        self._parks = parks
        #: Per thread (a greenlet belongs to the thread that made it): the member greenlets
        #: between members.
        self._idle = threading.local()

    def run(self, deliveries: Sequence[Delivery], transport: Transport, *,
            one_at_a_time: bool = False) -> None:
        """Process ``deliveries`` (at most ``size``), then acknowledge together those their
        messages acknowledged; raise what escaped a message (see :class:`Member`).
        ``one_at_a_time`` (the circuit breaker is open): each message is processed and
        acknowledged before the next one starts."""
        if len(deliveries) > self.size:
            raise ValueError(f"a batch of {len(deliveries)} deliveries, more than {self.size}")
        members = [Member(index, delivery, ack_at_once=one_at_a_time)
                   for index, delivery in enumerate(deliveries)]
        for wave in ([member] for member in members) if one_at_a_time else [members]:
            self._settle(wave)
        acked = [member.delivery.original for member in members if member.delivery.acked]
        if acked:
            transport.ack_many(acked)
        for member in members:
            if member.escaped is not None:
                raise member.escaped

    def _settle(self, members: list[Member]) -> None:
        """Run ``members`` to their end, doing their parked work together."""
        if not self._parks:
            for member in members:
                self._runner_of(member)()
            return
        idle: list[_MemberGreenlet] | None = getattr(self._idle, "greenlets", None)
        if idle is None:
            idle = self._idle.greenlets = []
        runner = greenlet.getcurrent()
        for member in members:
            runs_in = idle.pop() if idle else _MemberGreenlet()
            if runs_in.parent is not runner:
                runs_in.parent = runner
            runs_in.member = member
            member.greenlet = runs_in
            runs_in.switch(self._runner_of(member))  # until it parks or is done
        while True:
            parked = [member for member in members if member.parked is not None]
            if not parked:
                break
            for member in _do_parked(parked):
                assert member.greenlet is not None
                member.greenlet.switch()
        for member in members:  # all done: their greenlets serve the next batch's
            if member.greenlet is not None and member.greenlet.member is None:
                idle.append(member.greenlet)
            member.greenlet = None

    def _runner_of(self, member: Member) -> Callable[[], None]:
        def run() -> None:
            try:
                if self._requeue_escaped:
                    Transport.deliver(member.delivery, self._process)
                else:
                    self._process(member.delivery)
            except greenlet.GreenletExit:
                raise  # a greenlet dropped while parked (the batch given up): it ends
            except BaseException as escaped:  # reported by the runner, after the batch
                member.escaped = escaped
            finally:
                member.holds = None
                member.parked = None

        return run


def _do_parked(parked: list[Member]) -> list[Member]:
    """Do the work the ``parked`` members (in delivery order) wait for, as one call per
    kind and target, except loads of an aggregate an earlier member holds or loads now;
    return the members whose work is done, in delivery order."""
    blocked: set[tuple[str, str]] = set()
    chosen: dict[str, list[Member]] = {COMMIT: [], DISPATCH: [], LOAD: []}
    done: list[Member] = []  # in delivery order, as ``parked`` is
    for member in parked:
        work = member.parked
        assert work is not None
        if work.kind == LOAD:
            if work.aggregate in blocked:
                continue  # after the earlier member's commit
            blocked.add(work.aggregate)  # type: ignore[arg-type]  # a load names it
        if member.holds is not None:
            blocked.add(member.holds)
        chosen[work.kind].append(member)
        done.append(member)
    if not done:
        raise RuntimeError("a batch's messages wait for each other")  # cannot happen
    for kind in (COMMIT, DISPATCH, LOAD):  # commits first: a load sees them
        members = chosen[kind]
        if not members:
            continue
        target = members[0].parked.target  # type: ignore[union-attr]
        if all(member.parked.target is target  # type: ignore[union-attr]
               for member in members):
            _do_group(kind, members)  # the usual case: one storage, one transport
            continue
        by_target: dict[int, list[Member]] = {}
        for member in members:
            by_target.setdefault(id(member.parked.target), []).append(  # type: ignore[union-attr]
                member)
        for group in by_target.values():
            _do_group(kind, group)
    for member in done:
        work = member.parked
        member.parked = None
        if work.kind == LOAD and work.error is None:  # type: ignore[union-attr]
            member.holds = work.aggregate  # type: ignore[union-attr]
    return done


def _do_group(kind: str, group: list[Member]) -> None:
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
        outcomes = [error] + [_copied(error) for _ in requests[1:]]
    for work, outcome in zip(works, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            work.error = outcome
        else:
            work.outcome = outcome


def _copied(error: Exception) -> Exception:
    """Another instance of ``error`` for another message to raise (an exception raised in
    several places would collect all their tracebacks), with the same cause."""
    try:
        twin = copy.copy(error)
    except Exception:  # an exception class that cannot be rebuilt from its arguments
        return error
    twin.__cause__, twin.__context__ = error.__cause__, error.__context__
    twin.__traceback__ = None
    return twin
