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

A request that only sends needs no aggregate: :class:`OutboxWork`
(``with endpoint.outbox(operation_id=key) as work:``) commits what the block sends keyed by
the operation id alone, and a retried operation id is no error there (``work.duplicate``).
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
from ..storage.base import INBOX, AggregateRecord, AggregateStore
from ..storage.errors import AlreadyProcessed, StorageUnavailable
from ..transports.errors import TransportUnavailable
from .dispatching import Dispatcher
from .endpoint_context import EndpointContext

log = logging.getLogger(__name__)

StateT = TypeVar("StateT", bound=BaseModel)

#: The handler name units of work are recorded under (dedup key ``unit-of-work/<id>``).
UNIT_OF_WORK = "unit-of-work"


class _RecordedWork:
    """What both kinds of unit of work share: a bus that records what the block sends,
    the dedup key of the operation, and the dispatch of what was committed."""

    def __init__(self, context: EndpointContext, dispatcher: Dispatcher,
                 address: tuple[str, str | None], operation_id: str | None) -> None:
        """``address`` is the storage record's (type, id); id ``None``: the dedup key."""
        self.operation_id = operation_id or str(uuid.uuid4())
        self._dispatcher = dispatcher
        self._context = MessageContext(
            message_id=self.operation_id, message_type=UNIT_OF_WORK, headers={},
            handler_name=UNIT_OF_WORK, endpoint=context.name,
        )
        self._aggregate_type, self._record_id = address[0], address[1] or self.key
        self._outgoing: list[Envelope] = []
        #: Records what is sent and published; dispatched after the commit.
        self.bus = Bus(context.name, context.router,
                       dispatcher.pipeline.recorder(self._outgoing.append, self._context),
                       self._context, clock=context.clock)

    @property
    def key(self) -> str:
        """The dedup key the operation is stored under: ``unit-of-work/<operation id>``."""
        return self._context.dedup_key

    def _send(self, outgoing: tuple[Envelope, ...] | list[Envelope]) -> None:
        """Dispatch what was committed. If the broker cannot be reached the messages stay
        stored: running the operation again with the same operation id sends them (and
        the outbox does, once its grace has passed)."""
        try:
            self._dispatcher.send_committed(self._aggregate_type, self._record_id, self.key,
                                            outgoing, source="unit_of_work",
                                            endpoint=self._context.endpoint)
        except (TransportUnavailable, StorageUnavailable) as exc:
            log.warning("operation %s is committed but its messages were not all sent (%s); "
                        "run it again with the same operation id to send them",
                        self.operation_id, exc)


class UnitOfWork(_RecordedWork, Generic[StateT]):
    """One change of one aggregate outside handlers; use it as a context manager."""

    #: The storage role a unit of work uses.
    storage_roles = (AggregateStore,)

    def __init__(self, context: EndpointContext, dispatcher: Dispatcher,
                 state_type: type[StateT], aggregate: tuple[str, str], *,
                 operation_id: str | None = None,
                 new_state: Callable[[], StateT] | None = None) -> None:
        """``aggregate`` is the aggregate's (storage type name, id)."""
        super().__init__(context, dispatcher, aggregate, operation_id)
        self.aggregate_id = aggregate[1]
        self._state_type = state_type
        self._new_state = new_state or state_type
        self._storage = context.role(AggregateStore)
        self._loaded: AggregateRecord | None = None
        self._completed = False
        self.state: StateT

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
                self._storage.commit(self._loaded, key=self.key,
                                     state=self.state.model_dump(mode="json"),
                                     outgoing=self._outgoing, completed=True,
                                     **version_keyword(self._state_type))
            else:
                self._storage.commit(self._loaded, key=self.key,
                                     state=self.state.model_dump(mode="json"),
                                     outgoing=self._outgoing,
                                     **version_keyword(self._state_type))
        except AlreadyProcessed as duplicate:  # the same operation won meanwhile
            self._send(duplicate.outgoing)
            raise
        self._send(tuple(self._outgoing))

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


class OutboxWork(_RecordedWork):
    """Sends from outside handlers through the outbox, keyed only by an operation id (a
    web request's idempotency key), with no aggregate: ``endpoint.outbox(operation_id=key)``.

    On leaving the block what it sent and published is committed in one conditional write,
    as a stateless handler's entry (:data:`~idembus.storage.base.INBOX`, keyed
    ``unit-of-work/<operation id>``), then dispatched; a crash between the two leaves it to
    the outbox relay, which sends it with the same ids. The same operation id again commits
    nothing new: entering the block sends again what the first attempt stored (same ids),
    and leaving it drops what the block sent; :attr:`duplicate` tells which it was. An
    exception inside the block writes nothing.
    """

    #: The storage role an outbox operation uses.
    storage_roles = (AggregateStore,)

    def __init__(self, context: EndpointContext, dispatcher: Dispatcher, *,
                 operation_id: str) -> None:
        if not isinstance(operation_id, str) or not operation_id:
            raise ValueError(f"operation_id must be a non-empty str, got {operation_id!r}")
        super().__init__(context, dispatcher, (INBOX, None), operation_id)
        self._storage = context.role(AggregateStore)
        self._loaded: AggregateRecord | None = None
        #: True when this operation id was committed before (by an earlier attempt, or by a
        #: concurrent one that won): what it stored was sent again and this block's sends
        #: are dropped. Known on entering the block; a concurrent winner is found on leaving.
        self.duplicate = False

    def __enter__(self) -> OutboxWork:
        loaded = self._storage.load(INBOX, self._record_id, self.key)
        previous = loaded.processed.get(self.key)
        if previous is not None:
            self.duplicate = True
            self._send(previous.outgoing)
        self._loaded = loaded
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if kind is not None or self._loaded is None or self.duplicate:
            return  # the block failed, or the operation was done before: nothing is written
        try:
            self._storage.commit(self._loaded, key=self.key, state=None,
                                 outgoing=self._outgoing)
        except AlreadyProcessed as won:  # the same operation committed meanwhile
            self.duplicate = True
            self._send(won.outgoing)
            return
        self._send(tuple(self._outgoing))

    async def __aenter__(self) -> OutboxWork:
        """``async with endpoint.outbox(operation_id=key) as work:`` in an async web app:
        the same as ``with``, the storage and broker work in a thread."""
        return await asyncio.to_thread(self.__enter__)

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        """Commit and dispatch in a thread, as ``with`` does on leaving the block."""
        await asyncio.to_thread(self.__exit__, kind, error, trace)
