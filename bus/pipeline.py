"""The message pipeline: middleware around what an endpoint does with each message.

::

    class TenantGuard(Middleware):
        def before_message(self, incoming: IncomingMessage) -> None:
            if incoming.headers.get("tenant") in self.suspended:
                raise RetryLater(300, reason="tenant suspended")

    Endpoint("sales", middleware=[TenantGuard(), Tracing(), Metrics()], ...)

A middleware overrides the hooks it needs; the others cost nothing (the pipeline calls only
the hooks a class overrides). Five stages, each with its own context object:

``message``
    ``before_message`` / ``after_message`` around the processing of one delivery: from
    before it is decoded until it is settled (handled, skipped, retried later or moved to the
    error queue), just before it is acknowledged.
``handler``
    ``before_handler`` / ``after_handler`` around one attempt of one handler on the message:
    load, run, commit (immediate retries are new attempts, each with both hooks).
``commit``
    ``before_commit`` / ``after_commit`` around the conditional write of one attempt (a lost
    optimistic race writes again, with both hooks again).
``outgoing``
    ``outgoing(envelope, origin)`` returns the envelope to record, once for each message a
    handler, a unit of work or ``endpoint.bus`` sends, **before it is committed**: headers
    added here are stored with the message, so a redispatch and an outbox repair send exactly
    the same bytes. Hooks run in list order, each on the previous one's result.
``dispatch``
    ``before_dispatch`` / ``after_dispatch`` around each send of an outgoing message to the
    transport: first dispatch, a duplicate's redispatch, an outbox repair, a unit of work,
    ``endpoint.bus``.

Order: ``before_*`` hooks run in list order, ``after_*`` hooks in reverse, and an ``after``
hook runs exactly when its ``before`` hook returned — with the error that ended the stage, or
``None``. Whatever an ``after`` hook raises is logged and changes nothing, except a
:class:`BaseException` that is not an :class:`Exception` (a simulated crash, Ctrl-C): the
outer ``after`` hooks still run, with it as their error, and then it goes on like the
process dying.

Control flow: a ``before_message`` or ``before_handler`` hook, or a handler itself, may
raise :class:`SkipMessage` (acknowledge without handling: the whole message from
``before_message``, this handler only otherwise), :class:`RetryLater` (put the message back,
same id, after a delay; at most ``give_up_after`` times in a row, then the error queue) or
:class:`RejectMessage` (the error queue at once, with the reason). Any other exception is a
failure and follows the retry policy.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from . import headers as h
from .context import MessageContext
from .envelope import Envelope
from .errors import ConfigurationError
from .messages import Message

log = logging.getLogger(__name__)

T = TypeVar("T")


class PipelineControl(Exception):
    """Base of the exceptions middleware and handlers raise to steer a message."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason)
        self.reason = reason


class SkipMessage(PipelineControl):
    """Acknowledge without handling: from ``before_message``, the whole message; from
    ``before_handler`` or a handler, that handler only (nothing is recorded for it)."""


class RetryLater(PipelineControl):
    """Put the message back on its queue, same id, delivered ``delay`` seconds from now.

    Handlers that already committed their effects find it processed when it comes back.
    After ``give_up_after`` postponements in a row the message goes to the error queue with
    ``reason``: nothing is postponed forever — except a postponement with ``counted=False``,
    which a limit that frees up by itself uses
    (:mod:`idembus.runtime.recoverability.limits`): it neither counts nor spends a retry.
    ``headers`` are set on the message put back.
    """

    def __init__(self, delay: float, reason: str = "", *, give_up_after: int = 100,
                 counted: bool = True, headers: Mapping[str, str] | None = None) -> None:
        if delay < 0:
            raise ValueError(f"delay cannot be negative, got {delay!r}")
        if give_up_after < 1:
            raise ValueError(f"give_up_after must be at least 1, got {give_up_after!r}")
        super().__init__(reason or f"retry in {delay:g}s")
        self.delay = float(delay)
        self.give_up_after = give_up_after
        self.counted = counted
        self.headers: Mapping[str, str] = dict(headers or {})


class RejectMessage(PipelineControl):
    """Move the message to the error queue at once with ``reason``, without retries."""


@dataclass
class IncomingMessage:
    """One delivery on its way through the pipeline (the ``message`` stage's context)."""

    endpoint: str
    queue: str
    headers: Mapping[str, str]
    #: The decoded message; ``None`` before decoding, and for input that does not decode.
    message: Message | None = None
    #: How processing ended, as ``after_message`` sees it: ``handled`` (every handler
    #: handled it, found it a duplicate or skipped it), ``discarded`` (so did they, but at
    #: least one did not run because the message had expired, :mod:`idembus.expiry`),
    #: ``retry_later``, ``retrying`` (a delayed retry of a failure) or ``dead_lettered``;
    #: ``None`` while in progress, when
    #: processing was interrupted (an outage at shutdown), and when a later middleware's
    #: ``before_message`` raised (the ``error`` says what it asked for).
    outcome: str | None = None
    #: What the handlers did, once every one is done (``outcome`` ``handled`` or
    #: ``discarded``): ``handled`` when at least one committed its effects, ``duplicate``
    #: when none did and one found the message processed before, ``dropped`` when none ran
    #: (expired, no saga for it, a completed saga's timeout, skipped). The endpoint's ledger
    #: counts it (:mod:`idembus.runtime.counters`); ``None`` until then.
    effects: str | None = None
    #: Room for middleware to keep things between its hooks (a span, a start time).
    items: dict[str, Any] = field(default_factory=dict)

    @property
    def message_id(self) -> str | None:
        return self.headers.get(h.MESSAGE_ID)

    @property
    def message_type(self) -> str | None:
        return self.headers.get(h.MESSAGE_TYPE)


@dataclass
class HandlerCall:
    """One attempt of one handler on one message (the ``handler`` and ``commit`` stages)."""

    incoming: IncomingMessage
    context: MessageContext
    message: Message
    #: 1 for the first immediate attempt, 2 for the next, ...
    attempt: int
    #: After the handler stage: the message was already processed by this handler.
    duplicate: bool = False
    #: The messages the attempt recorded (set before the commit).
    outgoing: Sequence[Envelope] = ()
    items: dict[str, Any] = field(default_factory=dict)
    #: The handler object, whose options a middleware reads with
    #: :meth:`Middleware.option` (``None`` where no handler is at hand).
    handler_object: Any = None

    @property
    def handler(self) -> str:
        return self.context.handler_name


@dataclass
class Dispatch:
    """One send of a committed (or directly sent) outgoing message (the ``dispatch`` stage)."""

    envelope: Envelope
    #: The endpoint whose message it is.
    endpoint: str
    #: Who sends it: ``handler`` (right after its commit), ``redispatch`` (a duplicate
    #: sending what was stored), ``outbox`` (a repair after a crash), ``unit_of_work``,
    #: ``schedule`` (an occurrence, right after the scheduler committed it) or ``bus``
    #: (``endpoint.bus``, at once).
    source: str
    items: dict[str, Any] = field(default_factory=dict)


class Middleware:
    """Base class of middleware; override the hooks you need (see the module docstring)."""

    #: The storage roles this middleware writes to (``"audit"``): an endpoint given it
    #: checks at construction that its storage has them.
    storage_roles: ClassVar[frozenset[str]] = frozenset()
    #: The handler class attributes this middleware reads (``("time_limit",)``), through
    #: :meth:`option`: an endpoint refuses a handler that sets an option none of its
    #: policies reads (a misspelling, or a middleware left out).
    handler_options: ClassVar[tuple[str, ...]] = ()

    def option(self, handler: object, name: str, default: Any = None) -> Any:
        """The handler option ``name`` of ``handler`` (its class attribute), ``default`` if it
        sets none; ``name`` must be one of this middleware's :attr:`handler_options`."""
        return handler_option(self, handler, name, default)

    def setup(self, endpoint: Any) -> None:
        """Called once by the endpoint that was given this middleware, at construction."""

    def close(self) -> None:
        """Called when the endpoint closes: flush and release what the middleware holds."""

    def before_message(self, incoming: IncomingMessage) -> None:
        """Before a delivery is decoded; may raise SkipMessage, RetryLater or RejectMessage."""

    def after_message(self, incoming: IncomingMessage, error: BaseException | None) -> None:
        """Once the delivery is settled, just before its ack; ``error`` ended it, or None."""

    def before_handler(self, call: HandlerCall) -> None:
        """Before one attempt of one handler (load, run, commit); may raise SkipMessage,
        RetryLater or RejectMessage."""

    def after_handler(self, call: HandlerCall, error: BaseException | None) -> None:
        """After that attempt, with the exception that ended it, or None."""

    def before_commit(self, call: HandlerCall) -> None:
        """Before the handler's conditional write (again after a lost race)."""

    def after_commit(self, call: HandlerCall, error: BaseException | None) -> None:
        """After the conditional write, with its exception (a conflict, a duplicate), or None."""

    def outgoing(self, envelope: Envelope, origin: MessageContext | None) -> Envelope:
        """Each message sent, before it is committed: return it, or a changed copy (headers
        added here are stored with it). ``origin`` is the incoming message's context, None
        outside handlers."""
        return envelope

    def before_dispatch(self, dispatch: Dispatch) -> None:
        """Before each send of an outgoing message (a redispatch and an outbox repair too)."""

    def after_dispatch(self, dispatch: Dispatch, error: BaseException | None) -> None:
        """After that send, with its exception, or None."""


_STAGES = ("message", "handler", "commit", "dispatch")


def handler_option(reader: object, handler: object, name: str, default: Any = None) -> Any:
    """The class attribute ``name`` of ``handler`` (a handler option), ``default`` if unset
    or ``None``, for ``reader``: a policy that declares ``name`` in its ``handler_options``
    (a TypeError otherwise: an undeclared option would escape the endpoint's check)."""
    if name not in getattr(reader, "handler_options", ()):
        raise TypeError(f"{type(reader).__name__} reads the handler option {name!r} without "
                        "declaring it in its handler_options")
    value = getattr(type(handler), name, None)
    return default if value is None else value


def declared_handler_options(readers: Iterable[object]) -> dict[str, str]:
    """Handler option -> the name of the first of ``readers`` that declares it."""
    declared: dict[str, str] = {}
    for reader in readers:
        for name in getattr(reader, "handler_options", ()):
            declared.setdefault(name, type(reader).__name__)
    return declared


def _every_middleware_class(root: type = Middleware) -> Iterator[type]:
    """Every subclass of ``root`` defined so far, at any depth."""
    subclass: type
    for subclass in root.__subclasses__():
        yield subclass
        yield from _every_middleware_class(subclass)


def check_handler_options(handler: type, readers: Iterable[object]) -> None:
    """Refuse ``handler`` (a handler class) if it sets a class attribute that looks like a
    handler option no policy of the endpoint reads: an option some middleware class declares
    but the endpoint was not given (``time_limit`` without the middleware that reads it), or
    a near miss of a known one (``retry_polcy``). The attributes of idembus's own base
    classes (``handler_name``, ``sends``, ``retry_policy``, ...) are options; ``readers``:
    the endpoint's policies and middleware, with their ``handler_options``. A handler's
    methods, and attributes unlike any option (its own constants), are left alone."""
    ours = [cls for cls in handler.__mro__ if cls.__module__.startswith("idembus.")]
    declared = set(declared_handler_options(readers))
    # Every public name of idembus's own bases (methods included) is a handler's to set;
    # those that are not code are the options a near miss is compared with.
    defined = {name: value for cls in ours for name, value in vars(cls).items()
               if not name.startswith("_")}
    annotated = {name for cls in ours for name in vars(cls).get("__annotations__", ())
                 if not name.startswith("_")}
    known = set(defined) | annotated | declared
    options = {name for name, value in defined.items() if not _is_code(value)}
    options |= annotated | declared
    elsewhere = {name: cls.__name__ for cls in _every_middleware_class()
                 for name in getattr(cls, "handler_options", ()) if name not in known}
    for cls in handler.__mro__:
        if cls in ours or cls is object:
            continue
        for name, value in vars(cls).items():
            if name.startswith("_") or name in known or _is_code(value):
                continue
            if name in elsewhere:
                raise ConfigurationError(
                    f"handler {handler.__name__} sets {name!r}, which {elsewhere[name]} reads, "
                    "but this endpoint has no such middleware. Did you forget to add a "
                    "middleware?")
            close = difflib.get_close_matches(name, [*options, *elsewhere], n=1, cutoff=0.85)
            if close:
                raise ConfigurationError(
                    f"handler {handler.__name__} sets {name!r}, which is no handler option: "
                    f"did you mean {close[0]!r}? Did you forget to add a middleware?")


def _is_code(value: object) -> bool:
    """A method, a property or another descriptor of a class: code, not an option."""
    return (isinstance(value, (staticmethod, classmethod, property))
            or (callable(value) and not isinstance(value, type)))


def _overrides(middleware: Middleware, hook: str) -> bool:
    return getattr(type(middleware), hook) is not getattr(Middleware, hook)


class _Stage:
    """The before and after hooks of one stage, of the middleware that override them."""

    def __init__(self, middleware: Sequence[Middleware], name: str) -> None:
        self.name = name
        after = {id(m): getattr(m, f"after_{name}") for m in middleware
                 if _overrides(m, f"after_{name}")}
        #: Pairs (before or None, after or None) in list order.
        self.pairs = [(getattr(m, f"before_{name}") if _overrides(m, f"before_{name}") else None,
                       after.get(id(m))) for m in middleware
                      if _overrides(m, f"before_{name}") or id(m) in after]
        #: (position, after hook) of the pairs that have one, innermost first: what a stage
        #: whose hooks all returned runs after its body.
        self.afters = [(position, hook) for position, (_, hook) in reversed(
            list(enumerate(self.pairs))) if hook is not None]

    def run(self, context: Any, body: Callable[[], T]) -> T:
        pairs = self.pairs
        if not pairs:
            return body()
        entered = 0  # the pairs whose before hook returned (or that have none)
        try:
            for before, _ in pairs:
                if before is not None:
                    before(context)
                entered += 1
            result = body()
        except BaseException as error:
            self._unwind(entered, context, error)
            raise
        for position, after in self.afters:
            try:
                after(context, None)
            except Exception:
                log.exception("after_%s hook %r raised; ignored", self.name, after)
            except BaseException as escaping:
                self._unwind(position, context, escaping, crash=escaping)
        return result

    def _unwind(self, entered: int, context: Any, error: BaseException | None, *,
                crash: BaseException | None = None) -> None:
        """Run the after hooks of the first ``entered`` pairs, innermost first. An
        :class:`Exception` one raises is logged; a bare :class:`BaseException` (a simulated
        crash) is raised once the outer hooks have run, with it as their error (``crash``:
        one that an inner hook already raised)."""
        for index in range(entered - 1, -1, -1):
            after = self.pairs[index][1]
            if after is None:
                continue
            try:
                after(context, error)
            except Exception:
                log.exception("after_%s hook %r raised; ignored", self.name, after)
            except BaseException as escaping:
                crash = crash or escaping
                error = escaping
        if crash is not None:
            raise crash


class Pipeline:
    """The middleware of one endpoint, arranged by stage."""

    def __init__(self, middleware: Sequence[Middleware] = ()) -> None:
        for item in middleware:
            if not isinstance(item, Middleware):
                raise ConfigurationError(
                    f"middleware must be idembus.Middleware instances, got {item!r}")
        self.middleware: tuple[Middleware, ...] = ()
        self._arrange(tuple(middleware))

    def _arrange(self, middleware: tuple[Middleware, ...]) -> None:
        self.middleware = middleware
        self._stages = {name: _Stage(middleware, name) for name in _STAGES}
        #: Each stage, or ``None`` when no middleware hooks it: its body is then called
        #: straight away (four times a message).
        self._message, self._handler, self._commit, self._dispatch = (
            stage if stage.pairs else None
            for stage in (self._stages[name] for name in _STAGES))
        self._outgoing = [m.outgoing for m in middleware if _overrides(m, "outgoing")]
        #: Whether any middleware hooks the ``commit`` and ``dispatch`` stages: without
        #: one, a caller may run the stage's body itself (and skip making the
        #: :class:`Dispatch` that :meth:`dispatch` would not look at).
        self.hooks_commit = self._commit is not None
        #: Whether any middleware has ``outgoing`` hooks (:meth:`prepare` changes nothing
        #: without one).
        self.hooks_outgoing = bool(self._outgoing)
        self.hooks_dispatch = self._dispatch is not None

    def append(self, middleware: Middleware) -> None:
        """Add ``middleware`` last (innermost). Not while messages are processed: the
        endpoint's :meth:`~idembus.runtime.endpoint.Endpoint.add_middleware` checks that."""
        if not isinstance(middleware, Middleware):
            raise ConfigurationError(
                f"middleware must be idembus.Middleware instances, got {middleware!r}")
        self._arrange((*self.middleware, middleware))

    def message(self, incoming: IncomingMessage, body: Callable[[], T]) -> T:
        """Run ``body`` (the processing of one delivery) inside the message stage."""
        stage = self._message
        return body() if stage is None else stage.run(incoming, body)

    def handler(self, call: HandlerCall, body: Callable[[], T]) -> T:
        stage = self._handler
        return body() if stage is None else stage.run(call, body)

    def commit(self, call: HandlerCall, body: Callable[[], T]) -> T:
        stage = self._commit
        return body() if stage is None else stage.run(call, body)

    def dispatch(self, dispatch: Dispatch, body: Callable[[], T]) -> T:
        stage = self._dispatch
        return body() if stage is None else stage.run(dispatch, body)

    def prepare(self, envelope: Envelope, origin: MessageContext | None) -> Envelope:
        """The envelope as the ``outgoing`` hooks leave it, to be recorded or sent."""
        for hook in self._outgoing:
            envelope = hook(envelope, origin)
            if not isinstance(envelope, Envelope):
                raise TypeError(f"outgoing hook {hook!r} returned {envelope!r}, not an "
                                "Envelope")
        return envelope

    def recorder(self, emit: Callable[[Envelope], None],
                 origin: MessageContext | None) -> Callable[[Envelope], None]:
        """``emit`` behind the ``outgoing`` hooks (what a :class:`~idembus.sending.Bus`
        is given)."""
        return lambda envelope: emit(self.prepare(envelope, origin))

    def setup(self, endpoint: Any) -> None:
        for item in self.middleware:
            item.setup(endpoint)

    def close(self) -> None:
        for item in self.middleware:
            try:
                item.close()
            except Exception:
                log.exception("closing middleware %r failed", item)


@dataclass(frozen=True)
class PropagateHeaders(Middleware):
    """Copies the named headers of the message being handled to every message its handlers
    send (``Endpoint(propagate_headers=("tenant",))``); a header the outgoing message sets
    itself wins. Stored with the message, like every header."""

    names: tuple[str, ...]

    def __post_init__(self) -> None:
        reserved = [name for name in self.names if name.startswith("idembus.")]
        if reserved:
            raise ConfigurationError(
                f"propagate_headers cannot name idembus headers {reserved}: idembus sets "
                "them itself")

    def outgoing(self, envelope: Envelope, origin: MessageContext | None) -> Envelope:
        if origin is None:
            return envelope
        carried = {name: origin.headers[name] for name in self.names
                   if name in origin.headers and name not in envelope.headers}
        return envelope.with_headers(carried) if carried else envelope
