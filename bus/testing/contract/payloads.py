"""The contract of :class:`~idembus.storage.base.PayloadStore`: claim-checked bodies kept
under their ids, written again idempotently, held, collected only once their time has passed
and no hold keeps them."""

from __future__ import annotations

import datetime
from typing import ClassVar

from ...storage.base import PayloadStore, StorageRole
from .base import RoleContract, StorageFactory

UTC = datetime.timezone.utc
START = datetime.datetime(2031, 5, 4, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime.datetime:
    return START + datetime.timedelta(seconds=seconds)


class PayloadStoreContract(RoleContract):
    """Bodies read back byte for byte (large ones too), written again without a second
    copy, kept until the latest time any write asked for (or, held, until every hold is
    released), and collected after it."""

    roles: ClassVar[tuple[type[StorageRole], ...]] = (PayloadStore,)

    def test_a_body_is_read_back_byte_for_byte_and_an_unknown_id_is_none(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        body = bytes(range(256)) * 4 + "é\u2603".encode()
        storage.put_payload("p-1", body, keep_until=at(60))
        assert storage.get_payload("p-1") == body
        assert storage.get_payload("p-2") is None

    def test_a_body_larger_than_a_document_is_read_back_whole(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        body = b"".join(i.to_bytes(4, "big") for i in range(5 * 1024 * 1024))  # 20 MiB
        storage.put_payload("big", body, keep_until=at(60))
        assert storage.get_payload("big") == body

    def test_writing_again_keeps_one_body_and_the_latest_time(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        storage.put_payload("p", b"body", keep_until=at(100))
        storage.put_payload("p", b"body", keep_until=at(50))  # an earlier time: no effect
        assert storage.collect_payloads(at(99)) == 0
        assert storage.get_payload("p") == b"body"
        storage.put_payload("p", b"body", keep_until=at(200))  # a later one moves it on
        assert storage.collect_payloads(at(150)) == 0
        assert storage.get_payload("p") == b"body"

    def test_collecting_removes_only_bodies_whose_time_has_passed_a_batch_at_a_time(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        for number in range(5):
            storage.put_payload(f"old-{number}", b"x", keep_until=at(10))
        storage.put_payload("young", b"y", keep_until=at(1000))
        assert storage.collect_payloads(at(10)) == 0  # kept until then, not before
        assert storage.collect_payloads(at(11), batch=3) == 3
        assert storage.collect_payloads(at(11), batch=3) == 2
        assert storage.collect_payloads(at(11)) == 0
        assert [storage.get_payload(f"old-{n}") for n in range(5)] == [None] * 5
        assert storage.get_payload("young") == b"y"

    def test_a_held_body_outlives_its_time_until_every_hold_is_released(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        storage.put_payload("p", b"held", keep_until=at(10))
        assert storage.hold_payload("p", "copy-1") is True
        assert storage.hold_payload("p", "copy-1") is True  # again: one hold
        assert storage.hold_payload("p", "copy-2") is True
        storage.put_payload("p", b"held", keep_until=at(20))  # written again: still held
        assert storage.collect_payloads(at(1000)) == 0
        assert storage.release_payload("copy-1", keep_until=at(30)) is True
        assert storage.release_payload("copy-1", keep_until=at(30)) is False  # gone already
        assert storage.collect_payloads(at(1000)) == 0  # copy-2 still holds it
        assert storage.get_payload("p") == b"held"
        # released with a time: kept until then (a retried copy on its way), then collected
        assert storage.release_payload("copy-2", keep_until=at(2000)) is True
        assert storage.collect_payloads(at(1500)) == 0
        assert storage.get_payload("p") == b"held"
        assert storage.collect_payloads(at(2001)) == 1
        assert storage.get_payload("p") is None

    def test_a_hold_on_a_large_body_keeps_all_of_it(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        body = b"".join(i.to_bytes(4, "big") for i in range(5 * 1024 * 1024))  # 20 MiB
        storage.put_payload("big", body, keep_until=at(10))
        assert storage.hold_payload("big", "copy")
        assert storage.collect_payloads(at(100)) == 0
        assert storage.get_payload("big") == body
        storage.release_payload("copy", keep_until=at(50))
        assert storage.collect_payloads(at(100)) == 1
        assert storage.get_payload("big") is None

    def test_holding_a_body_that_is_not_there_holds_nothing(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        assert storage.hold_payload("never", "copy") is False
        assert storage.release_payload("copy", keep_until=at(10)) is False
        storage.put_payload("gone", b"x", keep_until=at(10))
        assert storage.collect_payloads(at(11)) == 1
        assert storage.hold_payload("gone", "copy") is False
        storage.put_payload("unheld", b"y", keep_until=at(10))
        assert storage.release_payload("other", keep_until=at(500)) is False
        assert storage.collect_payloads(at(11)) == 1  # a release elsewhere moved nothing
