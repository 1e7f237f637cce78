"""Building an endpoint's collaborators from its context, in one place (:func:`assemble`).

Who needs whom, in the order they are built:

* the shared transaction, when the queues are in the storage's database, commits, sends
  and acknowledges in one transaction;
* when the endpoint batches (``Endpoint(batching=...)``, no shared transaction), the ports
  of the per-message path are wrapped in :mod:`.batching_ports`' decorators, which group a
  batch's loads, commits and dispatches; otherwise that path calls the ports directly;
* the :class:`~.dispatching.Dispatcher` sends what was committed and marks it;
* the :class:`~.recoverability.time_limits.TimeLimiter` runs the handling methods within
  their time limits and knows which run long (the status reports show them);
* the :class:`~.invocation.HandlerInvoker` loads, runs a handler and commits;
* :class:`~.recoverability.policy.Recovery` applies the retries and the circuit breaker;
* the :class:`~.processing.MessageProcessor` takes a delivery through all of them;
* the :class:`~.requests.Requests` (the reply queue of ``bus.request``, created at the
  first request) and the :class:`~idembus.sending.Bus`, which sends from outside handlers;
* the background threads: the :class:`~.delayed.DelayedDeliveries` poller (transports
  without native delay), the :class:`~.outbox.OutboxRelay`, the
  :class:`~.scheduler.Scheduler` (with schedules) and the :class:`~.status.StatusReporter`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from ..envelope import Envelope
from ..policies import Batching, OutboxPolicy
from ..schedules import SchedulerPolicy
from ..sending import Bus
from ..storage.base import AggregateStore, JournalStore, OutboxStore, StatusStore
from ..transports.base import Transport
from .batching_ports import BatchingStorage, BatchingTransport
from .delayed import DelayedDeliveries
from .dispatching import Dispatcher
from .endpoint_context import EndpointContext
from .invocation import HandlerInvoker
from .journal import Journal, JournalPolicy, journal_for
from .outbox import OutboxRelay
from .processing import MessageProcessor
from .recoverability.policy import Recovery
from .recoverability.time_limits import TimeLimiter
from .requests import Requests
from .scheduler import Scheduler
from .shared_transaction import SharedTransaction, shared_transaction
from .status import StatusReporter


@dataclass(frozen=True)
class Settings:
    """What an endpoint's options say about its collaborators, beyond the context."""

    outbox: OutboxPolicy
    journal: JournalPolicy
    scheduling: SchedulerPolicy
    delayed_poll_interval: float = 0.5
    status_interval: float = 5.0
    #: A send-only endpoint: no queue, consumer, processor or status reports; only what
    #: sending through the outbox needs.
    send_only: bool = False
    #: Deliveries taken in batches (``None``: one at a time).
    batching: Batching | None = None


@dataclass(frozen=True)
class Assembly:
    """An endpoint's collaborators, built by :func:`assemble`."""

    dispatcher: Dispatcher
    shared_transaction: SharedTransaction | None
    #: Whether deliveries are processed in batches: batching asked for, and no shared
    #: transaction (whose commit, send and acknowledgement are one already).
    batched: bool
    #: ``None`` in a send-only endpoint, which processes no message.
    recovery: Recovery | None
    #: ``None`` in a send-only endpoint.
    processor: MessageProcessor | None
    bus: Bus
    delayed: DelayedDeliveries | None
    #: ``None`` on a storage without the outbox role (``outbox=False`` allows that).
    outbox: OutboxRelay | None
    scheduler: Scheduler | None
    #: ``None`` when the endpoint makes no status reports (``status_interval=0``).
    status: StatusReporter | None
    #: The reply queue of ``bus.request`` in this process, and the requests waiting.
    requests: Requests
    #: ``None`` in a send-only endpoint.
    time_limits: TimeLimiter | None = None
    #: Whether a batch's messages park to share their loads, commits and dispatches
    #: (:mod:`.batch_runner`): batched, unless both the storage and the transport live in
    #: this process (nothing to share: the messages run one after another).
    parks: bool = False


def assemble(context: EndpointContext, settings: Settings, *,
             on_unrouted: Callable[[Envelope], None],
             counters: Callable[[], Mapping[str, int]]) -> Assembly:
    """Build the collaborators of the endpoint of ``context``: ``on_unrouted`` is called
    with each event no queue took, ``counters`` gives what the status reports carry. A
    send-only endpoint gets only its dispatcher, outbox relay, bus and delayed poller
    (:func:`_sending_only`)."""
    if settings.send_only:
        return _sending_only(context, settings, on_unrouted=on_unrouted)
    # A database queue reads a message's size before its body and moves larger ones aside.
    context.transport.limit_bodies(context.name, max_bytes=context.max_message_bytes,
                                   error_queue=context.error_queue)
    policy = settings.outbox
    journal = _journal(context, settings)
    keep_bodies = not policy.compact_after_dispatch
    shared = shared_transaction(context, journal, keep_bodies=keep_bodies,
                                on_unrouted=on_unrouted)
    batched = settings.batching is not None and shared is None
    # A batch's messages park to share round trips; where the storage and the transport
    # both live in this process there are none to share, and they run one after another.
    parks = batched and not (context.transport.process_local
                             and context.role(AggregateStore).process_local)
    dispatcher, outbox, bus, delayed, requests = _sending(
        context, settings, journal, on_unrouted=on_unrouted,
        dispatch_through=BatchingTransport(context.transport) if parks else None)
    limiter = TimeLimiter(context.name, context.recoverability.time_limits,
                          context.table.handlers, stopping=context.stopping)
    invoker = HandlerInvoker(
        replace(context, storage=BatchingStorage(context.role(AggregateStore))) if parks
        else context, defer_fresh_redispatch=policy.defer_fresh_redispatch, shared=shared,
        requests=requests, time_limits=limiter)
    recovery = Recovery(context.name, context.recoverability, stopping=context.stopping,
                        health=context.health)
    def wake_outbox() -> None:  # a duplicate left an entry to the outbox: look sooner
        if outbox is not None:
            outbox.wake_in(policy.grace)

    processor = MessageProcessor(context, invoker, dispatcher, recovery,
                                 left_to_outbox=wake_outbox)
    scheduler = (Scheduler(context, settings.scheduling, dispatcher)
                 if settings.scheduling.schedules else None)
    def problems() -> dict[str, str]:  # what blocks the process, and the hung handlers
        return {**context.health.problems(), **limiter.hung()}

    status = StatusReporter(context.role(StatusStore), context.name, counters,
                            interval=settings.status_interval,
                            problems=problems) if settings.status_interval else None
    return Assembly(dispatcher=dispatcher, shared_transaction=shared, batched=batched,
                    parks=parks, recovery=recovery, processor=processor, bus=bus, delayed=delayed,
                    outbox=outbox, scheduler=scheduler, status=status, requests=requests,
                    time_limits=limiter)


def _journal(context: EndpointContext, settings: Settings) -> Journal | None:
    events = settings.journal.events
    return (None if events is False or events is None
            else journal_for(context.role(JournalStore), events))


def _sending(context: EndpointContext, settings: Settings, journal: Journal | None, *,
             on_unrouted: Callable[[Envelope], None], dispatch_through: Transport | None = None,
             ) -> tuple[Dispatcher, OutboxRelay | None, Bus, DelayedDeliveries | None, Requests]:
    """What every endpoint needs to send: the dispatcher (dispatching through
    ``dispatch_through``, a batching decorator of the transport, if given), the outbox
    relay (none on a storage without the outbox role, which only an endpoint with
    ``outbox=False`` may have), the bus, on a transport without native delay the delayed
    poller, and the reply queue of the bus's requests."""
    policy = settings.outbox
    dispatcher = Dispatcher(
        replace(context, transport=dispatch_through) if dispatch_through else context,
        journal, keep_bodies=not policy.compact_after_dispatch, on_unrouted=on_unrouted)
    outbox = OutboxRelay(context, dispatcher, grace=policy.grace,
                         journal_retention=settings.journal.retention if journal else None
                         ) if isinstance(context.storage, OutboxStore) else None
    requests = Requests(context, dispatcher)
    bus = Bus(context.name, context.router,
              context.pipeline.recorder(dispatcher.dispatch_now, None), clock=context.clock,
              requests=requests)
    delayed = None if context.transport.native_delay else DelayedDeliveries(
        context, interval=settings.delayed_poll_interval)
    return dispatcher, outbox, bus, delayed, requests


def _sending_only(context: EndpointContext, settings: Settings, *,
                  on_unrouted: Callable[[Envelope], None]) -> Assembly:
    """A send-only endpoint's collaborators: no queue limits, no shared transaction,
    invoker, recovery, processor, scheduler or status reporter."""
    dispatcher, outbox, bus, delayed, requests = _sending(
        context, settings, _journal(context, settings), on_unrouted=on_unrouted)
    return Assembly(dispatcher=dispatcher, shared_transaction=None, batched=False, recovery=None,
                    processor=None, bus=bus, delayed=delayed, outbox=outbox, scheduler=None,
                    status=None, requests=requests)
