"""idembus: a message bus whose handlers are idempotent even when messages are not.

The public API in one namespace::

    from idembus import Command, Endpoint, AggregateHandler, handles, PostgresStorage

Messages, errors, policies and the ``Bus`` load with the package. ``Endpoint``, the handler
base classes, the storages and the transports are imported on first use, so that importing
``idembus`` loads no broker or database driver, and an optional one (psycopg for
``PostgresStorage``) only when it is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import headers
from .context import MessageContext
from .envelope import Envelope
from .errors import (
    BusError,
    ConfigurationError,
    IncompatibleState,
    InvalidMessage,
    MalformedMessage,
    MessageError,
    RequestFailed,
    RequestTimeout,
    RoutingError,
    TimeLimitExceeded,
    UnknownMessageType,
)
from .evolution import upcaster
from .messages import Command, Event, Message, message_name
from .pipeline import Middleware, PropagateHeaders, RejectMessage, RetryLater, SkipMessage
from .policies import Backoff, Batching, ConflictPolicy, OutboxPolicy, RetryPolicy
from .runtime.recoverability.breaker import BreakerPolicy
from .sending import Bus

if TYPE_CHECKING:
    from .handlers import AggregateHandler, Handler, handles
    from .observability.audit import Audit
    from .observability.metrics import Metrics
    from .observability.tracing import Tracing
    from .runtime.aio import LoopLocal
    from .runtime.endpoint import Endpoint, default_middleware
    from .runtime.journal import JournalPolicy
    from .runtime.recoverability.limits import ConcurrencyLimit, Limits, RateLimit
    from .runtime.recoverability.policy import Recoverability
    from .runtime.recoverability.time_limits import TimeLimits
    from .schedules import Schedule, SchedulerPolicy
    from .storage.claims import ClaimCheck
    from .storage.memory import MemoryStorage
    from .storage.mongo import MongoStorage
    from .storage.postgres import PostgresStorage
    from .transports.kombu import KombuTransport

#: Names imported on first use, with the module (relative to this package) that has them.
_LAZY = {
    "AggregateHandler": ".handlers",
    "Audit": ".observability.audit",
    "ClaimCheck": ".storage.claims",
    "ConcurrencyLimit": ".runtime.recoverability.limits",
    "Limits": ".runtime.recoverability.limits",
    "RateLimit": ".runtime.recoverability.limits",
    "JournalPolicy": ".runtime.journal",
    "LoopLocal": ".runtime.aio",
    "Recoverability": ".runtime.recoverability.policy",
    "Schedule": ".schedules",
    "SchedulerPolicy": ".schedules",
    "Endpoint": ".runtime.endpoint",
    "Handler": ".handlers",
    "KombuTransport": ".transports.kombu",
    "Metrics": ".observability.metrics",
    "MemoryStorage": ".storage.memory",
    "MongoStorage": ".storage.mongo",
    "PostgresStorage": ".storage.postgres",
    "TimeLimits": ".runtime.recoverability.time_limits",
    "Tracing": ".observability.tracing",
    "handles": ".handlers",
    "default_middleware": ".runtime.endpoint",
}

#: Names whose module needs an optional dependency: (what, the extra that installs it).
_EXTRAS = {"PostgresStorage": ("psycopg", "postgres"),
           "Metrics": ("opentelemetry-api", "otel"),
           "Tracing": ("opentelemetry-api", "otel")}

__all__ = [
    "AggregateHandler",
    "Audit",
    "Backoff",
    "Batching",
    "BreakerPolicy",
    "Bus",
    "BusError",
    "ClaimCheck",
    "Command",
    "ConcurrencyLimit",
    "ConfigurationError",
    "ConflictPolicy",
    "Endpoint",
    "Envelope",
    "Event",
    "Handler",
    "IncompatibleState",
    "InvalidMessage",
    "JournalPolicy",
    "KombuTransport",
    "Limits",
    "LoopLocal",
    "MalformedMessage",
    "MemoryStorage",
    "Message",
    "MessageContext",
    "MessageError",
    "Metrics",
    "Middleware",
    "MongoStorage",
    "OutboxPolicy",
    "PostgresStorage",
    "PropagateHeaders",
    "RateLimit",
    "Recoverability",
    "RejectMessage",
    "RequestFailed",
    "RequestTimeout",
    "RetryLater",
    "RetryPolicy",
    "RoutingError",
    "Schedule",
    "SchedulerPolicy",
    "SkipMessage",
    "TimeLimitExceeded",
    "TimeLimits",
    "Tracing",
    "UnknownMessageType",
    "default_middleware",
    "handles",
    "headers",
    "message_name",
    "upcaster",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'idembus' has no attribute {name!r}")
    try:
        return getattr(importlib.import_module(module, __name__), name)
    except ModuleNotFoundError as missing:
        extra = _EXTRAS.get(name)
        if extra is not None:
            raise ImportError(f"{name} needs {extra[0]}: pip install 'idembus[{extra[1]}]' "
                              f"({missing})") from missing
        raise


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
