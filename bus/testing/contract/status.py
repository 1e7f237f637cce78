"""The contract of :class:`~idembus.storage.base.StatusStore`: what endpoint processes
report for ``idembus status``."""

from __future__ import annotations

import dataclasses
import datetime
from typing import ClassVar

from ...storage.base import StatusReport, StatusStore, StorageRole
from .base import RoleContract, StorageFactory

UTC = datetime.timezone.utc
START = datetime.datetime(2031, 5, 4, 12, 0, tzinfo=UTC)


def report(instance: str, seconds: float, handled: int, *, endpoint: str = "sales",
           stopped: bool = False) -> StatusReport:
    return StatusReport(endpoint=endpoint, instance=instance, counters={"handled": handled},
                        started_at=START, updated_at=START + datetime.timedelta(seconds=seconds),
                        stopped=stopped)


class StatusStoreContract(RoleContract):
    """A report per endpoint process, replaced by its next, newest first, forgotten when
    old."""

    roles: ClassVar[tuple[type[StorageRole], ...]] = (StatusStore,)

    def test_a_report_is_read_back_as_written(self, storage_factory: StorageFactory) -> None:
        storage = storage_factory()
        written = report("host:1:aa", 5, 3, stopped=True)
        storage.report_status(written)
        assert storage.status_reports("sales") == [written]

    def test_a_later_report_of_one_instance_replaces_its_earlier_one(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        storage.report_status(report("host:1:aa", 5, 3))
        storage.report_status(report("host:1:aa", 10, 7))
        (kept,) = storage.status_reports("sales")
        assert kept.counters == {"handled": 7}
        assert kept.updated_at == START + datetime.timedelta(seconds=10)

    def test_reports_are_per_endpoint_and_newest_first(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        storage.report_status(report("host:1:aa", 5, 1))
        storage.report_status(report("host:2:bb", 9, 2))
        storage.report_status(report("host:3:cc", 7, 3, endpoint="billing"))
        assert [r.instance for r in storage.status_reports("sales")] == ["host:2:bb", "host:1:aa"]
        assert [r.instance for r in storage.status_reports("billing")] == ["host:3:cc"]
        assert storage.status_reports("shipping") == []

    def test_a_reports_problems_are_kept_and_cleared_with_the_next_report(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        blocked = dataclasses.replace(report("host:1:aa", 5, 0), problems={
            "storage": "password authentication failed for user app"})
        storage.report_status(blocked)
        assert storage.status_reports("sales") == [blocked]

        storage.report_status(report("host:1:aa", 10, 1))
        (kept,) = storage.status_reports("sales")
        assert kept.problems == {}

    def test_reports_of_processes_long_gone_are_forgotten(
        self, storage_factory: StorageFactory,
    ) -> None:
        storage = storage_factory()
        storage.report_status(report("host:1:aa", 5, 1))
        storage.report_status(report("host:2:bb", 500, 2))
        storage.report_status(report("host:3:cc", 5, 3, endpoint="billing"))

        forgotten = storage.forget_status("sales",
                                          updated_before=START + datetime.timedelta(seconds=100))

        assert forgotten == 1
        assert [r.instance for r in storage.status_reports("sales")] == ["host:2:bb"]
        assert [r.instance for r in storage.status_reports("billing")] == ["host:3:cc"]
