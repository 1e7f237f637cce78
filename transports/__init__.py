"""The transport contract and its kombu implementation (memory://, amqp://, redis://)."""

from __future__ import annotations

from .base import Delivery, Transport
from .errors import TransportError, TransportUnavailable
from .kombu import KombuTransport

__all__ = ["Delivery", "KombuTransport", "Transport", "TransportError", "TransportUnavailable"]
