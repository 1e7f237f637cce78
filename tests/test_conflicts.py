"""Optimistic retries are bounded: a handler that keeps losing races fails into the
normal error path."""

from __future__ import annotations

from typing import Any

from idembus import ConflictPolicy, RetryPolicy
from idembus import headers as h
from idembus.runtime.recoverability.policy import Recoverability
from idembus.storage.errors import ConcurrencyConflict
from idembus.storage.memory import MemoryStorage
from tests.support import AccountHandler, Deposit, SignalCounter


class AlwaysMovedOn(MemoryStorage):
    """Storage on which somebody else always commits first."""

    def commit(self, loaded: Any, **kwargs: Any) -> None:
        raise ConcurrencyConflict("another consumer committed first")


def test_a_handler_that_always_loses_the_race_ends_in_the_error_queue(make_endpoint):
    # Given an endpoint whose every commit loses an optimistic race
    accounts = make_endpoint(
        "accounts", handlers=[AccountHandler], storage=AlwaysMovedOn(),
        recoverability=Recoverability(
            conflicts=ConflictPolicy(attempts=3, base_delay=0.0),
            retries=RetryPolicy(immediate_retries=1, delayed=())),
    )
    conflicts = SignalCounter(accounts, "conflict")
    dead = SignalCounter(accounts, "dead_lettered")
    accounts.start()

    # When a deposit arrives
    accounts.bus.send(Deposit(account="a", amount=1))

    # Then each attempt re-ran the handler 3 times, and 2 attempts later it is dead-lettered
    assert dead.wait_for(1)
    assert conflicts.count == 3 * 2
    copy = accounts.transport.get(accounts.error_queue)
    assert copy is not None
    assert copy.headers[h.EXCEPTION_TYPE] == "idembus.storage.errors.ConflictRetriesExhausted"
    assert "lost 3 optimistic races" in copy.headers[h.EXCEPTION_MESSAGE]
    assert copy.headers[h.IMMEDIATE_ATTEMPTS] == "2"
