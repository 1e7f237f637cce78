"""What time it is, for the parts of an endpoint whose behaviour depends on it.

An endpoint reads the time through a :class:`Clock` (``Endpoint(clock=...)``), so that
tests can run deferred messages, saga timeouts, expiry and schedules in virtual time
(:class:`idembus.testing.Scenario`). The default, :class:`SystemClock`, is the wall clock
in UTC.
"""

from __future__ import annotations

import datetime
from typing import Protocol, runtime_checkable

from .envelope import utc_now


@runtime_checkable
class Clock(Protocol):
    """A source of the current time."""

    def now(self) -> datetime.datetime:
        """The current time, timezone-aware, in UTC."""
        ...


class SystemClock:
    """The wall clock, in UTC."""

    def now(self) -> datetime.datetime:
        return utc_now()

    def __repr__(self) -> str:
        return "SystemClock()"
