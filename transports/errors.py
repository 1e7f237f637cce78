"""Errors raised by transports (the tree is drawn in :mod:`idembus.errors`).

Broker driver errors are translated into these at the transport boundary.
"""

from __future__ import annotations

from ..errors import BusError, EndpointBlocked, MessageRefused


class TransportError(BusError):
    """Root of the transport errors."""


class TransportUnavailable(TransportError):
    """The broker cannot be reached for now (transient): try again later."""


class BrokerAccessDenied(TransportUnavailable, EndpointBlocked):
    """The broker refuses this endpoint (login refused, its own queue refused or declared
    with other arguments): nothing works until an operator acts."""


class DestinationRefused(TransportError, MessageRefused):
    """The broker refused where or what this message is sent (no such queue, a reserved
    name, a queue declared with other arguments, headers too large): permanent for this
    message."""
