"""Handler base classes and the ``@handles`` decorator.

Users subclass :class:`Handler` for stateless work or :class:`AggregateHandler` to change
one aggregate's state per message::

    class OrderHandler(AggregateHandler[Order]):
        def aggregate_id(self, message: PlaceOrder) -> str:
            return message.order_id

        @handles
        def place(self, message: PlaceOrder) -> None:
            self.state.status = "placed"
            self.bus.publish(OrderPlaced(order_id=message.order_id))

The endpoint copies the handler object for every message (a shallow copy: dependencies
given to ``__init__`` are shared) and sets ``bus``, ``context`` and, for aggregates,
``state`` on the copy before calling the method.

An aggregate handler with ``starts = (PlaceOrder,)`` is a **saga**: only those messages
create it; any other message that finds no saga goes to :meth:`AggregateHandler.saga_not_found`;
:meth:`AggregateHandler.complete` ends it, leaving a tombstone that keeps late duplicates
duplicates (README, "Sagas").
"""

from __future__ import annotations

import datetime
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar, overload

from pydantic import BaseModel

from ..context import MessageContext
from ..logs import loggable, message_logger
from ..messages import DEFAULT_PARTITIONS, Command, Message
from ..policies import RetryPolicy
from ..sending import Bus
from .errors import HandlerDefinitionError
from .ordering import declare_order

log = message_logger(__name__)

StateT = TypeVar("StateT", bound=BaseModel)
F = TypeVar("F", bound=Callable[..., Any])

#: Attribute set by ``@handles`` on handler methods: the explicit message types, if any.
HANDLES_ATTRIBUTE = "__idembus_handles__"


class Handler:
    """Base of stateless handlers. Decorate each handling method with :func:`handles`.

    Deduplication is recorded per (handler name, message id); the name defaults to the
    class name. Renaming the class or ``handler_name`` makes duplicates of messages handled
    before the rename look new.
    """

    #: Stable name scoping deduplication; ``None`` means the class name.
    handler_name: ClassVar[str | None] = None
    #: Command types this handler sends; the endpoint checks at start that each has a route.
    sends: ClassVar[tuple[type[Message], ...]] = ()
    #: This handler's retries; ``None``: the endpoint's ``retry_policy``.
    retry_policy: ClassVar[RetryPolicy | None] = None
    #: Seconds this handler's method may run on a message before it is abandoned (a
    #: ``def``) or cancelled (an ``async def``), nothing it did committed, and the message
    #: retried per policy; ``None``: the endpoint's ``Recoverability(time_limits=...)``.
    time_limit: ClassVar[float | None] = None

    #: What orders the commands this handler handles (``ordered=`` or ``ordered_by=``
    #: class keyword, inherited): ``AGGREGATE_ID`` (an aggregate handler's
    #: :meth:`~AggregateHandler.aggregate_id`), a field name, or a callable taking the
    #: message; ``None``: unordered (unless their types declare it).
    __ordered_by__: ClassVar[object] = None
    #: Into how many partitions the keys are spread (``partitions=``, inherited).
    __partitions__: ClassVar[int] = DEFAULT_PARTITIONS

    #: The message-scoped bus: records what the handler sends, publishes and replies.
    bus: Bus
    #: Headers and ids of the message being handled.
    context: MessageContext

    def __init_subclass__(cls, *, ordered: bool = False, ordered_by: object = None,
                          partitions: int | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declare_order(cls, ordered=ordered, ordered_by=ordered_by, partitions=partitions)

    @classmethod
    def name(cls) -> str:
        """The name deduplication is scoped by."""
        return cls.handler_name or cls.__name__


class AggregateHandler(Handler, Generic[StateT]):
    """Base of handlers that change one aggregate per message.

    Subclass with the state type, ``AggregateHandler[Order]``, and implement
    :meth:`aggregate_id`. The endpoint loads the state, sets ``self.state``, runs the
    method and commits the new state together with the outgoing messages. A method may
    change ``self.state`` in place or assign a new one.
    """

    #: Storage name of this aggregate type; ``None`` means the state class's name.
    aggregate_type: ClassVar[str | None] = None
    #: The pydantic model of the state, taken from ``AggregateHandler[State]``.
    state_type: ClassVar[type[BaseModel]]
    #: The message types that may start this aggregate (their subclasses too): a tuple
    #: makes the class a saga, whose other messages, finding no saga, go to
    #: :meth:`saga_not_found`. ``None``: every message creates the aggregate it names.
    starts: ClassVar[tuple[type[Message], ...] | None] = None
    #: Whether :meth:`complete` keeps the state it ends with on the tombstone (its
    #: ``final_state``, shown by ``idembus sagas show`` and the dashboard until retention
    #: removes the tombstone). ``False``: the tombstone keeps no state (personal data that
    #: must go when the saga ends).
    keep_final_state: ClassVar[bool] = True

    state: StateT
    #: The aggregate being handled, ``(aggregate type, aggregate id)``; set by the endpoint.
    _idembus_aggregate: tuple[str, str] = ("", "")
    #: Whether the method called :meth:`complete`.
    _idembus_completed: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            if typing.get_origin(base) is AggregateHandler:
                (state_type,) = typing.get_args(base)
                if isinstance(state_type, type) and issubclass(state_type, BaseModel):
                    cls.state_type = state_type

    def aggregate_id(self, message: Any) -> str:
        """Return the id of the aggregate ``message`` is about. Must be overridden."""
        raise NotImplementedError

    def new_state(self, aggregate_id: str, message: Any) -> StateT:
        """State of an aggregate that does not exist yet; by default ``State()``."""
        return typing.cast(StateT, self.state_type())

    @classmethod
    def storage_name(cls) -> str:
        """The aggregate type stored: ``aggregate_type``, or the state class's name."""
        return cls.aggregate_type or cls.state_type.__name__

    def request_timeout(self, message: Command, delay: float | datetime.timedelta) -> str:
        """Have ``message`` (a command) delivered to this endpoint after ``delay``: a
        saga-style timeout, handled like any other message, exactly once. Handle its type
        in this class to get back to this aggregate.

        The message carries the header ``idembus.saga_timeout`` naming this aggregate: if
        it arrives once the aggregate was completed (or, for a saga, when none is found),
        it is acknowledged and dropped, counted as ``timeout_dropped``."""
        aggregate_type, aggregate_id = self._idembus_aggregate
        return self.bus.defer_timeout(message, delay, to=self.context.endpoint,
                                      aggregate=f"{aggregate_type}/{aggregate_id}")

    def complete(self) -> None:
        """End this aggregate (a saga) when this message's handling commits: it is no
        longer live from the same write on, and a tombstone keeps the processed messages
        (each with its type and time) and the state it ended with (unless
        ``keep_final_state`` is false), so a late
        duplicate is still a duplicate (its stored messages re-sent with their ids), a late
        message that does not start the saga finds it "not found", and a late timeout is
        dropped. What the method sends is sent. Retention removes the tombstone later."""
        self._idembus_completed = True

    def saga_not_found(self, message: Any) -> None:
        """Called, instead of the handling method, for a message that does not start this
        saga (``starts``) and finds none: never started, or completed. By default it logs at
        INFO and returns: the message is acknowledged (counted as ``not_found``) and nothing
        is stored. Override it to do otherwise: raise ``idembus.RejectMessage(reason)`` to
        put the message in the error queue at once; any other exception follows the retry
        policy. It may not send (nothing is committed for such a message); ``self.context``
        tells about the message."""
        aggregate_type, aggregate_id = self._idembus_aggregate
        log.info("%s found no %s %r for %s %s (a message that does not start it); "
                 "acknowledged", type(self).name(), aggregate_type, aggregate_id,
                 loggable(self.context.message_type), loggable(self.context.message_id))


@overload
def handles(function: F, /) -> F: ...


@overload
def handles(*message_types: type[Message]) -> Callable[[F], F]: ...


def handles(*args: Any) -> Any:
    """Mark a handler method.

    Bare, ``@handles`` takes the message type(s) from the annotation of the method's
    message parameter (``PlaceOrder`` or ``PlaceOrder | CancelOrder``); with arguments,
    ``@handles(PlaceOrder, CancelOrder)`` names them.
    """
    if len(args) == 1 and callable(args[0]) and not isinstance(args[0], type):
        setattr(args[0], HANDLES_ATTRIBUTE, ())
        return args[0]
    for candidate in args:
        if not isinstance(candidate, type):
            raise HandlerDefinitionError(
                f"@handles takes message classes, got {candidate!r}"
            )

    def mark(function: F) -> F:
        setattr(function, HANDLES_ATTRIBUTE, tuple(args))
        return function

    return mark
