"""The message types one endpoint knows, by wire name and by earlier names (aliases)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from .errors import ConfigurationError, UnknownMessageType
from .logs import LIMIT, loggable
from .messages import Message, is_message_type, message_aliases, message_name


class MessageRegistry:
    """Wire name (or alias) to message class, built explicitly when an endpoint is created."""

    def __init__(self, message_types: Iterable[type[Message]] = ()) -> None:
        self._by_name: dict[str, type[Message]] = {}
        self._types: list[type[Message]] = []
        for message_type in message_types:
            self.add(message_type)

    def add(self, message_type: type[Message]) -> None:
        """Know ``message_type`` by its wire name and its aliases; a name another type
        already has is a :class:`~idembus.errors.ConfigurationError`."""
        if not is_message_type(message_type):
            raise ConfigurationError(
                f"{message_type!r} is not a message type: derive it from bus.Command or bus.Event"
            )
        if message_type in self._types:
            return
        names = (message_name(message_type), *message_aliases(message_type))
        for name in names:
            known = self._by_name.get(name)
            if known is not None:
                raise ConfigurationError(
                    f"two message types share the wire name {name!r}: "
                    f"{_qualified(known)} ({_role(known, name)}) and "
                    f"{_qualified(message_type)} ({_role(message_type, name)}); give one of "
                    "them another name with class ...(Command, message_name='...') or drop "
                    "the alias"
                )
        for name in names:
            self._by_name[name] = message_type
        self._types.append(message_type)

    def resolve(self, name: str) -> type[Message]:
        """The type known by ``name``; :class:`~idembus.errors.UnknownMessageType` if none."""
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownMessageType(
                f"unknown message type {_quoted(name)}; this endpoint knows "
                f"{', '.join(sorted(self._by_name)) or 'no types'}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[type[Message]]:
        """Each known type once."""
        return iter(list(self._types))


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _role(cls: type[Message], name: str) -> str:
    return "its name" if message_name(cls) == name else "an alias"


def _quoted(name: str) -> str:
    """A wire name in a reason: quoted and escaped, and bounded (it came from a sender)."""
    return repr(name) if len(name) <= LIMIT else loggable(name)
