"""One client's event stream: replication if asked for, catch-up from the journal, then live.

A stream is planned before the response starts (:func:`plan`: a resume point the journal
cannot serve is a 400, one it no longer holds becomes full replication), then written by
:class:`ClientStream`:

1. **replication** (``Last-Event-ID: 0``, a timestamp the journal no longer reaches, or a
   position older than its retention): the journal's newest position ``P`` is read first;
   then a ``reset`` event (with the reason), the state of every aggregate of the requested
   types, and a ``live`` event with id ``P``. Events appended while the states were read
   have positions after ``P`` and follow the ``live`` event: none is lost in the switch
   (one may describe a change the state already showed);
2. **catch-up**: journal entries after the resume position, read from the storage in pages
   until the client is nearly current; then it subscribes to the hub and reads the rest of
   the storage up to the hub's position;
3. **live**: entries the hub offers, with a comment every ``heartbeat`` seconds when idle.

Every event with an ``id`` is a journal position, strictly increasing within a stream, so a
client that reconnects with the last id it saw gets each event once.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from ..errors import BadStreamRequest
from ..storage.base import AggregateRecord, JournalEntry, Storage
from . import sse
from .hub import JournalHub, Subscription
from .request import Filters, Mode, Resume

#: Journal entries read from the storage per page while catching up.
PAGE = 500

#: Seconds between looks, while a live stream is idle, for a client that hung up.
LOOK_FOR_HANGUPS = 1.0

Write = Callable[[bytes], None]


class Start(enum.Enum):
    LIVE = "live"
    CATCH_UP = "catch up"
    REPLICATE = "replicate"


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a stream starts: ``position`` to catch up after, or replication with ``reason``
    (of the aggregates changed since ``since``, or all)."""

    start: Start
    position: int = 0
    since: datetime.datetime | None = None
    reason: str = ""


def plan(resume: Resume, storage: Storage) -> Plan:
    """Decide how to serve ``resume``; :class:`~bus.errors.BadStreamRequest` if it cannot be."""
    if resume.mode is Mode.LIVE:
        return Plan(Start.LIVE)
    if resume.mode is Mode.REPLICATE:
        return Plan(Start.REPLICATE, reason="full replication asked for (Last-Event-ID 0)")
    if resume.mode is Mode.SINCE:
        assert resume.since is not None
        position = storage.journal_position_at(resume.since)
        if position is not None:
            return Plan(Start.CATCH_UP, position=position)
        return Plan(Start.REPLICATE, since=resume.since,
                    reason=f"the journal no longer reaches back to {resume.since.isoformat()}: "
                           "replicating the aggregates changed since then")
    bounds = storage.journal_bounds()
    if resume.position > bounds.newest:
        raise BadStreamRequest(
            f"Last-Event-ID {resume.position} is ahead of the journal, whose newest position "
            f"is {bounds.newest}: it comes from another journal; reconnect with 0 for full "
            "replication")
    if bounds.oldest is not None and resume.position < bounds.oldest - 1:
        return Plan(Start.REPLICATE, reason=(
            f"Last-Event-ID {resume.position} is older than the journal's retention (it "
            f"starts at {bounds.oldest}): replicating the current state"))
    return Plan(Start.CATCH_UP, position=resume.position)


@dataclasses.dataclass
class StreamCounters:
    """What the gateway's streams did (``GET /status``); updated under ``lock``."""

    clients: int = 0
    connections: int = 0
    events_sent: int = 0
    states_sent: int = 0
    replications: int = 0
    rejected: int = 0
    unauthorized: int = 0
    lock: threading.Condition = dataclasses.field(default_factory=threading.Condition,
                                                  repr=False)

    def add(self, **amounts: int) -> None:
        with self.lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)
            self.lock.notify_all()

    def wait_until(self, predicate: Callable[[StreamCounters], bool], timeout: float) -> bool:
        """Wait until ``predicate(self)`` holds (checked at every change); False after
        ``timeout`` seconds."""
        with self.lock:
            return self.lock.wait_for(lambda: predicate(self), timeout)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                    if field.name != "lock"}


@dataclasses.dataclass(frozen=True)
class StreamSettings:
    """What every stream of a gateway shares."""

    storage: Storage
    hub: JournalHub
    #: Aggregate type -> its state model (for the parents of a state during replication).
    aggregates: Mapping[str, type[BaseModel]]
    counters: StreamCounters
    stopping: threading.Event
    #: Live entries one client may have waiting before it is disconnected.
    buffer: int = 1000
    #: Seconds of silence before a keep-alive comment.
    heartbeat: float = 15.0
    #: Milliseconds a client should wait before reconnecting (SSE ``retry:``).
    reconnect_ms: int = 1000


class ClientStream:
    """Writes one client's stream until it disconnects, falls too far behind, or the
    gateway stops."""

    def __init__(self, settings: StreamSettings, filters: Filters, start: Plan, write: Write,
                 disconnect: Callable[[], None],
                 gone: Callable[[], bool] = lambda: False) -> None:
        self._settings = settings
        self._filters = filters
        self._plan = start
        self._write = write
        self._disconnect = disconnect
        self._gone = gone

    def run(self) -> None:
        """Write the stream; returns when it ends (a write to a gone client raises
        ``OSError``, which the server expects)."""
        settings = self._settings
        if self._plan.start is Start.LIVE:
            subscription, position = settings.hub.subscribe(settings.buffer, self._disconnect)
            self._write(sse.retry(settings.reconnect_ms))  # once subscribed: nothing missed
            self._live(subscription, position)
            return
        self._write(sse.retry(settings.reconnect_ms))
        position = self._plan.position
        if self._plan.start is Start.REPLICATE:
            position = self._replicate()
        position = self._catch_up(position, until=None)
        subscription, hub_position = settings.hub.subscribe(settings.buffer, self._disconnect)
        if position < hub_position:
            position = self._catch_up(position, until=hub_position)
        self._live(subscription, position)

    def _replicate(self) -> int:
        settings = self._settings
        settings.counters.add(replications=1)
        position = settings.storage.journal_bounds().newest
        self._write(sse.event("reset", {"reason": self._plan.reason, "position": position}))
        chunk: list[bytes] = []
        for aggregate_type in self._replicated_types():
            for record in settings.storage.records(aggregate_type):
                if settings.stopping.is_set():
                    return position
                if self._wanted(record):
                    chunk.append(sse.state_event(record))
                if len(chunk) >= PAGE:
                    self._write_states(chunk)
        self._write_states(chunk)
        self._write(sse.event("live", {"position": position}, event_id=position))
        return position

    def _write_states(self, chunk: list[bytes]) -> None:
        """Write the state events gathered so far, and empty ``chunk``."""
        if chunk:
            self._write(b"".join(chunk))
            self._settings.counters.add(states_sent=len(chunk))
            chunk.clear()

    def _replicated_types(self) -> list[str]:
        known = sorted(self._settings.aggregates)
        types = self._filters.types
        return known if types is None else [name for name in known if name in types]

    def _wanted(self, record: AggregateRecord) -> bool:
        since = self._plan.since
        if since is not None and (record.updated_at is None or record.updated_at < since):
            return False
        return self._filters.matches_aggregate(record.aggregate_type, record.aggregate_id,
                                               self._parents_of(record))

    def _parents_of(self, record: AggregateRecord) -> Sequence[str]:
        """The state's ``journal_parents()``, if its model defines one."""
        if self._filters.parents is None:
            return ()
        model = self._settings.aggregates.get(record.aggregate_type)
        if model is None or record.state is None or not hasattr(model, "journal_parents"):
            return ()
        state: Any = model.model_validate(record.state)
        return tuple(state.journal_parents())

    def _catch_up(self, position: int, *, until: int | None) -> int:
        """Send journal entries after ``position`` (up to ``until``) from the storage."""
        storage = self._settings.storage
        while not self._settings.stopping.is_set():
            limit = PAGE if until is None else min(PAGE, until - position)
            if limit <= 0:
                break
            entries = storage.read_journal(after=position, limit=limit)
            if entries:
                position = self._send(entries, position)
            if len(entries) < limit:
                break
        return position

    def _live(self, subscription: Subscription, position: int) -> None:
        settings = self._settings
        quiet_since = time.monotonic()
        try:
            while not settings.stopping.is_set() and not subscription.closed.is_set():
                # Short waits: a client that hung up is let go within a second, not at the
                # next keep-alive.
                entries = subscription.take(min(settings.heartbeat, LOOK_FOR_HANGUPS))
                if entries:
                    position = self._send(entries, position)
                    quiet_since = time.monotonic()
                elif self._gone():
                    return
                elif time.monotonic() - quiet_since >= settings.heartbeat:
                    self._write(sse.comment("keep-alive"))
                    quiet_since = time.monotonic()
        finally:
            settings.hub.unsubscribe(subscription)

    def _send(self, entries: Iterable[JournalEntry], position: int) -> int:
        """Write the entries after ``position`` that pass the filters; return the newest
        position seen."""
        chunk: list[bytes] = []
        for entry in entries:
            if entry.position <= position:
                continue  # already sent from the storage before the hub caught up
            position = entry.position
            if self._filters.matches(entry):
                chunk.append(sse.journal_event(entry))
        if chunk:
            self._write(b"".join(chunk))
            self._settings.counters.add(events_sent=len(chunk))
        return position
