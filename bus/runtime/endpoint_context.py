"""What the collaborators of one endpoint share (:class:`EndpointContext`).

An endpoint is a handful of collaborators — the dispatcher, the handler invoker, the
message processor, the outbox relay, the delayed-message poller, the scheduler — that all
need the same few things: the endpoint's name, its clock, its signals, its middleware, its
health, how it recovers from failures, its transport and its storage. They receive them
together, in one frozen context, instead of four to seven at a time by hand; each asks the
context for the storage *roles* it uses (:meth:`EndpointContext.role`) and declares them in
``storage_roles``, so none of them is handed more of the storage than it needs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TypeVar

from ..clock import Clock, SystemClock
from ..errors import ConfigurationError
from ..handlers.registration import HandlerTable
from ..pipeline import Pipeline
from ..registry import MessageRegistry
from ..routing import Router
from ..signals import EndpointSignals
from ..storage.base import PayloadStore, StorageRole
from ..storage.claims import ClaimCheck
from ..transports.base import Transport
from ..wire import DEFAULT_MAX_MESSAGE_BYTES
from .health import Health
from .recoverability.policy import Recoverability

RoleT = TypeVar("RoleT", bound=StorageRole)


@dataclass(frozen=True)
class EndpointContext:
    """One endpoint's shared collaborators and settings.

    ``name`` is the endpoint's (its queue, and the owner of what it commits and defers);
    ``table`` and ``registry`` are its handlers and the message types they know; ``stopping``
    is set when the endpoint is asked to stop. Build one for a tool or a test
    that runs a collaborator alone with :meth:`standalone`.
    """

    name: str
    transport: Transport
    storage: StorageRole
    clock: Clock
    signals: EndpointSignals
    pipeline: Pipeline
    health: Health
    recoverability: Recoverability
    router: Router
    table: HandlerTable
    registry: MessageRegistry
    error_queue: str = "error"
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    stopping: threading.Event = field(default_factory=threading.Event)
    #: Which bodies go on the wire as a reference (``Endpoint(claim_check=...)``).
    claim_check: ClaimCheck | None = None

    @classmethod
    def standalone(cls, name: str, transport: Transport, storage: StorageRole, *,
                   clock: Clock | None = None, pipeline: Pipeline | None = None,
                   health: Health | None = None) -> EndpointContext:
        """A context for running a collaborator outside an endpoint (``idembus outbox``,
        tests): the defaults of an endpoint without handlers, middleware or routes."""
        return cls(name=name, transport=transport, storage=storage,
                   clock=clock or SystemClock(), signals=EndpointSignals(name),
                   pipeline=pipeline or Pipeline(), health=health or Health(),
                   recoverability=Recoverability(), router=Router(),
                   table=HandlerTable(()), registry=MessageRegistry())

    def payloads(self) -> PayloadStore | None:
        """Where claim-checked bodies are kept and read: the claim check's own store, else
        the storage if it has the payload role; ``None``: neither."""
        if self.claim_check is not None and self.claim_check.store is not None:
            return self.claim_check.store
        return self.storage if isinstance(self.storage, PayloadStore) else None

    def role(self, role: type[RoleT]) -> RoleT:
        """The storage as ``role`` (one of :mod:`idembus.storage.base`'s roles); a
        :class:`~idembus.errors.ConfigurationError` if the storage lacks it."""
        if not isinstance(self.storage, role):
            raise ConfigurationError(
                f"{type(self.storage).__name__} lacks the {role.__name__} role that endpoint "
                f"{self.name!r} needs here")
        return self.storage
