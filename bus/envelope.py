"""The envelope: a message as it travels and as it is stored for redispatch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bus import headers as h


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

    @property
    def message_id(self) -> str:
        return self.headers[h.MESSAGE_ID]

    @property
    def message_type(self) -> str:
        return self.headers[h.MESSAGE_TYPE]

    @property
    def intent(self) -> h.Intent:
        return h.Intent(self.headers.get(h.INTENT, h.Intent.SEND.value))

    def to_record(self) -> dict[str, Any]:
        """Plain JSON-compatible form kept by storage backends."""
        return {"headers": dict(self.headers), "body": self.body, "destination": self.destination}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Envelope:
        """Inverse of :meth:`to_record`."""
        return cls(
            headers=dict(record["headers"]),
            body=record["body"],
            destination=record.get("destination"),
        )
