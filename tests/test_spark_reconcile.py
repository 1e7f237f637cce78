"""Reconciling stored aggregates with a dump of the source data on Spark
(idembus.spark.reconcile, ``idembus spark reconcile``), on the shared ``local[2,3]`` session.

Everything touching the endpoint runs on the driver, so these tests use in-process
endpoints (memory:// and MemoryStorage); Spark's workers only read the dump.
"""

from __future__ import annotations

import datetime
import json
import sys
import threading
import time
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import idembus.cli
from idembus import Endpoint
from idembus.envelope import format_utc
from idembus.errors import ConfigurationError
from idembus.handlers import Handler, handles
from idembus.spark.reconcile import (
    MESSAGE_ID_NAMESPACE,
    BadDump,
    Correction,
    Reconciled,
    ReconcileSummary,
    reconcile,
)
from idembus.storage.memory import MemoryStorage
from tests.support import Account, AccountHandler, SignalCounter

UTC = datetime.timezone.utc
MS = datetime.timedelta(milliseconds=1)


class Video(BaseModel):
    """An aggregate type no dump of these tests lists."""

    title: str = ""


class ReconciledLog(Handler):
    """A subscriber: one entry per Reconciled event it handles."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    @handles
    def record(self, message: Reconciled) -> None:
        with self._lock:
            self.entries.append((message.action, message.aggregate_id, self.context.message_id))


@pytest.fixture
def endpoint(unique: str) -> Iterator[Endpoint]:
    """The reconciled endpoint: Account aggregates in a MemoryStorage, on memory://."""
    service = Endpoint(f"accounts-{unique}", storage=MemoryStorage(), handlers=[AccountHandler],
                       error_queue=f"error-{unique}")
    yield service
    service.close()


@pytest.fixture
def subscriber(unique: str) -> Iterator[tuple[Endpoint, ReconciledLog]]:
    """A running endpoint subscribed to Reconciled, deduplicating in its own storage."""
    log = ReconciledLog()
    service = Endpoint(f"reconciled-{unique}", storage=MemoryStorage(), handlers=[log],
                       error_queue=f"error-sub-{unique}")
    service.start()
    yield service, log
    service.close()


def store(endpoint: Endpoint, state_type: type[BaseModel], aggregate_id: str) -> datetime.datetime:
    """Create an aggregate; return its stored updated_at."""
    with endpoint.unit_of_work(state_type, aggregate_id) as work:
        if isinstance(work.state, Account):
            work.state.balance = 1
    return updated_at(endpoint, state_type.__name__, aggregate_id)


def updated_at(endpoint: Endpoint, aggregate_type: str, aggregate_id: str) -> datetime.datetime:
    found = [r.updated_at for r in endpoint.storage.records(aggregate_type)
             if r.aggregate_id == aggregate_id]
    assert found and found[0] is not None
    return found[0]


def millis(moment: datetime.datetime) -> int:
    return (moment - datetime.datetime(1970, 1, 1, tzinfo=UTC)) // MS


def next_millisecond(moment: datetime.datetime) -> datetime.datetime:
    """The first whole millisecond after ``moment``."""
    return moment.replace(microsecond=moment.microsecond // 1000 * 1000) + MS


def write_dump(path: Path, lines: list[dict[str, Any] | str]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                            for line in lines))
    return path


@pytest.fixture
def world(endpoint: Endpoint, tmp_path: Path) -> dict[str, Any]:
    """Stored Accounts a1..a5 and Video v1, and a dump (two files) in which a1 and a2 are
    up to date, a3 is newer (stale), a9 is new (missing) and a4 is gone (deleted); a5
    changed after the dump's newest timestamp and v1 is of a type the dump does not list:
    both are left alone."""
    store(endpoint, Video, "v1")
    times = {name: store(endpoint, Account, name) for name in ("a1", "a2", "a4", "a3")}
    time.sleep(0.01)
    times["a5"] = store(endpoint, Account, "a5")
    stale_at = next_millisecond(times["a3"])  # written in milliseconds
    assert times["a4"] <= stale_at < times["a5"]  # stale_at is the dump's newest
    first = write_dump(tmp_path / "part-1.jsonl", [
        {"type": "Account", "id": "a1", "timestamp": format_utc(times["a1"]),
         "parents": ["user/1"]},
        {"type": "Account", "id": "a2", "timestamp": millis(times["a2"]) - 86_400_000},
        {"type": "Account", "id": "a2", "timestamp": str(millis(times["a2"]) - 3_600_000)},
    ])
    second = write_dump(tmp_path / "part-2.jsonl", [
        {"type": "Account", "id": "a3", "timestamp": millis(stale_at),
         "parents": ["user/3", "team/1"]},
        {"type": "Account", "id": "a9", "timestamp": format_utc(times["a1"]),
         "parents": ["user/9"]},
    ])
    return {"times": times, "stale_at": stale_at, "paths": [str(first), str(second)]}


def expected_corrections(world: dict[str, Any]) -> list[Correction]:
    times = world["times"]
    return [
        Correction("Account", "a3", "stale", world["stale_at"], times["a3"], ("user/3", "team/1")),
        Correction("Account", "a4", "deleted", None, times["a4"], ()),
        Correction("Account", "a9", "missing", times["a1"], None, ("user/9",)),
    ]


# -- the corrections ----------------------------------------------------------------------


def test_reconcile_publishes_and_journals_each_difference_once(
    spark, endpoint, subscriber, world,
):
    service, log = subscriber
    handled = SignalCounter(service, "handled")
    duplicates = SignalCounter(service, "duplicate")

    summary = reconcile(spark, endpoint, world["paths"])

    expected = expected_corrections(world)
    assert summary.line() == ("reconcile: dump=4 stored=5 missing=1 stale=1 deleted=1 "
                              "emitted=3 dry_run=false")
    assert summary.preview == tuple(expected)

    journal = endpoint.storage.read_journal(after=0)
    assert [(e.message_type, e.aggregate_type, e.aggregate_id, e.parents, e.message_id)
            for e in journal] == [
        ("idembus.Reconciled", "Account", c.aggregate_id, c.parents, c.message_id)
        for c in expected]
    assert [Reconciled.model_validate_json(e.body) for e in journal] == [
        c.event() for c in expected]
    assert Reconciled.model_validate_json(journal[0].body).source_timestamp == world["stale_at"]

    assert handled.wait_for(3)
    assert sorted(log.entries) == sorted(
        (c.action, c.aggregate_id, c.message_id) for c in expected)

    # The same reconciliation again: the same ids, nothing new in the journal, and the
    # subscriber recognises what it receives again.
    again = reconcile(spark, endpoint, world["paths"])
    assert again.line() == summary.line()
    assert endpoint.storage.journal_bounds().newest == 3
    assert duplicates.wait_for(3)
    assert len(log.entries) == 3


def test_the_message_ids_are_uuid5_of_type_id_action_and_time(world):
    stale, deleted, missing = expected_corrections(world)
    key = f"Account/a3/stale/{format_utc(world['stale_at'])}"
    assert stale.message_id == str(uuid.uuid5(MESSAGE_ID_NAMESPACE, key))
    key = f"Account/a4/deleted/{format_utc(world['times']['a4'])}"
    assert deleted.message_id == str(uuid.uuid5(MESSAGE_ID_NAMESPACE, key))
    assert missing.event().journal_parents() == ["user/9"]


def test_a_dry_run_reports_the_corrections_and_emits_nothing(spark, endpoint, world, unique):
    observer = f"observer-{unique}"
    endpoint.transport.declare(observer, subscriptions=["idembus.Reconciled"])

    directory = str(Path(world["paths"][0]).parent)  # holds both files of the dump
    summary = reconcile(spark, endpoint, [directory], dry_run=True)

    assert summary == ReconcileSummary(dump=4, stored=5, missing=1, stale=1, deleted=1,
                                       emitted=0, dry_run=True,
                                       preview=tuple(expected_corrections(world)))
    assert summary.line().endswith("emitted=0 dry_run=true")
    assert endpoint.storage.read_journal(after=0) == []
    assert endpoint.transport.pending(observer) == 0


def test_timestamps_in_iso_8601_or_milliseconds(spark, endpoint, tmp_path):
    moment = datetime.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)
    written = {
        "z": "2026-01-02T03:04:05.678Z",
        "offset": "2026-01-02T05:04:05.678+02:00",
        "compact-offset": "2026-01-02T01:04:05.678-0200",
        "naive": "2026-01-02 03:04:05.678",
        "number": millis(moment),
        "text": str(millis(moment)),
    }
    dump = write_dump(tmp_path / "times.jsonl", [
        *[{"type": "Account", "id": name, "timestamp": value}
          for name, value in written.items()],
        {"type": "Account", "id": "date", "timestamp": "2026-01-02"},
        {"type": "Account", "id": "minutes", "timestamp": "2026-01-02T03:04"},
    ])
    summary = reconcile(spark, endpoint, [str(dump)], dry_run=True)
    found = {c.aggregate_id: c.source_timestamp for c in summary.preview}
    assert found == {**{name: moment for name in written},
                     "date": datetime.datetime(2026, 1, 2, tzinfo=UTC),
                     "minutes": datetime.datetime(2026, 1, 2, 3, 4, tzinfo=UTC)}
    assert summary.missing == 8 and {c.action for c in summary.preview} == {"missing"}


def test_an_empty_dump_changes_nothing(spark, endpoint, tmp_path):
    store(endpoint, Account, "a1")
    dump = write_dump(tmp_path / "empty.jsonl", [])
    summary = reconcile(spark, endpoint, [str(dump)])
    assert summary.line() == ("reconcile: dump=0 stored=0 missing=0 stale=0 deleted=0 "
                              "emitted=0 dry_run=false")


# -- refusals -----------------------------------------------------------------------------


def test_bad_lines_fail_the_reconciliation_before_anything_is_emitted(
    spark, endpoint, tmp_path, unique,
):
    store(endpoint, Account, "a1")  # would be reported deleted if the bad lines were skipped
    observer = f"observer-{unique}"
    endpoint.transport.declare(observer, subscriptions=["idembus.Reconciled"])
    dump = write_dump(tmp_path / "bad.jsonl", [
        {"type": "Account", "id": "a2", "timestamp": "2026-01-01T00:00:00Z"},
        "not json at all",
        {"type": "Account", "id": "a3", "timestamp": "yesterday"},
        {"type": "Account", "timestamp": 1},
        {"type": "Account", "id": "a4", "timestamp": 1, "parents": ["user 4"]},
        # Java's $ accepted a trailing line break, which parents_of refuses
        {"type": "Account", "id": "a5", "timestamp": 1, "parents": ["user/5\n"]},
    ])
    with pytest.raises(BadDump) as refused:
        reconcile(spark, endpoint, [str(dump)])
    message = str(refused.value)
    assert "5 bad line(s); nothing was reconciled" in message
    assert "bad.jsonl" in message and "not json at all" in message
    assert "neither ISO 8601" in message and "no id" in message and "parents must be" in message
    assert endpoint.storage.read_journal(after=0) == []
    assert endpoint.transport.pending(observer) == 0


def test_a_type_the_endpoint_does_not_store_is_refused(spark, endpoint, tmp_path):
    dump = write_dump(tmp_path / "videos.jsonl", [
        {"type": "Video", "id": "v1", "timestamp": 0}])
    with pytest.raises(ConfigurationError, match="Video, which no aggregate handler.*Account"):
        reconcile(spark, endpoint, [str(dump)])


def test_a_dump_that_does_not_exist_is_refused(spark, endpoint, tmp_path):
    with pytest.raises(BadDump, match="cannot read the dump"):
        reconcile(spark, endpoint, [str(tmp_path / "nowhere")])


# -- idembus spark reconcile --------------------------------------------------------------


@pytest.fixture
def reference(endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch, unique: str) -> str:
    """``module:endpoint`` naming this test's endpoint (a module-level Endpoint object,
    which the command uses and does not close)."""
    name = f"reconcile_target_{unique}"
    module = types.ModuleType(name)
    module.endpoint = endpoint  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, module)
    return f"{name}:endpoint"


def test_idembus_spark_reconcile_dry_run_lists_the_corrections(
    spark, endpoint, world, reference, capsys,
):
    first, second = world["paths"]
    status = idembus.cli.main(["spark", "reconcile", reference, "--dump", first, "--dump", second,
                           "--dry-run", "--master", spark.sparkContext.master])
    printed = capsys.readouterr().out.splitlines()
    assert status == 0
    assert printed == [
        "reconcile: dump=4 stored=5 missing=1 stale=1 deleted=1 emitted=0 dry_run=true",
        *[c.line() for c in expected_corrections(world)]]
    assert printed[1].startswith("stale Account/a3 source=")
    assert printed[1].endswith("parents=user/3,team/1")
    assert endpoint.storage.read_journal(after=0) == []
    assert spark.range(3).count() == 3  # the command used the active session, left it running


def test_idembus_spark_reconcile_emits(spark, endpoint, world, reference, capsys):
    status = idembus.cli.main(["spark", "reconcile", reference, "--dump", *world["paths"]])
    assert status == 0
    assert capsys.readouterr().out.splitlines() == [
        "reconcile: dump=4 stored=5 missing=1 stale=1 deleted=1 emitted=3 dry_run=false"]
    assert [e.aggregate_id for e in endpoint.storage.read_journal(after=0)] == ["a3", "a4", "a9"]


def test_idembus_spark_reconcile_reports_a_bad_dump(spark, reference, tmp_path, capsys):
    dump = write_dump(tmp_path / "bad.jsonl", ["{"])
    status = idembus.cli.main(["spark", "reconcile", reference, "--dump", str(dump)])
    assert status == 2
    assert "1 bad line(s)" in capsys.readouterr().err


def test_the_help_states_the_rules(capsys):
    with pytest.raises(SystemExit) as done:
        idembus.cli.main(["spark", "reconcile", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "only for the types that appear in the dump" in text
    assert "not later than the newest timestamp in the dump" in text
    assert "milliseconds since the epoch" in text and "--dry-run" in text
