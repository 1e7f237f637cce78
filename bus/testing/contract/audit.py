"""The contract of :class:`~idembus.storage.base.AuditStore`: the audit trail."""

from __future__ import annotations

import datetime
from typing import ClassVar

from ...storage.base import AuditRecord, AuditStore, StorageRole
from .base import RoleContract, StorageFactory

UTC = datetime.timezone.utc
START = datetime.datetime(2031, 5, 4, 12, 0, tzinfo=UTC)


def record(number: int, outcome: str = "handled") -> AuditRecord:
    return AuditRecord(endpoint="sales", handler="OrderHandler", message_id=f"m{number}",
                       message_type="sales.PlaceOrder", outcome=outcome,
                       time_sent=START, recorded_at=START + datetime.timedelta(seconds=number))


class AuditStoreContract(RoleContract):
    """Audit records are kept as written and read back in parts, each once."""

    roles: ClassVar[tuple[type[StorageRole], ...]] = (AuditStore,)

    def test_audit_records_are_read_back_as_written(self, storage_factory: StorageFactory) -> None:
        storage = storage_factory()
        written = [record(1), record(2, "duplicate")]
        storage.write_audit(written)
        assert sorted(storage.read_audit(), key=lambda r: r.message_id) == written

    def test_parts_split_the_records_so_each_is_read_exactly_once(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        written = [record(number) for number in range(40)]
        storage.write_audit(written)
        parts = [list(storage.read_audit(part=part, parts=3)) for part in range(3)]
        read = sorted(r.message_id for part in parts for r in part)
        assert read == sorted(r.message_id for r in written)
        assert all(parts), "forty ids should land in every one of three parts"

    def test_a_record_without_a_time_sent_is_kept(self, storage_factory: StorageFactory) -> None:
        storage = storage_factory()
        bare = AuditRecord("sales", "", "m9", "x.Y", "dead_lettered", None, START)
        storage.write_audit([bare])
        assert list(storage.read_audit()) == [bare]
