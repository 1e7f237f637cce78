"""What a handler sends, found at start, and whether each command has a route.

A command sent without a route fails the message that sends it (``RoutingError``, straight
to the error queue). So that this shows when the endpoint starts rather than at its first
message, :func:`check_sent_routes` looks at every handler's commands:

* **declared** — ``sends = (ChargePayment, ...)`` on the class (checked when the endpoint
  is created: a missing route is a :class:`~idembus.errors.ConfigurationError` there);
* **inferred** — read from the source of the class's methods (its bases' too, not
  idembus's own), without running anything: a call ``self.bus.send(X(...))`` or
  ``self.bus.defer(X(...), ...)`` (also through ``bus = self.bus``), where ``X(...)`` is
  the command class called, ``X.model_validate(...)`` / ``X.model_construct(...)`` /
  ``X.model_validate_json(...)``, or a name assigned one of those in the same method, or a
  parameter or variable annotated with the command type (``command: ChargePayment``).
  ``X`` is looked up as the method sees it (its module, its closure), ``module.X`` too.
  A send with ``to=`` (or ``**options``) names its destination and needs no route;
  :meth:`~idembus.handlers.AggregateHandler.request_timeout` goes to the endpoint itself;
* **unknown** — a send whose command cannot be told that way (``self.bus.send(make())``),
  ``self.bus`` handed to other code, or a class whose source cannot be read.

An inferred command without a route, and unknown sends of a handler that declares no
``sends``, are logged at WARNING when the endpoint starts; with ``strict_routes=True``
(``idembus run --strict-routes``) they fail the start instead. A handler that declares
``sends`` is trusted with what the reading could not tell.
"""

from __future__ import annotations

import ast
import inspect
import logging
import sys
import textwrap
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError
from ..messages import Command, message_name
from ..routing import Router
from .base import Handler

log = logging.getLogger(__name__)

#: The bus methods whose first argument is a command routed by the endpoint's routes.
_ROUTED_METHODS = frozenset({"send", "defer"})
#: Every bus method (any other use of ``self.bus`` hands it to code not read here).
_BUS_METHODS = frozenset({"send", "defer", "publish", "reply", "defer_timeout"})
#: Class methods of a pydantic model that build one.
_BUILDERS = frozenset({"model_validate", "model_construct", "model_validate_json"})


@dataclass(frozen=True)
class FoundSend:
    """One send found in a handler's source: the command type (``None``: cannot tell),
    where (``Class.method (file:line)``) and the call as written."""

    command: type[Command] | None
    where: str
    call: str


@dataclass(frozen=True)
class HandlerSends:
    """What a handler class sends: declared, inferred from its source, and unknown."""

    declared: tuple[type[Any], ...]
    inferred: tuple[FoundSend, ...]
    unknown: tuple[FoundSend, ...]

    @property
    def commands(self) -> list[type[Command]]:
        """Every command type declared or inferred, each once."""
        found = [t for t in self.declared if isinstance(t, type) and issubclass(t, Command)]
        for send in self.inferred:
            if send.command is not None and send.command not in found:
                found.append(send.command)
        return found


def sends_of(handler_class: type[Handler]) -> HandlerSends:
    """What ``handler_class`` sends (see the module docstring), read from its source (as
    ``linecache`` keeps it) each time: an endpoint's start asks once per handler."""
    inferred: list[FoundSend] = []
    unknown: list[FoundSend] = []
    for owner, name, function in _methods(handler_class):
        where = f"{owner.__name__}.{name}"
        try:
            lines, first = inspect.getsourcelines(function)
            tree = ast.parse(textwrap.dedent("".join(lines)))
        except (OSError, TypeError, SyntaxError):
            unknown.append(FoundSend(None, where, "(its source cannot be read)"))
            continue
        file = inspect.getsourcefile(function) or "?"
        reader = _MethodReader(function, f"{where} ({file.rsplit('/', 1)[-1]}:{{}})", first)
        for send in reader.read(tree):
            (inferred if send.command is not None else unknown).append(send)
    return HandlerSends(tuple(handler_class.sends), tuple(inferred), tuple(unknown))


def route_problems(handlers: Iterable[Handler], router: Router, endpoint: str) -> list[str]:
    """What :func:`check_sent_routes` reports, one sentence each (empty: nothing)."""
    problems: list[str] = []
    for handler in handlers:
        cls = type(handler)
        found = sends_of(cls)
        for send in found.inferred:
            assert send.command is not None
            if not router.has_route(send.command) and not _reported(problems, send.command,
                                                                      cls):
                problems.append(
                    f"{cls.__qualname__} sends {message_name(send.command)} ({send.where}: "
                    f"{send.call}) but {endpoint!r} has no route for it: add "
                    f"routes={{{send.command.__name__}: '<endpoint name>'}}, or pass to= "
                    "to send()")
        if not found.declared:
            for send in found.unknown:
                problems.append(
                    f"{cls.__qualname__} sends a command idembus cannot name ({send.where}: "
                    f"{send.call}), so its route cannot be checked at start: declare "
                    f"sends = (...) on {cls.__qualname__} with the commands it sends")
    return problems


def check_sent_routes(handlers: Iterable[Handler], router: Router, endpoint: str, *,
                      strict: bool = False) -> None:
    """Check at start that every command the handlers send has a route (see the module
    docstring): each problem logged at WARNING, or, ``strict``, one
    :class:`~idembus.errors.ConfigurationError` naming every handler and command."""
    problems = route_problems(handlers, router, endpoint)
    if problems and strict:
        raise ConfigurationError(f"endpoint {endpoint!r} (strict routes): "
                                 + "; ".join(problems))
    for problem in problems:
        log.warning("endpoint %s: %s (strict_routes=True, or idembus run --strict-routes, "
                    "makes this a start failure)", endpoint, problem,
                    extra={"endpoint": endpoint})


def _reported(problems: list[str], command: type[Command], cls: type[Handler]) -> bool:
    """Whether a problem about ``cls`` sending ``command`` is already in ``problems``."""
    return any(p.startswith(f"{cls.__qualname__} sends {message_name(command)} ")
               for p in problems)


def _methods(handler_class: type[Handler]) -> Iterator[tuple[type[Any], str, Any]]:
    """The functions defined by ``handler_class`` and its bases, idembus's own excepted."""
    for owner in handler_class.__mro__:
        top = owner.__module__.split(".")[0]
        if top == "idembus" or top in sys.stdlib_module_names:
            continue
        for name, value in vars(owner).items():
            function = value.__func__ if isinstance(value, (staticmethod, classmethod)) \
                else value
            if inspect.isfunction(function):
                yield owner, name, function


class _MethodReader:
    """Finds the sends in one method's syntax tree and resolves their command types."""

    def __init__(self, function: Any, where: str, first_line: int) -> None:
        self._function = function
        self._where = where
        self._offset = first_line - 1
        self._names = dict(function.__globals__)
        closure = function.__closure__ or ()
        for name, cell in zip(function.__code__.co_freevars, closure, strict=False):
            try:
                self._names[name] = cell.cell_contents
            except ValueError:  # an empty cell
                continue

    def read(self, tree: ast.AST) -> Iterator[FoundSend]:
        parents = {id(child): node for node in ast.walk(tree)
                   for child in ast.iter_child_nodes(node)}
        aliases = _bus_aliases(tree)
        assigned = _assignments(tree)
        for node in ast.walk(tree):
            if not _is_bus(node, aliases):
                continue
            parent = parents.get(id(node))
            if isinstance(parent, ast.Attribute) and parent.attr in _BUS_METHODS:
                call = parents.get(id(parent))
                if isinstance(call, ast.Call) and call.func is parent:
                    if parent.attr in _ROUTED_METHODS and not _names_destination(call):
                        yield from self._sends(call, assigned)
                    continue
            if isinstance(parent, ast.Assign) and node is parent.value:
                continue  # ``bus = self.bus``: an alias, read as self.bus
            yield FoundSend(None, self._at(node), f"{ast.unparse(parent or node)} (self.bus "
                            "given to code not read here)")

    def _sends(self, call: ast.Call, assigned: dict[str, list[ast.expr]]) -> Iterator[FoundSend]:
        text = ast.unparse(call)
        if not call.args:
            yield FoundSend(None, self._at(call), text)
            return
        for command in self._commands(call.args[0], assigned, depth=0):
            yield FoundSend(command, self._at(call), text)

    def _commands(self, expression: ast.expr, assigned: dict[str, list[ast.expr]],
                  depth: int) -> list[type[Command] | None]:
        """The command types ``expression`` may be (``None`` among them: unknown)."""
        if isinstance(expression, ast.Call):
            built = expression.func
            if isinstance(built, ast.Attribute) and built.attr in _BUILDERS:
                built = built.value
            return [_command(self._resolve(built))]
        if isinstance(expression, ast.Name) and depth < 3:
            annotated = self._annotation(expression.id)
            if annotated is not None:
                return [annotated]
            values = assigned.get(expression.id, [])
            if values:
                return [found for value in values
                        for found in self._commands(value, assigned, depth + 1)]
        return [None]

    def _annotation(self, name: str) -> type[Command] | None:
        """The command type a parameter or variable ``name`` is annotated with, if any."""
        try:
            hints = typing.get_type_hints(self._function, globalns=self._names)
        except Exception:  # a hint that cannot be evaluated: no hint
            hints = {}
        found = _command(hints.get(name))
        if found is None:
            raw = self._function.__annotations__.get(name)
            if isinstance(raw, str):
                found = _command(self._names.get(raw))
        return found

    def _resolve(self, expression: ast.expr) -> Any:
        """The object a name or a dotted name refers to in the method, if it can tell."""
        if isinstance(expression, ast.Name):
            return self._names.get(expression.id)
        if isinstance(expression, ast.Constant) and isinstance(expression.value, str):
            return self._names.get(expression.value)  # a quoted annotation
        if isinstance(expression, ast.Attribute):
            owner = self._resolve(expression.value)
            return getattr(owner, expression.attr, None) if owner is not None else None
        return None

    def _at(self, node: ast.AST) -> str:
        return self._where.format(getattr(node, "lineno", 1) + self._offset)


def _command(candidate: Any) -> type[Command] | None:
    return candidate if isinstance(candidate, type) and issubclass(candidate, Command) else None


def _is_bus(node: ast.AST, aliases: set[str]) -> bool:
    """``self.bus``, or a name it was assigned to."""
    if isinstance(node, ast.Attribute):
        return (node.attr == "bus" and isinstance(node.value, ast.Name)
                and node.value.id == "self")
    return isinstance(node, ast.Name) and node.id in aliases and isinstance(node.ctx, ast.Load)


def _bus_aliases(tree: ast.AST) -> set[str]:
    """Names assigned ``self.bus`` (``bus = self.bus``)."""
    return {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
            and _is_bus(node.value, set()) for target in node.targets
            if isinstance(target, ast.Name)}


def _assignments(tree: ast.AST) -> dict[str, list[ast.expr]]:
    """What each plain name is assigned in the method (``name = value``)."""
    found: dict[str, list[ast.expr]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, []).append(node.value)
        elif isinstance(node, ast.NamedExpr):
            found.setdefault(node.target.id, []).append(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            # ``command: ChargePayment = ...``: the annotation says, as a call of it would
            found.setdefault(node.target.id, []).append(ast.Call(node.annotation, [], []))
    return found


def _names_destination(call: ast.Call) -> bool:
    """The send says where it goes (``to=``), or may (``**options``)."""
    return any(keyword.arg in (None, "to") for keyword in call.keywords)
