"""Message expiry: a time after which a message is worthless to its receiver.

A sender gives a message a time to live, ``bus.send(quote, discard_after=30)`` (seconds or a
``timedelta``), or its type gives every message of it one::

    class PriceQuote(Event, discard_after=30):
        ...

The message then carries the absolute time :data:`~idembus.headers.DISCARD_AFTER`: when it
was sent (by the sending endpoint's clock) plus that time, or, for a deferred message, when
it is due plus that time. An endpoint that receives it after that time acknowledges it
without running the handlers that have not processed it yet: the ``discarded`` signal and
counter, one INFO line. The deduplication lookup comes first: a handler that had already
processed the message still sends again what it stored (its first dispatch may have been
lost). Nothing that sends stored messages — a duplicate's redispatch, the outbox, delayed
deliveries, ``idembus errors retry`` — looks at the time: only a receiver does, so nothing
committed is ever dropped on its way out.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping

from . import headers as h
from .envelope import format_utc, parse_utc
from .errors import MalformedMessage
from .wire import shown

#: What ``discard_after=`` takes: seconds, or a timedelta.
TimeToLive = float | datetime.timedelta


def time_to_live(value: object) -> datetime.timedelta:
    """``value`` (seconds or a timedelta) as a positive timedelta; ``TypeError`` or
    ``ValueError`` saying what to give instead."""
    if isinstance(value, bool) or not isinstance(value, int | float | datetime.timedelta):
        raise TypeError(
            f"discard_after takes seconds or a datetime.timedelta, got {value!r}")
    if isinstance(value, datetime.timedelta):
        ttl = value
    else:
        if not math.isfinite(value):
            raise ValueError(f"discard_after must be a finite number of seconds, got {value!r}")
        ttl = datetime.timedelta(seconds=value)
    if ttl <= datetime.timedelta(0):
        raise ValueError(f"discard_after must be positive, got {value!r}")
    return ttl


def discard_time(base: datetime.datetime, ttl: datetime.timedelta) -> str:
    """The :data:`~idembus.headers.DISCARD_AFTER` value of a message living ``ttl`` from
    ``base`` (when it is sent, or due)."""
    try:
        return format_utc(base + ttl)
    except OverflowError:
        raise ValueError(f"discard_after={ttl!r} reaches past the year 9999") from None


def expiry_of(headers: Mapping[str, str]) -> datetime.datetime | None:
    """When the message with ``headers`` becomes worthless, or ``None`` if never.

    A header that is not a time is bad input (:class:`~idembus.errors.MalformedMessage`):
    the message goes to the error queue with the reason rather than being handled against
    its sender's wish or discarded on a guess. A time without a zone is taken as UTC, as
    every idembus time header is.
    """
    text = headers.get(h.DISCARD_AFTER)
    if text is None:
        return None
    moment = parse_utc(text)
    if moment is None:
        raise MalformedMessage(
            f"the {h.DISCARD_AFTER} header {shown(text)} is not an ISO 8601 time (write "
            "it as 2026-01-31T12:00:00+00:00, or leave it out)")
    return moment
