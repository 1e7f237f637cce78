"""Per-endpoint blinker signals: observation only, never control flow.

Signals are how anything watches an endpoint: its counters, its message log, the audit
trail, the handling-time buckets and the OpenTelemetry metrics all subscribe to them (the
middleware of :mod:`idembus.pipeline` is for what changes or wraps the work: tracing,
propagated headers, your own policies). A signal nobody receives costs a call and a look-up.

Every signal is sent with the endpoint name as sender and keyword arguments
``message_id``, ``message_type`` and, where a handler is involved, ``handler`` and
``time_sent`` (the incoming message's header).
The ``schedule_*`` signals carry the id and type of the occurrence's message (``None`` for
a type a message function did not get to build), ``schedule`` and ``occurrence``.
``failed``, ``retried`` and ``dead_lettered`` add ``error``; ``dispatched`` adds ``envelope``;
``discarded`` adds ``discard_after`` (the header); ``settled`` adds ``outcome`` (as
:attr:`idembus.pipeline.IncomingMessage.outcome` has it, ``None``: interrupted), ``effects``
(:attr:`idembus.pipeline.IncomingMessage.effects`), ``seconds`` (from the arrival of the
delivery, measured once for every observer) and ``deliver_at`` (the header, if delayed).
Receivers that raise are the receiver's bug: the endpoint logs and ignores them.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Coroutine, Hashable
from typing import Any

from blinker import ANY, Signal
from blinker.base import ANY_ID

log = logging.getLogger(__name__)

SIGNAL_NAMES = (
    "received",       # a delivery arrived
    "handled",        # a handler committed its effects for the first time
    "duplicate",      # a handler found the message already processed
    "redispatched",   # a duplicate's stored outgoing messages were sent again
    "left_to_outbox", # a duplicate left a fresh, undispatched entry to its committer
    "dispatched",     # one outgoing message reached the broker
    "conflict",       # a commit lost an optimistic race and will be retried
    "failed",         # a handler attempt raised
    "retried",        # a failed handler is tried again (kind: "immediate" or "delayed")
    "dead_lettered",  # the message went to the error queue
    "outside_window", # a message sent before the oldest one its aggregate still remembers
    "paused",         # the circuit breaker holds a consumer back (seconds)
    "skipped",        # middleware or a handler raised SkipMessage (reason; handler if one)
    "postponed",      # middleware or a handler raised RetryLater (delay, attempt, reason)
    "schedule_fired",   # an occurrence of a schedule was committed to be sent (schedule,
                        # occurrence)
    "schedule_skipped", # an occurrence missed while no scheduler ran was skipped (schedule,
                        # occurrence)
    "schedule_failed",  # an occurrence's message could not be built or stored (schedule,
                        # occurrence, error)
    "discarded",      # a handler did not run: the message came after its discard_after
    "not_found",      # a saga's message found no saga and does not start one (acknowledged)
    "timeout_dropped",  # a saga's timeout arrived once the saga was completed (acknowledged)
    "unrouted",       # a published event the broker reported no queue took (envelope)
    "unordered",      # a message of an ordered type arrived without its key (handled)
    "settled",        # a received delivery is done with, just before its ack (outcome,
                      # effects, seconds, time_sent, deliver_at)
)


class _CachedSignal(Signal):
    """A blinker signal that remembers, per sender, which receivers to call: what
    ``receivers_for`` works out at every send (a set union, a generator) is worked out
    again only after a receiver connects or disconnects."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        #: Bumped by every change of the receivers; a cached list of an older version is
        #: worked out again.
        self._version = 0
        self._cached: dict[Hashable, tuple[int, list[Any], tuple[Tally, ...]]] = {}

    def connect(self, receiver: Any, sender: Any = ANY, weak: bool = True) -> Any:
        try:
            return super().connect(receiver, sender, weak)
        finally:
            self._version += 1

    def _disconnect(self, receiver_id: Hashable, sender_id: Hashable) -> None:
        try:
            super()._disconnect(receiver_id, sender_id)
        finally:
            self._version += 1

    def _clear_state(self) -> None:
        try:
            super()._clear_state()
        finally:
            self._version += 1

    def references_for(self, sender: str) -> list[tuple[Any, Any]]:
        """The receivers for ``sender`` (a string: its own id), in ``receivers_for``'s
        order, as pairs ready to call: ``(None, receiver)`` for one held strongly,
        ``(reference, None)`` for a weakly held callable (call what the reference gives),
        ``(reference, function)`` for a weakly held bound method (``function`` called with
        what the reference to its instance gives: no ``WeakMethod`` call and no bound
        method made per send). The function of a method is held strongly; its instance
        stays weak, and when it is collected blinker disconnects it, which works the pairs
        out again."""
        return self._prepared(sender)[1]

    def _prepared(self, sender: str) -> tuple[int, list[tuple[Any, Any]], tuple[Tally, ...]]:
        """``(version, pairs, tallies)`` for ``sender``, from the cache while the receivers
        are unchanged: the pairs of :meth:`references_for` but for the strongly held
        :class:`Tally` receivers, which :meth:`EndpointSignals.emit` counts itself."""
        cached = self._cached.get(sender)
        version = self._version
        if cached is not None and cached[0] == version:
            return cached
        ids = self._by_sender[ANY_ID] | self._by_sender.get(sender, set())
        references = []
        tallies = []
        for each in ids:
            stored = self.receivers.get(each)
            if type(stored) is Tally:
                tallies.append(stored)
                continue
            pair = None if stored is None else _callable(stored)
            if pair is not None:
                references.append(pair)
        prepared = self._cached[sender] = (version, references, tuple(tallies))
        return prepared


class Tally:
    """A receiver that counts the sends of one signal, as ``counts[name] += 1`` under
    ``lock``, and does nothing else: the endpoint's counters
    (:mod:`idembus.runtime.counters`). Connected strongly (``weak=False``), it is counted
    by :meth:`EndpointSignals.emit` without a call (a call with the details as keyword
    arguments costs more than the count); a plain ``send`` calls it."""

    __slots__ = ("counts", "lock", "name", "__weakref__")

    def __init__(self, counts: dict[str, int], lock: Any, name: str) -> None:
        self.counts = counts
        self.lock = lock
        self.name = name

    def __call__(self, sender: Any, **details: Any) -> None:
        self.add()

    def add(self) -> None:
        """Count one send."""
        lock = self.lock
        lock.acquire()
        try:
            self.counts[self.name] += 1
        finally:
            lock.release()


def _callable(stored: Any) -> tuple[Any, Any] | None:
    """A receiver as blinker stores it (itself, a ``weakref.ref`` or a ``WeakMethod``) as
    the pair :meth:`_CachedSignal.references_for` describes (``None``: a method whose
    instance was collected, which blinker disconnects)."""
    if isinstance(stored, weakref.WeakMethod):
        method = stored()
        if method is None:
            return None
        return weakref.ref(method.__self__), method.__func__
    if isinstance(stored, weakref.ref):
        return stored, None
    return None, stored


class EndpointSignals:
    """The signals of one endpoint; ``endpoint.signals.handled.connect(receiver)``."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        for name in SIGNAL_NAMES:
            setattr(self, name, _CachedSignal(name))

    received: Signal
    handled: Signal
    duplicate: Signal
    redispatched: Signal
    left_to_outbox: Signal
    dispatched: Signal
    conflict: Signal
    failed: Signal
    retried: Signal
    dead_lettered: Signal
    outside_window: Signal
    paused: Signal
    skipped: Signal
    postponed: Signal
    schedule_fired: Signal
    schedule_skipped: Signal
    schedule_failed: Signal
    discarded: Signal
    not_found: Signal
    timeout_dropped: Signal
    unrouted: Signal
    unordered: Signal
    settled: Signal

    def emit(self, name: str, **details: Any) -> None:
        """Send signal ``name``; a receiver's exception is logged, never propagated, and
        the other receivers still run.

        Calls the receivers blinker's ``receivers_for`` would yield itself, as
        ``Signal.send`` does without its per-receiver coroutine check and result list
        (and remembered between changes of the receivers): a signal the
        endpoint's own observers always receive (``settled``) is sent for every delivery.
        A coroutine function cannot receive a signal (it would never run)."""
        signal: _CachedSignal = getattr(self, name)
        if not signal.receivers:
            return
        endpoint = self.endpoint
        cached = signal._cached.get(endpoint)  # _prepared's cache, looked at here
        if cached is None or cached[0] != signal._version:
            cached = signal._prepared(endpoint)
        for tally in cached[2]:  # counted here: Tally.add without its call
            lock = tally.lock
            lock.acquire()
            try:
                tally.counts[tally.name] += 1
            finally:
                lock.release()
        for reference, function in cached[1]:
            try:
                if reference is None:
                    result = function(endpoint, **details)
                else:
                    receiver = reference()
                    if receiver is None:  # collected: blinker disconnects it
                        continue
                    result = (receiver(endpoint, **details) if function is None
                              else function(receiver, endpoint, **details))
            except Exception:
                log.exception("a receiver of the %r signal of %s raised", name, endpoint)
                continue
            if result is not None and isinstance(result, Coroutine):
                result.close()
                log.error("a receiver of the %r signal of %s is a coroutine function; "
                          "signals are sent from the consumer's thread and call receivers "
                          "directly", name, self.endpoint)
