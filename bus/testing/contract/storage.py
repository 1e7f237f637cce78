"""The whole storage contract: every role's tests, for a backend with every role
(:class:`~idembus.storage.base.Storage`)."""

from __future__ import annotations

from typing import ClassVar

from ...storage.base import ROLES, Storage, StorageRole
from .aggregates import AggregateStoreContract
from .audit import AuditStoreContract
from .delayed import DelayedStoreContract
from .journal import JournalStoreContract
from .outbox import OutboxStoreContract
from .parking import ParkingStoreContract
from .status import StatusStoreContract


class StorageContract(AggregateStoreContract, OutboxStoreContract, DelayedStoreContract,
                      JournalStoreContract, AuditStoreContract, StatusStoreContract,
                      ParkingStoreContract):
    """Every role's contract in one class, for a backend that subclasses ``Storage``."""

    roles: ClassVar[tuple[type[StorageRole], ...]] = tuple(
        role for role in ROLES if issubclass(Storage, role))
