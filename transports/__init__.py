"""The transport contract and its kombu implementation (memory://, amqp://, redis://)."""

from __future__ import annotations

from transports.base import Delivery, Transport
from transports.errors import TransportError, TransportUnavailable
from transports.kombu import KombuTransport

__all__ = ["Delivery", "KombuTransport", "Transport", "TransportError", "TransportUnavailable"]
