"""Handlers keep a contract idembus can check: they return nothing, and their hooks
(``aggregate_id``, ``new_state``) are plain functions. An ``async def`` hook is refused when
the endpoint is created; a returned value fails the message before anything is committed
(``async def`` handling methods are tests/test_async_handlers.py's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from idembus import Endpoint, RetryPolicy
from idembus import headers as h
from idembus.errors import HandlerContractError
from idembus.handlers import AggregateHandler, Handler, HandlerDefinitionError, handles
from idembus.runtime.recoverability.policy import Recoverability
from idembus.storage.memory import MemoryStorage
from idembus.testing import handle, wait_until_idle
from tests.support import Account, Deposit, SignalCounter


def test_an_async_aggregate_id_is_refused() -> None:
    class AsyncAddress(AggregateHandler[Account]):
        async def aggregate_id(self, message: Deposit) -> str:  # type: ignore[override]
            return message.account

        @handles
        def deposit(self, message: Deposit) -> None:
            self.state.balance += message.amount

    with pytest.raises(HandlerDefinitionError, match="AsyncAddress.aggregate_id"):
        Endpoint("async-address", handlers=[AsyncAddress], storage=MemoryStorage())


class Returning(AggregateHandler[Account]):
    """Written as in frameworks where a handler returns its reply."""

    def aggregate_id(self, message: Deposit) -> str:
        return message.account

    @handles
    def deposit(self, message: Deposit) -> Any:
        self.state.balance += message.amount
        return {"ok": True}


def test_the_testing_helper_fails_a_handler_that_returns_a_value() -> None:
    with pytest.raises(HandlerContractError) as failed:
        handle(Returning, Deposit(account="a", amount=5))

    assert "Returning.deposit returned {'ok': True}" in str(failed.value)
    assert "self.bus" in str(failed.value)


def test_a_returned_value_sends_the_message_to_the_error_queue_at_once_with_nothing_committed(
    make_endpoint: Callable[..., Endpoint],
) -> None:
    # Given an endpoint whose handler returns a value
    accounts = make_endpoint("returning", handlers=[Returning])
    dead_lettered = SignalCounter(accounts, "dead_lettered")
    accounts.start()

    # When a deposit arrives
    accounts.bus.send(Deposit(account="a", amount=5))

    # Then it goes to the error queue without retries, saying what is wrong
    assert dead_lettered.wait_for(1)
    wait_until_idle([accounts])
    copy = accounts.transport.get(accounts.error_queue)
    assert copy is not None
    assert copy.headers[h.EXCEPTION_TYPE] == "idembus.errors.HandlerContractError"
    assert "returned" in copy.headers[h.EXCEPTION_MESSAGE]
    assert accounts.counters["failed"] == 1
    assert accounts.counters["retried"] == 0
    # And the deposit was not applied
    assert not accounts.storage.load("Account", "a").exists


def test_a_coroutine_returned_by_a_plain_method_is_closed_and_fails_the_message() -> None:
    async def later() -> None:
        pass

    class HandsBackACoroutine(Handler):
        @handles
        def deposit(self, message: Deposit) -> Any:
            return later()

    # filterwarnings=error: a coroutine left unclosed would fail this test with a warning
    with pytest.raises(HandlerContractError, match="returned a coroutine|returned <coroutine"):
        handle(HandsBackACoroutine, Deposit(account="a", amount=1))


def test_a_policy_with_its_own_unrecoverable_types_still_never_retries_a_broken_contract(
    make_endpoint: Callable[..., Endpoint],
) -> None:
    # Given a retry policy that lists only its own unrecoverable type
    accounts = make_endpoint("returning-own-policy", handlers=[Returning],
                             recoverability=Recoverability(
                                 retries=RetryPolicy(immediate_retries=3, delayed=(60.0,),
                                                     unrecoverable=(KeyError,))))
    dead_lettered = SignalCounter(accounts, "dead_lettered")
    accounts.start()

    # When a handler breaks the contract
    accounts.bus.send(Deposit(account="a", amount=5))

    # Then the message still goes to the error queue at once, without any retry
    assert dead_lettered.wait_for(1)
    wait_until_idle([accounts])
    assert (accounts.counters["failed"], accounts.counters["retried"]) == (1, 0)


def test_an_async_new_state_is_refused() -> None:
    class AsyncNewState(AggregateHandler[Account]):
        def aggregate_id(self, message: Deposit) -> str:
            return message.account

        async def new_state(self, aggregate_id: str, message: Any) -> Account:  # type: ignore[override]
            return Account()

        @handles
        def deposit(self, message: Deposit) -> None:
            self.state.balance += message.amount

    with pytest.raises(HandlerDefinitionError, match="AsyncNewState.new_state"):
        Endpoint("async-new-state", handlers=[AsyncNewState], storage=MemoryStorage())
