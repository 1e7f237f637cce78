"""The storage contract as abstract pytest classes, one per role, for any backend.

A backend proves itself by subclassing the classes of the roles it implements (the role
classes of :mod:`idembus.storage.base`) in its own test suite, with one fixture,
``storage_factory``: a callable returning a fresh, empty storage on each call (keyword
options such as ``processed_window=3`` or ``retention=...``; ``pytest.skip`` the ones the
backend does not take), cleaning up afterwards::

    import pytest
    from idembus.testing.contract import AggregateStoreContract, ParkingStoreContract

    class TestMyStorage(AggregateStoreContract, ParkingStoreContract):
        @pytest.fixture
        def storage_factory(self):
            created = []

            def make(**options):
                created.append(MyStorage(**options))
                return created[-1]

            yield make
            for storage in created:
                storage.close()

:class:`StorageContract` holds every role's tests, for a backend with every role. A test
that also needs another role than its class's (a fenced mark carrying journal entries needs
the outbox's leases) is skipped, with the reason, on a backend without it. Tests of what a
second storage object on the same data sees run once the subclass overrides
:meth:`~idembus.testing.contract.base.RoleContract.another_instance`.

The classes' names do not start with ``Test``, so pytest collects only the subclasses.
Importing this package imports pytest; ``import idembus`` never does.
"""

from __future__ import annotations

from .aggregates import AggregateStoreContract
from .audit import AuditStoreContract
from .base import RoleContract, StorageFactory
from .delayed import DelayedStoreContract
from .journal import JournalStoreContract
from .limits import LimitStoreContract
from .outbox import OutboxStoreContract
from .parking import ParkingStoreContract
from .payloads import PayloadStoreContract
from .status import StatusStoreContract
from .storage import StorageContract

__all__ = [
    "AggregateStoreContract",
    "AuditStoreContract",
    "DelayedStoreContract",
    "JournalStoreContract",
    "LimitStoreContract",
    "OutboxStoreContract",
    "ParkingStoreContract",
    "PayloadStoreContract",
    "RoleContract",
    "StatusStoreContract",
    "StorageContract",
    "StorageFactory",
]
