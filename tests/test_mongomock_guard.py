"""mongomock is not thread-safe; MongoStorage must serialise access to it, and say so.

The issue: four threads doing guarded conditional updates through mongomock applied one
message up to four times. MongoStorage recognises a mongomock client and puts every
operation behind one re-entrant lock; a real pymongo client (thread-safe) gets no lock.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import mongomock
import pymongo
import pytest

import idembus.storage.mongo
from idembus import headers as h
from idembus.envelope import Envelope
from idembus.storage.base import AggregateRecord
from idembus.storage.errors import AlreadyProcessed
from idembus.storage.mongo import MongoStorage, is_mongomock

_RLOCK_TYPE = type(threading.RLock())


@pytest.fixture
def unconnected_pymongo_client() -> Iterator[pymongo.MongoClient[dict[str, Any]]]:
    """A real pymongo client that never reaches a server (nothing listens on port 1)."""
    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
        "mongodb://127.0.0.1:1", connect=False
    )
    yield client
    client.close()


def test_is_mongomock_recognises_a_mongomock_client() -> None:
    assert is_mongomock(mongomock.MongoClient())


def test_is_mongomock_does_not_take_a_pymongo_client_for_mongomock(
    unconnected_pymongo_client: pymongo.MongoClient[dict[str, Any]],
) -> None:
    assert not is_mongomock(unconnected_pymongo_client)
    assert not is_mongomock(object())
    assert not is_mongomock(None)


def test_the_embedded_storage_guards_mongomock_with_a_reentrant_lock() -> None:
    embedded = MongoStorage.embedded(f"guard-{uuid.uuid4().hex}")

    assert isinstance(embedded._guard, _RLOCK_TYPE)


def test_a_storage_given_a_mongomock_client_directly_is_guarded_too() -> None:
    given = MongoStorage(mongomock.MongoClient(), database=f"guard-{uuid.uuid4().hex}")

    assert isinstance(given._guard, _RLOCK_TYPE)


def test_a_storage_around_a_pymongo_client_takes_no_lock(
    unconnected_pymongo_client: pymongo.MongoClient[dict[str, Any]],
) -> None:
    real = MongoStorage(unconnected_pymongo_client, database="guard")

    assert not isinstance(real._guard, _RLOCK_TYPE)
    assert isinstance(real._guard, contextlib.nullcontext)


def test_storage_operations_wait_for_the_guard() -> None:
    """The lock is not only created but taken: a load cannot run while another holds it."""
    embedded = MongoStorage.embedded(f"guard-{uuid.uuid4().hex}")
    loaded = threading.Event()

    def load() -> None:
        embedded.load("Account", "a")
        loaded.set()

    with embedded._guard:
        reader = threading.Thread(target=load, daemon=True)
        reader.start()
        # A negative check needs a bound: 0.2 s is ample for an uncontended mongomock read.
        assert not loaded.wait(0.2), "load ran while another thread held the mongomock guard"
    reader.join(timeout=10)
    assert loaded.is_set()


def test_a_refused_commit_reloads_under_the_guard_without_deadlocking() -> None:
    """The guard must be re-entrant: the refusal path loads while the guard is held."""
    embedded = MongoStorage.embedded(f"guard-{uuid.uuid4().hex}")
    empty = embedded.load("Account", "a")
    embedded.commit(empty, key="H/m1", state={"n": 1}, outgoing=[])
    outcome: list[BaseException] = []

    def commit_again() -> None:
        try:
            embedded.commit(empty, key="H/m1", state={"n": 2}, outgoing=[])
        except BaseException as error:  # collected for the assertion below
            outcome.append(error)

    worker = threading.Thread(target=commit_again, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "a refused commit deadlocked on its own guard"
    assert len(outcome) == 1 and isinstance(outcome[0], AlreadyProcessed)


THREADS = 4
ROUNDS = 200


def commit_from_every_thread(
    embedded: MongoStorage, loaded: AggregateRecord, key: str, state: dict[str, Any]
) -> tuple[int, list[BaseException]]:
    """All threads commit ``key`` against ``loaded`` at once; return (successes, other errors).

    A refusal as AlreadyProcessed is the expected fate of all threads but one; anything
    else (a ConcurrencyConflict included: same key, same version) is unexpected.
    """
    barrier = threading.Barrier(THREADS)
    successes: list[int] = []
    unexpected: list[BaseException] = []
    lock = threading.Lock()

    def commit(index: int) -> None:
        outgoing = [Envelope(
            headers={h.MESSAGE_ID: f"{key}/{index}", h.MESSAGE_TYPE: "test.Applied",
                     h.INTENT: h.Intent.PUBLISH.value},
            body="{}",
        )]
        try:
            barrier.wait(timeout=30)
            embedded.commit(loaded, key=key, state=state, outgoing=outgoing)
        except AlreadyProcessed:
            return
        except BaseException as error:  # collected for the caller's assertion
            with lock:
                unexpected.append(error)
            return
        with lock:
            successes.append(index)

    threads = [threading.Thread(target=commit, args=(i,), daemon=True) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a committing thread hung"
    return len(successes), unexpected


@pytest.mark.usefixtures("eager_thread_switching")
def test_four_threads_committing_one_message_through_mongomock_apply_it_once_per_round() -> None:
    embedded = MongoStorage.embedded(f"guard-{uuid.uuid4().hex}")
    embedded.commit(embedded.load("Account", "a"), key="Seed/m0", state={"applied": 0},
                    outgoing=[])
    per_round: list[int] = []
    unexpected: list[BaseException] = []

    for round_number in range(ROUNDS):
        loaded = embedded.load("Account", "a")
        applied = int((loaded.state or {})["applied"])
        successes, errors = commit_from_every_thread(
            embedded, loaded, f"AccountHandler/m{round_number}", {"applied": applied + 1})
        per_round.append(successes)
        unexpected.extend(errors)

    assert unexpected == []
    assert per_round == [1] * ROUNDS
    final = embedded.load("Account", "a")
    assert final.version == ROUNDS + 1
    assert dict(final.state or {}) == {"applied": ROUNDS}


def test_the_mongo_module_documents_that_it_serialises_mongomock() -> None:
    doc = idembus.storage.mongo.__doc__ or ""

    assert "serialises" in doc
    assert "mongomock" in doc
    assert "thread-safe" in doc
