"""MongoDB's refusals by the failure taxonomy, decided from pymongo's own error classes
and the server's codes (the server's errors are raised as pymongo would raise them: no
MongoDB server can run here)."""

from __future__ import annotations

from typing import Any

import mongomock
import pymongo.errors
import pytest

from idembus.errors import ConfigurationError
from idembus.storage.errors import StorageAccessDenied, StorageRefused, StorageUnavailable
from idembus.storage.mongo import MongoStorage, _translated


@pytest.mark.parametrize("error, expected", [
    (pymongo.errors.AutoReconnect("connection reset"), StorageUnavailable),
    (pymongo.errors.ServerSelectionTimeoutError("no primary"), StorageUnavailable),
    (pymongo.errors.NotPrimaryError("not primary"), StorageUnavailable),
    (pymongo.errors.OperationFailure("interrupted", code=11602), StorageUnavailable),
    (pymongo.errors.OperationFailure("Authentication failed.", code=18), StorageAccessDenied),
    (pymongo.errors.OperationFailure("not authorized on idembus", code=13),
     StorageAccessDenied),
    (pymongo.errors.WriteError("BSONObj size: 17000000 is invalid", code=10334),
     StorageRefused),
    (pymongo.errors.DocumentTooLarge("BSON document too large"), StorageRefused),
    (pymongo.errors.InvalidDocument("key 'a\\x00' must not contain NUL"), StorageRefused),
], ids=lambda value: type(value).__name__ if isinstance(value, Exception) else value.__name__)
def test_each_driver_error_is_classified(error: Exception, expected: type[Exception]) -> None:
    with pytest.raises(expected) as raised, _translated():
        raise error
    assert type(raised.value) is expected  # an access refusal is not reported as an outage


def test_a_duplicate_key_passes_through_for_the_caller_to_read_as_a_lost_race() -> None:
    with pytest.raises(pymongo.errors.DuplicateKeyError), _translated():
        raise pymongo.errors.DuplicateKeyError("E11000", code=11000)


def test_a_refused_login_is_reported_without_the_password() -> None:
    with pytest.raises(StorageAccessDenied) as raised, _translated():
        raise pymongo.errors.OperationFailure(
            "Authentication failed for mongodb://app:hunter22@db/x", code=18)
    assert "hunter22" not in str(raised.value)


def test_a_state_bson_cannot_hold_fails_the_message_on_mongomock() -> None:
    storage = MongoStorage.embedded("taxonomy")
    loaded = storage.load("Account", "a")
    with pytest.raises(StorageRefused):
        storage.commit(loaded, key="k", state={"n": 2**70}, outgoing=())


class RefusingServer:
    """A client whose server refuses the login, as pymongo reports it (code 18)."""

    def __init__(self) -> None:
        self._databases = mongomock.MongoClient()
        self.admin = self

    def __getitem__(self, name: str) -> Any:
        return self._databases[name]

    def command(self, name: str) -> Any:
        raise pymongo.errors.OperationFailure(
            "Authentication failed for mongodb://app:hunter22@db/x", code=18)


def test_a_refused_login_at_start_is_a_configuration_error() -> None:
    storage = MongoStorage(RefusingServer(), database="taxonomy")

    with pytest.raises(ConfigurationError) as raised:
        storage.verify()

    assert "code 18" in str(raised.value) and "hunter22" not in str(raised.value)
    assert isinstance(raised.value.__cause__, StorageAccessDenied)
