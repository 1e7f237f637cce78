"""The envelope: a message as it travels and as it is stored for redispatch."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from . import headers as h

#: The content encoding of the bodies idembus writes (JSON text).
TEXT_ENCODING = "utf-8"


@dataclass(frozen=True)
class Envelope:
    """A serialised message with its headers and destination.

    ``destination`` is the queue of a sent or replied message; for a published event it is
    ``None`` and the transport routes by ``message_type``.
    """

    headers: Mapping[str, str]
    body: str
    destination: str | None = None
    #: Only a dead-lettered copy of a foreign message carries anything but JSON.
    content_type: str = h.CONTENT_TYPE
    #: The content encoding the body is published with. ``body`` holds the bytes as they
    #: are (``bytes.decode("utf-8", "surrogateescape")``) whatever this says: a
    #: dead-lettered copy keeps the original's encoding (``latin-1``, ``gzip``) next to its
    #: unchanged bytes. ``None``: the original had none (kombu then writes ``binary``).
    content_encoding: str | None = TEXT_ENCODING

    def __init__(self, headers: Mapping[str, str], body: str, destination: str | None = None,
                 content_type: str = h.CONTENT_TYPE,
                 content_encoding: str | None = TEXT_ENCODING) -> None:
        # The frozen dataclass's own __init__ sets each field with object.__setattr__; one
        # update of the instance's dict does the same (once per message sent).
        self.__dict__.update(headers=headers, body=body, destination=destination,
                             content_type=content_type, content_encoding=content_encoding)

    @property
    def message_id(self) -> str:
        """The ``idembus.message_id`` header (``KeyError`` without one)."""
        return self.headers[h.MESSAGE_ID]

    @property
    def message_type(self) -> str:
        """The ``idembus.message_type`` header: the wire name (``KeyError`` without one)."""
        return self.headers[h.MESSAGE_TYPE]

    @property
    def intent(self) -> h.Intent:
        """Send, publish or reply (``idembus.intent``; send when absent)."""
        return h.Intent(self.headers.get(h.INTENT, h.Intent.SEND.value))

    @property
    def deliver_at(self) -> datetime.datetime | None:
        """When the message may be delivered, if it was deferred."""
        return parse_utc(self.headers.get(h.DELIVER_AT))

    def with_headers(self, changes: Mapping[str, str]) -> Envelope:
        """A copy with ``changes`` applied to the headers."""
        return replace(self, headers={**self.headers, **changes})

    def to_record(self) -> dict[str, Any]:
        """Plain JSON-compatible form kept by storage backends."""
        record: dict[str, Any] = {"headers": dict(self.headers), "body": self.body,
                                  "destination": self.destination}
        if self.content_type != h.CONTENT_TYPE:
            record["content_type"] = self.content_type
        if self.content_encoding != TEXT_ENCODING:
            record["content_encoding"] = self.content_encoding
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Envelope:
        """Inverse of :meth:`to_record`."""
        return cls(
            headers=dict(record["headers"]),
            body=record["body"],
            destination=record.get("destination"),
            content_type=record.get("content_type", h.CONTENT_TYPE),
            content_encoding=record.get("content_encoding", TEXT_ENCODING),
        )


def utc_now() -> datetime.datetime:
    """The current time, timezone-aware UTC: every time idembus stores or sends."""
    return datetime.datetime.now(datetime.timezone.utc)


#: ``"00"`` to ``"99"``: the two-digit fields of a formatted time, looked up.
_TWO_DIGITS = tuple(f"{number:02d}" for number in range(100))


def format_utc(moment: datetime.datetime) -> str:
    """ISO 8601 in UTC, the form of every time header.

    What ``moment.astimezone(timezone.utc).isoformat()`` gives; for a UTC moment with
    microseconds and a four-digit year (every header idembus stamps) put together from its
    fields here, without ``isoformat``'s formatting of each field and of the offset
    (``printf`` in C, the costlier part of stamping a message)."""
    zone = moment.tzinfo
    if zone is datetime.timezone.utc:
        microsecond = moment.microsecond
        year = moment.year
        if microsecond and year >= 1000:
            two = _TWO_DIGITS
            return (f"{year}-{two[moment.month]}-{two[moment.day]}T{two[moment.hour]}:"
                    f"{two[moment.minute]}:{two[moment.second]}."
                    f"{str(1000000 + microsecond)[1:]}+00:00")
        return moment.isoformat()
    if zone is None:
        raise ValueError(f"{moment!r} has no time zone; use an aware datetime (UTC)")
    return moment.astimezone(datetime.timezone.utc).isoformat()


def parse_utc(text: str | None) -> datetime.datetime | None:
    """A time header as an aware datetime (a zone-less time is taken as UTC); ``None`` if
    absent or unreadable."""
    if not text:
        return None
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=datetime.timezone.utc)
