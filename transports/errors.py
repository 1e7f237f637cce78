"""Errors raised by transports (the tree is drawn in :mod:`bus.errors`).

Broker driver errors are translated into these at the transport boundary.
"""

from __future__ import annotations

from bus.errors import BusError


class TransportError(BusError):
    """Root of the transport errors."""


class TransportUnavailable(TransportError):
    """The broker cannot be reached, or refused a publish."""
