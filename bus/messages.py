"""Message base classes and their wire names.

Messages are pydantic v2 models. Commands ask one endpoint to do something and are
*sent*; events state that something happened and are *published* to every subscriber.
Each message type has a stable name used on the wire: the class name unless the class
says otherwise with the ``message_name`` keyword::

    class PlaceOrder(Command, message_name="sales.PlaceOrder"):
        order_id: str

A type may also give its messages a time to live, after which a receiver discards them
(:mod:`idembus.expiry`; a subclass inherits it)::

    class PriceQuote(Event, discard_after=30):  # seconds, or a timedelta
        price: int

A type can evolve (README, "Evolving messages and state"): ``aliases=("OldName", ...)``
are names it was sent under before, still decoded as it; ``message_version=N`` (default 1)
is the version of its body's shape, sent in ``idembus.message_version``, and
:func:`idembus.evolution.upcaster` functions turn older bodies into it. A message type
derived from another (``class OrderPlaced(OrderEvent)``) reaches the handlers of both
(README, "Message hierarchies"): :func:`enclosed_types` lists what it is.

A command type may be ordered by a key: ``ordered_by="account_id"`` (a field, or a callable
taking the message) makes its messages with the same key handled one at a time in the
order they were sent (``docs/guide/ordered-processing.md``); ``partitions=N`` (default
16) is how many partitions the keys are spread into (:func:`partition_of`).

Nothing is registered by defining a class; endpoints learn their types from the handlers
and routes they are given.
"""

from __future__ import annotations

import datetime
import hashlib
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from pydantic import BaseModel

from .errors import ConfigurationError
from .expiry import time_to_live

#: Partitions of an ordered type unless it says otherwise (``partitions=``).
DEFAULT_PARTITIONS = 16
#: The most partitions a type may have (each is a queue on RabbitMQ).
MAX_PARTITIONS = 256

#: Characters allowed in a wire name. Dots group names; AMQP topic wildcards are excluded.
_WIRE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")

#: A parent reference of an event (``user/42``): no commas (they separate parents in the
#: header and in the gateway's filter) and no whitespace.
_PARENT = re.compile(r"[^,\s]+")


class Message(BaseModel):
    """Base of every message; derive from :class:`Command` or :class:`Event` instead.

    Class keywords: ``message_name`` (the wire name; default the class name), ``aliases``
    (earlier wire names, still decoded as this type) and ``message_version`` (the version
    of the body's shape, default 1), none of them inherited; ``discard_after`` (the time
    to live of its messages, inherited by subclasses).
    """

    __message_name__: ClassVar[str]
    __message_aliases__: ClassVar[tuple[str, ...]] = ()
    __message_version__: ClassVar[int] = 1
    #: The time to live of this type's messages (``discard_after=`` class keyword).
    __discard_after__: ClassVar[datetime.timedelta | None] = None
    #: What orders this type's messages (``ordered_by=`` class keyword, inherited): a
    #: field name or a callable giving the key; ``None``: unordered.
    __ordered_by__: ClassVar[str | Callable[[Any], object] | None] = None
    #: Into how many partitions the keys are spread (``partitions=``, inherited).
    __partitions__: ClassVar[int] = DEFAULT_PARTITIONS

    def __init_subclass__(cls, *, message_name: str | None = None,
                          aliases: Sequence[str] = (), message_version: int = 1,
                          discard_after: object = None, ordered_by: object = None,
                          partitions: int | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if discard_after is not None:
            cls.__discard_after__ = _class_time_to_live(cls, discard_after)
        _declare_order(cls, ordered_by, partitions)
        wire_name = message_name or cls.__name__
        _check_wire_name(cls, wire_name, "message name")
        if isinstance(aliases, str):
            raise ConfigurationError(
                f"{cls.__qualname__}: aliases must be a tuple of names, e.g. "
                f"aliases=({aliases!r},), not the string {aliases!r}")
        for alias in aliases:
            _check_wire_name(cls, alias, "alias")
        if wire_name in aliases or len(set(aliases)) != len(aliases):
            raise ConfigurationError(
                f"{cls.__qualname__}: aliases {tuple(aliases)!r} repeat a name (or the "
                f"message name {wire_name!r}); list each earlier name once")
        if (isinstance(message_version, bool) or not isinstance(message_version, int)
                or message_version < 1):
            raise ConfigurationError(
                f"{cls.__qualname__}: message_version must be a whole number from 1, got "
                f"{message_version!r}")
        cls.__message_name__ = wire_name
        cls.__message_aliases__ = tuple(aliases)
        cls.__message_version__ = message_version

    @classmethod
    def __pydantic_init_subclass__(cls, *, message_name: str | None = None,
                                   aliases: Sequence[str] = (), message_version: int = 1,
                                   discard_after: object = None, ordered_by: object = None,
                                   partitions: int | None = None, **kwargs: Any) -> None:
        # __init_subclass__ consumed the keywords; pydantic passes class keywords here too.
        super().__pydantic_init_subclass__(**kwargs)


def _declare_order(cls: type[Message], ordered_by: object, partitions: int | None) -> None:
    """Check and keep the ``ordered_by=`` and ``partitions=`` keywords of ``cls``."""
    if ordered_by is not None:
        if not (isinstance(ordered_by, str) and ordered_by.isidentifier()
                or callable(ordered_by)):
            raise ConfigurationError(
                f"{cls.__qualname__}: ordered_by must name a field (ordered_by='account_id') "
                f"or be a callable taking the message, not {ordered_by!r}")
        if issubclass(cls, Event):
            raise ConfigurationError(
                f"{cls.__qualname__}: ordered_by is for commands; an event reaches every "
                "subscriber's queue and is not ordered by key")
        if isinstance(ordered_by, str) and not any(
                ordered_by in getattr(base, "__annotations__", {}) for base in cls.__mro__):
            raise ConfigurationError(
                f"{cls.__qualname__}: ordered_by={ordered_by!r} is not a field of the message")
        cls.__ordered_by__ = ordered_by
    if partitions is not None:
        if isinstance(partitions, bool) or not isinstance(partitions, int) \
                or not 1 <= partitions <= MAX_PARTITIONS:
            raise ConfigurationError(
                f"{cls.__qualname__}: partitions must be a whole number from 1 to "
                f"{MAX_PARTITIONS}, not {partitions!r}")
        cls.__partitions__ = partitions


def ordering_key(message: Message) -> str | None:
    """The key that orders ``message`` (its type's ``ordered_by=``), as text; ``None`` for
    a message of an unordered type."""
    order = type(message).__ordered_by__
    if order is None:
        return None
    key = getattr(message, order) if isinstance(order, str) else order(message)
    if key is None:
        raise ValueError(f"{type(message).__qualname__}: the ordering key (ordered_by) of "
                         "this message is None; give every ordered message a key")
    return str(key)


def ordered_partitions(message_type: type[Message] | Message) -> int:
    """How many partitions the keys of ``message_type`` are spread into; 0 if unordered."""
    cls = message_type if isinstance(message_type, type) else type(message_type)
    return cls.__partitions__ if cls.__ordered_by__ is not None else 0


def partition_of(key: str, partitions: int) -> int:
    """The partition of ``key``, in ``[0, partitions)``: the same in every process, every
    language and every version (the first 8 bytes of the key's BLAKE2b digest, big-endian,
    modulo ``partitions``), never Python's salted ``hash()``."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % partitions


def _check_wire_name(cls: type, name: object, what: str) -> None:
    if not isinstance(name, str) or not _WIRE_NAME.fullmatch(name):
        raise ConfigurationError(
            f"{cls.__qualname__}: {what} {name!r} must start with a letter or '_'"
            " and contain only letters, digits, '_', '-' and '.'"
        )


class Command(Message):
    """A request for one endpoint to act; sent with ``bus.send``."""


class Event(Message):
    """A fact other endpoints may react to; published with ``bus.publish``."""

    def journal_parents(self) -> Sequence[str]:
        """References such as ``user/42`` that clients of the event stream filter on
        (``idembus gateway``'s ``parents=``); none by default. Override to name them::

            def journal_parents(self) -> list[str]:
                return [f"user/{self.user_id}", f"video/{self.video_id}"]

        Each must be non-empty, without commas or whitespace. They travel in the
        ``idembus.parents`` header and are kept in the event journal.
        """
        return ()


def parents_of(event: Event) -> tuple[str, ...]:
    """The event's :meth:`~Event.journal_parents`, checked."""
    parents = tuple(event.journal_parents())
    for parent in parents:
        if not isinstance(parent, str) or not _PARENT.fullmatch(parent):
            raise ValueError(
                f"{type(event).__qualname__}.journal_parents() gave {parent!r}: a parent is a "
                "non-empty string without commas or whitespace, such as 'user/42'")
    return parents


def _class_time_to_live(cls: type, value: object) -> datetime.timedelta:
    try:
        return time_to_live(value)
    except (TypeError, ValueError) as wrong:
        raise ConfigurationError(
            f"{cls.__qualname__}: {wrong}; write discard_after=30 (seconds) or "
            "discard_after=datetime.timedelta(minutes=5)") from None


def default_time_to_live(message_type: type[Message] | Message) -> datetime.timedelta | None:
    """How long messages of this type live unless a send says otherwise (the type's
    ``discard_after=`` keyword, or its nearest base's); ``None``: for ever."""
    cls = message_type if isinstance(message_type, type) else type(message_type)
    return cls.__discard_after__


def message_name(message_type: type[Message] | Message) -> str:
    """Return the wire name of a message type (or of a message's type)."""
    cls = message_type if isinstance(message_type, type) else type(message_type)
    return cls.__message_name__


def message_aliases(message_type: type[Message]) -> tuple[str, ...]:
    """The earlier wire names of a message type (its ``aliases=`` keyword)."""
    return message_type.__message_aliases__


def message_version(message_type: type[Message] | Message) -> int:
    """The version of a message type's body (its ``message_version=`` keyword; 1 unless
    it says otherwise)."""
    cls = message_type if isinstance(message_type, type) else type(message_type)
    return cls.__message_version__


def enclosed_types(message_type: type[Message] | Message) -> tuple[type[Message], ...]:
    """The message type and the message types it derives from (the concrete subclasses of
    Command or Event in its MRO), most derived first: what a message of this type is, for
    dispatch and routing (``OrderPlaced(OrderEvent)`` -> ``(OrderPlaced, OrderEvent)``)."""
    cls = message_type if isinstance(message_type, type) else type(message_type)
    return tuple(base for base in cls.__mro__ if is_message_type(base))


def is_message_type(candidate: object) -> bool:
    """True for concrete message classes: subclasses of Command or Event."""
    return (
        isinstance(candidate, type)
        and issubclass(candidate, (Command, Event))
        and candidate not in (Command, Event)
    )
