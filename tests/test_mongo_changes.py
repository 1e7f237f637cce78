"""The change-stream wake-up of the outbox dispatcher is guarded: where MongoDB has no
change streams (mongomock, a standalone server) the dispatcher polls. The stream itself is
verified only against a replica set (set IDEMBUS_MONGODB_URL to one)."""

from __future__ import annotations

import datetime
import threading

import mongomock
import pytest

from storage.base import OUTBOX_LEASE
from storage.errors import StaleLease
from storage.mongo import LEASES, MongoStorage
from storage.mongo_changes import _save, can_watch

NOW = datetime.datetime(2031, 5, 4, 12, 0, tzinfo=datetime.timezone.utc)


def test_mongomock_is_not_watched_so_the_dispatcher_polls():
    storage = MongoStorage.embedded("changes")
    woken = threading.Event()
    assert storage.watch(woken.set, threading.Event(), lambda: None) is False
    assert not woken.is_set()


def test_a_server_that_does_not_answer_hello_is_not_watched():
    assert can_watch(mongomock.MongoClient()) is False


def test_the_resume_token_is_saved_only_under_the_current_lease():
    # Given the dispatcher's lease document, now owned with token 2
    storage = MongoStorage.embedded("changes")
    first = storage.acquire_lease(OUTBOX_LEASE, "A", ttl=30, now=NOW)
    current = storage.acquire_lease(OUTBOX_LEASE, "B", ttl=30,
                                    now=NOW + datetime.timedelta(seconds=31))
    leases = storage.database[LEASES]

    # When the current owner saves its checkpoint, it is kept
    _save(leases, OUTBOX_LEASE, current, {"_data": "token-2"})
    assert leases.find_one({"_id": OUTBOX_LEASE})["resume_token"] == {"_data": "token-2"}

    # And an old owner cannot move it
    with pytest.raises(StaleLease):
        _save(leases, OUTBOX_LEASE, first, {"_data": "token-1"})
    assert leases.find_one({"_id": OUTBOX_LEASE})["resume_token"] == {"_data": "token-2"}
