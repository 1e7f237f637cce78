"""Handler base classes users subclass, and the ``@handles`` decorator."""

from __future__ import annotations

from .base import AggregateHandler, Handler, handles
from .errors import HandlerDefinitionError

__all__ = ["AggregateHandler", "Handler", "HandlerDefinitionError", "handles"]
