"""The endpoint: explicit wiring of a queue, a transport, a storage and handlers.

::

    sales = Endpoint(
        "sales",
        transport="amqp://guest:guest@127.0.0.1:5672//",
        storage=MongoStorage("mongodb://127.0.0.1:27017", database="sales"),
        handlers=[OrderHandler],
        routes={ChargeCard: "billing"},
    )
    sales.run()          # blocks until SIGINT/SIGTERM or stop()

Everything that can be checked without a broker is checked when the endpoint is created;
the rest (the broker, the database) when it starts. Either way the error says what to fix.
"""

from __future__ import annotations

import datetime
import functools
import logging
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar, cast

from pydantic import BaseModel

from ..clock import Clock, SystemClock
from ..envelope import Envelope
from ..errors import BusError, ConfigurationError
from ..evolution import check_upcasters, version_of
from ..handlers.base import AggregateHandler, Handler
from ..handlers.registration import HandlerTable, handler_orderings
from ..handlers.sends import check_sent_routes
from ..hierarchy import check_routing_keys
from ..logs import MessageLog, Throttle
from ..messages import (
    Command,
    Event,
    Message,
    is_message_type,
    message_name,
)
from ..pipeline import Middleware, Pipeline, PropagateHeaders, check_handler_options
from ..policies import DEFAULT_BATCHING, Batching, OutboxPolicy
from ..redaction import redact
from ..registry import MessageRegistry
from ..routing import Router, partition_queue
from ..schedules import Schedule, SchedulerPolicy, scheduler_policy
from ..sending import Bus
from ..signals import EndpointSignals
from ..storage.base import AggregateStore, StorageRole
from ..storage.claims import ClaimCheck
from ..storage.roles import check_storage_roles
from ..transports.base import Delivery, Transport
from ..wire import DEFAULT_MAX_MESSAGE_BYTES
from .aio import close_thread_loop
from .assembly import Settings, assemble
from .batch_runner import BatchRunner
from .counters import Counters
from .dispatching import Dispatcher
from .endpoint_context import EndpointContext, RoleT
from .health import Health
from .journal import Journal, JournalPolicy
from .outbox import OutboxRelay
from .processing import MessageProcessor
from .recoverability.policy import Recoverability, Recovery
from .recoverability.time_limits import TimeLimiter
from .scheduler import Scheduler
from .shared_transaction import SharedTransaction
from .shutdown import Deadline, StopSignals
from .timings import HandlingTimes
from .unit_of_work import UnitOfWork

if TYPE_CHECKING:
    from ..observability.audit import Audit

log = logging.getLogger(__name__)

StateT = TypeVar("StateT", bound=BaseModel)
_ENDPOINT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


class Endpoint:
    """A named endpoint: consumes its queue, runs its handlers, sends through its bus.

    Parameters
    ----------
    name:
        The endpoint's name, also its queue and the reply address of what it sends.
    transport:
        A :class:`~idembus.transports.base.Transport`, or a URL (default ``memory://``):
        ``postgresql://`` and ``mongodb://`` keep the queues in that database, any other
        is a kombu URL (:func:`idembus.transports.urls.transport_for`).
    storage:
        A storage backend (:mod:`idembus.storage.base`; it needs the roles the options below
        use); default: a :class:`~idembus.storage.memory.MemoryStorage` of its own, in this
        process (for trials and tests: nothing survives the process).
    handlers:
        Handler classes (created once, without arguments) or handler instances.
    routes:
        Command type -> endpoint name. Commands this endpoint handles route to itself.
    concurrency:
        Consumer threads.
    prefetch:
        Messages the broker may push to each consumer ahead of processing.
    error_queue:
        Where bad messages and exhausted retries go.
    recoverability:
        Retries of failing handlers, optimistic retries of lost races, the circuit breaker
        and the backoff while the database or broker is unreachable
        (:class:`~idembus.Recoverability`; a handler class may set its own
        ``retry_policy``), and the handlers' time limits (``time_limits=``; a handler class
        may set its own ``time_limit``).
    outbox:
        What happens to committed outgoing messages (:class:`~idembus.policies.OutboxPolicy`:
        run the outbox relay here, its grace, deferred redispatch, compaction);
        ``False`` runs no outbox relay in this endpoint.
    journal:
        Append the events this endpoint publishes to the storage's event journal
        (:mod:`idembus.runtime.journal`, served by ``idembus gateway``): ``True`` for every event, a
        list of Event types, or a :class:`~idembus.runtime.journal.JournalPolicy` with a retention.
    middleware:
        :class:`~idembus.pipeline.Middleware` around every message, handler, commit and
        dispatch, in this order (tracing, metrics, audit, fault injection, your own), after
        the default middleware.
    propagate_headers:
        Names of incoming headers copied to every message the handlers send (stored with
        them, so a redispatch carries them too).
    default_middleware:
        The built-in middleware that comes first, in order; ``None``: those of
        :func:`default_middleware` (the handling-time buckets, then the propagated
        headers). Take that list and reorder, drop or replace what you need; with it,
        ``propagate_headers`` goes into your list as a
        :class:`~idembus.pipeline.PropagateHeaders`.
    max_message_bytes:
        Larger bodies go to the error queue unread, with the reason (default 1 MiB,
        :data:`idembus.wire.DEFAULT_MAX_MESSAGE_BYTES`).
    delayed_poll_interval:
        Seconds between looks for due deferred messages in the storage (transports
        without native delay).
    status_interval:
        Seconds between reports of the counters to the storage (``idembus status``); 0: no
        reports (a storage without the status role).
    clock:
        Where the endpoint reads the time (:class:`~idembus.clock.Clock`; default the wall
        clock in UTC): the time sent, when deferred messages and delayed retries are due,
        whether a message expired. Tests pass a fake one to run timeouts and schedules in
        virtual time (:class:`idembus.testing.Scenario`). Storage bookkeeping (commit
        times, leases, retention) stays on the wall clock.
    batching:
        Take deliveries in batches (:class:`~idembus.policies.Batching`): the ready ones up
        to a size, their loads, commits and publisher confirms each in one round trip,
        acknowledged together; each message keeps its own handlers, deduplication, retries
        and failure path (:mod:`idembus.runtime.batch_runner`; where the storage and the
        transport both live in the process, memory:// with ``MemoryStorage``, there is no
        round trip to share and a batch's messages run one after another). On by default
        (``Batching()``: up to ``prefetch`` deliveries, 2 ms of linger); ``None``: one
        message at a time.
    schedules:
        Recurring messages (:class:`~idembus.schedules.Schedule`), sent exactly once per
        occurrence by one scheduler among the endpoint's processes
        (:mod:`idembus.runtime.scheduler`); or a :class:`~idembus.schedules.SchedulerPolicy` with
        them and the scheduler's lease. They need the storage's outbox role (leases).
    strict_routes:
        Fail :meth:`start` (:class:`~idembus.errors.ConfigurationError` naming the handler
        and the command) when a command a handler sends has no route, or when a handler
        that declares no ``sends`` sends something its source does not name; by default
        these are WARNING lines at start (:mod:`idembus.handlers.sends` says what is
        inferred). ``idembus run --strict-routes`` sets it.
    warn_unrouted_events:
        Log an event that reached no queue at WARNING (once per type every 10 s); by
        default it is logged at INFO the first time for its type and at DEBUG after
        (publishing for subscribers still to come is normal). The ``unrouted`` signal and
        counter count every one either way.
    send_only:
        An endpoint that only sends (a web app, a script): no queue is declared, no
        consumer runs, nothing is subscribed and no status is reported; ``start()`` runs
        only the outbox relay and, on a transport without native delay, the delayed
        poller. It takes no handlers and no schedules. Send with :attr:`bus`, through the
        outbox with ``endpoint.outbox(operation_id=...)``, or with :meth:`unit_of_work`.
    claim_check:
        Send bodies over a threshold as a reference to a payload store
        (:class:`~idembus.storage.claims.ClaimCheck`; the storage's payload role unless it
        names a store). Receiving needs no option: a claim-checked message is read from the
        claim check's store, else from the storage.
    ordering_from:
        Handlers hosted by other endpoints (classes created without arguments, or
        instances) whose ordering declarations (``ordered=True``, ``ordered_by=``) this
        endpoint's sends follow: the commands they handle are sent with their key. The
        handlers this endpoint hosts are followed without it.
    """

    #: How deliveries are taken in batches (``None``: one at a time).
    batching: Batching | None
    #: The recurring messages this endpoint sends (``schedules=...``).
    schedules: tuple[Schedule, ...]
    #: How this endpoint recovers from failures.
    recoverability: Recoverability
    #: Where its aggregates, outbox and the rest are kept (the roles its options use).
    storage: StorageRole
    #: What this endpoint shares with its collaborators (:mod:`.endpoint_context`).
    context: EndpointContext

    def __init__(
        self,
        name: str,
        *,
        transport: Transport | str = "memory://",
        storage: StorageRole | None = None,
        handlers: Sequence[Handler | type[Handler]] = (),
        routes: Mapping[type[Message], str] | None = None,
        concurrency: int = 1,
        prefetch: int = 16,
        error_queue: str = "error",
        recoverability: Recoverability | None = None,
        outbox: OutboxPolicy | bool = True,
        journal: bool | Sequence[type[Event]] | JournalPolicy = False,
        middleware: Sequence[Middleware] = (),
        propagate_headers: Sequence[str] = (),
        default_middleware: Sequence[Middleware] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        delayed_poll_interval: float = 0.5,
        status_interval: float = 5.0,
        clock: Clock | None = None,
        schedules: Sequence[Schedule] | SchedulerPolicy = (),
        batching: Batching | None = DEFAULT_BATCHING, claim_check: ClaimCheck | None = None,
        strict_routes: bool = False, warn_unrouted_events: bool = False, send_only: bool = False,
        ordering_from: Sequence[Handler | type[Handler]] = (),
    ) -> None:
        _check_options(name, concurrency=concurrency, prefetch=prefetch, clock=clock,
                       max_message_bytes=max_message_bytes, error_queue=error_queue,
                       batching=batching, storage=storage, send_only=send_only,
                       handlers=handlers, schedules=schedules)
        self.name, self.error_queue, self.batching = name, error_queue, batching
        self.concurrency, self.prefetch = concurrency, prefetch
        self.strict_routes, self.send_only = strict_routes, send_only
        self.table = HandlerTable(handlers)
        self.registry = MessageRegistry(self.table.message_types)
        self.router = _router(name, routes or {}, self.table, ordering_from)
        self._check_routes(routes or {})
        self.transport = _transport_from(transport)
        self.recoverability, settings = recoverability or Recoverability(), Settings(
            outbox=_outbox_policy(outbox), journal=_journal_policy(journal), send_only=send_only,
            scheduling=scheduler_policy(schedules, endpoint=name, has_route=self.router.has_route),
            delayed_poll_interval=delayed_poll_interval, status_interval=status_interval,
            batching=batching)
        _check_roles(storage, settings, self.transport, middleware, claim_check)
        self.schedules, self.outbox_policy = tuple(settings.scheduling.schedules), settings.outbox
        self.status_interval, self.warn_unrouted_events = status_interval, warn_unrouted_events
        self.storage = storage if storage is not None else _embedded_storage()
        self._check_retention()
        self.context = EndpointContext(
            name=name, transport=self.transport, storage=self.storage,
            clock=clock or SystemClock(), signals=EndpointSignals(name),
            pipeline=_pipeline(default_middleware, propagate_headers, middleware),
            health=Health(), recoverability=self.recoverability, router=self.router,
            table=self.table, registry=self.registry, error_queue=error_queue,
            max_message_bytes=max_message_bytes, claim_check=claim_check)
        self._assembly = assemble(self.context, settings, on_unrouted=self.unrouted,
                                  counters=self._reported_counters)
        self._check_definitions(settings.journal)
        self._watch_and_consume()
        self.pipeline.setup(self)

    def _watch_and_consume(self) -> None:
        """The counters and the message log on the endpoint's signals, and the state of
        its consumer threads (none running, nothing in flight)."""
        self.counters = Counters(self.signals)
        self._unrouted_lines = Throttle(10.0)
        self._started = False
        self._message_log = MessageLog(self.signals)
        self._message_log_connected = False
        self._unrouted_lines = Throttle(10.0)  # warn_unrouted_events: a WARNING per 10 s
        self._unrouted_seen = Throttle(math.inf)  # otherwise: INFO once per type, DEBUG after
        self._threads: list[threading.Thread] = []
        self._activity = threading.Condition()
        self._in_flight = 0

    # -- what the context and the assembly hold, by their documented names ---------------

    @property
    def clock(self) -> Clock:
        """Where this endpoint reads the time."""
        return self.context.clock

    @property
    def signals(self) -> EndpointSignals:
        """The endpoint's blinker signals (what counters, logs and audit observe)."""
        return self.context.signals

    @property
    def pipeline(self) -> Pipeline:
        """The middleware around messages, handlers, commits and dispatches."""
        return self.context.pipeline

    @property
    def health(self) -> Health:
        """What keeps this process from working now (``idembus status`` shows it)."""
        return self.context.health

    @property
    def _stop(self) -> threading.Event:
        return self.context.stopping

    @property
    def dispatcher(self) -> Dispatcher:
        """Sends what handlers, units of work and ``bus`` send, and marks it."""
        return self._assembly.dispatcher

    @property
    def journal(self) -> Journal | None:
        """Appends published events to the event journal (``journal=...``), else ``None``."""
        return self.dispatcher.journal

    @property
    def shared_transaction(self) -> SharedTransaction | None:
        """Commits, sends and acknowledgements in one transaction when the queues are in
        the storage's database (:mod:`.shared_transaction`), else ``None``."""
        return self._assembly.shared_transaction

    @property
    def bus(self) -> Bus:
        """Sends and publishes from outside handlers, at once (or when deferred, later)."""
        return self._assembly.bus

    @property
    def outbox(self) -> OutboxRelay:
        """Repairs crashes between commit and dispatch (one active per storage); called,
        sends through the outbox from outside handlers without an aggregate: ``with
        endpoint.outbox(operation_id=key) as work: work.bus.send(...)``
        (:class:`~.unit_of_work.OutboxWork`). A ConfigurationError on a storage without the
        outbox role."""
        if self._assembly.outbox is None:
            raise ConfigurationError(
                f"{type(self.storage).__name__} lacks the OutboxStore role: endpoint "
                f"{self.name!r} has no outbox (run it on a storage that has one)")
        return self._assembly.outbox

    @property
    def scheduler(self) -> Scheduler | None:
        """Sends the schedules' occurrences (one active per endpoint and storage), or
        ``None`` without schedules."""
        return self._assembly.scheduler

    @property
    def _recovery(self) -> Recovery:
        if self._assembly.recovery is None:
            raise self._processes_nothing()
        return self._assembly.recovery

    @property
    def _processor(self) -> MessageProcessor:
        if self._assembly.processor is None:
            raise self._processes_nothing()
        return self._assembly.processor

    @property
    def time_limits(self) -> TimeLimiter | None:
        """Runs the handling methods within their time limits and knows which run long
        (:mod:`.recoverability.time_limits`: ``hung()``, ``stuck``); ``None`` in a
        send-only endpoint."""
        return self._assembly.time_limits

    @property
    def recycle_requested(self) -> bool:
        """Whether this endpoint stopped (or is stopping) to have its process recycled: more
        handler threads were stuck past their time limits than
        ``Recoverability(time_limits=TimeLimits(max_stuck_threads=...))`` tolerates
        (:mod:`.recoverability.time_limits`). ``idembus run`` then exits with status 3."""
        limiter = self._assembly.time_limits
        return limiter is not None and limiter.recycle_requested

    def _processes_nothing(self) -> ConfigurationError:
        return ConfigurationError(f"endpoint {self.name!r} is send-only: it processes no "
                                  "message (it has no queue and no handlers)")

    def storage_as(self, role: type[RoleT]) -> RoleT:
        """The storage as one of its roles (:mod:`idembus.storage.base`), for tools that
        read it; a ConfigurationError if it lacks that role."""
        return self.context.role(role)

    @property
    def handling_times(self) -> HandlingTimes | None:
        """How long handled deliveries took, by bucket (reported with the counters): the
        first :class:`~idembus.runtime.timings.HandlingTimes` of the pipeline, if any."""
        for item in self.pipeline.middleware:
            if isinstance(item, HandlingTimes):
                return item
        return None

    def _reported_counters(self) -> dict[str, int]:
        """What the status reports carry: the signal counters and the handling-time
        buckets (:mod:`idembus.runtime.timings`)."""
        times = self.handling_times
        return {**self.counters.snapshot(), **(times.snapshot() if times else {})}

    def add_middleware(self, middleware: Middleware) -> None:
        """Add ``middleware`` after those given at construction (innermost), and set it up;
        for tools that wrap an endpoint they loaded (``idembus run --metrics-port``). Not
        while the endpoint runs."""
        if self._threads or self._started:
            raise RuntimeError(f"endpoint {self.name!r} is running: add middleware before "
                               "starting it")
        self.pipeline.append(middleware)
        middleware.setup(self)

    @property
    def audit(self) -> Audit | None:
        """The :class:`~idembus.Audit` middleware of this endpoint, if it has one."""
        for item in self.pipeline.middleware:
            if "audit" in item.storage_roles:
                return cast("Audit", item)
        return None

    # -- configuration checks ----------------------------------------------------------

    def _check_routes(self, routes: Mapping[type[Message], str]) -> None:
        for command_type, destination in routes.items():
            if destination == self.name and not self.table.bindings_for(command_type):
                raise ConfigurationError(
                    f"routes send {message_name(command_type)} to {self.name!r} itself, but "
                    f"no handler of {self.name!r} handles it; add a handler or fix the route"
                )
        for handler in self.table.handlers:
            for sent in type(handler).sends:
                if not is_message_type(sent) or not issubclass(sent, Command):
                    raise ConfigurationError(
                        f"{type(handler).__qualname__}.sends lists {sent!r}; list the "
                        "Command types the handler sends (events need no route)"
                    )
                if not self.router.has_route(sent):
                    raise ConfigurationError(
                        f"{type(handler).__qualname__} sends {message_name(sent)} but "
                        f"{self.name!r} has no route for it: add "
                        f"routes={{{sent.__name__}: '<endpoint name>'}}"
                    )

    def _check_handler_options(self) -> None:
        """Every handler option a handler sets is read by a policy of this endpoint (its
        recoverability or a middleware that declares it): a misspelled option, or one whose
        middleware is missing, fails here rather than being silently ignored."""
        if not self.table.handlers:
            return  # a send-only endpoint among them: it has no recovery to read options
        readers = [self._recovery, *self.pipeline.middleware]
        for handler in self.table.handlers:
            check_handler_options(type(handler), readers)

    def _check_definitions(self, journal: JournalPolicy) -> None:
        """The message and state types' evolution, and the handlers' options."""
        self._check_evolution(journal)
        self._check_handler_options()

    def _check_evolution(self, journal: JournalPolicy) -> None:
        """Upcaster chains without gaps, state versions that are whole numbers, routing keys
        within the AMQP limit: for every type this endpoint knows."""
        journaled = [] if isinstance(journal.events, bool) else list(journal.events)
        known = [*self.registry, *(t for t in journaled if t not in self.registry)]
        for message_type in known:
            check_upcasters(message_type)
        check_routing_keys(known)
        for handler in self.table.handlers:
            if isinstance(handler, AggregateHandler):
                version_of(type(handler).state_type)
                check_upcasters(type(handler).state_type)

    def unrouted(self, envelope: Envelope) -> None:
        """Note an event the broker reported no queue took: the ``unrouted`` signal (and
        counter), and a line at INFO the first time for its type, at DEBUG after (with
        ``warn_unrouted_events=True``: a WARNING per type every 10 s at most). It is not
        kept: publishing for subscribers still to come is normal, and an event nobody
        subscribes to is not a failure of the message (README, "Message hierarchies")."""
        message_id, message_type = envelope.message_id, envelope.message_type
        self.signals.emit("unrouted", message_id=message_id, message_type=message_type,
                          envelope=envelope)
        if self.warn_unrouted_events:
            held = self._unrouted_lines.allow(message_type)
            if held is None:
                return
            level, said = logging.WARNING, self._unrouted_lines.said(held)
        elif self._unrouted_seen.allow(message_type) is not None:
            level, said = logging.INFO, "; further ones of this type are logged at DEBUG"
        else:
            level, said = logging.DEBUG, ""
        if log.isEnabledFor(level):  # the line's fields only when it is written
            log.log(level, "event %s %s reached no queue: no endpoint subscribes to it or to "
                    "a type it derives from%s", message_type, message_id, said,
                    extra={"endpoint": self.name, "message_id": message_id,
                           "message_type": message_type})

    def unit_of_work(
        self,
        state_type: type[StateT],
        aggregate_id: str,
        *,
        operation_id: str | None = None,
        new_state: Callable[[], StateT] | None = None,
    ) -> UnitOfWork[StateT]:
        """Change one aggregate from outside handlers in one write (see
        :mod:`.unit_of_work`): ``with endpoint.unit_of_work(Order, order_id) as work:``.

        ``operation_id`` makes a retried operation (an HTTP request with an idempotency
        key) take effect once; ``new_state`` builds the state of an aggregate that does not
        exist yet (default: ``state_type()``).
        """
        return UnitOfWork(self.context, self.dispatcher, state_type,
                          (self._aggregate_type_of(state_type), aggregate_id),
                          operation_id=operation_id, new_state=new_state)

    def _aggregate_type_of(self, state_type: type[BaseModel]) -> str:
        """The storage name a handler of this endpoint gives ``state_type``, or its name."""
        for handler in self.table.handlers:
            if isinstance(handler, AggregateHandler) and type(handler).state_type is state_type:
                return type(handler).storage_name()
        return state_type.__name__

    def _check_retention(self) -> None:
        """Deduplication must remember a message for longer than it can keep coming back."""
        retention = self.storage.retention if isinstance(self.storage, AggregateStore) else None
        if retention is None:
            return
        policies = [self.recoverability.retries] + [
            type(h).retry_policy for h in self.table.handlers if type(h).retry_policy]
        longest = max(policy.longest_path for policy in policies if policy is not None)
        if retention.total_seconds() <= longest:
            raise ConfigurationError(
                f"{type(self.storage).__name__} remembers processed messages for "
                f"{retention.total_seconds():.0f}s, but a failing message can come back "
                f"{longest:.0f}s after its first attempt (delayed retries): its duplicates "
                "would then be processed again. Keep them longer (retention=...) or shorten "
                "the delayed retries (RetryPolicy(delayed=...))."
            )

    @property
    def subscriptions(self) -> list[str]:
        """Wire names of the event types this endpoint's handlers subscribe to."""
        return sorted(message_name(t) for t in self.table.message_types if issubclass(t, Event))

    # -- life cycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Check the storage, declare the topology and start the consumer threads. A
        send-only endpoint declares nothing and starts only what sending through the
        outbox needs (:meth:`_start_sending_only`)."""
        if self._threads or self._started:
            raise RuntimeError(f"endpoint {self.name!r} is already running")
        if self.send_only:
            self._start_sending_only()
            return
        check_sent_routes(self.table.handlers, self.router, self.name,
                          strict=self.strict_routes)
        self.storage.verify()
        self.transport.declare(self.name, subscriptions=self.subscriptions)
        self.transport.declare(self.error_queue)
        self._sweep_reply_queues()
        if self._assembly.delayed is not None:
            self._assembly.delayed.start()
        if self._assembly.status is not None:
            self._assembly.status.start()
        if self.outbox_policy.run:
            self.outbox.start()
        if self.scheduler is not None:
            self.scheduler.start()
            log.info("endpoint %s schedules: %s", self.name, "; ".join(
                f"{s.name} ({s.cron}, {s.timezone}: {s.describe_message()})"
                for s in self.schedules), extra={"endpoint": self.name})
        self._declare_partitions()
        # A stop requested meanwhile (SIGTERM during start-up) is kept, not cleared here.
        for index in range(self.concurrency):
            thread = threading.Thread(
                target=self._consume, args=(self._consume_once,),
                name=f"idembus-{self.name}-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._start_partition_consumers()
        if not self._message_log_connected:
            self._message_log_connected = self._message_log.connect()
        local = [part for part in (self.storage, self.transport) if part.process_local]
        if local:
            log.warning("endpoint %s runs on %s: process-local and not durable (messages and "
                        "state are lost when this process ends, and other processes cannot "
                        "see them); pass a broker URL and a database for anything but trials",
                        self.name, " and ".join(_described(part) for part in local),
                        extra={"endpoint": self.name})
        log.info("endpoint %s started: queue %s, %d consumer(s), handlers %s, subscribed to "
                 "%s; transport %s, storage %s", self.name, self.name, self.concurrency,
                 ", ".join(type(h).name() for h in self.table.handlers) or "none",
                 ", ".join(self.subscriptions) or "nothing", _described(self.transport),
                 _described(self.storage), extra={"endpoint": self.name})
        if self.shared_transaction is not None:
            log.info("endpoint %s commits, sends and acknowledges in one transaction: its "
                     "queues are in its storage's database", self.name,
                     extra={"endpoint": self.name})

    def _sweep_reply_queues(self) -> None:
        """Delete the reply queues of requesters that died, where the transport has
        expiring ones (:mod:`idembus.transports.reply_leases`): so they go even where no
        process requests any more. A failure is only logged; the requesting processes
        sweep too."""
        if not self.transport.expiring_reply_queues:
            return
        try:
            self.transport.sweep_reply_queues()
        except Exception as error:
            log.warning("endpoint %s could not delete the reply queues of requesters that "
                        "are gone: %s", self.name, error, extra={"endpoint": self.name})

    def _start_sending_only(self) -> None:
        """Check the storage; start the outbox relay (unless ``outbox=False``) and, on a
        transport without native delay, the delayed poller. No queue is declared and no
        consumer, scheduler or status reporter runs."""
        self.storage.verify()
        if self._assembly.delayed is not None:
            self._assembly.delayed.start()
        if self.outbox_policy.run:
            self.outbox.start()
        self._started = True
        log.info("endpoint %s started, send-only: no queue, no consumer; outbox relay %s; "
                 "transport %s, storage %s", self.name,
                 "running" if self.outbox_policy.run else "off (outbox=False)",
                 _described(self.transport), _described(self.storage),
                 extra={"endpoint": self.name})

    def stop(self, timeout: float | None = 30.0) -> bool:
        """Stop taking messages, let the ones in progress finish; True if all threads ended
        within ``timeout`` seconds (one budget for every thread, not one each)."""
        self._stop.set()
        deadline = Deadline(timeout)
        for thread in self._threads:
            thread.join(deadline.left())
        if self._assembly.delayed is not None:
            self._assembly.delayed.stop(deadline.left())
        if self._assembly.status is not None:
            self._assembly.status.stop(deadline.left())
        if self._assembly.outbox is not None:
            self._assembly.outbox.stop(deadline.left())
        if self.scheduler is not None:
            self.scheduler.stop(deadline.left())
        stopped = not any(thread.is_alive() for thread in self._threads)
        if stopped and self._threads:
            counts = self.counters.snapshot()
            log.info("endpoint %s stopped: %s", self.name, ", ".join(
                f"{name} {counts[name]}" for name in sorted(counts) if counts[name]) or
                "no messages", extra={"endpoint": self.name})
        if stopped:
            self._threads, self._started = [], False
            self._stop.clear()  # ready to start again
        return stopped

    def run(self, *, shutdown_timeout: float = 30.0) -> bool:
        """Start and block until ``stop()``, SIGINT or SIGTERM; then stop gracefully:
        take no new message, finish the ones in progress. Returns False if they did not
        finish within ``shutdown_timeout`` seconds (the broker will redeliver them)."""
        with StopSignals() as signals:  # kept through stop(): a second signal only notes
            self.start()
            try:
                signals.wait(self._stop)
            finally:
                stopped = self.stop(timeout=shutdown_timeout)
        return stopped

    def request_stop(self) -> None:
        """Ask a running endpoint to stop gracefully, as SIGTERM does; returns at once."""
        self._stop.set()

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop (see :meth:`stop`), stop consuming the reply queue of ``bus.request`` (if
        a request made one), then release the transport's and the storage's connections."""
        deadline = Deadline(timeout)
        self.stop(deadline.left())
        self._assembly.requests.close(deadline.left())
        self.pipeline.close()
        self.transport.close()
        self.storage.close()

    def __enter__(self) -> Endpoint:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    # -- consuming ----------------------------------------------------------------------

    @property
    def partitions(self) -> int:
        """How many partition queues this endpoint's ordered messages travel in (the most
        ``partitions=`` of the ordered types it handles); 0 if it handles none, or if its
        transport orders them in the endpoint's queue (the database queues)."""
        if not self.transport.partition_queues:
            return 0
        return max((self.router.partitions_of(t) for t in self.table.message_types),
                   default=0)

    @property
    def ordered_types(self) -> list[type[Message]]:
        """The message types this endpoint handles whose messages are ordered by key (their
        own ``ordered_by=``, or a handler's declaration)."""
        return [t for t in self.table.message_types if self.router.partitions_of(t)]

    def _declare_partitions(self) -> None:
        if self.partitions:
            self.transport.declare_partitions(self.name, self.partitions)

    def _start_partition_consumers(self) -> None:
        """One more thread per consumer thread for the partition queues, each consuming
        its share of them (partition ``i`` goes to thread ``i mod concurrency``) one
        delivery at a time: a partition's messages are handled in order in this process,
        and each partition is consumed by one process at a time (the broker's single active
        consumer on RabbitMQ, a lease per partition on Redis)."""
        for index in range(min(self.concurrency, self.partitions)):
            share = list(range(index, self.partitions, self.concurrency))
            thread = threading.Thread(
                target=self._consume, args=(functools.partial(
                    self.transport.consume_partitions, self.name, share, self._on_delivery,
                    stop=self._stop),),
                name=f"idembus-{self.name}-ordered-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _consume(self, consume_once: Callable[[], None]) -> None:
        """One consumer thread: consume until stopped, whatever the transport raises.

        The transport waits out outages itself. What it cannot wait out — the broker
        refusing this endpoint (:class:`~idembus.errors.EndpointBlocked`) or a bug — is logged
        (at ERROR) and shown by ``idembus status``, and consuming starts again after a
        growing wait, once declaring the queue works again: never a live process that
        consumes nothing.
        """
        try:
            self._consume_until_stopped(consume_once)
        finally:
            close_thread_loop()  # this thread's event loop, if async handlers made one

    def _consume_until_stopped(self, consume_once: Callable[[], None]) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                if failures:
                    self.transport.declare(self.name, subscriptions=self.subscriptions)
                    self._declare_partitions()
                    self.health.resolved("transport")
                consume_once()
                return
            except Exception as error:
                delay = self.recoverability.outage_backoff.delay(failures)
                failures += 1
                self.health.problem("transport", error)
                if isinstance(error, BusError):
                    log.error("endpoint %s cannot consume its queue: %s; trying again in %.1fs",
                              self.name, redact(str(error)), delay)
                else:
                    log.exception("a consumer of endpoint %s failed; starting it again in "
                                  "%.1fs", self.name, delay)
                self._stop.wait(delay)

    def _consume_once(self) -> None:
        """Consume until stopped, one delivery or one batch at a time. Where the queues share
        the storage's database, commit, send and acknowledgement are one transaction
        already: deliveries go one at a time, batching or not."""
        size = self.batch_size
        if size is None:
            self.transport.consume(self.name, self._on_delivery, stop=self._stop,
                                   prefetch=self.prefetch)
            return
        assert self.batching is not None
        runner = BatchRunner(self._processor, size=size, parks=self._assembly.parks)
        self.transport.consume_batches(
            self.name, functools.partial(self._on_batch, runner), stop=self._stop,
            prefetch=max(self.prefetch, size), size=size, linger=self.batching.linger)

    @property
    def batch_size(self) -> int | None:
        """The most deliveries a batch holds; ``None`` when they go one at a time (no
        batching, or a shared transaction)."""
        if self.batching is None or not self._assembly.batched:
            return None
        return self.batching.size_for(self.prefetch)

    def _on_batch(self, runner: BatchRunner, deliveries: Sequence[Delivery]) -> None:
        with self._activity:
            self._in_flight += len(deliveries)
        try:
            runner.run(deliveries, self.transport, one_at_a_time=self._recovery.breaker.open)
        finally:
            with self._activity:
                self._in_flight -= len(deliveries)
                self._activity.notify_all()

    def _on_delivery(self, delivery: Delivery) -> None:
        with self._activity:
            self._in_flight += 1
        try:
            self._processor(delivery)
        finally:
            with self._activity:
                self._in_flight -= 1
                self._activity.notify_all()

    def process(self, delivery: Delivery) -> None:
        """Process one delivery in the calling thread, exactly as a consumer would: the
        same deduplication, dispatch, retries and error queue. For tools that bring their
        own messages (``idembus spark replay``); the endpoint need not be started."""
        self._on_delivery(delivery)

    def process_batch(self, deliveries: Sequence[Delivery]) -> None:
        """Process ``deliveries`` in the calling thread as a consumer's batches would be
        (at most :attr:`batch_size` a batch, in order; one at a time without batching): the
        same deduplication, dispatch, retries and error queue, their loads, commits and
        dispatches shared by each batch. What escapes a message's processing (a crash) is
        raised once its batch is settled, as :meth:`process` raises it: nothing gives such
        a delivery back, so the caller runs it again (Spark: the task). For tools that
        bring their own messages (``idembus spark replay``)."""
        size = self.batch_size
        if size is None:
            for delivery in deliveries:
                self._on_delivery(delivery)
            return
        runner = BatchRunner(self._processor, size=size, requeue_escaped=False,
                             parks=self._assembly.parks)
        for start in range(0, len(deliveries), size):
            self._on_batch(runner, deliveries[start:start + size])

    def reject(self, delivery: Delivery, reason: str) -> None:
        """Send a delivery that is not a readable message to the error queue with
        ``reason``, as bad input; then acknowledge it."""
        self._processor.reject(delivery, reason)

    def is_idle(self) -> bool:
        """True when no message is being processed and none waits in the queue (a
        send-only endpoint has neither)."""
        with self._activity:
            busy = self._in_flight > 0
        return self.send_only or (not busy and self.transport.pending(self.name) == 0 and all(
            self.transport.pending(partition_queue(self.name, index)) == 0
            for index in range(self.partitions)))

    def wait_for_activity(self, timeout: float) -> None:
        """Block until a message finishes processing here, or ``timeout`` passes."""
        with self._activity:
            self._activity.wait(timeout)

    @property
    def process_local(self) -> bool:
        """True if the transport or the storage lives inside this process, so that other
        processes cannot share the endpoint's queue or data (memory://, mongomock)."""
        return self.transport.process_local or self.storage.process_local

    @property
    def running(self) -> bool:
        """Whether any of the endpoint's consumer or helper threads is alive (a send-only
        endpoint: whether it was started and not stopped)."""
        return self._started or any(thread.is_alive() for thread in self._threads)


def _router(name: str, routes: Mapping[type[Message], str], table: HandlerTable,
            ordering_from: Sequence[Handler | type[Handler]]) -> Router:
    """The endpoint's router: its routes, its own commands to itself, and the orderings of
    the handlers it is told about and of those it hosts."""
    return Router(_with_own_commands(name, routes, table.message_types),
                  orderings={**handler_orderings(ordering_from),
                             **handler_orderings(table.handlers)})


def _with_own_commands(
    name: str, routes: Mapping[type[Message], str], handled: Sequence[type[Message]]
) -> dict[type[Message], str]:
    merged: dict[type[Message], str] = {t: name for t in handled if issubclass(t, Command)}
    merged.update(routes)
    return merged


def _transport_from(transport: Transport | str) -> Transport:
    if isinstance(transport, Transport):
        return transport
    if isinstance(transport, str):
        from ..transports.urls import transport_for

        return transport_for(transport)
    raise ConfigurationError(
        f"transport must be a Transport or a kombu URL such as 'memory://' (or a database "
        f"URL: 'postgresql://...', 'mongodb://...'), got {transport!r}"
    )


def _embedded_storage() -> StorageRole:
    """The storage of an endpoint given none: in-process dicts, whose time per message does
    not grow with what they hold (mongomock, the earlier default, scans whole collections
    and slowed down as data grew; it stays MongoStorage's test double)."""
    from ..storage.memory import MemoryStorage

    return MemoryStorage()


def _described(part: object) -> str:
    """A transport or storage as the start-up line names it: its class and where it
    connects, password hidden."""
    where = getattr(part, "safe_url", None) or getattr(part, "conninfo", None)
    if where is None and getattr(part, "database", None) is not None:
        where = getattr(part.database, "name", None)  # type: ignore[attr-defined]
    name = type(part).__name__
    return f"{name} ({redact(str(where))})" if where else name


def _outbox_policy(option: OutboxPolicy | bool) -> OutboxPolicy:
    if isinstance(option, OutboxPolicy):
        return option
    if isinstance(option, bool):
        return OutboxPolicy(run=option)
    raise ConfigurationError(f"outbox must be True, False or an OutboxPolicy, got {option!r}")


def _journal_policy(option: bool | Sequence[type[Event]] | JournalPolicy) -> JournalPolicy:
    if isinstance(option, JournalPolicy):
        if option.retention <= datetime.timedelta(0):
            raise ConfigurationError(
                f"the journal's retention must be positive, got {option.retention!r}")
        return option
    return JournalPolicy(events=option)


def _check_options(name: str, *, concurrency: int, prefetch: int, clock: Clock | None,
                   max_message_bytes: int, error_queue: str, batching: Batching | None,
                   storage: StorageRole | None, send_only: bool = False,
                   handlers: Sequence[object] = (),
                   schedules: Sequence[Schedule] | SchedulerPolicy = ()) -> None:
    """The endpoint's options that can be checked alone; a ConfigurationError saying what
    to fix for the first that is wrong."""
    if send_only is not True and send_only is not False:
        raise ConfigurationError(f"send_only must be True or False, got {send_only!r}")
    if send_only and handlers:
        raise ConfigurationError(
            f"endpoint {name!r} is send-only: it has no queue, so it cannot handle messages; "
            "give its handlers to an endpoint that consumes, or drop send_only=True")
    if send_only and (schedules.schedules if isinstance(schedules, SchedulerPolicy)
                      else schedules):
        raise ConfigurationError(
            f"endpoint {name!r} is send-only: it runs no scheduler; give its schedules to an "
            "endpoint that consumes, or drop send_only=True")
    if not isinstance(name, str) or not _ENDPOINT_NAME.fullmatch(name):
        raise ConfigurationError(
            f"endpoint name {name!r} must be non-empty letters, digits, '_', '-' or '.'")
    if concurrency < 1:
        raise ConfigurationError(f"concurrency must be at least 1, got {concurrency}")
    if prefetch < 1:
        raise ConfigurationError(f"prefetch must be at least 1, got {prefetch}")
    if max_message_bytes < 1:
        raise ConfigurationError(f"max_message_bytes must be at least 1, got {max_message_bytes}")
    if error_queue == name:
        raise ConfigurationError(f"the error queue cannot be the endpoint's own queue {name!r}")
    if clock is not None and not isinstance(clock, Clock):
        raise ConfigurationError(
            f"clock must have a now() method returning an aware UTC datetime, got {clock!r}")
    if batching is not None and not isinstance(batching, Batching):
        raise ConfigurationError(
            f"batching must be idembus.Batching(size=..., linger=...) or None, got {batching!r}")
    if storage is not None and not isinstance(storage, StorageRole):
        raise ConfigurationError(
            f"storage must be a storage backend such as MongoStorage(...), got {storage!r}")


def _check_roles(storage: StorageRole | None, settings: Settings, transport: Transport,
                 middleware: Sequence[Middleware], claim_check: ClaimCheck | None) -> None:
    """The storage has every role the endpoint's options use (one error naming all that
    are missing, :func:`~idembus.storage.roles.check_storage_roles`); the embedded one
    (``None``) has them all."""
    if claim_check is not None and not isinstance(claim_check, ClaimCheck):
        raise ConfigurationError(
            f"claim_check must be idembus.ClaimCheck(threshold_bytes=...) or None, got "
            f"{claim_check!r}")
    if storage is None:
        return
    check_storage_roles(
        storage, outbox=settings.outbox.run, delayed=not transport.native_delay,
        journal=bool(settings.journal.events),
        audit=any("audit" in getattr(item, "storage_roles", ()) for item in middleware),
        status=bool(settings.status_interval) and not settings.send_only,
        schedules=bool(settings.scheduling.schedules),
        limits=any("limits" in getattr(item, "storage_roles", ()) for item in middleware),
        claims=claim_check is not None and claim_check.store is None)


def default_middleware(propagate_headers: Sequence[str] = ()) -> list[Middleware]:
    """The built-in middleware an endpoint puts before yours, in order: the handling-time
    buckets of its status reports (:class:`~idembus.runtime.timings.HandlingTimes`), then,
    if ``propagate_headers`` names any, the headers copied to every outgoing message
    (:class:`~idembus.pipeline.PropagateHeaders`). A new list each call: take it, reorder
    or replace items, and give it as ``Endpoint(default_middleware=...)``."""
    defaults: list[Middleware] = [HandlingTimes()]
    if propagate_headers:
        defaults.append(PropagateHeaders(tuple(propagate_headers)))
    return defaults


def _pipeline(defaults: Sequence[Middleware] | None, propagate_headers: Sequence[str],
              middleware: Sequence[Middleware]) -> Pipeline:
    """The endpoint's pipeline: the default middleware (given, or
    :func:`default_middleware`), then the user's."""
    if defaults is None:
        defaults = default_middleware(propagate_headers)
    elif propagate_headers:
        raise ConfigurationError(
            "give either default_middleware or propagate_headers: with default_middleware, "
            "put PropagateHeaders(...) in that list where it belongs")
    return Pipeline([*defaults, *middleware])
