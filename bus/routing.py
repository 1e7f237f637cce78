"""Where commands go: a validated map from command type to endpoint queue, and what keys
the ordered ones.

A command type may declare its ordering key itself (``class Post(Command,
ordered_by="account")``, :mod:`idembus.messages`); an aggregate handler may declare it for
the commands it handles (``class Ledger(AggregateHandler[Balance], ordered=True)``: by its
``aggregate_id``), and the sender must know that declaration to send them with their key.
A sender knows it through its :class:`Router` (:class:`Ordering`, one per command type): an
endpoint's router carries the orderings of the handlers it hosts and of those it is told
about (``Endpoint(ordering_from=[...])``), a bare :class:`~idembus.sending.Bus` those of
the router it is given. Nothing is registered anywhere else: a sender without the
declaration sends such commands without a key (the receiver handles them, counts them as
``unordered`` and says so once per type).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .errors import ConfigurationError, RoutingError
from .messages import (
    Command,
    Event,
    Message,
    enclosed_types,
    message_name,
    ordered_partitions,
    ordering_key,
)


@dataclass(frozen=True)
class Ordering:
    """How the messages of one command type are ordered by a handler's declaration: the
    ``key`` of a message (text; ``None`` is refused at the send), into how many
    ``partitions`` the keys are spread, and who declared it (for messages)."""

    key: Callable[[Message], object]
    partitions: int
    declared_by: str


def _ordering_of(message_type: type[Message],
                 orderings: Mapping[type[Message], Ordering]) -> Ordering | None:
    """What orders ``message_type``: its own declaration first, else its ordering (or
    that of the nearest type it derives from) in ``orderings``; ``None``: nothing."""
    own = ordered_partitions(message_type)
    if own:
        return Ordering(ordering_key, own, f"{message_type.__qualname__}'s ordered_by")
    for level in enclosed_types(message_type):
        ordering = orderings.get(level)
        if ordering is not None:
            return ordering
    return None


def partitions_of(message_type: type[Message],
                  orderings: Mapping[type[Message], Ordering]) -> int:
    """Into how many partitions the keys of ``message_type`` are spread (its own
    declaration, else its ordering in ``orderings``); 0 if nothing orders it."""
    ordering = _ordering_of(message_type, orderings)
    return ordering.partitions if ordering is not None else 0


class Router:
    """Maps command types to the queue of the endpoint that handles them, and knows the
    orderings handlers declared for command types (``orderings``, :class:`Ordering`:
    what a bus sending them through this router keys them by)."""

    def __init__(self, routes: Mapping[type[Message], str] | None = None, *,
                 orderings: Mapping[type[Message], Ordering] | None = None) -> None:
        self._orderings: dict[type[Message], Ordering] = dict(orderings or {})
        #: What orders each type sent so far (``None``: nothing), worked out on first use.
        self._order_by_type: dict[type[Message], Ordering | None] = {}
        self._routes: dict[type[Message], str] = {}
        for message_type, destination in (routes or {}).items():
            if isinstance(message_type, type) and issubclass(message_type, Event):
                raise ConfigurationError(
                    f"routes: {message_type.__qualname__} is an event; events are published "
                    "to their subscribers, not routed. Remove it from routes."
                )
            if not (isinstance(message_type, type) and issubclass(message_type, Command)):
                raise ConfigurationError(
                    f"routes: key {message_type!r} is not a command type; route subclasses "
                    "of bus.Command to endpoint names, e.g. routes={PlaceOrder: 'sales'}"
                )
            if not isinstance(destination, str) or not destination.strip():
                raise ConfigurationError(
                    f"routes: {message_type.__qualname__} needs an endpoint name, "
                    f"got {destination!r}"
                )
            self._routes[message_type] = destination

    def destination_for(self, command_type: type[Message]) -> str:
        """The queue for ``command_type`` (or a routed base class of it)."""
        for candidate in command_type.__mro__:
            destination = self._routes.get(candidate)
            if destination is not None:
                return destination
        raise RoutingError(
            f"no route for command {message_name(command_type)}: add "
            f"routes={{{command_type.__name__}: '<endpoint name>'}} to the Endpoint, "
            "or pass to='<endpoint name>' to send()"
        )

    def has_route(self, command_type: type[Message]) -> bool:
        return any(candidate in self._routes for candidate in command_type.__mro__)

    @property
    def command_types(self) -> list[type[Message]]:
        return list(self._routes)

    @property
    def orderings(self) -> Mapping[type[Message], Ordering]:
        """The orderings handlers declared, by command type (types that declare their own
        ``ordered_by=`` are not among them)."""
        return dict(self._orderings)

    def order_of(self, message: Message) -> tuple[str, int] | None:
        """The ordering key of ``message`` and its number of partitions (its type's own
        declaration, else a handler's this router knows); ``None``: unordered."""
        cls = type(message)
        try:
            ordering = self._order_by_type[cls]
        except KeyError:
            ordering = self._order_by_type[cls] = _ordering_of(cls, self._orderings)
        if ordering is None:
            return None
        key = ordering.key(message)
        if key is None:
            raise ValueError(f"{cls.__qualname__}: its ordering key, from "
                             f"{ordering.declared_by}, is None; give every ordered message "
                             "a key")
        return str(key), ordering.partitions

    def partitions_of(self, message_type: type[Message]) -> int:
        """Into how many partitions the keys of ``message_type`` are spread; 0 if nothing
        this router knows orders it."""
        return partitions_of(message_type, self._orderings)


#: How the queue of one partition of an endpoint's ordered messages is named.
_PARTITION_SUFFIX = ".ordered."


def partition_queue(queue: str, partition: int) -> str:
    """The queue of ``partition`` of ``queue``'s ordered messages: ``<queue>.ordered.<i>``
    (RabbitMQ; the database queues keep them in ``queue`` itself, :func:`base_queue`)."""
    return f"{queue}{_PARTITION_SUFFIX}{partition}"


def base_queue(queue: str) -> str:
    """The endpoint queue a partition queue belongs to (``queue`` itself if it is none)."""
    head, found, tail = queue.rpartition(_PARTITION_SUFFIX)
    return head if found and tail.isdigit() else queue
