"""Running one handler for one message, exactly once per (handler, message id).

Load the aggregate; if the message is already recorded, return the stored outgoing
messages instead of running the handler. Otherwise run the handler on a copy, recording
what it sends, and commit state and outgoing messages in one conditional write. A lost
race reloads and runs the handler again on the fresh state (bounded, with jitter).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bus import headers as h
from bus.context import MessageContext
from bus.envelope import Envelope, parse_utc
from bus.faults import CrashPoint, FaultInjector
from bus.messages import Message
from bus.policies import ConflictPolicy
from bus.routing import Router
from bus.sending import Bus
from bus.signals import EndpointSignals
from handlers.base import AggregateHandler
from handlers.registration import HandlerBinding
from storage.base import INBOX, AggregateRecord, Storage
from storage.errors import AlreadyProcessed, ConcurrencyConflict, ConflictRetriesExhausted


@dataclass(frozen=True)
class Outcome:
    """What one handler's processing of one message left to dispatch."""

    aggregate_type: str
    aggregate_id: str
    key: str
    outgoing: tuple[Envelope, ...]
    duplicate: bool
    handler: str = ""


class HandlerInvoker:
    """Runs handler bindings against storage with deduplication and optimistic retries."""

    def __init__(
        self,
        *,
        endpoint: str,
        router: Router,
        storage: Storage,
        signals: EndpointSignals,
        faults: FaultInjector,
        conflicts: ConflictPolicy,
    ) -> None:
        self._endpoint = endpoint
        self._router = router
        self._storage = storage
        self._signals = signals
        self._faults = faults
        self._conflicts = conflicts

    def invoke(
        self, binding: HandlerBinding, message: Message, headers: Mapping[str, str]
    ) -> Outcome:
        context = MessageContext(
            message_id=headers[h.MESSAGE_ID],
            message_type=headers[h.MESSAGE_TYPE],
            headers=headers,
            handler_name=binding.handler_name,
            endpoint=self._endpoint,
        )
        key = context.dedup_key
        aggregate_type, aggregate_id = self._address(binding, message, key)
        details = {"message_id": context.message_id, "message_type": context.message_type,
                   "handler": binding.handler_name, "time_sent": headers.get(h.TIME_SENT)}
        for attempt in range(self._conflicts.attempts):
            loaded = self._storage.load(aggregate_type, aggregate_id, key)
            previous = loaded.processed.get(key)
            if previous is None:
                if attempt == 0:
                    self._notice_forgotten_window(loaded, headers, details)
                state, outgoing = self._run(binding, message, context, loaded)
                self._faults.reached(CrashPoint.BEFORE_COMMIT, context.message_id)
                try:
                    self._storage.commit(loaded, key=key, state=state, outgoing=outgoing)
                except ConcurrencyConflict:
                    self._signals.emit("conflict", attempt=attempt + 1, **details)
                    if attempt + 1 < self._conflicts.attempts:
                        self._conflicts.pause(attempt)
                    continue
                except AlreadyProcessed as duplicate:
                    stored = duplicate.outgoing
                else:
                    self._signals.emit("handled", **details)
                    return Outcome(aggregate_type, aggregate_id, key, tuple(outgoing), False,
                                   binding.handler_name)
            else:
                stored = previous.outgoing
            self._signals.emit("duplicate", **details)
            return Outcome(aggregate_type, aggregate_id, key, stored, True, binding.handler_name)
        raise ConflictRetriesExhausted(
            f"{binding.handler_name} lost {self._conflicts.attempts} optimistic races on "
            f"{aggregate_type} {aggregate_id!r} while handling {context.message_id}"
        )

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
            raise TypeError(
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
    ) -> tuple[dict[str, Any] | None, list[Envelope]]:
        outgoing: list[Envelope] = []
        handler = copy.copy(binding.handler)
        handler.bus = Bus(self._endpoint, self._router, outgoing.append, context)
        handler.context = context
        if isinstance(handler, AggregateHandler):
            if loaded.exists:
                handler.state = handler.state_type.model_validate(loaded.state)
            else:
                handler.state = handler.new_state(loaded.aggregate_id, message)
            getattr(handler, binding.method_name)(message)
            if not isinstance(handler.state, handler.state_type):
                raise TypeError(
                    f"{binding.handler_name} left self.state as {type(handler.state).__name__}"
                    f", not {handler.state_type.__name__}"
                )
            return handler.state.model_dump(mode="json"), outgoing
        getattr(handler, binding.method_name)(message)
        return None, outgoing

