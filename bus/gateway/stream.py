"""One client's event stream: replication if asked for, catch-up from the journal, then live.

A stream is planned before the response starts (:func:`plan`: a resume point the journal
cannot serve is a 400, one it no longer holds becomes full replication), then written by
:class:`ClientStream`:

1. **replication** (``Last-Event-ID: 0``, a timestamp the journal no longer reaches, or a
   position older than its retention): the journal's newest position ``P`` is read first;
   then a ``reset`` event (with the reason), the state of every aggregate of the requested
   types, and a ``live`` event with id ``P``. Events appended while the states were read
   have positions after ``P`` and follow the ``live`` event: none is lost in the switch
   (one may describe a change the state already showed). A completed saga (a tombstone)
   counts as deleted: full replication leaves it out; replication of what changed since a
   time sends it as a state event with ``"deleted": true`` and no state;
2. **catch-up**: journal entries after the resume position, read from the storage in pages
   until the client is nearly current; then it subscribes to the hub and reads the rest of
   the storage up to the hub's position;
3. **live**: entries the hub offers, with a comment every ``heartbeat`` seconds when idle.

The stream is an async generator of chunks run on the gateway's event loop; what touches
the storage (reading the journal or the aggregates, encoding) runs in worker threads, a
page at a time, so memory stays bounded however large the storage is. Journal events are
encoded once and shared by every client (:mod:`idembus.gateway.encoded`).

Every event with an ``id`` is a journal position, strictly increasing within a stream, so a
client that reconnects with the last id it saw gets each event once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import enum
import itertools
import logging
import threading
import time
import traceback
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from ..errors import BadStreamRequest, IncompatibleState
from ..evolution import upcast_state, version_of
from ..redaction import redact
from ..storage.base import AggregateRecord, JournalStore, Storage
from ..storage.errors import StorageUnavailable
from . import sse
from .encoded import Batch
from .hub import JournalHub, Subscription
from .request import Filters, Mode, Resume

log = logging.getLogger(__name__)

#: Journal entries (or aggregate states) read from the storage per page.
PAGE = 500


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


def plan(resume: Resume, storage: JournalStore) -> Plan:
    """Decide how to serve ``resume``; :class:`~idembus.errors.BadStreamRequest` if it cannot be."""
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

    #: Streams open now (and being opened).
    clients: int = 0
    #: Streams served since the start.
    connections: int = 0
    events_sent: int = 0
    states_sent: int = 0
    replications: int = 0
    rejected: int = 0
    unauthorized: int = 0
    #: Requests answered 429: their address had failed to log in too often.
    throttled: int = 0
    #: Stream requests answered 503 because ``max_clients`` streams were open.
    over_capacity: int = 0
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
    """One client's stream: :meth:`chunks` yields what to send until the client is gone
    (the server then stops iterating), falls too far behind, or the gateway stops."""

    def __init__(self, settings: StreamSettings, filters: Filters, start: Plan) -> None:
        self._settings = settings
        self._filters = filters
        self._plan = start
        self._unfiltered = filters.types is None and filters.parents is None
        #: The newest journal position the stream has passed (sent, or filtered out).
        self.position = start.position

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The chunks of the stream. An error ends it — logged, redacted — and never
        escapes: the response has begun, and the client resumes when it reconnects."""
        try:
            async for chunk in self._stream():
                yield chunk
        except StorageUnavailable as error:
            log.warning("ending a stream: %s (the client resumes when it reconnects)",
                        redact(str(error)))
        except Exception:
            log.error("a stream failed; ended it (the client resumes when it reconnects):\n%s",
                      redact(traceback.format_exc().rstrip()))

    async def _stream(self) -> AsyncIterator[bytes]:
        settings = self._settings
        subscription: Subscription | None = None
        try:
            if self._plan.start is Start.LIVE:
                subscription, ready, self.position = self._subscribe()
                yield sse.retry(settings.reconnect_ms)  # once subscribed: nothing missed
            else:
                yield sse.retry(settings.reconnect_ms)
                if self._plan.start is Start.REPLICATE:
                    async for chunk in self._replicate():
                        yield chunk
                async for chunk in self._catch_up(until=None):
                    yield chunk
                if settings.stopping.is_set():
                    return
                subscription, ready, hub_position = self._subscribe()
                async for chunk in self._catch_up(until=hub_position):
                    yield chunk
            async for chunk in self._live(subscription, ready):
                yield chunk
        finally:
            if subscription is not None:
                settings.hub.unsubscribe(subscription)

    def _subscribe(self) -> tuple[Subscription, asyncio.Event, int]:
        """Subscribe to the hub; the hub wakes this loop through ``ready``."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:  # called in the hub's thread
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:
                pass  # the loop is closed: the stream is over

        subscription, position = self._settings.hub.subscribe(self._settings.buffer, wake)
        return subscription, ready, position

    async def _replicate(self) -> AsyncIterator[bytes]:
        settings = self._settings
        settings.counters.add(replications=1)
        bounds = await run_in_threadpool(settings.storage.journal_bounds)
        position = bounds.newest
        yield sse.event("reset", {"reason": self._plan.reason, "position": position})
        for aggregate_type in self._replicated_types():
            records = await run_in_threadpool(settings.storage.records, aggregate_type)
            more = True
            while more:
                if settings.stopping.is_set():
                    return
                states, more = await run_in_threadpool(self._states, records)
                if states:
                    yield b"".join(states)
                    settings.counters.add(states_sent=len(states))
        self.position = position
        yield sse.event("live", {"position": position}, event_id=position)

    def _states(self, records: Iterator[AggregateRecord]) -> tuple[list[bytes], bool]:
        """The next page of ``records`` (in a worker thread): the wanted ones encoded, and
        whether more may follow."""
        page = [self._current(record) for record in itertools.islice(records, PAGE)]
        return [sse.state_event(record) for record in page if self._wanted(record)], (
            len(page) == PAGE)

    def _current(self, record: AggregateRecord) -> AggregateRecord:
        """``record`` with its state upcast to its model's current ``state_version``
        (:mod:`idembus.evolution`); as stored if its model is unknown, or if it cannot be
        upcast (logged: replication goes on)."""
        model = self._settings.aggregates.get(record.aggregate_type)
        if model is None or record.state is None:
            return record
        try:
            if (record.state_version or 1) == version_of(model):
                return record
            state = upcast_state(model, record.state, record.state_version)
        except IncompatibleState as exc:
            log.warning("%s %r is replicated as stored: %s", record.aggregate_type,
                        record.aggregate_id, exc)
            return record
        return dataclasses.replace(record, state=state, state_version=version_of(model))

    def _replicated_types(self) -> list[str]:
        known = sorted(self._settings.aggregates)
        types = self._filters.types
        return known if types is None else [name for name in known if name in types]

    def _wanted(self, record: AggregateRecord) -> bool:
        since = self._plan.since
        if since is None and record.completed:
            return False  # a completed saga is deleted: full replication leaves it out
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

    async def _catch_up(self, *, until: int | None) -> AsyncIterator[bytes]:
        """The journal entries after :attr:`position` (up to ``until``), from the storage."""
        while not self._settings.stopping.is_set():
            limit = PAGE if until is None else min(PAGE, until - self.position)
            if limit <= 0:
                break
            batch = await run_in_threadpool(self._read, self.position, limit)
            chunk = self._select(batch)
            if chunk:
                yield chunk
            if len(batch) < limit:
                break

    def _read(self, after: int, limit: int) -> Batch:
        """A page of the journal, encoded (in a worker thread)."""
        entries = self._settings.storage.read_journal(after=after, limit=limit)
        return self._settings.hub.cache.batch(entries)

    async def _live(self, subscription: Subscription, ready: asyncio.Event,
                    ) -> AsyncIterator[bytes]:
        settings = self._settings
        quiet_since = time.monotonic()
        while not settings.stopping.is_set():
            ready.clear()  # before taking: a wake-up after this is not lost
            batches = subscription.take()
            if batches:
                for batch in batches:
                    chunk = self._select(batch)
                    if chunk:
                        yield chunk
                        quiet_since = time.monotonic()
                continue
            if subscription.closed:
                return  # fell behind (overflowed), or the gateway stops
            left = settings.heartbeat - (time.monotonic() - quiet_since)
            if left <= 0:
                yield sse.comment("keep-alive")
                quiet_since = time.monotonic()
                continue
            with anyio.move_on_after(left):
                await ready.wait()

    def _select(self, batch: Batch) -> bytes:
        """What of ``batch`` this client gets: the events after :attr:`position` that pass
        its filters, as the shared encoded bytes (the batch's own joined bytes when it takes
        all of it)."""
        if batch.last <= self.position:
            return b""  # already sent from the storage before the hub caught up
        if self._unfiltered and batch.first > self.position:
            data, count = batch.joined, len(batch)
        else:
            chosen = [event.data for event in batch.events
                      if event.entry.position > self.position
                      and self._filters.matches(event.entry)]
            data, count = b"".join(chosen), len(chosen)
        self.position = batch.last
        if count:
            self._settings.counters.add(events_sent=count)
        return data
