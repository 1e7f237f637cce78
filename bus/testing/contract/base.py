"""What the contract classes share: the one fixture a subclass provides, and helpers.

A subclass provides the fixture ``storage_factory``: a callable that returns a fresh,
empty storage each time it is called, accepting the keyword options the contract passes
(``processed_window=3``, ``retention=datetime.timedelta(0)``) or skipping the test with
``pytest.skip`` when its backend does not take one (PostgreSQL has no count window). The
fixture cleans up what it created after the test.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest

from ...storage.base import StorageRole

#: The fixture a contract subclass provides: ``storage_factory(**options)`` -> a fresh storage.
StorageFactory = Callable[..., Any]


def needs(storage: object, *roles: type[StorageRole]) -> None:
    """Skip the test unless ``storage`` also has ``roles`` (a test that spans two roles)."""
    missing = [role.__name__ for role in roles if not isinstance(storage, role)]
    if missing:
        pytest.skip(f"needs the {' and '.join(missing)} role(s) too")


class RoleContract:
    """Base of the abstract contract classes (not collected: no ``Test`` prefix)."""

    #: The roles the storage under test must have for this class's tests.
    roles: ClassVar[tuple[type[StorageRole], ...]] = ()

    def test_the_storage_has_the_roles_of_its_contract(
        self, storage_factory: StorageFactory,
    ) -> None:
        # An endpoint checks its storage's roles by its classes: a backend subclasses the
        # role classes of idembus.storage.base it implements.
        storage = storage_factory()
        assert [role.__name__ for role in self.roles if not isinstance(storage, role)] == []

    def another_instance(self, storage: Any) -> Any:
        """A second storage object on the same data as ``storage``, as another process
        (or the same one after a restart) would open it; the caller closes it. Override it
        to run the tests that need one; by default they are skipped."""
        if storage.process_local:
            pytest.skip("lives inside one storage object")
        pytest.skip(f"{type(self).__name__} does not override another_instance(): no second "
                    "storage on the same data")

    @pytest.fixture
    def eager_thread_switching(self) -> Iterator[None]:
        """Threads switch every few bytecodes during the test (:func:`eager_switching`)."""
        with eager_switching():
            yield


@contextlib.contextmanager
def eager_switching() -> Iterator[None]:
    """Make the interpreter switch threads every few bytecodes instead of every 5 ms.

    Without this, a commit is short enough to run within one time slice and an unguarded
    backend passes race tests by luck.
    """
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)
