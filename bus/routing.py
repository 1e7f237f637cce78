"""Where commands go: a validated map from command type to endpoint queue."""

from __future__ import annotations

from collections.abc import Mapping

from .errors import ConfigurationError, RoutingError
from .messages import Command, Event, Message, message_name


class Router:
    """Maps command types to the queue of the endpoint that handles them."""

    def __init__(self, routes: Mapping[type[Message], str] | None = None) -> None:
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
