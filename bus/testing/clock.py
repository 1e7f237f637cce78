"""A clock that moves only when a test moves it."""

from __future__ import annotations

import datetime
import threading

from ..envelope import utc_now


class FakeClock:
    """A :class:`~idembus.clock.Clock` for virtual time: ``now()`` stays put until
    :meth:`advance` or :meth:`set` moves it forward.

    ``start`` (an aware datetime) is where it starts; by default the wall-clock time it was
    made at, to the whole second (so that the times it gives are never older than the ones
    the storage stamps on the wall clock). It never moves back: a deferred message that
    came due stays due. Safe to read from several threads.
    """

    def __init__(self, start: datetime.datetime | None = None) -> None:
        if start is None:
            start = utc_now().replace(microsecond=0)
        self._now = _aware(start, "start")
        self._lock = threading.Lock()

    def now(self) -> datetime.datetime:
        """The current virtual time, in UTC."""
        with self._lock:
            return self._now

    def advance(self, delta: datetime.timedelta | None = None, *, seconds: float = 0,
                minutes: float = 0, hours: float = 0, days: float = 0) -> datetime.datetime:
        """Move forward by ``delta`` and/or the given units; return the new time."""
        step = (delta or datetime.timedelta()) + datetime.timedelta(
            seconds=seconds, minutes=minutes, hours=hours, days=days)
        if step < datetime.timedelta(0):
            raise ValueError(f"a FakeClock only moves forward; cannot advance by {step}")
        with self._lock:
            self._now += step
            return self._now

    def set(self, moment: datetime.datetime) -> datetime.datetime:
        """Move forward to ``moment`` (an aware datetime, not before now); return it."""
        moment = _aware(moment, "set()")
        with self._lock:
            if moment < self._now:
                raise ValueError(
                    f"a FakeClock only moves forward: it is {self._now.isoformat()}, cannot "
                    f"set it to {moment.isoformat()}")
            self._now = moment
            return moment

    def __repr__(self) -> str:
        return f"FakeClock({self.now().isoformat()})"


def _aware(moment: datetime.datetime, what: str) -> datetime.datetime:
    if not isinstance(moment, datetime.datetime) or moment.tzinfo is None:
        raise ValueError(f"FakeClock {what} takes an aware datetime such as "
                         f"datetime.datetime(2030, 1, 1, tzinfo=datetime.timezone.utc), "
                         f"got {moment!r}")
    return moment.astimezone(datetime.timezone.utc)
