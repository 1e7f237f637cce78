"""Which storage roles a storage has, and which an endpoint's options need.

The roles are the abstract classes of :mod:`idembus.storage.base`. Every endpoint needs
:class:`~idembus.storage.base.AggregateStore` (its handlers load, commit and deduplicate
there) and :class:`~idembus.storage.base.ParkingStore` (where it keeps what neither the broker
nor the error queue took, so that nothing is lost); its options need the others:

==========================  =====================================================
role                        needed by
==========================  =====================================================
``OutboxStore``             ``outbox=True`` (the outbox dispatcher runs here) and
                            ``schedules=...`` (the scheduler's lease)
``DelayedStore``            a transport without native delay (memory://, Redis)
``JournalStore``            ``journal=...``
``AuditStore``              the :class:`~idembus.observability.audit.Audit` middleware
``StatusStore``             status reports (``idembus status``)
``LimitStore``              the :class:`~idembus.runtime.recoverability.limits.Limits` middleware
``PayloadStore``            ``claim_check=...`` without a ``store`` of its own
==========================  =====================================================

:func:`check_storage_roles` raises :class:`~idembus.errors.ConfigurationError` naming each
missing role, its methods and what needs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigurationError
from .base import (
    ROLES,
    AggregateStore,
    AuditStore,
    DelayedStore,
    JournalStore,
    LimitStore,
    OutboxStore,
    ParkingStore,
    PayloadStore,
    StatusStore,
    StorageRole,
)

__all__ = ["ROLE_NAMES", "check_storage_roles", "role_methods", "roles_of"]

#: What each role is called in messages.
ROLE_NAMES: dict[type[StorageRole], str] = {
    AggregateStore: "aggregate",
    OutboxStore: "outbox",
    DelayedStore: "delayed-message",
    JournalStore: "journal",
    AuditStore: "audit",
    StatusStore: "status",
    ParkingStore: "parking",
    LimitStore: "limits",
    PayloadStore: "payload",
}


@dataclass(frozen=True)
class _Need:
    """Why an endpoint needs a role, and what it could do instead of implementing it."""

    by: str
    otherwise: str | None = None


_ALWAYS: dict[type[StorageRole], _Need] = {
    AggregateStore: _Need("every endpoint needs (its handlers load, commit and deduplicate "
                          "there)"),
    ParkingStore: _Need("every endpoint needs (it keeps there what neither the broker nor the "
                        "error queue took, so that nothing is lost)"),
}
_OUTBOX = _Need("outbox=True needs", "turn the option off (outbox=False)")
_DELAYED = _Need("a transport without native delay needs (deferred messages wait in the "
                 "storage)", "use a transport with native delay (RabbitMQ)")
_JOURNAL = _Need("journal=... needs", "turn the option off (journal=False)")
_AUDIT = _Need("the Audit middleware needs", "leave the middleware out")
_STATUS = _Need("status reports need", "turn status reports off")
_LIMITS = _Need("the Limits middleware needs", "leave the middleware out")
_CLAIMS = _Need("claim_check=... needs (the bodies it takes off the wire)",
                "give the claim check a store of its own: ClaimCheck(store=...)")
_SCHEDULES = _Need("schedules=... needs (the scheduler's lease)", "leave the schedules out")


def roles_of(storage: object) -> tuple[type[StorageRole], ...]:
    """The roles ``storage`` has, in the order :class:`~idembus.storage.base.Storage`
    combines them."""
    return tuple(role for role in ROLES if isinstance(storage, role))


def role_methods(role: type[StorageRole]) -> tuple[str, ...]:
    """The methods a backend implements to have ``role``: its abstract methods, in the
    order the role declares them."""
    abstract: frozenset[str] = getattr(role, "__abstractmethods__", frozenset())
    return tuple(name for name in vars(role) if name in abstract)


def check_storage_roles(
    storage: object, *, outbox: bool, delayed: bool, journal: bool, audit: bool, status: bool,
    schedules: bool = False, limits: bool = False, claims: bool = False,
) -> None:
    """Check that ``storage`` has the roles an endpoint with these options needs.

    ``outbox``: the outbox dispatcher runs in the endpoint; ``delayed``: its transport has
    no native delay, so deferred messages wait in the storage; ``journal``: it journals
    events; ``audit``: it has the audit middleware; ``status``: it reports its status;
    ``schedules``: it sends recurring messages under a lease; ``limits``: it has the
    limits middleware; ``claims``: it claim-checks large bodies into its storage.
    The aggregate and parking roles are always needed.

    Raises :class:`~idembus.errors.ConfigurationError` naming every missing role with its
    methods, what needs it and what to do instead, in one line.
    """
    needs: dict[type[StorageRole], _Need] = dict(_ALWAYS)
    if schedules and not outbox:
        needs[OutboxStore] = _SCHEDULES
    for wanted, role, need in ((outbox, OutboxStore, _OUTBOX), (delayed, DelayedStore, _DELAYED),
                               (journal, JournalStore, _JOURNAL), (audit, AuditStore, _AUDIT),
                               (status, StatusStore, _STATUS), (limits, LimitStore, _LIMITS),
                               (claims, PayloadStore, _CLAIMS)):
        if wanted:
            needs[role] = need
    missing = [role for role in ROLES if role in needs and not isinstance(storage, role)]
    if not missing:
        return
    clauses = [_clause(role, needs[role]) for role in missing]
    lacks = clauses[0] if len(clauses) == 1 else (
        f"{len(clauses)} storage roles: " + "; ".join(clauses))
    raise ConfigurationError(
        f"{type(storage).__name__} lacks {lacks}; idembus.testing.contract has the contract "
        "tests of each role")


def _clause(role: type[StorageRole], need: _Need) -> str:
    remedy = "implement it" + (f" or {need.otherwise}" if need.otherwise else "")
    methods = ", ".join(role_methods(role))
    return f"the {ROLE_NAMES[role]} role ({role.__name__}: {methods}) that {need.by}: {remedy}"
