"""Rate and concurrency limits that postpone a message instead of failing it.

::

    from idembus import ConcurrencyLimit, Limits, RateLimit

    Endpoint("billing", handlers=[...], middleware=[Limits(
        RateLimit(per_second=5, types=(ChargeCard,)),                 # the card gateway's quota
        ConcurrencyLimit(2, types=(ExportReport,), key="tenant_id"),  # two exports per tenant
    )])

Each limit is shared by every process whose endpoint uses the same storage (the storage's
:class:`~idembus.storage.base.LimitStore` role: memory, MongoDB and PostgreSQL have it), and
is checked once per delivered message, before its first handler runs. A message over a
limit goes back on its queue, same id, for later (:class:`~idembus.pipeline.RetryLater`
with ``counted=False``): it spends none of its retries and never reaches the error queue
because of a limit.

A **rate limit** keeps a schedule of slots ``1 / per_second`` apart (up to ``burst`` at
once after a quiet spell). A message takes the next slot whether it is free or not. If the
slot is later than now, the message goes back to come at its slot, carrying the
reservation (``idembus.limits.reserved``) so that it is not charged again; a backlog is thus
spread out evenly instead of coming back all at once. Without batching, a slot within
``wait_inline`` seconds is waited for in the handler's thread instead (in a batch, waiting
would hold every message of the batch, whose handlers then run together). A broker that
delays in whole seconds (RabbitMQ's delay levels) brings a message back up to a second
after its slot, so on RabbitMQ the messages of one second may run close together: the rate
holds over each second and longer, not between two messages.

A **concurrency limit** lets at most ``max_in_flight`` messages be handled at once: a
message takes a slot (a lease of ``lease`` seconds, in case its process dies) and gives it
back once it is settled; with every slot taken it comes back ``retry_after`` seconds later.

``types`` limits a limit to those message types (and their subclasses; none: every type);
``key`` gives each value of an attribute (a name) or of a function of the message its own
limit; ``name`` names the limit in the storage (default: made from the endpoint, the limit
and the types), so that endpoints that share a storage can share a limit.
"""

from __future__ import annotations

import json
import random
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ... import headers as h
from ...errors import ConfigurationError
from ...messages import Message
from ...pipeline import HandlerCall, IncomingMessage, Middleware, RetryLater
from ...storage.base import LimitStore
from ..batch_runner import running_member

#: The item of :attr:`IncomingMessage.items` that holds what this middleware took.
_TAKEN = "idembus.limits"

Key = Callable[[Message], object] | str | None


@dataclass(frozen=True)
class RateLimit:
    """At most ``per_second`` messages a second (``burst`` at once after a quiet spell)."""

    per_second: float
    burst: int = 1
    types: tuple[type[Message], ...] = ()
    key: Key = None
    name: str | None = None
    #: A slot at most this many seconds away is waited for in place.
    wait_inline: float = 1.0

    def __post_init__(self) -> None:
        if not self.per_second > 0:
            raise ConfigurationError(f"RateLimit per_second must be above 0, got "
                                     f"{self.per_second!r}")
        if self.burst < 1:
            raise ConfigurationError(f"RateLimit burst must be at least 1, got {self.burst!r}")
        if self.wait_inline < 0:
            raise ConfigurationError("RateLimit wait_inline cannot be negative")


@dataclass(frozen=True)
class ConcurrencyLimit:
    """At most ``max_in_flight`` messages handled at once."""

    max_in_flight: int
    types: tuple[type[Message], ...] = ()
    key: Key = None
    name: str | None = None
    #: Seconds a slot is held at most (a process that died gives it back then).
    lease: float = 300.0
    #: Seconds after which a message that found every slot taken comes back.
    retry_after: float = 1.0

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ConfigurationError(f"ConcurrencyLimit max_in_flight must be at least 1, "
                                     f"got {self.max_in_flight!r}")
        if not self.lease > 0 or self.retry_after < 0:
            raise ConfigurationError("ConcurrencyLimit lease must be above 0 and retry_after "
                                     "not negative")


Limit = RateLimit | ConcurrencyLimit


class Limits(Middleware):
    """The middleware that applies ``limits`` (see the module docstring)."""

    storage_roles = frozenset({"limits"})

    def __init__(self, *limits: Limit) -> None:
        if not limits:
            raise ConfigurationError("Limits needs at least one RateLimit or ConcurrencyLimit")
        for limit in limits:
            if not isinstance(limit, RateLimit | ConcurrencyLimit):
                raise ConfigurationError(f"Limits takes RateLimit and ConcurrencyLimit, got "
                                         f"{type(limit).__name__}")
        self.limits: tuple[Limit, ...] = limits
        self._store: LimitStore | None = None
        self._clock: Any = None
        self._endpoint = ""
        self._holder = uuid.uuid4().hex  # this process's slots
        self._pause = threading.Event()  # never set: a wait that a shutdown does not need

    def setup(self, endpoint: Any) -> None:
        storage = endpoint.storage
        if not isinstance(storage, LimitStore):
            raise ConfigurationError(f"{type(storage).__name__} cannot keep limits (the "
                                     "limits role, LimitStore); use MemoryStorage, "
                                     "MongoStorage or PostgresStorage")
        self._store = storage
        self._clock = endpoint.clock
        self._endpoint = endpoint.name

    def before_handler(self, call: HandlerCall) -> None:
        incoming = call.incoming
        if _TAKEN in incoming.items:  # another handler, or another attempt, of this message
            return
        store = self._store
        if store is None:
            raise ConfigurationError("Limits was not set up by an endpoint")
        reserved = _reserved(incoming)
        taken: list[str] = []
        try:
            for limit in self.limits:
                if limit.types and not isinstance(call.message, limit.types):
                    continue
                name = self._name(limit, call.message)
                if isinstance(limit, RateLimit):
                    if name not in reserved:
                        self._reserve(store, limit, name, reserved)
                elif store.acquire_slot(name, slots=limit.max_in_flight,
                                        holder=self._holder_of(incoming), lease=limit.lease,
                                        now=self._clock.now()):
                    taken.append(name)
                else:
                    raise RetryLater(
                        limit.retry_after * random.uniform(1.0, 1.5),
                        f"concurrency limit {name}: {limit.max_in_flight} in flight",
                        counted=False, headers=_reservations(reserved))
        except BaseException:
            self._release(incoming, taken)
            raise
        incoming.items[_TAKEN] = taken

    def after_message(self, incoming: IncomingMessage, error: BaseException | None) -> None:
        self._release(incoming, incoming.items.pop(_TAKEN, ()))

    def _reserve(self, store: LimitStore, limit: RateLimit, name: str,
                 reserved: set[str]) -> None:
        wait = store.reserve_rate(name, interval=1.0 / limit.per_second, burst=limit.burst,
                                  now=self._clock.now())
        if wait <= 0:
            return
        if wait <= limit.wait_inline and running_member() is None:
            self._pause.wait(wait)
            return
        reserved.add(name)
        raise RetryLater(wait, f"rate limit {name}: {limit.per_second:g}/s", counted=False,
                         headers=_reservations(reserved))

    def _release(self, incoming: IncomingMessage, names: Sequence[str]) -> None:
        store = self._store
        for name in names:
            if store is not None:
                store.release_slot(name, self._holder_of(incoming))

    def _holder_of(self, incoming: IncomingMessage) -> str:
        return f"{self._holder}/{incoming.message_id}"

    def _name(self, limit: Limit, message: Message) -> str:
        base = limit.name or ":".join([
            self._endpoint, "rate" if isinstance(limit, RateLimit) else "concurrency",
            ",".join(sorted(t.__name__ for t in limit.types)) or "*"])
        if limit.key is None:
            return base
        value = (getattr(message, limit.key) if isinstance(limit.key, str)
                 else limit.key(message))
        return f"{base}:{value}"


def _reserved(incoming: IncomingMessage) -> set[str]:
    """The rate limits whose slot the message holds already (its header; bad: none)."""
    try:
        found = json.loads(incoming.headers.get(h.LIMITS_RESERVED) or "[]")
    except ValueError:
        return set()
    return {name for name in found if isinstance(name, str)} if isinstance(found, list) else set()


def _reservations(reserved: set[str]) -> dict[str, str]:
    return {h.LIMITS_RESERVED: json.dumps(sorted(reserved))} if reserved else {}
