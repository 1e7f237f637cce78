"""Turning handler classes into a validated table: message type -> handler bindings.

Everything that can be wrong with a handler is found here, when the endpoint is created,
and reported with what to change.

Dispatch is polymorphic: a message reaches every handler class that handles its type or a
message type it derives from, each class once, through its most specific method (the one
whose type is nearest in the message's MRO). Two classes handling different levels of a
hierarchy both get it; deduplication stays per (handler, message id).
"""

from __future__ import annotations

import functools
import inspect
import operator
import re
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Union

from ..evolution import version_of
from ..messages import (
    Command,
    Message,
    enclosed_types,
    is_message_type,
    message_name,
    ordered_partitions,
)
from ..routing import Ordering
from .base import HANDLES_ATTRIBUTE, AggregateHandler, Handler
from .errors import HandlerDefinitionError
from .ordering import AGGREGATE_ID

#: What an aggregate type name may be: a storage name (a MongoDB collection, a PostgreSQL
#: column value), the event name of the gateway's replication stream, the first half of
#: ``Type/id`` references. Letters, digits, ``_``, ``-`` and ``.``; no ``/``, ``,``,
#: whitespace, ``$`` or line break. Checked with ``fullmatch``: ``$`` would accept a
#: trailing newline.
_AGGREGATE_TYPE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,99}")
#: Prefixes of names that idembus's own records and the database's use (``idembus_inbox``,
#: ``idembus_journal``, ``idembus_parked``..., MongoDB's ``system.*``), compared in lower case.
_RESERVED_PREFIXES = ("idembus", "system.")


def check_aggregate_type(name: object, owner: str) -> None:
    """Refuse an aggregate type name that could be read as something else: one with a line
    break could forge events in the gateway's stream (``event: <type>`` is a line of it),
    one with ``/`` forge a ``Type/id`` reference, one named like ``idembus_journal`` write
    into idembus's own collections (the journal's entries, the inbox, parked messages)."""
    if not isinstance(name, str) or not _AGGREGATE_TYPE.fullmatch(name):
        raise HandlerDefinitionError(
            f"{owner}: aggregate type {name!r} must start with a letter or '_', contain "
            "only letters, digits, '_', '-' and '.', and be at most 100 characters (it names "
            "the aggregate's storage, its stream events and its Type/id references)")
    if name.lower().startswith(_RESERVED_PREFIXES):
        raise HandlerDefinitionError(
            f"{owner}: aggregate type {name!r} starts with a name idembus or the database "
            f"reserves ({', '.join(_RESERVED_PREFIXES)}): its records would mix with "
            "idembus's own (journal, inbox, parked messages); choose another aggregate_type")


@dataclass(frozen=True)
class HandlerBinding:
    """One handler method bound to one message type."""

    handler: Handler
    method_name: str
    message_type: type[Message]

    @functools.cached_property
    def handler_name(self) -> str:
        """The handler's :meth:`~idembus.handlers.Handler.name` (asked once per binding:
        a class attribute, set when the class is made)."""
        return type(self.handler).name()

    @functools.cached_property
    def state_version(self) -> int | None:
        """The ``state_version`` an aggregate handler's commit stores: its state model's
        version, ``None`` at version 1 (read back as 1, as units of work store it too);
        ``None`` for a stateless handler. Asked once per binding."""
        handler = self.handler
        if not isinstance(handler, AggregateHandler):
            return None
        version = version_of(type(handler).state_type)  # what version_keyword gives a commit
        return None if version == 1 else version

    @property
    def is_aggregate(self) -> bool:
        return isinstance(self.handler, AggregateHandler)

    @property
    def aggregate_type(self) -> str | None:
        handler = self.handler
        return type(handler).storage_name() if isinstance(handler, AggregateHandler) else None


class HandlerTable:
    """The handlers of one endpoint, by message type."""

    def __init__(self, handlers: Iterable[Handler | type[Handler]]) -> None:
        self._bindings: dict[type[Message], list[HandlerBinding]] = {}
        #: The bindings a concrete type reaches, worked out on first use.
        self._dispatch: dict[type[Message], list[HandlerBinding]] = {}
        self._handlers: list[Handler] = []
        names: dict[str, type[Handler]] = {}
        for given in handlers:
            handler = _instantiate(given)
            cls = type(handler)
            other = names.get(cls.name())
            if other is not None:
                raise HandlerDefinitionError(
                    f"two handlers are named {cls.name()!r} ({_qualified(other)} and "
                    f"{_qualified(cls)}); deduplication is scoped by this name, so set a "
                    "distinct handler_name on one of them"
                )
            names[cls.name()] = cls
            self._handlers.append(handler)
            for binding in _bindings_of(handler):
                self._add(binding)

    def _add(self, binding: HandlerBinding) -> None:
        for handled, existing in self._bindings.items():
            for other in existing:
                if (binding.is_aggregate and other.aggregate_type == binding.aggregate_type
                        and other.handler is not binding.handler
                        and _overlap(handled, binding.message_type)):
                    raise HandlerDefinitionError(
                        f"{_qualified(type(other.handler))} and "
                        f"{_qualified(type(binding.handler))} both change aggregate "
                        f"{binding.aggregate_type!r} on {_overlap(handled, binding.message_type)}"
                        "; let one handler handle it"
                    )
        self._bindings.setdefault(binding.message_type, []).append(binding)

    def bindings_for(self, message_type: type[Message]) -> list[HandlerBinding]:
        """The bindings a message of the concrete type ``message_type`` is handled by: one
        per handler class that handles it or a message type it derives from, the most
        specific method of each, in the order the handlers were given."""
        found = self._dispatch.get(message_type)
        if found is None:
            found = self._dispatch[message_type] = self._resolve(message_type)
        return found

    def _resolve(self, message_type: type[Message]) -> list[HandlerBinding]:
        levels = enclosed_types(message_type)
        chosen: list[HandlerBinding] = []
        for handler in self._handlers:
            for level in levels:  # most derived first: the nearest method wins
                binding = next((b for b in self._bindings.get(level, ())
                                if b.handler is handler), None)
                if binding is not None:
                    chosen.append(binding)
                    break
        return chosen

    @property
    def message_types(self) -> list[type[Message]]:
        return list(self._bindings)

    @property
    def handlers(self) -> list[Handler]:
        return list(self._handlers)


def handler_orderings(handlers: Iterable[Handler | type[Handler]]
                      ) -> dict[type[Message], Ordering]:
    """The orderings the ``handlers`` (instances, or classes created without arguments)
    declare with ``ordered=True`` or ``ordered_by=``: one for each command type each
    handles, keyed by its ``aggregate_id``, the field or the callable. Events are not
    ordered (they reach every subscriber), nor types that declare ``ordered_by=``
    themselves (their own declaration is used). A named field must be a field of every
    command type the handler handles; two handlers ordering one type is a
    :class:`~idembus.handlers.HandlerDefinitionError`."""
    found: dict[type[Message], Ordering] = {}
    for given in handlers:
        handler = _instantiate(given)
        cls = type(handler)
        declared = cls.__ordered_by__
        if declared is None:
            continue
        key = _key_function(handler, declared)
        for binding in _bindings_of(handler):
            message_type = binding.message_type
            if not issubclass(message_type, Command) or ordered_partitions(message_type):
                continue
            if isinstance(declared, str) and declared not in message_type.model_fields:
                raise HandlerDefinitionError(
                    f"{_qualified(cls)}: ordered_by={declared!r} is not a field of "
                    f"{message_name(message_type)}, which it handles")
            other = found.get(message_type)
            if other is not None and other.declared_by != _qualified(cls):
                raise HandlerDefinitionError(
                    f"{other.declared_by} and {_qualified(cls)} both order "
                    f"{message_name(message_type)}; let one declare it (or the type, with "
                    "ordered_by=)")
            found[message_type] = Ordering(key, cls.__partitions__, _qualified(cls))
    return found


def _key_function(handler: Handler, declared: object) -> Callable[[Message], object]:
    """The key of a message under ``handler``'s declaration."""
    if declared is AGGREGATE_ID:
        return typing.cast(AggregateHandler[Any], handler).aggregate_id
    if isinstance(declared, str):
        return operator.attrgetter(declared)
    return typing.cast(Callable[[Message], object], declared)


def _overlap(one: type[Message], other: type[Message]) -> str | None:
    """The wire name of the type a message must be of to reach handlers of both ``one``
    and ``other`` (the more derived of the two), if one derives from the other."""
    if issubclass(one, other):
        return message_name(one)
    if issubclass(other, one):
        return message_name(other)
    return None


def _instantiate(given: Handler | type[Handler]) -> Handler:
    if isinstance(given, type):
        if not issubclass(given, Handler):
            raise HandlerDefinitionError(
                f"{given!r} is not a handler: subclass handlers.Handler or AggregateHandler"
            )
        try:
            return given()
        except TypeError as exc:
            raise HandlerDefinitionError(
                f"{_qualified(given)}() cannot be created without arguments ({exc}); "
                "pass an instance instead, e.g. handlers=[MyHandler(dependency)]"
            ) from exc
    if not isinstance(given, Handler):
        raise HandlerDefinitionError(
            f"{given!r} is not a handler: subclass handlers.Handler or AggregateHandler"
        )
    return given


def _bindings_of(handler: Handler) -> list[HandlerBinding]:
    cls = type(handler)
    if isinstance(handler, AggregateHandler):
        _check_aggregate(type(handler))
    bindings: list[HandlerBinding] = []
    seen: dict[type[Message], str] = {}
    for attribute, function in _handling_methods(cls):
        _refuse_async(cls, attribute, function)
        for message_type in _message_types(cls, attribute, function):
            if message_type in seen:
                raise HandlerDefinitionError(
                    f"{_qualified(cls)}.{seen[message_type]} and .{attribute} both handle "
                    f"{message_name(message_type)}; keep one"
                )
            seen[message_type] = attribute
            bindings.append(HandlerBinding(handler, attribute, message_type))
    if not bindings:
        raise HandlerDefinitionError(
            f"{_qualified(cls)} handles nothing: decorate its handling methods with @handles"
        )
    if isinstance(handler, AggregateHandler):
        _check_starts(type(handler), [binding.message_type for binding in bindings])
    return bindings


def _handling_methods(cls: type) -> list[tuple[str, Any]]:
    found = []
    for attribute in dir(cls):
        function = inspect.getattr_static(cls, attribute, None)
        if callable(function) and hasattr(function, HANDLES_ATTRIBUTE):
            found.append((attribute, function))
    return found


def _message_types(cls: type, attribute: str, function: Any) -> list[type[Message]]:
    declared = getattr(function, HANDLES_ATTRIBUTE)
    if not declared:
        declared = _annotated_types(cls, attribute, function)
    for message_type in declared:
        if not is_message_type(message_type):
            raise HandlerDefinitionError(
                f"{_qualified(cls)}.{attribute} handles {message_type!r}, which is not a "
                "message type: derive it from bus.Command or bus.Event"
            )
    return list(declared)


def _annotated_types(cls: type, attribute: str, function: Any) -> tuple[Any, ...]:
    parameters = list(inspect.signature(function).parameters.values())[1:]
    where = f"{_qualified(cls)}.{attribute}"
    if not parameters:
        raise HandlerDefinitionError(f"{where} must take the message as its parameter")
    try:
        hints = typing.get_type_hints(function)
    except Exception as exc:
        raise HandlerDefinitionError(f"{where}: cannot resolve its annotations ({exc})") from exc
    annotation = hints.get(parameters[0].name)
    if annotation is None:
        raise HandlerDefinitionError(
            f"{where}: annotate its message parameter (message: PlaceOrder) or name the "
            "types with @handles(PlaceOrder)"
        )
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _refuse_async(cls: type, attribute: str, function: Any, *, hook: bool = False) -> None:
    """Handling methods may be ``async def`` (run to completion on the consumer thread's
    loop, :mod:`idembus.runtime.aio`), but not async generators: the body would never run. The
    ``hook`` methods (``aggregate_id``, ``new_state``) are called synchronously, to name or
    build the aggregate the handling method works on: an ``async def`` there would hand
    back a coroutine instead."""
    unwrapped = inspect.unwrap(getattr(function, "__func__", function))
    is_async = inspect.iscoroutinefunction(unwrapped) or inspect.isasyncgenfunction(unwrapped)
    if hook and is_async:
        raise HandlerDefinitionError(
            f"{_qualified(cls)}.{attribute} is 'async def', but idembus calls {attribute}() "
            "synchronously, to name or build the aggregate the handling method works on: "
            "the coroutine would never run. Write it as a plain 'def' (handling methods "
            "may be 'async def'; do the async work there)"
        )
    if inspect.isasyncgenfunction(unwrapped):
        raise HandlerDefinitionError(
            f"{_qualified(cls)}.{attribute} is an async generator ('async def' with "
            "'yield'): its body would never run. Handling methods are 'def' or 'async def' "
            "and return None; send, publish or reply through self.bus"
        )


def _check_aggregate(cls: type[AggregateHandler[Any]]) -> None:
    if not hasattr(cls, "state_type"):
        raise HandlerDefinitionError(
            f"{_qualified(cls)} needs its state type: class {cls.__name__}"
            "(AggregateHandler[MyState]) where MyState is a pydantic model"
        )
    if cls.aggregate_id is AggregateHandler.aggregate_id:
        raise HandlerDefinitionError(
            f"{_qualified(cls)} must implement aggregate_id(self, message) -> str"
        )
    check_aggregate_type(cls.storage_name(), _qualified(cls))
    for hook in ("aggregate_id", "new_state"):
        _refuse_async(cls, hook, inspect.getattr_static(cls, hook), hook=True)
    required = [name for name, field in cls.state_type.model_fields.items() if field.is_required()]
    if required and cls.new_state is AggregateHandler.new_state:
        raise HandlerDefinitionError(
            f"{_qualified(cls)}: {cls.state_type.__name__} has required fields {required}; "
            "give them defaults or implement new_state(self, aggregate_id, message)"
        )


def _check_starts(cls: type[AggregateHandler[Any]], handled: list[type[Message]]) -> None:
    """A saga's ``starts`` is a non-empty tuple of message types the class handles (a
    handled subclass of a listed type counts: it starts the saga too)."""
    starts: Any = cls.starts
    if starts is None:
        return
    where = f"{_qualified(cls)}.starts"
    if not isinstance(starts, tuple):
        raise HandlerDefinitionError(
            f"{where} must be a tuple of message types, got {starts!r}; write "
            "starts = (PlaceOrder,) (note the comma), or leave it None to let every message "
            "create the aggregate")
    if not starts:
        raise HandlerDefinitionError(
            f"{where} is empty, so no message could ever start this saga; list the messages "
            "that start it, starts = (PlaceOrder,), or leave it None to let every message "
            "create the aggregate")
    for started_by in starts:
        if not is_message_type(started_by):
            raise HandlerDefinitionError(
                f"{where} lists {started_by!r}, which is not a message type: list Command or "
                "Event classes this saga handles")
        if not any(issubclass(message_type, started_by) for message_type in handled):
            raise HandlerDefinitionError(
                f"{where} lists {message_name(started_by)}, which {cls.__name__} does not "
                f"handle: add a @handles method for it, or remove it from starts")
    _refuse_async(cls, "saga_not_found", inspect.getattr_static(cls, "saga_not_found"))


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
