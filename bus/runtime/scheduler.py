"""The scheduler: sends each occurrence of an endpoint's schedules exactly once.

One scheduler works at a time per endpoint and storage: every process of the endpoint runs
one, and they compete for the endpoint's lease (``idembus-scheduler:<endpoint>``, taken and
renewed like the outbox relay's, every ``lease_ttl / 2`` seconds). The holder, on each
round, for each schedule:

1. loads the schedule's record (aggregate type :data:`SCHEDULE_AGGREGATE`, id
   ``<endpoint>/<schedule>``), whose state says which occurrence was decided last;
2. computes what is due since then (the first round ever records the start and sends
   nothing for the past);
3. commits the newest due occurrence, as a handler commits a message: one conditional
   write of the new state with the occurrence's key (``<schedule>/<occurrence ISO UTC>``)
   and its outgoing message, whose id derives from the occurrence
   (:func:`idembus.schedules.occurrence_id`). Missed occurrences before it are recorded
   as skipped in the same write, unless the schedule catches up (then each is committed
   in turn, :data:`CATCH_UP_BATCH` per round);
4. sends what it committed and marks it
(:meth:`idembus.runtime.dispatching.Dispatcher.send_committed`).

The write is refused if the record moved since it was loaded, so two schedulers (a lease
lost while its holder was paused, clocks apart) decide each occurrence once between them:
the loser reloads and finds it decided. A process that dies after the commit leaves the
message stored and unmarked, and the outbox relay sends it with its id. A restart
continues from the stored record.

A message function that raises, or returns something that is not a message, and a message
the storage refuses, fail that occurrence alone: it is recorded as failed with the reason
(``idembus schedules`` shows it), logged at ERROR, shown by ``idembus status`` and never
tried again; the next occurrence is tried as usual. Outages end the round and the next
one waits with backoff.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .. import headers as h
from ..envelope import Envelope, format_utc, parse_utc
from ..messages import Command, message_name
from ..redaction import redact
from ..schedules import Schedule, SchedulerPolicy
from ..sending import Bus
from ..storage.base import AggregateRecord, AggregateStore, OutboxStore
from ..storage.errors import AlreadyProcessed, ConcurrencyConflict, StorageUnavailable
from ..transports.errors import TransportUnavailable
from .background import LeasedPeriodic
from .dispatching import Dispatcher
from .endpoint_context import EndpointContext

log = logging.getLogger(__name__)

#: The aggregate type of the schedules' records.
SCHEDULE_AGGREGATE = "idembus_schedule"
#: The lease the schedulers of one endpoint compete for is ``<this>:<endpoint>``.
SCHEDULER_LEASE = "idembus-scheduler"
#: Occurrences a catching-up schedule sends per round (the next round follows at once).
CATCH_UP_BATCH = 100
#: Missed occurrences counted one by one before skipping; past this many the newest due
#: one is found backwards from now, and the skipped ones are counted as this many.
SKIP_SCAN = 10_000

_OUTAGES = (StorageUnavailable, TransportUnavailable)


def record_id(endpoint: str, schedule: str) -> str:
    """The aggregate id of one schedule's record."""
    return f"{endpoint}/{schedule}"


@dataclass(frozen=True)
class ScheduleState:
    """What the storage keeps of one schedule (the state of its record)."""

    #: When a scheduler first saw the schedule (nothing before it is ever sent).
    since: datetime.datetime
    #: The newest occurrence decided (sent, skipped or failed), or ``since``.
    last: datetime.datetime
    #: The newest occurrence sent, and its message id.
    last_sent: datetime.datetime | None = None
    last_message_id: str | None = None
    sent: int = 0
    skipped: int = 0
    failed: int = 0
    #: Why the newest failed occurrence failed (redacted).
    last_error: str | None = None

    def to_record(self) -> dict[str, Any]:
        return {"since": format_utc(self.since), "last": format_utc(self.last),
                "last_sent": format_utc(self.last_sent) if self.last_sent else None,
                "last_message_id": self.last_message_id, "sent": self.sent,
                "skipped": self.skipped, "failed": self.failed,
                "last_error": self.last_error}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ScheduleState:
        since = parse_utc(record.get("since"))
        last = parse_utc(record.get("last")) or since
        if since is None or last is None:
            raise ValueError(f"a schedule record without its times: {dict(record)!r}")
        return cls(since=since, last=last, last_sent=parse_utc(record.get("last_sent")),
                   last_message_id=record.get("last_message_id"),
                   sent=int(record.get("sent", 0)), skipped=int(record.get("skipped", 0)),
                   failed=int(record.get("failed", 0)), last_error=record.get("last_error"))


def read_state(storage: AggregateStore, endpoint: str, schedule: str) -> ScheduleState | None:
    """The stored state of one schedule, or ``None`` if no scheduler has run it yet."""
    record = storage.load(SCHEDULE_AGGREGATE, record_id(endpoint, schedule))
    return ScheduleState.from_record(record.state) if record.exists and record.state else None


@dataclass(frozen=True)
class _Step:
    """One decision: send ``occurrence``, recording ``skipped`` (missed) ones before it."""

    occurrence: datetime.datetime
    skipped: Sequence[datetime.datetime] = ()
    #: More were missed than :data:`SKIP_SCAN`: ``skipped`` is only the first of them.
    more_skipped: bool = False


class Scheduler(LeasedPeriodic):
    """Sends an endpoint's schedules under its lease; see the module docstring."""

    #: The storage roles a scheduler uses: a lease, and its state kept as an aggregate.
    storage_roles = (OutboxStore, AggregateStore)

    def __init__(self, context: EndpointContext, policy: SchedulerPolicy,
                 dispatcher: Dispatcher) -> None:
        endpoint = context.name
        super().__init__(f"idembus-{endpoint}-scheduler", leases=context.role(OutboxStore),
                         lease_name=f"{SCHEDULER_LEASE}:{endpoint}",
                         lease_ttl=policy.lease_ttl,
                         backoff=context.recoverability.outage_backoff, health=context.health)
        self.schedules: tuple[Schedule, ...] = tuple(policy.schedules)
        self.endpoint = endpoint
        self._storage = context.role(AggregateStore)
        self._dispatcher = dispatcher
        self._router = context.router
        self._clock = context.clock
        self._signals = context.signals
        #: A round left due occurrences for the next one (catching up).
        self._behind = False

    # -- rounds -------------------------------------------------------------------------

    def run_once(self) -> int:
        """Take or renew the lease; if held, send what is due of every schedule. Returns how
        many occurrences were sent (0 when another scheduler holds the lease). An outage
        ends the round; anything else wrong with one schedule is logged and the others go
        on."""
        now = self._clock.now()
        self._behind = False
        if self.take_lease(now) is None:
            return 0
        sent = 0
        for schedule in self.schedules:
            try:
                sent += self._run(schedule, now)
            except _OUTAGES:
                raise
            except Exception as error:
                log.exception("schedule %s of %s failed this round; trying again next round",
                              schedule.name, self.endpoint)
                self.health.problem(_source(schedule), error)
        return sent

    def round(self) -> float:
        self.run_once()
        if self._behind:
            return 0.0
        wait = self.lease_ttl / 2  # renew the lease, or look whether it is free again
        if self.lease is None:
            return wait
        now = self._clock.now()
        upcoming = [moment for schedule in self.schedules
                    if (moment := schedule.next_after(now)) is not None]
        if upcoming:
            wait = min(wait, (min(upcoming) - now).total_seconds())
        return max(wait, 0.0)

    # -- one schedule -------------------------------------------------------------------

    def _run(self, schedule: Schedule, now: datetime.datetime) -> int:
        """Decide what is due of ``schedule`` one step at a time, reloading its record
        before each (another scheduler may have moved it). Returns how many were sent."""
        sent = 0
        for _ in range(CATCH_UP_BATCH):
            record = self._storage.load(SCHEDULE_AGGREGATE,
                                        record_id(self.endpoint, schedule.name))
            if not record.exists or not record.state:
                self._start(schedule, record, now)
                return sent
            state = ScheduleState.from_record(record.state)
            step = self._next_step(schedule, state, now)
            if step is None:
                return sent
            sent += self._decide(schedule, record, state, step)
        self._behind = True
        return sent

    def _next_step(self, schedule: Schedule, state: ScheduleState,
                   now: datetime.datetime) -> _Step | None:
        if schedule.catch_up:
            due, _ = schedule.due(state.last, now, limit=1)
            return _Step(due[0]) if due else None
        due, more = schedule.due(state.last, now, limit=SKIP_SCAN)
        if not due:
            return None
        newest = schedule.newest_due(now) if more else None
        if newest is None or newest <= due[-1]:
            return _Step(due[-1], due[:-1])
        return _Step(newest, due, more_skipped=True)

    def _start(self, schedule: Schedule, record: AggregateRecord,
               now: datetime.datetime) -> None:
        """The first round ever of ``schedule``: record that it starts now."""
        state = ScheduleState(since=now, last=now)
        try:
            self._storage.commit(record, key=f"{schedule.name}/since", state=state.to_record(),
                                 outgoing=())
        except (AlreadyProcessed, ConcurrencyConflict):
            return  # another scheduler started it meanwhile
        upcoming = schedule.next_after(now)
        log.info("schedule %s of %s starts; first occurrence %s", schedule.name,
                 self.endpoint, format_utc(upcoming) if upcoming else "never",
                 extra={"endpoint": self.endpoint})

    def _decide(self, schedule: Schedule, record: AggregateRecord, state: ScheduleState,
                step: _Step) -> int:
        """Commit ``step`` and send its message; 1 if it was sent, 0 if it failed or
        another scheduler decided it first."""
        occurrence = step.occurrence
        key = f"{schedule.name}/{format_utc(occurrence)}"
        message_id = schedule.occurrence_id(self.endpoint, occurrence)
        decided = replace(state, last=occurrence, skipped=state.skipped + len(step.skipped))
        try:
            envelope = self._envelope(schedule, occurrence, message_id)
            committed = self._commit(record, key, replace(
                decided, last_sent=occurrence, last_message_id=message_id,
                sent=state.sent + 1), [envelope])
        except _OUTAGES:
            raise
        except Exception as error:
            return self._fail(schedule, record, decided, step, key, message_id, error)
        if not committed:
            return 0
        self._skipped(schedule, step)
        self._signals.emit("schedule_fired", message_id=message_id,
                           message_type=envelope.message_type, schedule=schedule.name,
                           occurrence=occurrence)
        self.health.resolved(_source(schedule))
        log.debug("schedule %s of %s: occurrence %s committed as %s %s", schedule.name,
                  self.endpoint, format_utc(occurrence), envelope.message_type, message_id,
                  extra={"endpoint": self.endpoint, "message_id": message_id})
        self._dispatcher.send_committed(
            SCHEDULE_AGGREGATE, record.aggregate_id, key, [envelope], source="schedule",
            endpoint=self.endpoint)
        return 1

    def _commit(self, record: AggregateRecord, key: str, state: ScheduleState,
                outgoing: Sequence[Envelope]) -> bool:
        """Commit one decision; False if another scheduler moved the record first."""
        try:
            self._storage.commit(record, key=key, state=state.to_record(), outgoing=outgoing)
        except (AlreadyProcessed, ConcurrencyConflict):
            return False
        return True

    def _fail(self, schedule: Schedule, record: AggregateRecord, decided: ScheduleState,
              step: _Step, key: str, message_id: str, error: Exception) -> int:
        """Record the occurrence as failed (never tried again), and say so."""
        reason = redact(f"{type(error).__name__}: {error}")
        if not self._commit(record, key, replace(decided, failed=decided.failed + 1,
                                                 last_error=reason), ()):
            return 0
        self._skipped(schedule, step)
        self.health.problem(_source(schedule), reason)
        fixed = schedule.fixed_message
        self._signals.emit("schedule_failed", message_id=message_id,
                           message_type=message_name(fixed) if fixed else None,
                           schedule=schedule.name, occurrence=step.occurrence, error=error)
        log.error("schedule %s of %s: the occurrence at %s failed and will not be tried "
                  "again (%s); the next occurrence is tried as usual", schedule.name,
                  self.endpoint, format_utc(step.occurrence), reason,
                  extra={"endpoint": self.endpoint, "message_id": message_id})
        return 0

    def _skipped(self, schedule: Schedule, step: _Step) -> None:
        """Count and log the missed occurrences a decision skipped."""
        if not step.skipped:
            return
        fixed = schedule.fixed_message
        message_type = message_name(fixed) if fixed else None
        for moment in step.skipped:
            self._signals.emit("schedule_skipped",
                               message_id=schedule.occurrence_id(self.endpoint, moment),
                               message_type=message_type, schedule=schedule.name,
                               occurrence=moment)
        log.warning("schedule %s of %s: skipped %s%d occurrence(s) missed while no scheduler "
                    "ran (%s to %s) and went on with the one at %s (catch_up=True sends "
                    "missed occurrences)", schedule.name, self.endpoint,
                    "at least " if step.more_skipped else "", len(step.skipped),
                    format_utc(step.skipped[0]), format_utc(step.skipped[-1]),
                    format_utc(step.occurrence), extra={"endpoint": self.endpoint})

    def _envelope(self, schedule: Schedule, occurrence: datetime.datetime,
                  message_id: str) -> Envelope:
        """The occurrence's message as it will be stored and sent: built, routed, through
        the ``outgoing`` middleware, with its id and the schedule's headers."""
        message = schedule.message_for(occurrence)
        built: list[Envelope] = []
        record = self._dispatcher.pipeline.recorder(built.append, None)
        marks = {h.SCHEDULE: schedule.name, h.OCCURRENCE: format_utc(occurrence)}
        bus = Bus(self.endpoint, self._router,
                  lambda envelope: record(envelope.with_headers(marks)))
        if isinstance(message, Command):
            bus.send(message, message_id=message_id)
        else:
            bus.publish(message, message_id=message_id)
        return built[0]


def _source(schedule: Schedule) -> str:
    """Where a schedule's problems are filed in the endpoint's health."""
    return f"schedule {schedule.name}"
