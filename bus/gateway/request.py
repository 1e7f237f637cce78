"""What a stream client asks for: where to resume, and which events it wants.

``Last-Event-ID`` (the header, or the ``last_event_id`` query parameter for clients that
cannot set headers) is one of:

* absent: live events from now on;
* a journal position ``n`` (what the client last received): every event after ``n``;
* ``0``: full replication — the current state of every aggregate, then the events since;
* a millisecond Unix timestamp (13 digits: anything from 10^12 on, September 2001): the
  events recorded since then, or, if the journal no longer reaches that far back,
  replication of the aggregates changed since then.

Anything else — not a whole number, more than :data:`LONGEST` digits, a timestamp in the
future — is a :class:`~idembus.errors.BadStreamRequest` (a 400 with the reason).
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import BadStreamRequest
from ..storage.base import JournalEntry

#: A ``Last-Event-ID`` from this value on is a millisecond timestamp, not a position.
TIMESTAMP_FROM = 10**12

#: The most digits a ``Last-Event-ID`` may have: positions and timestamps fit a signed
#: 64-bit integer (PostgreSQL's ``bigint``).
LONGEST = 19

#: How far ahead of this machine's clock a timestamp may be (the client's clock may run
#: fast).
CLOCK_SKEW = datetime.timedelta(minutes=5)

#: Query parameters a stream request may carry.
PARAMETERS = ("types", "parents", "last_event_id")


class Mode(enum.Enum):
    LIVE = "live"
    AFTER = "after"
    REPLICATE = "replicate"
    SINCE = "since"


@dataclass(frozen=True)
class Resume:
    """Where a client's stream starts."""

    mode: Mode
    position: int = 0
    since: datetime.datetime | None = None


def resume_point(value: str | None) -> Resume:
    """Read a ``Last-Event-ID``; :class:`~idembus.errors.BadStreamRequest` says what is wrong
    with it."""
    if value is None or value.strip() == "":
        return Resume(Mode.LIVE)
    text = value.strip()
    if not text.isdigit() or not text.isascii():
        raise BadStreamRequest(
            f"Last-Event-ID {_shown(value)} is not a journal position: send the id of the last "
            "event received (a whole number), 0 for full replication, or a Unix time in "
            "milliseconds")
    digits = text.lstrip("0") or "0"
    if len(digits) > LONGEST or int(digits) >= 2**63:
        raise BadStreamRequest(
            f"Last-Event-ID {_shown(text)} is out of range: journal positions and millisecond "
            "timestamps are below 2^63")
    number = int(digits)
    if number == 0:
        return Resume(Mode.REPLICATE)
    if number < TIMESTAMP_FROM:
        return Resume(Mode.AFTER, position=number)
    latest = datetime.datetime.now(datetime.timezone.utc) + CLOCK_SKEW
    if number > latest.timestamp() * 1000:
        raise BadStreamRequest(f"Last-Event-ID {value!r} read as a millisecond timestamp is "
                               "in the future")
    since = datetime.datetime.fromtimestamp(number / 1000, datetime.timezone.utc)
    return Resume(Mode.SINCE, since=since)


@dataclass(frozen=True)
class Filters:
    """``types=`` and ``parents=``; ``None`` means no filter on that."""

    types: frozenset[str] | None = None
    parents: frozenset[str] | None = None

    def matches(self, entry: JournalEntry) -> bool:
        """An event matches when its type or its aggregate's type is among ``types``, and
        one of its parents, or its aggregate itself (``Type/id``), is among ``parents``."""
        if self.types is not None and not (
                entry.message_type in self.types or entry.aggregate_type in self.types):
            return False
        return self.parents is None or not self.parents.isdisjoint(
            _references(entry.aggregate_type, entry.aggregate_id, entry.parents))

    def matches_aggregate(self, aggregate_type: str, aggregate_id: str,
                          parents: Sequence[str]) -> bool:
        """The same rule for an aggregate's state during replication."""
        if self.types is not None and aggregate_type not in self.types:
            return False
        return self.parents is None or not self.parents.isdisjoint(
            _references(aggregate_type, aggregate_id, parents))


def filters_from(query: Mapping[str, Sequence[str]]) -> Filters:
    """The filters of a parsed query string (``urllib.parse.parse_qs(...,
    keep_blank_values=True)``)."""
    unknown = sorted(set(query) - set(PARAMETERS))
    if unknown:
        raise BadStreamRequest(f"unknown query parameter(s) {', '.join(unknown)}; the stream takes "
                         f"{', '.join(PARAMETERS)}")
    return Filters(types=_listed(query, "types"), parents=_listed(query, "parents"))


def _listed(query: Mapping[str, Sequence[str]], name: str) -> frozenset[str] | None:
    values = query.get(name)
    if values is None:
        return None
    items = [item.strip() for value in values for item in value.split(",")]
    if not items or any(not item for item in items):
        raise BadStreamRequest(f"{name}= needs a comma-separated list without empty items, "
                         f"got {','.join(values)!r}")
    return frozenset(items)


def _shown(value: str) -> str:
    """``value`` quoted, cut short if long (it goes back in an answer)."""
    return repr(value) if len(value) <= 40 else repr(value[:40]) + "..."


def _references(aggregate_type: str | None, aggregate_id: str | None,
                parents: Iterable[str]) -> set[str]:
    found = set(parents)
    if aggregate_type and aggregate_id:
        found.add(f"{aggregate_type}/{aggregate_id}")
    return found
