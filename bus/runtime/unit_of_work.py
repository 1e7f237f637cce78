"""Changing an aggregate from outside handlers (a web request, a script) with the same
one-write guarantee handlers have::

    with sales.unit_of_work(Order, order_id, operation_id=request_key) as work:
        work.state.status = "placed"
        work.bus.publish(OrderPlaced(order_id=order_id))

On leaving the block the new state and the recorded messages are committed in one
conditional write keyed by the operation id, and only then dispatched. Give the operation
id of the request (an idempotency key) and a retried request is recognised: entering the
block raises :class:`~idembus.storage.errors.AlreadyProcessed` after sending again whatever the
first attempt stored and did not get to send. Another writer changing the aggregate meanwhile
makes the exit raise :class:`~idembus.storage.errors.ConcurrencyConflict`: nothing was written, try
again. An exception inside the block writes nothing.

In an async web app, ``async with sales.unit_of_work(...) as work:`` does the same, with the
storage and broker work in a thread so that the event loop is never blocked.

``work.complete()`` ends the aggregate (a saga) as a handler's ``complete()`` does: the exit
commits a tombstone instead of the state. A unit of work on a completed aggregate starts
it again from ``new_state``, keeping the tombstone's processed operations.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from types import TracebackType
from typing import Generic, TypeVar

from pydantic import BaseModel

from ..context import MessageContext
from ..envelope import Envelope
from ..evolution import load_state, version_keyword
from ..sending import Bus
from ..storage.base import AggregateRecord, AggregateStore
from ..storage.errors import AlreadyProcessed, StorageUnavailable
from ..transports.errors import TransportUnavailable
from .dispatching import Dispatcher
from .endpoint_context import EndpointContext

log = logging.getLogger(__name__)

StateT = TypeVar("StateT", bound=BaseModel)

#: The handler name units of work are recorded under (dedup key ``unit-of-work/<id>``).
UNIT_OF_WORK = "unit-of-work"


class UnitOfWork(Generic[StateT]):
    """One change of one aggregate outside handlers; use it as a context manager."""

    #: The storage role a unit of work uses.
    storage_roles = (AggregateStore,)

    def __init__(self, context: EndpointContext, dispatcher: Dispatcher,
                 state_type: type[StateT], aggregate: tuple[str, str], *,
                 operation_id: str | None = None,
                 new_state: Callable[[], StateT] | None = None) -> None:
        """``aggregate`` is the aggregate's (storage type name, id)."""
        aggregate_type, aggregate_id = aggregate
        endpoint = context.name
        self.aggregate_id = aggregate_id
        self.operation_id = operation_id or str(uuid.uuid4())
        self._aggregate_type = aggregate_type
        self._state_type = state_type
        self._new_state = new_state or state_type
        self._storage = context.role(AggregateStore)
        self._dispatcher = dispatcher
        self._context = MessageContext(
            message_id=self.operation_id, message_type=UNIT_OF_WORK, headers={},
            handler_name=UNIT_OF_WORK, endpoint=endpoint,
        )
        self._outgoing: list[Envelope] = []
        #: Records what is sent and published; dispatched after the commit.
        self.bus = Bus(endpoint, context.router,
                       dispatcher.pipeline.recorder(self._outgoing.append, self._context),
                       self._context, clock=context.clock)
        self._loaded: AggregateRecord | None = None
        self._completed = False
        self.state: StateT

    @property
    def key(self) -> str:
        return self._context.dedup_key

    def __enter__(self) -> UnitOfWork[StateT]:
        loaded = self._storage.load(self._aggregate_type, self.aggregate_id, self.key)
        previous = loaded.processed.get(self.key)
        if previous is not None:
            self._send(previous.outgoing)
            raise AlreadyProcessed(self.key, previous.outgoing)
        self._loaded = loaded
        self.state = (load_state(self._state_type, loaded.state or {}, loaded.state_version)
                      if loaded.live else self._new_state())
        return self

    def complete(self) -> None:
        """End the aggregate on leaving the block: a tombstone is committed instead of the
        state (see :meth:`idembus.handlers.AggregateHandler.complete`); what the block sent
        is sent."""
        self._completed = True

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if kind is not None or self._loaded is None:
            return  # the block failed: nothing is written
        try:
            if self._completed:
                self._storage.commit(self._loaded, key=self.key, state=None,
                                     outgoing=self._outgoing, completed=True)
            else:
                self._storage.commit(self._loaded, key=self.key,
                                     state=self.state.model_dump(mode="json"),
                                     outgoing=self._outgoing,
                                     **version_keyword(self._state_type))
        except AlreadyProcessed as duplicate:  # the same operation won meanwhile
            self._send(duplicate.outgoing)
            raise
        self._send(tuple(self._outgoing))

    def _send(self, outgoing: tuple[Envelope, ...] | list[Envelope]) -> None:
        """Dispatch what was committed. If the broker cannot be reached the messages stay
        stored: running the operation again with the same operation id sends them (and
        the outbox does, once its grace has passed)."""
        try:
            self._dispatcher.send_committed(self._aggregate_type, self.aggregate_id, self.key,
                                            outgoing, source="unit_of_work",
                                            endpoint=self._context.endpoint)
        except (TransportUnavailable, StorageUnavailable) as exc:
            log.warning("operation %s is committed but its messages were not all sent (%s); "
                        "run it again with the same operation id to send them",
                        self.operation_id, exc)

    async def __aenter__(self) -> UnitOfWork[StateT]:
        """``async with endpoint.unit_of_work(...) as work:`` in an async web app: the
        same as ``with``, the storage and broker work in a thread so that the app's event
        loop is never blocked. A retried operation id raises
        :class:`~idembus.storage.errors.AlreadyProcessed` here, after sending again what the
        first attempt stored."""
        return await asyncio.to_thread(self.__enter__)

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        """Commit and dispatch in a thread, as ``with`` does on leaving the block; an
        exception inside the block (a cancelled request too) writes nothing. A request
        cancelled during the commit does not stop it: the commit lands or not, and a retry
        with the same operation id finds out which."""
        await asyncio.to_thread(self.__exit__, kind, error, trace)
