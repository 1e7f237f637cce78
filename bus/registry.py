"""The message types one endpoint knows, by wire name."""

from __future__ import annotations

from collections.abc import Iterable

from .errors import ConfigurationError, UnknownMessageType
from .messages import Message, is_message_type, message_name


class MessageRegistry:
    """Wire name to message class, built explicitly when an endpoint is created."""

    def __init__(self, message_types: Iterable[type[Message]] = ()) -> None:
        self._by_name: dict[str, type[Message]] = {}
        for message_type in message_types:
            self.add(message_type)

    def add(self, message_type: type[Message]) -> None:
        if not is_message_type(message_type):
            raise ConfigurationError(
                f"{message_type!r} is not a message type: derive it from bus.Command or bus.Event"
            )
        name = message_name(message_type)
        known = self._by_name.get(name)
        if known is not None and known is not message_type:
            raise ConfigurationError(
                f"two message types share the wire name {name!r}: "
                f"{known.__module__}.{known.__qualname__} and "
                f"{message_type.__module__}.{message_type.__qualname__}; give one of them "
                "another name with class ...(Command, message_name='...')"
            )
        self._by_name[name] = message_type

    def resolve(self, name: str) -> type[Message]:
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownMessageType(
                f"unknown message type {name!r}; this endpoint knows "
                f"{', '.join(sorted(self._by_name)) or 'no types'}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._by_name.values())
