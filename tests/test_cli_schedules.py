"""``idembus schedules ENDPOINT`` lists each schedule: cron, time zone, what it sends, the
last occurrence sent (from the storage) and the next ones.

The CLI runs in-process on a :class:`~tests.test_cli_errors.SharedMemoryStorage`, shared in
this test process as a database is between processes.
"""

from __future__ import annotations

import datetime
import json
import sys
import types

import pytest

from idembus import Endpoint
from idembus.cli import main
from idembus.schedules import Schedule, occurrence_id
from idembus.storage.memory import MemoryStorage
from tests.test_cli_errors import SharedMemoryStorage
from tests.test_schedules import FakeClock, Recording, Rollups, RunRollup, at


@pytest.fixture
def exposed(monkeypatch: pytest.MonkeyPatch):
    """``exposed(endpoint)`` makes it reachable as ``schedules_app:endpoint``."""
    def expose(endpoint: Endpoint) -> str:
        module = types.ModuleType("schedules_app")
        module.endpoint = endpoint  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "schedules_app", module)
        return "schedules_app:endpoint"
    return expose


def nightly_and_hourly(storage: object, clock: FakeClock | None = None) -> Endpoint:
    return Endpoint(
        "reports", storage=storage, transport=Recording(), handlers=[Rollups()],  # type: ignore[arg-type]
        clock=clock, status_interval=0, schedules=[
            Schedule("nightly", cron="0 2 * * *", message=RunRollup(), timezone="Europe/Riga"),
            Schedule("hourly", cron="0 * * * *", message=RunRollup(), catch_up=True)])


def test_schedules_lists_cron_zone_last_sent_and_the_next_occurrences(exposed, capsys) -> None:
    # Given the nightly schedule sent its 20 November occurrence, and the hourly one never ran
    storage = SharedMemoryStorage()
    clock = FakeClock(at("2026-11-19T23:00:00"))
    ran = nightly_and_hourly(storage, clock)
    assert ran.scheduler is not None
    ran.scheduler.schedules = ran.scheduler.schedules[:1]
    ran.scheduler.run_once()
    clock.advance(hours=1)
    assert ran.scheduler.run_once() == 1

    # When the schedules are listed by another process
    assert main(["schedules", exposed(nightly_and_hourly(storage)), "--json",
                 "--next", "3"]) == 0
    listed = json.loads(capsys.readouterr().out)

    # Then each shows its definition, what was sent, and its next occurrences in both zones
    nightly, hourly = listed["schedules"]
    assert listed["endpoint"] == "reports"
    assert nightly["cron"] == "0 2 * * *" and nightly["timezone"] == "Europe/Riga"
    assert nightly["message"] == "send sched.RunRollup"
    assert nightly["last_sent"] == {"utc": "2026-11-20T00:00:00+00:00",
                                    "local": "2026-11-20 02:00:00 EET"}
    assert nightly["last_message_id"] == occurrence_id("reports", "nightly",
                                                       at("2026-11-20T00:00:00"))
    assert (nightly["sent"], nightly["skipped"], nightly["failed"]) == (1, 0, 0)
    assert len(nightly["next"]) == 3
    now = datetime.datetime.now(datetime.timezone.utc)
    for moment in nightly["next"]:
        assert datetime.datetime.fromisoformat(moment["utc"]) > now
        assert moment["local"][11:19] == "02:00:00"
    assert hourly["since"] is None and hourly["last_sent"] is None and hourly["catch_up"]
    assert [datetime.datetime.fromisoformat(m["utc"]).minute for m in hourly["next"]] == [0] * 3

    # And the text form says the same for people
    assert main(["schedules", exposed(nightly_and_hourly(storage)), "--next", "2"]) == 0
    text = capsys.readouterr().out
    assert "nightly: cron '0 2 * * *' in Europe/Riga, send sched.RunRollup; missed " \
           "occurrences skipped" in text
    assert "  last sent  2026-11-20T00:00:00+00:00 (2026-11-20 02:00:00 EET), id " in text
    assert "hourly: cron '0 * * * *' in UTC, send sched.RunRollup; missed occurrences sent " \
           "late, in order" in text
    assert "  not started yet: no scheduler has run it" in text
    assert text.count("  next       ") == 2


def test_schedules_shows_why_the_last_failed_occurrence_failed_escaped(exposed, capsys) -> None:
    storage = SharedMemoryStorage()
    clock = FakeClock(at("2026-11-20T01:00:00"))

    def broken(occurrence: datetime.datetime) -> RunRollup:
        raise ValueError("no rollup today \x1b[31m")

    failing = Endpoint("reports", storage=storage, transport=Recording(),
                       handlers=[Rollups()], clock=clock, status_interval=0,
                       schedules=[Schedule("nightly", cron="0 2 * * *", message=broken)])
    assert failing.scheduler is not None
    failing.scheduler.run_once()
    clock.advance(hours=1)
    failing.scheduler.run_once()

    assert main(["schedules", exposed(failing)]) == 0
    text = capsys.readouterr().out
    assert "built by test_schedules_shows_why_the_last_failed_occurrence_failed_escaped." \
           "<locals>.broken" in text
    assert "sent 0, skipped 0, failed 1" in text
    assert "  last failure: ValueError: no rollup today \\x1b[31m" in text


def test_schedules_refuses_a_storage_no_other_process_can_read_with_exit_2(
    exposed, capsys
) -> None:
    local = nightly_and_hourly(MemoryStorage())
    assert main(["schedules", exposed(local)]) == 2
    error = capsys.readouterr().err
    assert "the storage of endpoint 'reports' (MemoryStorage) is process-local" in error
    assert "schedules' records" in error
