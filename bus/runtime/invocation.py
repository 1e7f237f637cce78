"""Running one handler for one message, exactly once per (handler, message id).

Load the aggregate; if the message is already recorded, return the stored outgoing
messages instead of running the handler. Otherwise run the handler on a copy, recording
what it sends, and commit state and outgoing messages in one conditional write. A lost
race reloads and runs the handler again on the fresh state (bounded, with jitter).

Sagas (aggregate handlers with ``starts``): a message that finds no live saga and does not
start one goes to the handler's ``saga_not_found`` instead, and nothing is committed; a
timeout (``idembus.saga_timeout``) for a completed one is dropped. A handler that called
``complete()`` commits a tombstone instead of its state.

A handler with a time limit runs on its consumer thread's handler thread and is abandoned
(or cancelled) at its limit: :class:`~idembus.errors.TimeLimitExceeded`, nothing committed
(:mod:`idembus.runtime.recoverability.time_limits`); every handling method is watched while
it runs, for the status reports.
"""

from __future__ import annotations

import copy
import datetime
import functools
import inspect
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from .. import headers as h
from ..context import MessageContext
from ..envelope import Envelope, parse_utc, utc_now
from ..errors import EndpointBlocked, HandlerContractError, TimeLimitExceeded
from ..evolution import load_state
from ..handlers.base import AggregateHandler
from ..handlers.registration import HandlerBinding
from ..messages import Message
from ..pipeline import HandlerCall
from ..sending import Bus, RequestChannel
from ..storage.base import INBOX, AggregateRecord, AggregateStore
from ..storage.errors import (
    AlreadyProcessed,
    CommitOutcomeUnknown,
    ConcurrencyConflict,
    ConflictRetriesExhausted,
    StorageUnavailable,
)
from ..transports.base import Delivery
from .aio import run_to_completion
from .endpoint_context import EndpointContext
from .recoverability.time_limits import Running, TimeLimiter, cancelled_after
from .requests import answered_again
from .shared_transaction import SharedTransaction


@dataclass(frozen=True)
class Outcome:
    """What one handler's processing of one message left to dispatch."""

    aggregate_type: str
    aggregate_id: str
    key: str
    outgoing: tuple[Envelope, ...]
    duplicate: bool
    handler: str = ""
    #: A duplicate whose entry was committed moments ago and is not yet marked dispatched:
    #: its sending is left to the committer, or to the outbox once its grace has passed
    #: (``Endpoint(defer_fresh_redispatch=...)``).
    left_to_outbox: bool = False
    #: The message had expired (``idembus.discard_after``) and this handler had not
    #: processed it: nothing ran, nothing was stored (:mod:`idembus.expiry`).
    discarded: bool = False
    #: The handler did not run and nothing was stored: a saga's message that found no saga
    #: (``not_found``) or a completed saga's timeout (``timeout_dropped``).
    dropped: bool = False

    def __init__(self, aggregate_type: str, aggregate_id: str, key: str,
                 outgoing: tuple[Envelope, ...], duplicate: bool, handler: str = "",
                 left_to_outbox: bool = False, discarded: bool = False,
                 dropped: bool = False) -> None:
        # What the dataclass would generate, but frozen it sets field by field with
        # object.__setattr__: one update of the instance's dict does it (once per handler
        # and message).
        self.__dict__.update(aggregate_type=aggregate_type, aggregate_id=aggregate_id,
                             key=key, outgoing=outgoing, duplicate=duplicate,
                             handler=handler, left_to_outbox=left_to_outbox,
                             discarded=discarded, dropped=dropped)


class HandlerInvoker:
    """Runs handler bindings against storage with deduplication and optimistic retries."""

    #: The storage role an invoker uses: aggregates, their deduplication and commits.
    storage_roles = (AggregateStore,)

    def __init__(self, context: EndpointContext, *, defer_fresh_redispatch: float = 0.0,
                 shared: SharedTransaction | None = None,
                 requests: RequestChannel | None = None,
                 time_limits: TimeLimiter | None = None) -> None:
        self._endpoint = context.name
        #: Where handlers' ``self.bus.request`` sends and waits (the endpoint's reply queue).
        self._requests = requests
        #: Runs the handling methods within their time limits and watches them
        #: (:mod:`idembus.runtime.recoverability.time_limits`); ``None``: neither.
        self._limiter = time_limits
        #: Commits with the outgoing messages and the incoming one's removal, when the
        #: queues share the storage's database (:mod:`idembus.runtime.shared_transaction`).
        self._shared = shared
        #: The handlers' "now" (what their buses stamp and defer by).
        self._clock = context.clock
        #: Seconds during which a duplicate leaves an undispatched entry to its committer.
        self._defer_fresh = datetime.timedelta(seconds=defer_fresh_redispatch)
        self._router = context.router
        self._storage = context.role(AggregateStore)
        self._signals = context.signals
        self._conflicts = context.recoverability.conflicts
        self._pipeline = context.pipeline
        #: Whether a handling method's function is ``async def`` (behind any decorators),
        #: by function: asked once, not at every message.
        self._async_functions: dict[Any, bool] = {}

    def context_for(self, binding: HandlerBinding, headers: Mapping[str, str]) -> MessageContext:
        """What ``binding``'s handler knows of the message with ``headers``."""
        return MessageContext(
            message_id=headers[h.MESSAGE_ID],
            message_type=headers[h.MESSAGE_TYPE],
            headers=headers,
            handler_name=binding.handler_name,
            endpoint=self._endpoint,
        )

    def invoke(
        self, binding: HandlerBinding, call: HandlerCall, *,
        commit_may_have_landed: bool = False, expired: bool = False,
        settle: Delivery | None = None,
    ) -> Outcome:
        """Run the binding's handler on ``call.message`` once per (handler, message id),
        the commit inside the pipeline's ``commit`` stage; sets ``call.duplicate`` and
        ``call.outgoing``.

        ``commit_may_have_landed``: an earlier attempt of this very delivery lost the
        database during its commit (:class:`~idembus.storage.errors.CommitOutcomeUnknown`). Finding
        the message recorded then means that commit was applied: it counts as handled, not
        as a duplicate, and what it stored is dispatched without a ``redispatched``.

        ``expired``: the message was received after its ``idembus.discard_after``. Found
        recorded, it is a duplicate as ever (what was stored is sent again); otherwise the
        handler does not run and the outcome says ``discarded``.

        ``settle``: the delivery, when this is its last handler; with a shared transaction
        its removal is part of the commit, and the outgoing messages go out with it (the
        outcome then has nothing left to dispatch).
        """
        context, message, headers = call.context, call.message, call.context.headers
        key = context.dedup_key
        aggregate_type, aggregate_id = self._address(binding, message, key)
        details = {"message_id": context.message_id, "message_type": context.message_type,
                   "handler": context.handler_name, "time_sent": headers.get(h.TIME_SENT)}
        for attempt in range(self._conflicts.attempts):
            loaded = self._storage.load(aggregate_type, aggregate_id, key)
            previous = loaded.processed.get(key)
            committed_at: datetime.datetime | None  # of the entry a duplicate found
            if previous is None:
                if expired:
                    return Outcome(aggregate_type, aggregate_id, key, (), False,
                                   context.handler_name, discarded=True)
                if attempt == 0 and self._storage.processed_window is not None:
                    # (a storage keeping every entry, PostgreSQL's, forgets none)
                    self._notice_forgotten_window(loaded, headers, details)
                absent = _without_saga(binding, message, headers, loaded)
                if absent is not None:
                    if absent == NOT_FOUND:
                        self._saga_not_found(binding, message, context, loaded)
                    self._signals.emit(absent, **details)
                    return Outcome(aggregate_type, aggregate_id, key, (), False,
                                   context.handler_name, dropped=True)
                state, outgoing, completed = self._run(binding, message, context, loaded)
                call.outgoing = outgoing
                version = None if state is None else binding.state_version
                committer: Callable[..., bool | None] = (
                    self._storage.commit if self._shared is None
                    else functools.partial(self._shared.commit, settle=settle))
                commit = _committing(committer, loaded, key, state, outgoing, completed,
                                     version, context.message_type)
                pipeline = self._pipeline
                try:  # the commit stage, if any middleware hooks it
                    sent = pipeline.commit(call, commit) if pipeline.hooks_commit else commit()
                except StorageUnavailable as outage:
                    if isinstance(outage, EndpointBlocked | CommitOutcomeUnknown):
                        raise
                    raise CommitOutcomeUnknown(str(outage)) from outage
                except ConcurrencyConflict:
                    self._signals.emit("conflict", attempt=attempt + 1, **details)
                    if attempt + 1 < self._conflicts.attempts:
                        self._conflicts.pause(attempt)
                    continue
                except AlreadyProcessed as duplicate:
                    # Committed between our load and our commit: moments ago.
                    stored, committed_at = duplicate.outgoing, utc_now()
                else:
                    self._signals.emit("handled", **details)
                    return Outcome(aggregate_type, aggregate_id, key,
                                   () if sent is True else tuple(outgoing), False,
                                   context.handler_name)
            else:
                stored = previous.outgoing
                committed_at = None if previous.dispatched else previous.at
            stored = answered_again(stored, headers)  # a request sent again: its reply
            call.outgoing = stored
            if commit_may_have_landed:  # our own commit, whose reply the outage swallowed
                self._signals.emit("handled", **details)
                return Outcome(aggregate_type, aggregate_id, key, stored, False,
                               context.handler_name)
            call.duplicate = True
            self._signals.emit("duplicate", **details)
            return Outcome(aggregate_type, aggregate_id, key, stored, True, context.handler_name,
                           left_to_outbox=self._is_fresh(stored, committed_at))
        raise ConflictRetriesExhausted(
            f"{context.handler_name} lost {self._conflicts.attempts} optimistic races on "
            f"{aggregate_type} {aggregate_id!r} while handling {context.message_id}"
        )

    def _is_fresh(self, stored: tuple[Envelope, ...],
                  committed_at: datetime.datetime | None) -> bool:
        """Whether a duplicate leaves ``stored`` (undispatched, committed at
        ``committed_at``) to its committer and the outbox instead of re-sending it."""
        return (bool(stored) and committed_at is not None and bool(self._defer_fresh)
                and utc_now() - committed_at < self._defer_fresh)

    def _notice_forgotten_window(
        self, loaded: AggregateRecord, headers: Mapping[str, str], details: Mapping[str, Any]
    ) -> None:
        """Count messages older than everything the aggregate still remembers: had one of
        them been processed before, its entry is gone and it takes effect again."""
        window_start = loaded.window_start(self._storage.processed_window)
        if window_start is None:
            return
        sent = parse_utc(headers.get(h.TIME_SENT))
        if sent is not None and sent < window_start:
            self._signals.emit("outside_window", **details)

    @staticmethod
    def _address(binding: HandlerBinding, message: Message, key: str) -> tuple[str, str]:
        handler = binding.handler
        if not isinstance(handler, AggregateHandler):
            return INBOX, key
        aggregate_id = handler.aggregate_id(message)
        if isinstance(aggregate_id, int) and not isinstance(aggregate_id, bool):
            aggregate_id = str(aggregate_id)
        if not isinstance(aggregate_id, str) or not aggregate_id:
            raise HandlerContractError(
                f"{binding.handler_name}.aggregate_id() must return a non-empty str, "
                f"got {aggregate_id!r}"
            )
        return type(handler).storage_name(), aggregate_id

    def _run(
        self,
        binding: HandlerBinding,
        message: Message,
        context: MessageContext,
        loaded: AggregateRecord,
    ) -> tuple[dict[str, Any] | None, list[Envelope], bool]:
        """Run the handling method on a copy: the state it left (``None`` for stateless
        handlers, and for completed aggregates that keep no final state), what it sent,
        whether it completed."""
        outgoing: list[Envelope] = []
        limiter = self._limiter
        limited = limiter is not None and limiter.limits.get(
            type(binding.handler), limiter.policy.default) is not None
        sink = _Sink(outgoing, binding.handler_name) if limited else None
        record = sink or outgoing.append
        pipeline = self._pipeline  # middleware is not added while messages are processed
        handler = self._copy(binding, context, pipeline.recorder(record, context)
                             if pipeline.hooks_outgoing else record, loaded)
        try:
            if isinstance(handler, AggregateHandler):
                if loaded.live:
                    handler.state = load_state(handler.state_type, loaded.state or {},
                                               loaded.state_version)
                else:  # new, or a new start on a tombstone
                    handler.state = handler.new_state(loaded.aggregate_id, message)
                self._call(handler, binding, message)
                if handler._idembus_completed:
                    final = (handler.state.model_dump(mode="json")
                             if handler.keep_final_state and isinstance(handler.state, BaseModel)
                             else None)
                    return final, outgoing, True
                if not isinstance(handler.state, handler.state_type):
                    raise HandlerContractError(
                        f"{binding.handler_name} left self.state as "
                        f"{type(handler.state).__name__}, not {handler.state_type.__name__}"
                    )
                return handler.state.model_dump(mode="json"), outgoing, False
            self._call(handler, binding, message)
            return None, outgoing, False
        finally:
            if sink is not None:  # an abandoned method's later sends raise in its thread
                sink.closed = True

    def _copy(self, binding: HandlerBinding, context: MessageContext,
              emit: Callable[[Envelope], None], loaded: AggregateRecord) -> Any:
        """The handler object for one message: a shallow copy with its bus and context."""
        handler = _shallow_copy(binding.handler)
        handler.bus = Bus(self._endpoint, self._router, emit, context, clock=self._clock,
                          requests=self._requests)
        handler.context = context
        if isinstance(handler, AggregateHandler):
            handler._idembus_aggregate = (loaded.aggregate_type, loaded.aggregate_id)
        return handler

    def _saga_not_found(self, binding: HandlerBinding, message: Message,
                        context: MessageContext, loaded: AggregateRecord) -> None:
        """Run the handler's ``saga_not_found``; what it raises fails the message."""
        def refuse(envelope: Envelope) -> None:
            raise HandlerContractError(
                f"{binding.handler_name}.saga_not_found tried to send {envelope.message_type}:"
                " nothing is committed for a message that found no saga, so it cannot send, "
                "publish or reply; raise idembus.RejectMessage(reason) to put the message in "
                "the error queue, or handle its type in a Handler of its own")

        self._call(self._copy(binding, context, refuse, loaded), binding, message,
                   method_name="saga_not_found")

    def _call(self, handler: Any, binding: HandlerBinding, message: Message,
              method_name: str | None = None) -> None:
        """Run the handling method (or ``method_name``); an ``async def`` one runs to
        completion on the consumer thread's event loop (:mod:`idembus.runtime.aio`) before anything
        is committed. A method that returns something has misunderstood the contract
        (handlers record what they send through ``self.bus``), and whatever it meant by the
        value would be lost: fail the message instead of committing."""
        method_name = method_name or binding.method_name
        method = getattr(handler, method_name)
        limiter = self._limiter
        limit = None if limiter is None else limiter.limits.get(type(handler),
                                                                limiter.policy.default)
        if limit is not None:
            returned = self._call_limited(handler, binding, method, message, limit)
        elif limiter is None:
            returned = method(message)
            if returned is not None and inspect.iscoroutine(returned) and self._is_async(
                    method):
                returned = run_to_completion(returned)
        else:  # watched while it runs (idembus status shows it if it runs long), no limit
            key = id(handler)
            limiter.running[key] = (binding.handler_name, handler.context, time.monotonic())
            try:
                returned = method(message)
                if returned is not None and inspect.iscoroutine(returned) and self._is_async(
                        method):
                    returned = run_to_completion(returned)
            finally:
                del limiter.running[key]
        if returned is None:
            return
        if inspect.iscoroutine(returned):
            returned.close()  # never started: closing it keeps "never awaited" away
        raise HandlerContractError(
            f"{binding.handler_name}.{method_name} returned {_shown(returned)}; handling "
            "methods return None and send, publish or reply through self.bus"
        )


    def _call_limited(self, handler: Any, binding: HandlerBinding, method: Any,
                      message: Message, limit: float) -> Any:
        """``method(message)`` on the consumer thread's handler thread, abandoned after
        ``limit`` seconds (an ``async def`` cancelled then, and abandoned after the grace)."""
        limiter = self._limiter
        assert limiter is not None
        context: MessageContext = handler.context
        running = Running(binding.handler_name, context.message_type, context.message_id,
                          limit)
        is_async = self._is_async(method)

        def call() -> Any:
            returned = method(message)
            if inspect.iscoroutine(returned) and is_async:
                returned = run_to_completion(cancelled_after(returned, limit, running))
            return returned

        return limiter.run(running, call,
                           patience=limit + limiter.policy.grace if is_async else limit)

    def _is_async(self, method: Any) -> bool:
        """As registration judges it: an ``async def`` behind any decorators (a plain
        ``def`` that returns a coroutine is not run)."""
        function = getattr(method, "__func__", method)
        try:
            known = self._async_functions.get(function)
        except TypeError:  # an unhashable callable: judged every time
            return inspect.iscoroutinefunction(inspect.unwrap(function))
        if known is None:
            known = inspect.iscoroutinefunction(inspect.unwrap(function))
            self._async_functions[function] = known
        return known


#: Handler class -> whether ``copy.copy`` of its objects is a new object with the same
#: ``__dict__`` (no ``__copy__``, ``__reduce__``, ``__getstate__``, ``__setstate__``,
#: ``__new__`` or non-empty ``__slots__`` anywhere): such objects are copied without
#: ``copy``'s reduce protocol.
_PLAIN_COPY: dict[type, bool] = {}


def _shallow_copy(handler: Any) -> Any:
    """``copy.copy(handler)``, the short way for the usual handler class."""
    cls = type(handler)
    plain = _PLAIN_COPY.get(cls)
    if plain is None:
        root: Any = object  # its slots, as a class's methods are compared with
        plain = _PLAIN_COPY[cls] = (
            not hasattr(cls, "__copy__") and not hasattr(cls, "__setstate__")
            and all(vars(base).get("__slots__", ()) == () for base in cls.__mro__)
            and all(getattr(cls, name, None) is getattr(root, name, None)
                    for name in ("__new__", "__reduce_ex__", "__reduce__", "__getstate__"))
            and hasattr(handler, "__dict__"))
    if not plain:
        return copy.copy(handler)
    twin = object.__new__(cls)
    twin.__dict__.update(handler.__dict__)
    return twin


#: :func:`_without_saga`'s answers, which are also the names of their signals.
NOT_FOUND = "not_found"
TIMEOUT_DROPPED = "timeout_dropped"


def _without_saga(binding: HandlerBinding, message: Message, headers: Mapping[str, str],
                  loaded: AggregateRecord) -> str | None:
    """Why the handling method does not run, if it does not: :data:`TIMEOUT_DROPPED` for
    this aggregate's own timeout finding it completed (or, for a saga, gone);
    :data:`NOT_FOUND` for a saga's message that finds no live saga and does not start one.
    ``None``: run it (a live aggregate, a starting message, or any message of an aggregate
    handler without ``starts``)."""
    handler = binding.handler
    if not isinstance(handler, AggregateHandler) or loaded.live:
        return None
    starts = type(handler).starts
    own_timeout = headers.get(h.SAGA_TIMEOUT) == f"{loaded.aggregate_type}/{loaded.aggregate_id}"
    if own_timeout and (loaded.completed or starts is not None):
        return TIMEOUT_DROPPED
    if starts is None or isinstance(message, starts):
        return None
    return NOT_FOUND


def _committing(committer: Callable[..., bool | None], loaded: AggregateRecord, key: str,
                state: dict[str, Any] | None, outgoing: list[Envelope], completed: bool,
                version: int | None, message_type: str) -> Callable[[], bool | None]:
    """The commit stage's body: ``committer`` with these, in a closure (a
    ``functools.partial`` with keywords merges them into a new dict at its call)."""
    return lambda: committer(loaded, key=key, state=state, outgoing=outgoing,
                             completed=completed, state_version=version,
                             message_type=message_type)


class _Sink:
    """Where a time-limited handler's bus records what it sends: refused once the
    handler's run is over, so that a method abandoned at its time limit, still running in
    its thread, learns that nothing it sends counts."""

    def __init__(self, outgoing: list[Envelope], handler: str) -> None:
        self._outgoing = outgoing
        self._handler = handler
        self.closed = False

    def __call__(self, envelope: Envelope) -> None:
        if self.closed:
            raise TimeLimitExceeded(
                f"{self._handler} was abandoned at its time limit: it cannot send "
                f"{envelope.message_type} any more (nothing it does now is committed)")
        self._outgoing.append(envelope)


def _shown(value: object) -> str:
    """A value in an error message: its type, and its repr when short."""
    text = repr(value)
    return f"a {type(value).__name__}" if len(text) > 80 else f"{text} ({type(value).__name__})"

