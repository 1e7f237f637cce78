"""Helpers for testing handlers and for running endpoints inside one process.

``handle(handler, message)`` runs one handler on one message through the real
invocation path (deduplication and commit included) on in-memory storage, without a
broker, and returns what it sent, published and replied, and the state it left::

    result = handle(OrderHandler, PlaceOrder(order_id="o-1"))
    assert result.published == [OrderPlaced(order_id="o-1")]
    assert result.state == Order(status="placed")

For a saga, ``state=`` is the live saga the message finds (without it, none): ``completed``
tells whether the handler completed it (``state`` is then ``None``), ``not_found`` whether
the message went to ``saga_not_found``.

An ``async def`` handling method runs to completion as a consumer thread runs it, on an
event loop of its own (:mod:`idembus.runtime.aio`), closed when ``handle`` returns. ``handle`` is
synchronous: called inside a running loop it runs the method in a helper thread and holds
that loop up meanwhile; an async test awaits ``handle_async`` instead, which holds up
nothing.

:class:`Scenario` runs several endpoints' handlers together, through the endpoints' own
processor, on in-memory parts and a :class:`FakeClock`: send a message, advance the clock,
and see the deferred messages and timeouts that came due handled
(:mod:`idembus.testing.scenario`)::

    scenario = Scenario(handlers=[OrderPolicy])
    scenario.send(PlaceOrder(order_id="42"))
    scenario.advance(hours=25)
    assert scenario.state(Order, "42").status == "cancelled"
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from .. import headers as h
from ..clock import SystemClock
from ..envelope import Envelope
from ..evolution import version_keyword
from ..handlers.base import AggregateHandler, Handler
from ..handlers.registration import HandlerTable
from ..messages import Command, Message, message_name
from ..pipeline import HandlerCall, IncomingMessage
from ..policies import ConflictPolicy
from ..routing import Router
from ..runtime.aio import closing_thread_loop
from ..runtime.endpoint import Endpoint
from ..runtime.endpoint_context import EndpointContext
from ..runtime.invocation import HandlerInvoker
from ..runtime.recoverability.policy import Recoverability
from ..signals import EndpointSignals
from ..storage.base import AggregateRecord
from ..storage.memory import MemoryStorage
from .clock import FakeClock
from .decoding import ByIntent, decoded
from .scenario import FailedMessage, Outgoing, Scenario, ScenarioError
from .transport import ScenarioTransport

__all__ = [
    "FailedMessage",
    "Deferral",
    "FakeClock",
    "HandlerResult",
    "Outgoing",
    "Scenario",
    "ScenarioError",
    "handle",
    "handle_async",
    "wait_until_idle",
]

#: Consecutive idle observations required before endpoints count as quiescent.
_SETTLED_ROUNDS = 3
_SEED_KEY = "bus.testing/initial-state"


@dataclass(frozen=True)
class Deferral:
    """A message a handler run deferred: what, when it is due, where it goes, and whether it
    is a saga's timeout (:meth:`~idembus.handlers.AggregateHandler.request_timeout`)."""

    message: Message
    deliver_at: datetime.datetime
    destination: str | None
    timeout: bool


@dataclass(frozen=True)
class HandlerResult(ByIntent):
    """What one handler run left behind: ``sent`` (the commands sent now), ``deferred``
    (those held back until later, saga timeouts included; ``deferrals`` tells when and
    where), ``published``, ``replied``, and the state."""

    envelopes: tuple[Envelope, ...]
    state: BaseModel | None
    #: The handler completed the aggregate (a saga): ``state`` is ``None``.
    completed: bool = False
    #: The message found no saga and does not start one: ``saga_not_found`` ran.
    not_found: bool = False

    def _of(self, intent: h.Intent) -> list[Message]:
        return [decoded(envelope, strict=True) for envelope in self.envelopes
                if envelope.intent is intent and envelope.deliver_at is None]

    @property
    def sent(self) -> list[Message]:
        """The commands sent now (those deferred, timeouts too, are in :attr:`deferred`)."""
        return self._of(h.Intent.SEND)

    @property
    def deferred(self) -> list[Message]:
        """The messages deferred (``bus.defer``, ``deliver_at=``, ``request_timeout``), in
        the order they were; :attr:`deferrals` adds when and where."""
        return [deferral.message for deferral in self.deferrals]

    @property
    def deferrals(self) -> list[Deferral]:
        """The messages deferred, with when they are due, where they go and whether each
        is a saga's timeout."""
        return [Deferral(decoded(envelope, strict=True), envelope.deliver_at,
                         envelope.destination, h.SAGA_TIMEOUT in envelope.headers)
                for envelope in self.envelopes if envelope.deliver_at is not None]


def handle(
    handler: Handler | type[Handler],
    message: Message,
    *,
    state: BaseModel | None = None,
    headers: Mapping[str, str] | None = None,
    routes: Mapping[type[Message], str] | None = None,
    endpoint: str = "test",
) -> HandlerResult:
    """Run ``handler`` on ``message`` without a broker; see the module docstring.

    ``state`` is the aggregate's state before the message (default: a new aggregate);
    ``headers`` are added to the incoming message's; commands without a route in
    ``routes`` go to a queue named after their type.
    """
    table = HandlerTable([handler])
    bindings = table.bindings_for(type(message))
    if not bindings:
        raise ValueError(f"{handler!r} does not handle {message_name(message)}")
    (binding,) = bindings
    storage = MemoryStorage()
    address = None
    if isinstance(binding.handler, AggregateHandler):
        address = (type(binding.handler).storage_name(), binding.handler.aggregate_id(message))
        if state is not None:
            storage.commit(AggregateRecord(*address), key=_SEED_KEY,
                           state=state.model_dump(mode="json"), outgoing=(),
                           **version_keyword(type(state)))
    elif state is not None:
        raise ValueError("state is only for aggregate handlers")
    signals = EndpointSignals(endpoint)
    not_found: list[Mapping[str, Any]] = []
    signals.not_found.connect(lambda sender, **details: not_found.append(details), weak=False)
    router = _TestRouter({**{t: endpoint for t in table.message_types
                             if issubclass(t, Command)}, **(routes or {})})
    context = dataclasses.replace(
        EndpointContext.standalone(endpoint, ScenarioTransport(SystemClock()), storage),
        signals=signals,
        router=router, table=table,
        recoverability=Recoverability(conflicts=ConflictPolicy(attempts=1)))
    invoker = HandlerInvoker(context)
    incoming = {h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: message_name(message),
                h.REPLY_TO: "test-sender", **(headers or {})}
    call = HandlerCall(IncomingMessage(endpoint, endpoint, incoming, message),
                       invoker.context_for(binding, incoming), message, attempt=1)
    with closing_thread_loop():  # an async method's loop lives for this call only
        outcome = invoker.invoke(binding, call)
    final_state = None
    record = storage.load(*address) if address is not None else None
    if record is not None and record.live and isinstance(binding.handler, AggregateHandler):
        final_state = binding.handler.state_type.model_validate(record.state)
    return HandlerResult(outcome.outgoing, final_state,
                         completed=record is not None and record.completed,
                         not_found=bool(not_found))


async def handle_async(
    handler: Handler | type[Handler],
    message: Message,
    *,
    state: BaseModel | None = None,
    headers: Mapping[str, str] | None = None,
    routes: Mapping[type[Message], str] | None = None,
    endpoint: str = "test",
) -> HandlerResult:
    """:func:`handle` for async tests: ``result = await handle_async(handler, message)``.

    The handler runs in a worker thread (``asyncio.to_thread``), an ``async def`` method on
    that thread's own loop as in a consumer thread, so the calling loop goes on meanwhile.
    Like a consumer thread's loop, it is not the caller's: hand the handler no object bound
    to the caller's loop."""
    return await asyncio.to_thread(handle, handler, message, state=state, headers=headers,
                                   routes=routes, endpoint=endpoint)


class _TestRouter(Router):
    def destination_for(self, command_type: type[Message]) -> str:
        if self.has_route(command_type):
            return super().destination_for(command_type)
        return message_name(command_type)


def wait_until_idle(endpoints: Iterable[Endpoint], *, timeout: float = 30.0,
                    interval: float = 0.02) -> None:
    """Return once every endpoint's queue is empty and nothing is being processed,
    observed several times in a row (a message one endpoint is sending to another is
    seen on the next look). Raises ``TimeoutError`` after ``timeout`` seconds.

    A heuristic for tests and samples: a broker does not count messages it already pushed
    to a consumer that has not started on them yet, so wait for a deciding signal first
    where a test must be sure."""
    chosen = list(endpoints)
    deadline = time.monotonic() + timeout
    settled = 0
    while settled < _SETTLED_ROUNDS:
        if time.monotonic() > deadline:
            busy = [e.name for e in chosen if not e.is_idle()]
            raise TimeoutError(f"endpoints still busy after {timeout}s: {busy}")
        if all(endpoint.is_idle() for endpoint in chosen):
            settled += 1
        else:
            settled = 0
        chosen[0].wait_for_activity(interval)
