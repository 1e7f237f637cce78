"""Scenario tests in virtual time: several endpoints' handlers on in-memory parts.

::

    scenario = Scenario(handlers=[OrderPolicy])
    scenario.send(PlaceOrder(order_id="42"))
    scenario.advance(hours=25)                      # the 24-hour timeout comes due
    assert scenario.state(Order, "42").status == "cancelled"

Every endpoint of a scenario is a real :class:`~idembus.runtime.endpoint.Endpoint` on a
:class:`~idembus.storage.memory.MemoryStorage` of its own, one
:class:`~idembus.testing.transport.ScenarioTransport` they share and the scenario's
:class:`~idembus.testing.FakeClock`. Their consumer threads never start: the scenario takes
the messages from their queues one at a time, in the order they arrived, and hands each to
:meth:`Endpoint.process <idembus.runtime.endpoint.Endpoint.process>`, the very processor a consumer
thread runs — middleware, deduplication, the conditional commit, dispatch, immediate and
delayed retries, expiry, the error queue. A test proves what production does.

Time moves only when the test moves it. :meth:`Scenario.advance` walks the clock from one
due time to the next up to where it was asked to go, delivering at each what came due —
deferred messages, ``AggregateHandler.request_timeout`` timeouts, delayed retries — and
everything that causes, before it takes the next step. Nothing sleeps and nothing runs in
another thread, so a scenario is deterministic.

The circuit breaker is off: it paces consumers in wall-clock time and changes no message's
fate. Storage bookkeeping (commit times, retention) stays on the wall clock.
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from .. import headers as h
from ..envelope import Envelope
from ..errors import BusError, ConfigurationError, RoutingError
from ..expiry import TimeToLive
from ..handlers.base import AggregateHandler, Handler
from ..messages import Command, Event, Message, message_name
from ..pipeline import Dispatch, Middleware
from ..routing import Router
from ..runtime.endpoint import Endpoint
from ..runtime.recoverability.breaker import BreakerPolicy
from ..runtime.recoverability.policy import Recoverability
from ..sending import Bus
from ..storage.base import AggregateRecord, AggregateStore
from ..storage.memory import MemoryStorage
from .clock import FakeClock
from .decoding import ByIntent, decoded
from .transport import ScenarioTransport

StateT = TypeVar("StateT", bound=BaseModel)

#: The name the scenario sends under (the reply address of what a test sends).
CLIENT = "scenario"
#: Endpoint options a scenario sets itself.
_OWNED = ("transport", "clock")


class ScenarioError(BusError):
    """A scenario could not settle (a handler that keeps sending itself messages), or,
    with ``fail_fast``, a message went to the error queue."""


@dataclass(frozen=True)
class Outgoing:
    """One dispatch of a message an endpoint of the scenario sent: from a handler, a
    duplicate's redispatch (``source="redispatch"``, same id), a unit of work or
    ``endpoint.bus``."""

    envelope: Envelope
    #: The message read back (``None`` if no message class reads its body).
    message: Message | None
    #: The endpoint that sent it.
    endpoint: str
    #: ``handler``, ``redispatch``, ``unit_of_work``, ``bus`` or ``outbox``.
    source: str
    #: The scenario's time when it was dispatched.
    at: datetime.datetime

    @property
    def message_id(self) -> str:
        """The message's id."""
        return self.envelope.message_id

    @property
    def intent(self) -> h.Intent:
        """Send, publish or reply."""
        return self.envelope.intent

    @property
    def destination(self) -> str | None:
        """The queue of a sent or replied message; ``None`` for a published event."""
        return self.envelope.destination

    @property
    def headers(self) -> Mapping[str, str]:
        """The message's headers."""
        return self.envelope.headers

    @property
    def deliver_at(self) -> datetime.datetime | None:
        """When a deferred message (a timeout) is due; ``None`` if it was not deferred."""
        return self.envelope.deliver_at


@dataclass(frozen=True)
class FailedMessage:
    """A message in an error queue of the scenario, and why it is there."""

    #: The error-queue copy: the original headers and body plus the failure's headers.
    envelope: Envelope
    message: Message | None
    error_queue: str

    @property
    def message_id(self) -> str | None:
        """The failed message's id (None if it had none)."""
        return self.envelope.headers.get(h.MESSAGE_ID)

    @property
    def headers(self) -> Mapping[str, str]:
        """The message's headers."""
        return self.envelope.headers

    @property
    def reason(self) -> str:
        """The exception's message (redacted, bounded), as the error queue keeps it."""
        return self.envelope.headers.get(h.EXCEPTION_MESSAGE, "")

    @property
    def exception_type(self) -> str:
        """The exception's qualified name, ``module.Class``."""
        return self.envelope.headers.get(h.EXCEPTION_TYPE, "")

    @property
    def failed_queue(self) -> str | None:
        """The queue the message failed in."""
        return self.envelope.headers.get(h.FAILED_QUEUE)

    @property
    def attempts(self) -> tuple[int, int]:
        """(immediate attempts of the last round, delayed rounds before it)."""
        return (int(self.envelope.headers.get(h.IMMEDIATE_ATTEMPTS, 0)),
                int(self.envelope.headers.get(h.DELAYED_ATTEMPTS, 0)))


class Scenario(ByIntent):
    """Endpoints' handlers on in-memory parts with a fake clock; see the module docstring.

    ``handlers`` and ``routes`` (with any other ``Endpoint`` options but ``transport`` and
    ``clock``) make a first endpoint named ``endpoint``; :meth:`add_endpoint` adds more.
    ``clock``: the :class:`FakeClock` to run on (default: one starting now, to the second).
    ``fail_fast``: raise :class:`ScenarioError` as soon as a message goes to an error queue,
    instead of leaving it there for the test to look at (:attr:`errors`).
    ``max_messages``: deliveries one call may process before it gives up with
    :class:`ScenarioError` (a handler loop would otherwise never end).

    What happened: :attr:`sent`, :attr:`published` and :attr:`replied` list the messages
    the endpoints put out, each once however often it was dispatched; :attr:`outgoing` has
    every dispatch with its destination, headers, source and time; :attr:`deferred` the
    deferred ones with when they are due; :attr:`errors` what is in the error queues and
    why; :meth:`state` an aggregate's stored state.
    """

    def __init__(
        self,
        *,
        handlers: Sequence[Handler | type[Handler]] = (),
        routes: Mapping[type[Message], str] | None = None,
        endpoint: str = "app",
        clock: FakeClock | None = None,
        fail_fast: bool = False,
        max_messages: int = 10_000,
        **options: Any,
    ) -> None:
        if clock is not None and not isinstance(clock, FakeClock):
            raise ConfigurationError(
                f"a Scenario runs on a FakeClock (idembus.testing.FakeClock), got {clock!r}")
        if max_messages < 1:
            raise ConfigurationError(f"max_messages must be at least 1, got {max_messages}")
        #: The scenario's time; :meth:`advance` moves it.
        self.clock = clock or FakeClock()
        #: The queues of every endpoint of the scenario.
        self.transport = ScenarioTransport(self.clock)
        self.fail_fast = fail_fast
        self.max_messages = max_messages
        self._endpoints: dict[str, Endpoint] = {}
        self._outgoing: list[Outgoing] = []
        self._failures_seen = 0
        self._client = Bus(CLIENT, _ScenarioRouter(self._endpoints), self.transport.dispatch,
                           clock=self.clock)
        if handlers or routes or options:
            self.add_endpoint(endpoint, handlers=handlers, routes=routes, **options)

    # -- wiring ---------------------------------------------------------------------------

    def add_endpoint(
        self,
        name: str,
        *,
        handlers: Sequence[Handler | type[Handler]],
        routes: Mapping[type[Message], str] | None = None,
        **options: Any,
    ) -> Endpoint:
        """Add an endpoint with these handlers and routes (and ``Endpoint`` options, but
        ``transport`` and ``clock``, which are the scenario's; ``storage`` defaults to a
        new :class:`MemoryStorage`); return it."""
        owned = [option for option in _OWNED if option in options]
        if owned:
            raise ConfigurationError(
                f"a Scenario gives its endpoints its own {' and '.join(owned)}: leave "
                f"{', '.join(owned)}= out (the scenario's clock is scenario.clock)")
        if name in self._endpoints or name == CLIENT:
            raise ConfigurationError(
                f"the scenario already has an endpoint named {name!r}" if name != CLIENT else
                f"{CLIENT!r} is the name the scenario itself sends under; pick another")
        options.setdefault("storage", MemoryStorage())
        options.setdefault("status_interval", 0)
        recoverability = options.pop("recoverability", None) or Recoverability()
        endpoint = Endpoint(
            name, transport=self.transport, clock=self.clock, handlers=handlers, routes=routes,
            recoverability=dataclasses.replace(
                recoverability, breaker=BreakerPolicy(threshold=sys.maxsize)),
            **options)
        endpoint.add_middleware(_Recorder(self._record))
        self.transport.declare(name, subscriptions=endpoint.subscriptions)
        self.transport.declare(endpoint.error_queue)
        self._endpoints[name] = endpoint
        return endpoint

    def endpoint(self, name: str | None = None) -> Endpoint:
        """The endpoint named ``name`` (without a name: the only one)."""
        if name is None:
            if len(self._endpoints) != 1:
                raise ValueError(f"the scenario has endpoints {sorted(self._endpoints)}: "
                                 "name one")
            return next(iter(self._endpoints.values()))
        try:
            return self._endpoints[name]
        except KeyError:
            raise ValueError(f"the scenario has no endpoint {name!r}; it has "
                             f"{sorted(self._endpoints)}") from None

    # -- putting messages in --------------------------------------------------------------

    def send(self, command: Command, *, to: str | None = None,
             headers: Mapping[str, str] | None = None, message_id: str | None = None,
             deliver_at: datetime.datetime | None = None,
             discard_after: TimeToLive | None = None) -> str:
        """Send ``command`` from outside (to the endpoint that handles it, or ``to``), then
        :meth:`run`; return its id. A ``message_id`` sent twice makes a duplicate."""
        sent = self._client.send(command, to=to, headers=headers, message_id=message_id,
                                 deliver_at=deliver_at, discard_after=discard_after)
        self.run()
        return sent

    def defer(self, command: Command, delay: float | datetime.timedelta, *,
              to: str | None = None, headers: Mapping[str, str] | None = None,
              discard_after: TimeToLive | None = None) -> str:
        """Send ``command`` from outside, due ``delay`` from the scenario's now (it is
        delivered when :meth:`advance` gets there); return its id."""
        sent = self._client.defer(command, delay, to=to, headers=headers,
                                  discard_after=discard_after)
        self.run()
        return sent

    def publish(self, event: Event, *, headers: Mapping[str, str] | None = None,
                message_id: str | None = None,
                discard_after: TimeToLive | None = None) -> str:
        """Publish ``event`` from outside to the endpoints subscribed to it, then
        :meth:`run`; return its id."""
        published = self._client.publish(event, headers=headers, message_id=message_id,
                                         discard_after=discard_after)
        self.run()
        return published

    def deliver(self, envelope: Envelope) -> None:
        """Put ``envelope`` on the wire as it is (to its destination, or published if it
        has none): a foreign message, bad input, an exact copy of one already delivered.
        Then :meth:`run`."""
        self.transport.dispatch(envelope)
        self.run()

    # -- running --------------------------------------------------------------------------

    def run(self) -> int:
        """Process what waits in the endpoints' queues, and everything that causes, until
        they are all empty; return how many deliveries were processed. Time stands still."""
        return self._run(self.max_messages)

    def advance(self, delta: datetime.timedelta | None = None, *, seconds: float = 0,
                minutes: float = 0, hours: float = 0, days: float = 0) -> int:
        """Move the clock forward by ``delta`` and/or the given units, one due time at a
        time, processing at each what came due and what that causes (see the module
        docstring); return how many deliveries were processed."""
        step = (delta or datetime.timedelta()) + datetime.timedelta(
            seconds=seconds, minutes=minutes, hours=hours, days=days)
        if step < datetime.timedelta(0):
            raise ValueError(f"a scenario's time only moves forward; cannot advance by {step}")
        return self.advance_to(self.clock.now() + step)

    def advance_to(self, moment: datetime.datetime) -> int:
        """:meth:`advance` up to ``moment`` (an aware datetime, not before now)."""
        if moment.tzinfo is None or moment < self.clock.now():
            raise ValueError(f"advance_to() takes an aware datetime not before "
                             f"{self.clock.now().isoformat()}, got {moment!r}")
        processed = self.run()
        while (due := self.transport.next_due()) is not None and due <= moment:
            self.clock.set(max(due, self.clock.now()))
            self.transport.release_due()
            processed += self._run(self.max_messages - processed)
        self.clock.set(moment)
        return processed

    def _run(self, budget: int) -> int:
        processed = 0
        while (delivery := self.transport.take(self._endpoints)) is not None:
            if processed >= budget:
                delivery.requeue()
                raise ScenarioError(
                    f"the scenario was still busy after {self.max_messages} deliveries "
                    f"(at {self.clock.now().isoformat()}): does a handler keep sending "
                    "messages that cause more? Raise max_messages if the run is meant to "
                    "be that long")
            try:
                self._endpoints[delivery.queue].process(delivery)
            except BaseException:
                if not delivery.settled:
                    delivery.requeue()
                raise
            processed += 1
            self._notice_failures()
        return processed

    def _notice_failures(self) -> None:
        failed = sum(self.transport.pending(queue) for queue in self._error_queues)
        if failed <= self._failures_seen:
            return
        first_new = self._failures_seen
        self._failures_seen = failed
        if self.fail_fast:
            failure = self.errors[first_new]
            raise ScenarioError(
                f"{failure.headers.get(h.MESSAGE_TYPE)} {failure.message_id} went to "
                f"{failure.error_queue}: {failure.exception_type}: {failure.reason}")

    # -- what happened --------------------------------------------------------------------

    @property
    def now(self) -> datetime.datetime:
        """The scenario's current time."""
        return self.clock.now()

    @property
    def next_due(self) -> datetime.datetime | None:
        """When the next deferred message, timeout or delayed retry is due, if any waits."""
        return self.transport.next_due()

    @property
    def outgoing(self) -> list[Outgoing]:
        """Every dispatch of a message the endpoints sent, in order; a redispatch of a
        duplicate appears again with the same id."""
        return list(self._outgoing)

    @property
    def deferred(self) -> list[Outgoing]:
        """The messages the endpoints deferred (timeouts included), each once, with when
        they are due (``.deliver_at``)."""
        return [item for item in self._unique() if item.deliver_at is not None]

    @property
    def errors(self) -> list[FailedMessage]:
        """What is in the endpoints' error queues, oldest first, with the reasons."""
        preferred = self._known_types()
        return [FailedMessage(envelope, decoded(envelope, preferred), queue)
                for queue in self._error_queues for envelope in self.transport.messages(queue)]

    def state(self, state_type: type[StateT], aggregate_id: str, *,
              endpoint: str | None = None) -> StateT | None:
        """The stored state of the ``state_type`` aggregate ``aggregate_id`` (``None`` if
        it does not exist or was completed), in the endpoint whose aggregate handler keeps
        that type (name it when several do)."""
        record = self._record_of(state_type, aggregate_id, endpoint)
        return state_type.model_validate(record.state) if record.live else None

    def completed(self, state_type: type[BaseModel], aggregate_id: str, *,
                  endpoint: str | None = None) -> bool:
        """Whether the saga (or aggregate) ``aggregate_id`` of ``state_type`` was completed
        (``self.complete()``) and its tombstone is stored."""
        return self._record_of(state_type, aggregate_id, endpoint).completed

    def _record_of(self, state_type: type[BaseModel], aggregate_id: str,
                   endpoint: str | None) -> AggregateRecord:
        keepers = [(name, type(handler)) for name, candidate in self._endpoints.items()
                   if endpoint in (None, name) for handler in candidate.table.handlers
                   if isinstance(handler, AggregateHandler)
                   and type(handler).state_type is state_type]
        names = sorted({name for name, _ in keepers})
        if len(names) != 1:
            raise ValueError(
                f"{len(names) or 'no'} endpoints of the scenario keep {state_type.__name__}"
                f"{' (' + ', '.join(names) + '): name one with endpoint=' if names else ''}")
        name, handler_type = keepers[0]
        storage = self._endpoints[name].storage_as(AggregateStore)
        return storage.load(handler_type.storage_name(), aggregate_id)

    # -- bookkeeping ----------------------------------------------------------------------

    @property
    def _error_queues(self) -> list[str]:
        return list(dict.fromkeys(e.error_queue for e in self._endpoints.values()))

    def _known_types(self) -> list[type[Message]]:
        return [message_type for e in self._endpoints.values() for message_type in e.registry]

    def _record(self, dispatch: Dispatch) -> None:
        self._outgoing.append(Outgoing(
            dispatch.envelope, decoded(dispatch.envelope, self._known_types()),
            dispatch.endpoint, dispatch.source, self.clock.now()))

    def _unique(self) -> Iterable[Outgoing]:
        seen: set[str] = set()
        for item in self._outgoing:
            if item.message_id not in seen:
                seen.add(item.message_id)
                yield item

    def _of(self, intent: h.Intent) -> list[Message]:
        return [item.message for item in self._unique()
                if item.intent is intent and item.message is not None]


class _Recorder(Middleware):
    """Notes every outgoing message an endpoint dispatched (innermost: only what went)."""

    def __init__(self, record: Callable[[Dispatch], None]) -> None:
        self._record = record

    def after_dispatch(self, dispatch: Dispatch, error: BaseException | None) -> None:
        if error is None:
            self._record(dispatch)


class _ScenarioRouter(Router):
    """Where a command sent from outside goes: the one endpoint of the scenario that
    handles it, else where an endpoint's routes send it."""

    def __init__(self, endpoints: Mapping[str, Endpoint]) -> None:
        super().__init__()
        self._endpoints = endpoints

    def destination_for(self, command_type: type[Message]) -> str:
        name = message_name(command_type)
        handling = [e.name for e in self._endpoints.values() if name in e.registry]
        if len(handling) > 1:
            raise RoutingError(f"{name} is handled by {', '.join(handling)}: pass "
                               "to='<endpoint name>'")
        if handling:
            return handling[0]
        for endpoint in self._endpoints.values():
            if endpoint.router.has_route(command_type):
                return endpoint.router.destination_for(command_type)
        raise RoutingError(f"no endpoint of the scenario handles or routes {name}: add one "
                           "that does, or pass to='<queue>'")

    def order_of(self, message: Message) -> tuple[str, int] | None:
        """As the endpoint of the scenario that handles it orders it (it knows its
        handlers' ordering declarations), else as its type says."""
        name = message_name(type(message))
        for endpoint in self._endpoints.values():
            if name in endpoint.registry:
                return endpoint.router.order_of(message)
        return super().order_of(message)

    def has_route(self, command_type: type[Message]) -> bool:
        try:
            self.destination_for(command_type)
        except RoutingError:
            return False
        return True
