"""Evolving aggregate state: a state model's ``state_version`` is stored with the state,
state upcasters run when a handler or a unit of work loads it, and a stored field the
model no longer declares is refused — the message goes to the error queue with the reason,
never retried, nothing written — unless the model says to keep or drop such fields.
(Each backend's part, storing and returning the version: the storage contract.)"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import psycopg
import pytest
from pydantic import BaseModel, ConfigDict, Field

from idembus import Command, Endpoint, IncompatibleState, RetryPolicy, upcaster
from idembus import headers as h
from idembus.errors import ConfigurationError
from idembus.evolution import load_state, upcast_state, version_of
from idembus.handlers import AggregateHandler, handles
from idembus.runtime.recoverability.policy import Recoverability
from idembus.storage.base import AggregateRecord
from idembus.storage.memory import MemoryStorage
from idembus.storage.postgres import PostgresStorage
from idembus.testing import handle, wait_until_idle
from tests.conftest import POSTGRES_URL, require_service
from tests.support import SignalCounter

RETRIES = Recoverability(retries=RetryPolicy(immediate_retries=3, delayed=(1.0,)))


class Top(Command, message_name="evo.TopUp"):
    wallet: str
    cents: int


class Wallet(BaseModel):
    """Version 2: cents. Version 1 kept ``{"euros": float}``."""

    state_version: ClassVar[int] = 2
    cents: int = 0


@upcaster(Wallet, from_version=1)
def _euros_to_cents(state: dict[str, Any]) -> dict[str, Any]:
    return {"cents": round(state.pop("euros") * 100), **state}


class Wallets(AggregateHandler[Wallet]):
    def aggregate_id(self, message: Top) -> str:
        return message.wallet

    @handles
    def top_up(self, message: Top) -> None:
        self.state.cents += message.cents


def seeded(state: dict[str, Any], version: int | None = None) -> MemoryStorage:
    """A storage holding wallet ``w`` as an older version of the code left it."""
    storage = MemoryStorage()
    storage.commit(AggregateRecord("Wallet", "w"), key="seed", state=state, outgoing=(),
                   state_version=version)
    return storage


def run(storage: MemoryStorage, handler: Any = Wallets) -> tuple[Endpoint, dict[str, int]]:
    """Top wallet ``w`` up by 5 cents on an endpoint over ``storage``; its counters."""
    endpoint = Endpoint(f"wallets-{uuid.uuid4().hex[:8]}", storage=storage,
                        handlers=[handler], recoverability=RETRIES)
    settled = threading.Event()
    for name in ("handled", "dead_lettered"):
        getattr(endpoint.signals, name).connect(lambda *_, **__: settled.set(), weak=False)
    with endpoint:
        endpoint.bus.send(Top(wallet="w", cents=5))
        assert settled.wait(15)
        wait_until_idle([endpoint])
    return endpoint, endpoint.counters.snapshot()


def test_a_version_1_state_is_upcast_on_load_and_committed_at_version_2():
    storage = seeded({"euros": 1.5})  # written before versions existed

    _, counts = run(storage)

    assert counts["handled"] == 1
    stored = storage.load("Wallet", "w")
    assert (stored.state, stored.state_version) == ({"cents": 155}, 2)


def test_a_stored_field_the_model_no_longer_declares_sends_the_message_to_the_error_queue():
    # Given a wallet stored with a field the model dropped
    storage = seeded({"cents": 100, "owner": "ann"}, version=2)

    # When a message for it is handled
    endpoint, counts = run(storage)

    # Then it fails once, without retries, and goes to the error queue with the reason
    assert (counts["handled"], counts["failed"], counts["retried"]) == (0, 1, 0)
    assert counts["dead_lettered"] == 1
    copy = endpoint.transport.get(endpoint.error_queue)
    assert copy is not None
    assert copy.headers[h.EXCEPTION_TYPE].endswith("IncompatibleState")
    assert "'owner'" in copy.headers[h.EXCEPTION_MESSAGE]
    assert "extra='allow'" in copy.headers[h.EXCEPTION_MESSAGE]
    # And nothing was written
    assert storage.load("Wallet", "w").state == {"cents": 100, "owner": "ann"}


class KeepingWallet(Wallet):
    model_config = ConfigDict(extra="allow")


class KeepingWallets(AggregateHandler[KeepingWallet]):
    aggregate_type = "Wallet"

    def aggregate_id(self, message: Top) -> str:
        return message.wallet

    @handles
    def top_up(self, message: Top) -> None:
        self.state.cents += message.cents


class DroppingWallet(Wallet):
    model_config = ConfigDict(extra="ignore")


class DroppingWallets(KeepingWallets, AggregateHandler[DroppingWallet]):
    pass


@pytest.mark.parametrize(("handler", "left"), [
    (KeepingWallets, {"cents": 105, "owner": "ann"}),
    (DroppingWallets, {"cents": 105}),
])
def test_a_model_that_opts_in_keeps_or_drops_stored_fields_it_does_not_declare(
    handler: Any, left: dict[str, Any],
):
    storage = seeded({"cents": 100, "owner": "ann"}, version=2)

    _, counts = run(storage, handler)

    assert counts["handled"] == 1
    assert storage.load("Wallet", "w").state == left


def test_a_state_newer_than_the_model_is_refused_with_what_to_deploy():
    storage = seeded({"cents": 100, "currency": "EUR"}, version=3)

    endpoint, counts = run(storage)

    assert counts["dead_lettered"] == 1 and counts["retried"] == 0
    copy = endpoint.transport.get(endpoint.error_queue)
    assert copy is not None
    assert "version 3 of Wallet, newer than the version 2" in copy.headers[
        h.EXCEPTION_MESSAGE]


def test_a_unit_of_work_upcasts_too_and_refuses_an_undeclared_field_before_writing():
    storage = seeded({"euros": 2.0})
    endpoint = Endpoint(f"uow-{uuid.uuid4().hex[:8]}", storage=storage, handlers=[Wallets])

    with endpoint.unit_of_work(Wallet, "w") as work:
        assert work.state == Wallet(cents=200)
        work.state.cents += 1
    assert storage.load("Wallet", "w").state_version == 2

    strange = seeded({"cents": 1, "owner": "bob"}, version=2)
    other = Endpoint(f"uow-{uuid.uuid4().hex[:8]}", storage=strange, handlers=[Wallets])
    with pytest.raises(IncompatibleState, match="'owner'"):
        with other.unit_of_work(Wallet, "w"):
            pass
    assert strange.load("Wallet", "w").version == 1


def test_the_testing_helper_stores_a_given_state_at_its_version():
    result = handle(Wallets, Top(wallet="w", cents=3), state=Wallet(cents=4))

    assert result.state == Wallet(cents=7)


def test_a_state_version_that_is_not_a_whole_number_fails_when_the_endpoint_is_built():
    class Odd(BaseModel):
        state_version: ClassVar[Any] = "2"

    class Odds(AggregateHandler[Odd]):
        def aggregate_id(self, message: Top) -> str:
            return message.wallet

        @handles(Top)
        def top_up(self, message: Any) -> None: ...

    with pytest.raises(ConfigurationError, match="state_version must be a whole number"):
        Endpoint(f"odd-{uuid.uuid4().hex[:8]}", storage=MemoryStorage(), handlers=[Odds])


def test_each_models_version_and_declared_fields_are_its_own_when_looked_up_again():
    # Given two models, one a subclass with a version and a field of its own, each asked
    # for once already (what is looked up once per model is kept)
    class First(BaseModel):
        cents: int = 0

    class Second(First):
        state_version: ClassVar[int] = 3
        note: str = Field("", alias="remark")

    for model in (First, Second):
        version_of(model)
        load_state(model, {}, None if model is First else 3)

    # Then each still reads as its own: version, upcast, and the fields it declares
    assert (version_of(First), version_of(Second)) == (1, 3)
    assert load_state(First, {"cents": 2}, None) == First(cents=2)
    assert load_state(Second, {"cents": 2, "remark": "r"}, 3) == Second(cents=2, remark="r")
    with pytest.raises(IncompatibleState, match="'remark'"):
        load_state(First, {"cents": 2, "remark": "r"}, 1)
    with pytest.raises(IncompatibleState, match="version 2 of .*Second.* no upcaster"):
        load_state(Second, {"cents": 2}, 2)
    assert upcast_state(Wallet, {"euros": 1.5}, None) == {"cents": 150}
    assert upcast_state(Wallet, {"cents": 5}, 2) == {"cents": 5}


# -- PostgreSQL: the column, added to an existing schema --------------------------------


@pytest.fixture
def prefix() -> Iterator[str]:
    require_service(POSTGRES_URL, "PostgreSQL")
    prefix = f"sv{uuid.uuid4().hex[:10]}"
    yield prefix
    cleaner = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    cleaner.drop_tables()
    cleaner.close()


@pytest.mark.postgres
def test_an_aggregates_table_from_before_versions_gains_the_column_and_keeps_its_states(
    prefix: str,
):
    # Given a schema from before state versions, holding a version-1 wallet
    older = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    older.migrate()
    older.close()
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f"ALTER TABLE {prefix}_aggregates DROP COLUMN state_version")
        admin.execute(f"INSERT INTO {prefix}_aggregates (aggregate_type, aggregate_id, "
                      "version, state) VALUES ('Wallet', 'w', 1, '{\"euros\": 0.5}')")

    # When this version starts on it
    storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    try:
        storage.verify()

        # Then the state is there, unversioned (read as 1), and is upcast when handled
        loaded = storage.load("Wallet", "w", "k")
        assert (loaded.state, loaded.state_version) == ({"euros": 0.5}, None)
        endpoint = Endpoint(f"pgw-{uuid.uuid4().hex[:8]}", storage=storage, handlers=[Wallets])
        handled = SignalCounter(endpoint, "handled")
        with endpoint:
            endpoint.bus.send(Top(wallet="w", cents=1))
            assert handled.wait_for(1)
        storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
        stored = storage.load("Wallet", "w")
        assert (stored.state, stored.state_version) == ({"cents": 51}, 2)
    finally:
        storage.close()
