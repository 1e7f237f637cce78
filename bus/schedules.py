"""Recurring messages: what a schedule is, when it occurs, and each occurrence's id.

::

    Endpoint("reports", handlers=[Rollups], schedules=[
        Schedule("nightly-rollup", cron="0 2 * * *", message=RunRollup(),
                 timezone="Europe/Riga"),
    ])

A :class:`Schedule` names a cron expression, the time zone it is read in and the message to
send (a Command, routed like any other) or publish (an Event) at each occurrence, or a
function building that message from the occurrence's time. The
:class:`~idembus.runtime.scheduler.Scheduler` of the endpoint sends it; this module only computes.

Cron expressions are evaluated by cronsim, which follows Debian's cron, daylight saving time
included: a job at a fixed time of day that falls in the hour skipped in spring runs right
after the change, and one in the hour repeated in autumn runs once; jobs that run every hour
or more often follow the clock as it is. Five fields (minute hour day month weekday) or six,
seconds first (``*/15 * * * * *``). Occurrences are computed in the schedule's time zone and
carried in UTC.

Each occurrence has a fixed message id, ``uuid5(SCHEDULE_NAMESPACE,
"<endpoint>/<schedule>/<occurrence in ISO 8601 UTC>")``: every process that computes it
computes the same one, and receivers deduplicate it like any other.
"""

from __future__ import annotations

import datetime
import re
import uuid
import zoneinfo
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from cronsim import CronSim, CronSimError

from .envelope import format_utc
from .errors import ConfigurationError
from .messages import Command, Event, Message, message_name

#: Namespace of the occurrence ids (never change it: ids of past occurrences derive from it).
SCHEDULE_NAMESPACE = uuid.UUID("2b8f3c4e-7d1a-5e69-b0c2-5a4d8e9f1c37")

#: A function building the message of one occurrence from its time (aware, UTC).
MessageFactory = Callable[[datetime.datetime], Message]

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,99}")
_UTC = datetime.timezone.utc
#: Where construction looks for a first occurrence (any fixed moment would do).
_REFERENCE = datetime.datetime(2001, 1, 1, tzinfo=_UTC)


@dataclass(frozen=True)
class Schedule:
    """A message sent (a Command) or published (an Event) at each occurrence of ``cron``.

    Parameters
    ----------
    name:
        Unique within the endpoint: letters, digits, ``_``, ``-`` and ``.``, at most 100.
        The occurrence ids and the schedule's record in the storage derive from it, so
        renaming a schedule starts it afresh.
    cron:
        Five fields (``"0 2 * * *"``: at 02:00) or six with seconds first
        (``"*/10 * * * * *"``), as Debian's cron reads them, plus ``L``, ``LW``, ``5L``
        and ``MON#2``.
    message:
        A Command or Event instance, sent as it is at every occurrence (each time with
        the occurrence's own id), or a function of the occurrence time (aware, UTC)
        returning one.
    timezone:
        The IANA time zone ``cron`` is read in (``"Europe/Riga"``); ``"UTC"`` by default.
    catch_up:
        Occurrences missed while no scheduler ran are skipped (logged and counted) and only
        the newest is sent, late, by default; ``True`` sends every one of them, in order,
        up to :data:`~idembus.runtime.scheduler.CATCH_UP_BATCH` per round.
    """

    name: str
    cron: str
    message: Message | MessageFactory
    timezone: str = "UTC"
    catch_up: bool = False
    _zone: zoneinfo.ZoneInfo = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ConfigurationError(
                f"schedule name {self.name!r} must be 1 to 100 letters, digits, '_', '-' or "
                "'.', starting with a letter, digit or '_' (e.g. 'nightly-rollup')")
        object.__setattr__(self, "_zone", _zone(self.name, self.timezone))
        _check_cron(self.name, self.cron, self._zone)
        if not isinstance(self.catch_up, bool):
            raise ConfigurationError(
                f"schedule {self.name!r}: catch_up must be True or False, got "
                f"{self.catch_up!r}")
        message = self.message
        if isinstance(message, (Command, Event)):
            object.__setattr__(self, "message", message.model_copy(deep=True))
        elif isinstance(message, type) or not callable(message):
            hint = (f"the class {message.__qualname__}: pass an instance such as "
                    f"{message.__name__}(...)" if isinstance(message, type)
                    else repr(message))
            raise ConfigurationError(
                f"schedule {self.name!r}: message must be a Command or an Event instance, or "
                f"a function of the occurrence time returning one; got {hint}")

    @property
    def zone(self) -> zoneinfo.ZoneInfo:
        """The time zone the cron expression is read in."""
        return self._zone

    @property
    def fixed_message(self) -> Command | Event | None:
        """The message sent at every occurrence, or ``None`` when a function builds it."""
        return self.message if isinstance(self.message, (Command, Event)) else None

    def describe_message(self) -> str:
        """What the schedule sends, for people: ``send sales.Rollup``, ``publish ...``, or the
        function's name."""
        fixed = self.fixed_message
        if fixed is None:
            return f"built by {getattr(self.message, '__qualname__', repr(self.message))}"
        verb = "send" if isinstance(fixed, Command) else "publish"
        return f"{verb} {message_name(fixed)}"

    def message_for(self, occurrence: datetime.datetime) -> Command | Event:
        """The message of one occurrence: the fixed one, or the function's result (checked:
        a Command or an Event, else :class:`TypeError`)."""
        fixed = self.fixed_message
        if fixed is not None:
            return fixed
        built = self.message(occurrence)  # type: ignore[operator]
        if not isinstance(built, (Command, Event)):
            raise TypeError(f"schedule {self.name!r}: its message function returned "
                            f"{built!r}; return a Command or an Event instance")
        return built

    def occurrences(self, after: datetime.datetime) -> Iterator[datetime.datetime]:
        """The occurrences strictly after ``after`` (aware), oldest first, in UTC; they end
        when none comes within 50 years."""
        for moment in CronSim(self.cron, after.astimezone(self._zone)):
            yield moment.astimezone(_UTC)

    def due(self, after: datetime.datetime, now: datetime.datetime,
            limit: int) -> tuple[list[datetime.datetime], bool]:
        """Up to ``limit`` occurrences in ``(after, now]``, oldest first; and whether more
        are due beyond them."""
        found: list[datetime.datetime] = []
        for moment in self.occurrences(after):
            if moment > now:
                return found, False
            if len(found) == limit:
                return found, True
            found.append(moment)
        return found, False

    def newest_due(self, now: datetime.datetime) -> datetime.datetime | None:
        """The newest occurrence at or before ``now``, found backwards from ``now`` (for a
        gap too long to walk), then confirmed forwards so that it is one :meth:`occurrences`
        yields."""
        start = (now + datetime.timedelta(microseconds=1)).astimezone(self._zone)
        try:
            guess = next(CronSim(self.cron, start, reverse=True)).astimezone(_UTC)
        except StopIteration:
            return None
        confirmed, _ = self.due(guess - datetime.timedelta(seconds=1), now, limit=10)
        return confirmed[-1] if confirmed else guess

    def next_after(self, moment: datetime.datetime) -> datetime.datetime | None:
        """The first occurrence strictly after ``moment``, or ``None``."""
        return next(self.occurrences(moment), None)

    def occurrence_id(self, endpoint: str, occurrence: datetime.datetime) -> str:
        """The message id of one occurrence of this schedule at ``endpoint``."""
        return occurrence_id(endpoint, self.name, occurrence)


def occurrence_id(endpoint: str, schedule: str, occurrence: datetime.datetime) -> str:
    """``uuid5(SCHEDULE_NAMESPACE, "<endpoint>/<schedule>/<occurrence ISO UTC>")``."""
    return str(uuid.uuid5(SCHEDULE_NAMESPACE,
                          f"{endpoint}/{schedule}/{format_utc(occurrence)}"))


@dataclass(frozen=True)
class SchedulerPolicy:
    """The schedules of an endpoint and how its scheduler runs
    (``Endpoint(schedules=SchedulerPolicy([...], lease_ttl=...))``; a plain list of
    :class:`Schedule` takes the defaults).

    ``lease_ttl``: seconds one scheduler holds the endpoint's lease without renewing it
    (it renews at half); after a process dies, another takes over within about 1.5 times
    this.
    """

    schedules: Sequence[Schedule] = ()
    lease_ttl: float = 30.0


def scheduler_policy(option: Sequence[Schedule] | SchedulerPolicy, *, endpoint: str,
                     has_route: Callable[[type[Message]], bool]) -> SchedulerPolicy:
    """``Endpoint(schedules=...)`` checked: :class:`Schedule` objects with distinct names,
    commands that have a route, a positive lease; else :class:`ConfigurationError`."""
    policy = option if isinstance(option, SchedulerPolicy) else SchedulerPolicy(
        tuple(option) if isinstance(option, (list, tuple)) else _not_schedules(option))
    if not policy.lease_ttl > 0:
        raise ConfigurationError(
            f"the scheduler's lease_ttl must be positive seconds, got {policy.lease_ttl!r}")
    names: set[str] = set()
    for schedule in policy.schedules:
        if not isinstance(schedule, Schedule):
            _not_schedules(schedule)
        if schedule.name in names:
            raise ConfigurationError(
                f"endpoint {endpoint!r} has two schedules named {schedule.name!r}; give each "
                "its own name (occurrence ids derive from it)")
        names.add(schedule.name)
        fixed = schedule.fixed_message
        if isinstance(fixed, Command) and not has_route(type(fixed)):
            raise ConfigurationError(
                f"schedule {schedule.name!r} sends {message_name(fixed)}, but endpoint "
                f"{endpoint!r} has no route for it: add routes={{{type(fixed).__name__}: "
                "'<endpoint name>'}, or a handler of it to this endpoint")
    return policy


def _not_schedules(value: object) -> NoReturn:
    raise ConfigurationError(
        f"schedules must be a list of Schedule(...) or a SchedulerPolicy, got {value!r}")


def _zone(name: str, timezone: str) -> zoneinfo.ZoneInfo:
    if not isinstance(timezone, str) or not timezone:
        raise ConfigurationError(
            f"schedule {name!r}: timezone must be an IANA name such as 'Europe/Riga' or "
            f"'UTC', got {timezone!r}")
    try:
        return zoneinfo.ZoneInfo(timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        raise ConfigurationError(
            f"schedule {name!r}: unknown time zone {timezone!r}; write an IANA name such as "
            "'Europe/Riga', 'America/New_York' or 'UTC' (where the system has no time zone "
            "database, pip install tzdata)") from None


def _check_cron(name: str, cron: object, zone: zoneinfo.ZoneInfo) -> None:
    if not isinstance(cron, str):
        raise ConfigurationError(
            f"schedule {name!r}: cron must be a string such as '0 2 * * *', got {cron!r}")
    try:
        iterator = CronSim(cron, _REFERENCE.astimezone(zone))
    except CronSimError as error:
        raise ConfigurationError(
            f"schedule {name!r}: {cron!r} is not a cron expression ({error}); write five "
            "fields, minute hour day-of-month month day-of-week (e.g. '0 2 * * *': at 02:00 "
            "every day), or six with seconds first (e.g. '*/10 * * * * *')") from None
    if next(iterator, None) is None:
        raise ConfigurationError(
            f"schedule {name!r}: {cron!r} never occurs (no match within 50 years)")
