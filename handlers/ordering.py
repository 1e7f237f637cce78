"""A handler's ordering declaration (``ordered=`` / ``ordered_by=`` / ``partitions=`` class
keywords, :class:`~idembus.handlers.Handler`), checked when the class is made.

``ordered=True`` orders the commands an aggregate handler handles by its
:meth:`~idembus.handlers.AggregateHandler.aggregate_id`; ``ordered_by="field"`` or
``ordered_by=callable`` by what it names or returns. The endpoint turns declarations into
the orderings its senders follow (:func:`idembus.handlers.registration.handler_orderings`).
"""

from __future__ import annotations

from typing import Any

from ..messages import MAX_PARTITIONS
from .errors import HandlerDefinitionError


class _AggregateId:
    """The declaration ``ordered=True``: by the handler's ``aggregate_id``."""

    def __repr__(self) -> str:
        return "AGGREGATE_ID"


#: What ``__ordered_by__`` holds for ``ordered=True``.
AGGREGATE_ID: Any = _AggregateId()


def declare_order(cls: type, *, ordered: object, ordered_by: object,
                  partitions: object) -> None:
    """Check and keep a handler class's ordering keywords (inherited by subclasses)."""
    owner = f"{cls.__module__}.{cls.__qualname__}"
    if not isinstance(ordered, bool):
        raise HandlerDefinitionError(f"{owner}: ordered must be True or False, not {ordered!r}")
    if ordered and ordered_by is not None:
        raise HandlerDefinitionError(
            f"{owner}: give ordered=True (by aggregate_id) or ordered_by=..., not both")
    if ordered:
        if not callable(getattr(cls, "aggregate_id", None)):
            raise HandlerDefinitionError(
                f"{owner}: ordered=True orders by aggregate_id, which only an "
                "AggregateHandler has; give ordered_by='field' or ordered_by=callable")
        cls.__ordered_by__ = AGGREGATE_ID  # type: ignore[attr-defined]
    elif ordered_by is not None:
        if not (isinstance(ordered_by, str) and ordered_by.isidentifier()
                or callable(ordered_by)):
            raise HandlerDefinitionError(
                f"{owner}: ordered_by must name a field of the commands it handles "
                f"(ordered_by='account_id') or be a callable taking the message, not "
                f"{ordered_by!r}")
        cls.__ordered_by__ = ordered_by  # type: ignore[attr-defined]
    if partitions is not None:
        if getattr(cls, "__ordered_by__", None) is None:
            raise HandlerDefinitionError(
                f"{owner}: partitions= goes with ordered=True or ordered_by=")
        if isinstance(partitions, bool) or not isinstance(partitions, int) \
                or not 1 <= partitions <= MAX_PARTITIONS:
            raise HandlerDefinitionError(
                f"{owner}: partitions must be a whole number from 1 to {MAX_PARTITIONS}, "
                f"not {partitions!r}")
        cls.__partitions__ = partitions  # type: ignore[attr-defined]
