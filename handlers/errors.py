"""Errors about handler classes (the tree is drawn in :mod:`idembus.errors`)."""

from __future__ import annotations

from ..errors import ConfigurationError


class HandlerDefinitionError(ConfigurationError):
    """A handler class cannot be used as written; the message says what to change."""
