"""idembus: a message bus whose handlers are idempotent even when messages are not.

Public names of the ``bus`` package. ``Endpoint`` is imported on first use: it wires the
``handlers``, ``storage`` and ``transports`` packages, which themselves build on the
foundation modules imported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bus import headers
from bus.context import MessageContext
from bus.envelope import Envelope
from bus.errors import (
    BusError,
    ConfigurationError,
    InvalidMessage,
    MalformedMessage,
    MessageError,
    RoutingError,
    UnknownMessageType,
)
from bus.messages import Command, Event, Message, message_name
from bus.policies import Backoff, ConflictPolicy, RetryPolicy
from bus.sending import Bus

if TYPE_CHECKING:
    from bus.endpoint import Endpoint

__all__ = [
    "Backoff",
    "Bus",
    "BusError",
    "Command",
    "ConfigurationError",
    "ConflictPolicy",
    "Endpoint",
    "Envelope",
    "Event",
    "InvalidMessage",
    "MalformedMessage",
    "Message",
    "MessageContext",
    "MessageError",
    "RetryPolicy",
    "RoutingError",
    "UnknownMessageType",
    "headers",
    "message_name",
]


def __getattr__(name: str) -> object:
    if name == "Endpoint":
        from bus.endpoint import Endpoint

        return Endpoint
    raise AttributeError(f"module 'bus' has no attribute {name!r}")
