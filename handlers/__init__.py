"""Handler base classes users subclass, and the ``@handles`` decorator."""

from __future__ import annotations

from handlers.base import AggregateHandler, Handler, handles
from handlers.errors import HandlerDefinitionError

__all__ = ["AggregateHandler", "Handler", "HandlerDefinitionError", "handles"]
