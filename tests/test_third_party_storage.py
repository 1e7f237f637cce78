"""A backend written outside idembus proves itself with the contract classes idembus ships
(:mod:`idembus.testing.contract`), and an endpoint tells what its roles lack.

``DictStorage`` stands for a third party's backend: it implements only the two roles every
endpoint needs, aggregates and parking, so it runs only the contracts of those roles.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest

from idembus.envelope import Envelope, utc_now
from idembus.errors import ConfigurationError
from idembus.storage.base import (
    DEFAULT_PROCESSED_WINDOW,
    ROLES,
    AggregateRecord,
    AggregateStore,
    AuditStore,
    DelayedStore,
    JournalStore,
    Lease,
    LimitStore,
    OutboxStore,
    ParkedMessage,
    ParkingStore,
    PayloadStore,
    ProcessedMessage,
    StatusStore,
    Storage,
    StorageRole,
)
from idembus.storage.memory import MemoryStorage
from idembus.storage.mongo import MongoStorage
from idembus.storage.postgres import PostgresStorage
from idembus.storage.roles import check_storage_roles, role_methods, roles_of
from idembus.testing.contract import (
    AggregateStoreContract,
    AuditStoreContract,
    DelayedStoreContract,
    JournalStoreContract,
    OutboxStoreContract,
    ParkingStoreContract,
    StatusStoreContract,
    StorageContract,
    StorageFactory,
)
from idembus.testing.contract.base import RoleContract


class DictStorage(AggregateStore, ParkingStore):
    """A third party's backend: aggregates and parked messages in dicts, behind one lock."""

    process_local = True

    def __init__(self, *, processed_window: int = DEFAULT_PROCESSED_WINDOW,
                 retention: datetime.timedelta | None = None) -> None:
        super().__init__(processed_window=processed_window)
        self.retention = retention  # kept for the endpoint's check; entries outlive it
        self._records: dict[tuple[str, str], AggregateRecord] = {}
        self._parked: dict[str, ParkedMessage] = {}
        self._lock = threading.Lock()

    def load(self, aggregate_type: str, aggregate_id: str,
             key: str | None = None) -> AggregateRecord:
        with self._lock:
            record = self._records.get((aggregate_type, aggregate_id))
        return (copy.deepcopy(record) if record is not None
                else AggregateRecord(aggregate_type, aggregate_id))

    def commit(self, loaded: AggregateRecord, *, key: str, state: Mapping[str, Any] | None,
               outgoing: Sequence[Envelope], completed: bool = False,
               state_version: int | None = None, message_type: str | None = None) -> None:
        address = (loaded.aggregate_type, loaded.aggregate_id)
        entry = ProcessedMessage(key, tuple(outgoing), tuple(e.message_id for e in outgoing),
                                 dispatched=not outgoing, at=utc_now(),
                                 message_type=message_type)
        kept = copy.deepcopy(dict(state)) if state is not None else None
        with self._lock:
            current = self._records.get(address, AggregateRecord(*address))
            if current.version == loaded.version and key not in current.processed:
                processed = {**current.processed, key: entry}
                newest = list(processed)[-(self.processed_window or len(processed)):]
                self._records[address] = AggregateRecord(
                    *address, current.version + 1,
                    None if completed else kept or {},
                    {k: e for k, e in processed.items() if k in newest or not e.dispatched},
                    updated_at=entry.at, completed=completed, state_version=state_version,
                    final_state=kept if completed else None)
                return
        raise self._refusal(*address, key)

    def mark_dispatched(self, aggregate_type: str, aggregate_id: str, key: str, *,
                        keep_bodies: bool = False, lease: Lease | None = None,
                        journal: Sequence[Any] = ()) -> None:
        with self._lock:
            record = self._records.get((aggregate_type, aggregate_id))
            if record is None or key not in record.processed:
                return
            entry = record.processed[key]
            marked = dataclasses.replace(entry, outgoing=entry.outgoing if keep_bodies else (),
                                         dispatched=True)
            self._records[aggregate_type, aggregate_id] = dataclasses.replace(
                record, processed={**record.processed, key: marked})

    def records(self, aggregate_type: str) -> Iterator[AggregateRecord]:
        with self._lock:
            found = [r for (kind, _), r in self._records.items() if kind == aggregate_type]
        return iter(copy.deepcopy(found))

    def park(self, parked: ParkedMessage) -> None:
        with self._lock:
            self._parked.setdefault(parked.parked_id, parked)

    def parked_messages(self, endpoint: str) -> list[ParkedMessage]:
        with self._lock:
            found = [p for p in self._parked.values() if p.endpoint == endpoint]
        return sorted(found, key=lambda parked: parked.parked_at)

    def unpark(self, parked_ids: Sequence[str]) -> int:
        with self._lock:
            return sum(self._parked.pop(i, None) is not None for i in parked_ids)


class TestDictStorage(AggregateStoreContract, ParkingStoreContract):
    """What a third party writes in its own test suite: the contract classes of its roles
    and one fixture."""

    @pytest.fixture
    def storage_factory(self) -> Iterator[StorageFactory]:
        created: list[DictStorage] = []

        def make(**options: Any) -> DictStorage:
            created.append(DictStorage(**options))
            return created[-1]

        yield make
        for storage in created:
            storage.close()


def contract_tests(*classes: type) -> set[str]:
    """The tests a class runs (its own and those it inherits)."""
    return {name for cls in classes for name in dir(cls) if name.startswith("test_")}


def own_tests(contract: type) -> set[str]:
    """The tests a contract class adds to those of every role."""
    return contract_tests(contract) - contract_tests(RoleContract)


def test_a_partial_backend_runs_only_the_contracts_of_its_roles() -> None:
    ran = contract_tests(TestDictStorage)

    assert ran == contract_tests(AggregateStoreContract, ParkingStoreContract)
    for contract in (OutboxStoreContract, DelayedStoreContract, JournalStoreContract,
                     AuditStoreContract, StatusStoreContract):
        assert own_tests(contract), contract.__name__
        assert own_tests(contract) & ran == set(), contract.__name__


def test_the_whole_contract_holds_every_roles_tests() -> None:
    every = (AggregateStoreContract, OutboxStoreContract, DelayedStoreContract,
             JournalStoreContract, AuditStoreContract, StatusStoreContract, ParkingStoreContract)

    assert contract_tests(StorageContract) == contract_tests(*every)
    # every role but the limits and the payloads, which a backend adds to Storage
    # (idembus's three do)
    assert StorageContract.roles == tuple(role for role in ROLES
                                          if role not in (LimitStore, PayloadStore))


def test_the_shipped_contract_classes_are_not_collected_by_themselves() -> None:
    # pytest collects classes named Test*: only a backend's subclasses run.
    for contract in (AggregateStoreContract, OutboxStoreContract, DelayedStoreContract,
                     JournalStoreContract, AuditStoreContract, StatusStoreContract,
                     ParkingStoreContract, StorageContract):
        assert not contract.__name__.startswith("Test"), contract


def test_importing_idembus_imports_neither_pytest_nor_hypothesis() -> None:
    code = ("import sys, idembus, idembus.storage.roles; "
            "print(sorted({'pytest', 'hypothesis'} & set(sys.modules)))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, timeout=60)
    assert found.stdout.strip() == "[]"


# -- the endpoint's check of its storage's roles ---------------------------------------------

NOTHING = {"outbox": False, "delayed": False, "journal": False, "audit": False,
           "status": False}
EVERYTHING = {option: True for option in NOTHING}


def test_a_storage_tells_its_roles_by_the_role_classes_it_subclasses() -> None:
    assert roles_of(DictStorage()) == (AggregateStore, ParkingStore)
    assert roles_of(MemoryStorage()) == ROLES
    assert roles_of(object()) == ()
    assert role_methods(DelayedStore) == (
        "_schedule", "_claim_due", "forget_scheduled", "note_scheduled_failure")
    assert role_methods(AggregateStore) == ("load", "commit", "mark_dispatched", "records")


def test_a_storage_with_every_role_serves_every_option() -> None:
    check_storage_roles(MemoryStorage(), **EVERYTHING)


def test_aggregates_and_parking_serve_an_endpoint_without_options() -> None:
    check_storage_roles(DictStorage(), **NOTHING)


def test_an_option_whose_role_is_missing_is_refused_with_the_role_its_methods_and_a_remedy(
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        check_storage_roles(DictStorage(), **{**NOTHING, "journal": True})

    assert str(refused.value) == (
        "DictStorage lacks the journal role (JournalStore: append_journal, read_journal, "
        "journal_bounds, journal_position_at, trim_journal) that journal=... needs: "
        "implement it or turn the option off (journal=False); idembus.testing.contract has "
        "the contract tests of each role")


def test_every_missing_role_is_named_with_what_needs_it_in_one_line() -> None:
    with pytest.raises(ConfigurationError) as refused:
        check_storage_roles(DictStorage(), **EVERYTHING)

    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("DictStorage lacks 5 storage roles: the outbox role (OutboxStore:")
    for role, option in ((OutboxStore, "outbox=True needs"),
                         (DelayedStore, "a transport without native delay needs"),
                         (JournalStore, "journal=... needs"),
                         (AuditStore, "the Audit middleware needs"),
                         (StatusStore, "status reports need")):
        assert f"{role.__name__}: {', '.join(role_methods(role))}) that {option}" in message
    assert "aggregate role" not in message and "parking role" not in message


def test_every_endpoint_needs_aggregates_and_parking_whatever_its_options() -> None:
    with pytest.raises(ConfigurationError) as refused:
        check_storage_roles(object(), **NOTHING)

    assert str(refused.value) == (
        "object lacks 2 storage roles: the aggregate role (AggregateStore: load, commit, "
        "mark_dispatched, records) that every endpoint needs (its handlers load, commit and "
        "deduplicate there): implement it; the parking role (ParkingStore: park, "
        "parked_messages, unpark) that every endpoint needs (it keeps there what neither the "
        "broker nor the error queue took, so that nothing is lost): implement it; "
        "idembus.testing.contract has the contract tests of each role")


def test_every_backend_of_idembus_has_every_role() -> None:
    assert all(issubclass(role, StorageRole) for role in ROLES)
    assert all(issubclass(Storage, role) for role in ROLES
               if role not in (LimitStore, PayloadStore))
    for backend in (MemoryStorage, MongoStorage, PostgresStorage):
        assert all(issubclass(backend, role) for role in ROLES), backend


def test_an_endpoint_refuses_a_storage_without_the_roles_its_options_need() -> None:
    from idembus import Endpoint, JournalPolicy

    with pytest.raises(ConfigurationError) as refused:
        Endpoint("partial", storage=DictStorage(), journal=JournalPolicy(events=True))
    message = str(refused.value)
    for needed in ("JournalStore", "OutboxStore", "DelayedStore", "StatusStore"):
        assert needed in message


def test_an_endpoint_runs_on_a_partial_storage_when_its_options_need_no_more(
    make_endpoint: Any, make_transport: Any,
) -> None:
    # Given a backend with aggregates and parking only, the outbox run elsewhere and no
    # status reports
    from idembus.testing import wait_until_idle
    from tests.support import Account, AccountHandler, Deposit

    storage = DictStorage()
    transport = make_transport()
    options = dict(storage=storage, handlers=[AccountHandler], transport=transport,
                   outbox=False, status_interval=0)
    if not transport.native_delay:
        # a broker without native delay needs the storage to keep deferred messages
        with pytest.raises(ConfigurationError, match="DelayedStore"):
            make_endpoint("partial", **options)
        return
    accounts = make_endpoint("partial", **options)
    # When it handles a deposit on a broker that delays messages itself (RabbitMQ)
    with accounts:
        accounts.bus.send(Deposit(account="a", amount=7))
        wait_until_idle([accounts])
    # Then the partial backend holds the new state
    assert Account.model_validate(storage.load("Account", "a").state).balance == 7
