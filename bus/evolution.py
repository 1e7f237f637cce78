"""Evolving messages and aggregate state: versions and upcasters.

A message class says which version of its body's shape it is with ``message_version=N``
(default 1; sent in ``idembus.message_version``); an aggregate's state model with the class
variable ``state_version: ClassVar[int] = N`` (stored with the state). An **upcaster** turns
a body (or a stored state) of one version into the next, as plain JSON data, before
pydantic validates it::

    class OrderPlaced(Event, message_version=2):
        order_id: str
        amount_cents: int

    @upcaster(OrderPlaced, from_version=1)
    def _euros_to_cents(body: dict[str, Any]) -> dict[str, Any]:
        return {"order_id": body["order_id"], "amount_cents": round(body["amount"] * 100)}

Steps chain (1 -> 2 -> 3). They are attached to the class they upcast: nothing is registered
anywhere else, so importing the module that defines the class brings its upcasters. What
cannot be decided at definition — a step from a version the class is not above, a step
given twice — fails there; a gap in the chain fails when an endpoint is built
(:func:`check_upcasters`). A body newer than the class, or one whose chain has no step from
its version, is refused with the reason (messages: :class:`~idembus.errors.InvalidMessage`,
to the error queue; states: :class:`~idembus.errors.IncompatibleState`), never guessed at.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypedDict, TypeVar

import pydantic
from pydantic import BaseModel

from .errors import ConfigurationError, IncompatibleState, InvalidMessage
from .messages import Message

Body = dict[str, Any]
Upcast = Callable[[Body], Body]
F = TypeVar("F", bound=Upcast)

#: Where a class keeps its upcasters, by the version they start from (its own ``__dict__``
#: only: a subclass has versions of its own).
_UPCASTERS = "__idembus_upcasters__"
#: The class variable a state model declares its version with.
STATE_VERSION = "state_version"
#: State model -> its version, and the keys its fields are read from: looked up once per
#: model (a model's class variables and fields are set when the class is made).
_state_versions: dict[type[BaseModel], int] = {}
_declared_keys: dict[type[BaseModel], frozenset[str]] = {}


def upcaster(target: type[BaseModel], *, from_version: int) -> Callable[[F], F]:
    """Mark a function ``dict -> dict`` as the step from ``from_version`` to the next
    version of ``target``: a message class (``message_version=``) or a state model
    (``state_version``). The function gets the body as parsed JSON and returns the body of
    the next version; it may change its argument. Returns the function unchanged."""
    if not (isinstance(target, type) and issubclass(target, BaseModel)):
        raise ConfigurationError(
            f"@upcaster takes a message class or a pydantic state model, got {target!r}")
    current = version_of(target)
    if (isinstance(from_version, bool) or not isinstance(from_version, int)
            or not 1 <= from_version < current):
        where = (f"so a step starts from a version in 1..{current - 1}" if current > 1
                 else f"raise its version first ({_how(target)})")
        raise ConfigurationError(
            f"@upcaster({target.__qualname__}, from_version={from_version!r}): "
            f"{target.__qualname__} is at version {current}: {where}")

    def attach(function: F) -> F:
        if not callable(function):
            raise ConfigurationError(f"@upcaster decorates a function, got {function!r}")
        steps = _own_steps(target)
        if from_version in steps:
            raise ConfigurationError(
                f"{target.__qualname__} has two upcasters from version {from_version}: "
                f"{_named(steps[from_version])} and {_named(function)}; keep one")
        steps[from_version] = function
        return function

    return attach


def version_of(target: type[BaseModel]) -> int:
    """The current version of a message class or a state model (1 unless declared)."""
    if issubclass(target, Message):
        return target.__message_version__
    known = _state_versions.get(target)
    if known is not None:
        return known
    # Checked once per model: a model without the class variable misses it through
    # pydantic's metaclass, which raises AttributeError for getattr to catch.
    version = getattr(target, STATE_VERSION, 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ConfigurationError(
            f"{target.__qualname__}.{STATE_VERSION} must be a whole number from 1 "
            f"(state_version: ClassVar[int] = 2), got {version!r}")
    _state_versions[target] = version
    return version


def check_upcasters(target: type[BaseModel]) -> None:
    """Refuse a chain with a gap: steps from versions 1 and 3 of a version-4 class, but
    none from 2. (A chain that starts above 1 is allowed: older bodies are refused.)"""
    current = version_of(target)
    steps = sorted(target.__dict__.get(_UPCASTERS, {}))
    if not steps:
        return
    missing = [v for v in range(steps[0], current) if v not in steps]
    if missing:
        raise ConfigurationError(
            f"{target.__qualname__} (version {current}) has upcasters from versions "
            f"{', '.join(map(str, steps))} but none from {', '.join(map(str, missing))}: "
            f"add @upcaster({target.__qualname__}, from_version={missing[0]})")


def upcast_body(message_type: type[Message], body: Any, version: int) -> Any:
    """``body`` (parsed JSON) of ``version`` as the current version of ``message_type``;
    :class:`~idembus.errors.InvalidMessage` if that cannot be done."""
    return _upcast(message_type, body, version, InvalidMessage, "message")


def upcast_state(state_type: type[BaseModel], state: Mapping[str, Any],
                 version: int | None) -> Body:
    """A stored state of ``version`` (``None``: stored before versions existed, read as 1)
    as the current version of ``state_type``;
    :class:`~idembus.errors.IncompatibleState` if that cannot be done."""
    version = 1 if version is None else version
    if version == version_of(state_type):  # the usual case: nothing to upcast
        return dict(state)
    result = _upcast(state_type, dict(state), version, IncompatibleState, "stored state")
    return dict(result)


StateT = TypeVar("StateT", bound=BaseModel)


def load_state(state_type: type[StateT], stored: Mapping[str, Any],
               version: int | None) -> StateT:
    """The stored state of an aggregate as ``state_type``: upcast from its ``version``,
    then validated. A field the model no longer declares is not dropped silently: it is an
    :class:`~idembus.errors.IncompatibleState` unless the model says what to do with such
    fields — ``model_config = ConfigDict(extra="allow")`` keeps them (and stores them
    again), an explicit ``extra="ignore"`` drops them (``extra="forbid"`` refuses them, as
    the default does). Only the top level is checked: nested models follow their own
    ``extra``."""
    data = upcast_state(state_type, stored, version)
    if state_type.model_config.get("extra") is None:
        unknown = sorted(data.keys() - _declared(state_type))
        if unknown:
            raise IncompatibleState(
                f"the stored state of {state_type.__qualname__} has field(s) "
                f"{', '.join(map(repr, unknown))} that the model no longer declares; "
                "they would be lost at the next commit. Declare them again, move them in a "
                f"state upcaster (state_version, @upcaster({state_type.__qualname__}, "
                "from_version=...)), or set model_config = ConfigDict(extra='allow') to "
                "keep them or extra='ignore' to drop them; then retry the message")
    try:
        return state_type.model_validate(data)
    except pydantic.ValidationError as exc:
        raise IncompatibleState(
            f"the stored state does not match {state_type.__qualname__}: "
            + "; ".join(f"{'.'.join(str(p) for p in error['loc']) or 'state'}: "
                        f"{error['msg']}" for error in exc.errors())) from exc


class VersionKeyword(TypedDict, total=False):
    """The keyword arguments :func:`version_keyword` gives a commit."""

    state_version: int


def version_keyword(state_type: type[BaseModel]) -> VersionKeyword:
    """The ``state_version=`` keyword of a commit of a ``state_type`` state: its version, or
    nothing at version 1 (stored as ``None``, read back as 1), so that a storage backend
    written before versions existed keeps working for models that never declared one."""
    version = version_of(state_type)
    return VersionKeyword() if version == 1 else VersionKeyword(state_version=version)


def _declared(model: type[BaseModel]) -> frozenset[str]:
    """The keys a model's fields are read from: names and string aliases."""
    known = _declared_keys.get(model)
    if known is not None:
        return known
    names: set[str] = set()
    for name, field in model.model_fields.items():
        names.add(name)
        for alias in (field.alias, field.validation_alias):
            if isinstance(alias, str):
                names.add(alias)
    known = _declared_keys[model] = frozenset(names)
    return known


def _upcast(target: type[BaseModel], body: Any, version: int,
            refusal: Callable[[str], Exception], what: str) -> Any:
    current = version_of(target)
    name = target.__qualname__
    if version > current:
        raise refusal(
            f"the {what} is version {version} of {name}, newer than the version {current} "
            f"this endpoint has: deploy the new {name} here first, then retry it")
    steps: dict[int, Upcast] = target.__dict__.get(_UPCASTERS, {})
    for step in range(version, current):
        function = steps.get(step)
        if function is None:
            raise refusal(
                f"the {what} is version {version} of {name} (now version {current}) and no "
                f"upcaster goes from version {step}: add @upcaster({name}, "
                f"from_version={step}), then retry it")
        if not isinstance(body, dict):
            raise refusal(f"the {what} is not a JSON object: version {step} of {name} "
                          "cannot be upcast")
        try:
            body = function(body)
        except Exception as exc:
            raise refusal(
                f"the upcaster of {name} from version {step} ({_named(function)}) failed on "
                f"the {what}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(body, dict):
            raise refusal(
                f"the upcaster of {name} from version {step} ({_named(function)}) returned "
                f"{type(body).__name__}, not a dict")
    return body


def _own_steps(target: type[BaseModel]) -> dict[int, Upcast]:
    steps: dict[int, Upcast] | None = target.__dict__.get(_UPCASTERS)
    if steps is None:
        steps = {}
        setattr(target, _UPCASTERS, steps)
    return steps


def _how(target: type[BaseModel]) -> str:
    if issubclass(target, Message):
        return f"class {target.__name__}(..., message_version=2)"
    return f"{STATE_VERSION}: ClassVar[int] = 2 on {target.__name__}"


def _named(function: Any) -> str:
    return getattr(function, "__qualname__", repr(function))
