"""The audit trail on Spark: the ``idembus_audit`` data source reads every record once across
its partitions, and ``report`` / ``idembus spark report`` count and time them per endpoint
and message type.

Spark's workers resolve the endpoint reference themselves, in their own processes, so each
test writes a small module naming an endpoint on its own PostgreSQL tables and ships it to
them with ``addPyFile`` (the driver imports it from the same directory). Environment
variables would not do: the workers' environment is fixed when the session starts.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import math
import pickle
import re
import sys
import textwrap
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import idembus.cli
from idembus import Command, ConfigurationError, Endpoint, RetryPolicy
from idembus.handlers import Handler, handles
from idembus.observability.audit import Audit
from idembus.runtime.recoverability.policy import Recoverability
from idembus.spark import source
from idembus.spark.report import report
from idembus.storage.base import AUDIT_BUCKETS, AuditRecord
from idembus.storage.postgres import PostgresStorage
from tests.conftest import POSTGRES_URL, require_service
from tests.support import AccountHandler, Deposit, SignalCounter

pytestmark = pytest.mark.postgres


BASE = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.timezone.utc)
MS = datetime.timedelta(milliseconds=1)

ENDPOINT_MODULE = textwrap.dedent('''
    """Written by tests/test_spark_report.py; Spark's workers import it (addPyFile)."""
    from idembus import Endpoint
    from idembus.storage.memory import MemoryStorage
    from idembus.storage.mongo import MongoStorage
    from idembus.storage.postgres import PostgresStorage


    def make_endpoint():
        return Endpoint("spark-audit-reader", storage={storage})
''')


@pytest.fixture
def prefix(unique: str) -> str:
    """The table prefix of this test's PostgreSQL tables."""
    return f"spark{unique}"


@pytest.fixture
def pg_storage(prefix: str) -> Iterator[PostgresStorage]:
    """A PostgresStorage on tables of this test only, dropped afterwards."""
    require_service(POSTGRES_URL, "PostgreSQL")
    storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    storage.verify()
    yield storage
    storage.drop_tables()
    storage.close()


@pytest.fixture
def ship(spark: Any, tmp_path: Path, unique: str,
         monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], str]]:
    """``ship("PostgresStorage(...)")`` writes a module whose ``make_endpoint`` builds an
    Endpoint on that storage, makes it importable by the driver and Spark's workers, and
    returns its reference."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names: list[str] = []

    def write(storage_expression: str) -> str:
        name = f"spark_audit_{unique}_{len(names)}"
        path = tmp_path / f"{name}.py"
        path.write_text(ENDPOINT_MODULE.format(storage=storage_expression))
        spark.sparkContext.addPyFile(str(path))
        names.append(name)
        return f"{name}:make_endpoint"

    yield write
    for name in names:
        sys.modules.pop(name, None)


def postgres_reference(ship: Callable[[str], str], prefix: str) -> str:
    """A shipped endpoint reference whose storage is PostgreSQL on ``prefix``'s tables."""
    return ship(f"PostgresStorage({POSTGRES_URL!r}, table_prefix={prefix!r})")


def record(message_id: str, outcome: str, *, latency_ms: float | None = None,
           message_type: str = "test.A", endpoint: str = "sales",
           handler: str = "Handler") -> AuditRecord:
    """An audit record whose latency (recorded_at - time_sent) is ``latency_ms``."""
    recorded = BASE + 10_000 * MS
    sent = recorded - latency_ms * MS if latency_ms is not None else None
    return AuditRecord(endpoint=endpoint, handler=handler, message_id=message_id,
                       message_type=message_type, outcome=outcome, time_sent=sent,
                       recorded_at=recorded)


def known_trail() -> list[AuditRecord]:
    """test.A at sales: 200 handled in 1..200 ms, 3 duplicates, 2 failures, 1 redispatch;
    test.B at sales: handled in 1000 and 3000 ms, one without time_sent, one dead-lettered
    after 3 failures; test.A at billing: one handled in 5 ms."""
    a = [record(f"a{i}", "handled", latency_ms=float(i)) for i in range(1, 201)]
    a += [record(f"a{i}", "duplicate", latency_ms=9999.0) for i in (1, 1, 2)]
    a += [record("a3", "failed", latency_ms=9999.0) for _ in range(2)]
    a += [record("a4", "redispatched", latency_ms=9999.0)]
    b = [record("b0", "handled", latency_ms=1000.0, message_type="test.B"),
         record("b1", "handled", latency_ms=3000.0, message_type="test.B"),
         record("b2", "handled", message_type="test.B")]
    b += [record("b3", "failed", latency_ms=1.0, message_type="test.B") for _ in range(3)]
    b += [record("b3", "dead_lettered", latency_ms=1.0, message_type="test.B")]
    billing = [record("c0", "handled", latency_ms=5.0, endpoint="billing")]
    return a + b + billing


def as_row(r: AuditRecord) -> tuple[Any, ...]:
    """A record as comparable values: times in microseconds since the epoch."""
    def micros(moment: datetime.datetime | None) -> int | None:
        return None if moment is None else round(moment.timestamp() * 1_000_000)

    latency = ((r.recorded_at - r.time_sent).total_seconds() * 1000.0
               if r.time_sent is not None else None)
    return (r.endpoint, r.handler, r.message_id, r.message_type, r.outcome,
            micros(r.time_sent), micros(r.recorded_at), latency)


# -- the data source ----------------------------------------------------------------------


def test_the_source_reads_every_record_exactly_once_across_partitions(
    spark, pg_storage, prefix, ship,
):
    from pyspark.sql import functions as F

    pg_storage.write_audit(known_trail())
    frame = source.audit_frame(spark, postgres_reference(ship, prefix), partitions=3)

    assert frame.schema == source.AUDIT_SCHEMA
    assert frame.rdd.getNumPartitions() == 3
    rows = frame.select(
        "endpoint", "handler", "message_id", "message_type", "outcome",
        F.unix_micros("time_sent"), F.unix_micros("recorded_at"), "latency_ms",
        F.spark_partition_id().alias("partition"),
    ).collect()
    read = sorted(tuple(row)[:-1] for row in rows)
    assert read == sorted(as_row(r) for r in pg_storage.read_audit())
    assert len(read) == len(known_trail())
    # Partition i holds the records of the buckets read_audit(part=i, parts=3) returns.
    for row in rows:
        bucket = zlib.crc32(row.message_id.encode()) % AUDIT_BUCKETS
        assert row.partition == bucket % 3


def test_the_reader_pickles_to_its_reference_and_part_count_only():
    reader = source.AuditSource({"endpoint": "pkg.mod:make", "partitions": "5"}).reader(
        source.AUDIT_SCHEMA)
    assert vars(reader) == {"endpoint": "pkg.mod:make", "parts": 5}
    assert [p.value for p in reader.partitions()] == [0, 1, 2, 3, 4]
    assert vars(pickle.loads(pickle.dumps(reader))) == vars(reader)


@pytest.mark.parametrize("options, reason", [
    ({}, "option(\"endpoint\""),
    ({"endpoint": "a:b", "partitions": "0"}, "at least 1"),
    ({"endpoint": "a:b", "partitions": "many"}, "whole number"),
])
def test_the_source_refuses_bad_options(options, reason):
    with pytest.raises(ConfigurationError, match=re.escape(reason)):
        source.AuditSource(options).reader(source.AUDIT_SCHEMA)


@pytest.mark.parametrize("storage_expression, kind", [
    ("MemoryStorage()", "MemoryStorage"),
    ("None", "MemoryStorage"),  # the endpoint's default
    ("MongoStorage.embedded('spark-audit')", "MongoStorage"),  # mongomock
])
def test_a_process_local_storage_is_refused_saying_what_to_use(
    spark, ship, tmp_path, storage_expression, kind,
):
    reference = ship(storage_expression)
    with pytest.raises(ConfigurationError) as refused:
        report(spark, reference, out=tmp_path / "out")
    message = str(refused.value)
    assert kind in message and "PostgresStorage" in message and "MongoDB server" in message
    assert not (tmp_path / "out").exists()
    # A worker reading it directly (spark.read.format(...)) refuses it as well.
    with pytest.raises(ConfigurationError, match="cannot read"):
        list(source.AuditReader(reference, 2).read(source.InputPartition(0)))


# -- the report ---------------------------------------------------------------------------


def nearest_rank(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def test_report_counts_and_times_each_message_type_per_endpoint(
    spark, pg_storage, prefix, ship, tmp_path,
):
    pg_storage.write_audit(known_trail())
    out = tmp_path / "new" / "report"  # created by report()
    result = report(spark, postgres_reference(ship, prefix), out=out)

    counts = [(r.endpoint, r.message_type, r.messages, r.handled, r.duplicates,
               r.redispatches, r.failures, r.dead_lettered) for r in result.rows]
    assert counts == [
        ("billing", "test.A", 1, 1, 0, 0, 0, 0),
        ("sales", "test.A", 200, 200, 3, 1, 2, 0),
        ("sales", "test.B", 4, 3, 0, 0, 3, 1),
    ]
    billing, a, b = result.rows
    assert (billing.p50_ms, billing.p95_ms, billing.p99_ms) == (5.0, 5.0, 5.0)
    # percentile_approx: an observed latency within one rank of the exact percentile
    # (only handled records count: duplicates and failures carry 9999 ms).
    latencies = [float(i) for i in range(1, 201)]
    for fraction, value in zip((0.5, 0.95, 0.99), (a.p50_ms, a.p95_ms, a.p99_ms), strict=True):
        assert value in latencies
        assert abs(value - nearest_rank(latencies, fraction)) <= 1.0
    assert (b.p50_ms, b.p95_ms, b.p99_ms) == (1000.0, 3000.0, 3000.0)  # no time_sent: left out

    lines = result.table.splitlines()
    assert lines[0].split()[:3] == ["endpoint", "message", "type"]
    assert lines[2].split() == ["billing", "test.A", "1", "1", "0", "0", "0", "0",
                                "5.0", "5.0", "5.0"]
    assert "percentile_approx" in lines[-1]

    assert result.csv == out / "report.csv"
    with result.csv.open(newline="") as file:
        table = list(csv.DictReader(file))
    assert [(r["endpoint"], r["message_type"], r["handled"], r["dead_lettered"])
            for r in table] == [("billing", "test.A", "1", "0"), ("sales", "test.A", "200", "0"),
                                ("sales", "test.B", "3", "1")]
    assert float(table[2]["p95_ms"]) == 3000.0
    assert_png(result.chart, out / "report.png")


def assert_png(path: Path, expected: Path) -> None:
    assert path == expected
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000  # bars, labels and titles, not an empty canvas


def test_an_empty_trail_gives_an_empty_report(spark, pg_storage, prefix, ship, tmp_path):
    result = report(spark, postgres_reference(ship, prefix), out=tmp_path)
    assert result.rows == ()
    assert "no audit records" in result.table
    assert result.csv.read_text().splitlines()[0].startswith("endpoint,message_type,messages")
    assert result.chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- end to end from an audited endpoint --------------------------------------------------


class Refuse(Command, message_name="test.spark.Refuse"):
    reason: str


class Refuser(Handler):
    @handles
    def refuse(self, message: Refuse) -> None:
        raise RuntimeError(message.reason)


def test_report_of_a_real_audited_endpoint(spark, pg_storage, prefix, ship, unique, tmp_path):
    own = PostgresStorage(POSTGRES_URL, table_prefix=prefix)  # the endpoint closes it
    service = Endpoint(
        f"spark-audited-{unique}", storage=own, handlers=[AccountHandler, Refuser],
        middleware=[Audit()], error_queue=f"error-{unique}",
        recoverability=Recoverability(retries=RetryPolicy(immediate_retries=2, delayed=())))
    handled = SignalCounter(service, "handled")
    duplicates = SignalCounter(service, "duplicate")
    dead = SignalCounter(service, "dead_lettered")
    started = time.monotonic()
    with contextlib.closing(service):
        service.start()
        deposits = [Deposit(account=f"acc-{i % 3}", amount=i) for i in range(6)]
        ids = [service.bus.send(deposit) for deposit in deposits]
        for deposit, message_id in zip(deposits[:2], ids[:2], strict=True):
            service.bus.send(deposit, message_id=message_id)  # delivered again
        service.bus.send(Refuse(reason="no"))
        assert handled.wait_for(6) and duplicates.wait_for(2) and dead.wait_for(1)
        assert service.audit is not None
        service.audit.flush()
        elapsed_ms = (time.monotonic() - started) * 1000.0

        result = report(spark, postgres_reference(ship, prefix), out=tmp_path, partitions=2)

    counts = [(r.endpoint, r.message_type, r.messages, r.handled, r.duplicates, r.failures,
               r.dead_lettered) for r in result.rows]
    assert counts == [(service.name, "test.Deposit", 6, 6, 2, 0, 0),
                      (service.name, "test.spark.Refuse", 1, 0, 0, 3, 1)]
    deposits, refused = result.rows
    # A duplicate redispatches the stored Deposited unless its dispatch was marked already.
    assert 0 <= deposits.redispatches <= 2 and refused.redispatches == 0
    assert deposits.p50_ms is not None and deposits.p95_ms is not None
    assert deposits.p99_ms is not None
    assert 0.0 <= deposits.p50_ms <= deposits.p95_ms <= deposits.p99_ms <= elapsed_ms
    assert refused.p50_ms is None
    assert f"{service.name}  test.spark.Refuse" in result.table


# -- idembus spark report -----------------------------------------------------------------


def test_idembus_spark_report_prints_the_table_and_writes_the_files(
    spark, pg_storage, prefix, ship, tmp_path, capsys,
):
    pg_storage.write_audit(known_trail())
    master = spark.sparkContext.master
    out = tmp_path / "cli"
    status = idembus.cli.main(["spark", "report", postgres_reference(ship, prefix),
                           "--out", str(out), "--partitions", "2", "--master", master])

    printed = capsys.readouterr().out
    assert status == 0
    assert ["sales", "test.B", "4", "3"] in [line.split()[:4] for line in printed.splitlines()]
    assert f"written: {out / 'report.csv'} {out / 'report.png'}" in printed
    assert len((out / "report.csv").read_text().splitlines()) == 4
    assert_png(out / "report.png", out / "report.png")
    assert spark.range(3).count() == 3  # the command used the active session, left it running


def test_idembus_spark_report_refuses_a_process_local_storage(spark, ship, tmp_path, capsys):
    out = tmp_path / "unused"
    status = idembus.cli.main(["spark", "report", ship("MemoryStorage()"), "--out", str(out)])
    assert status == 2
    assert "PostgresStorage" in capsys.readouterr().err
    assert not out.exists()
    assert spark.range(3).count() == 3



def test_workers_that_cannot_import_the_endpoint_say_how_to_ship_it(
    spark, pg_storage, prefix, tmp_path, monkeypatch, unique,
):
    from pyspark.errors import PythonException

    name = f"driver_only_{unique}"
    (tmp_path / f"{name}.py").write_text(ENDPOINT_MODULE.format(
        storage=f"PostgresStorage({POSTGRES_URL!r}, table_prefix={prefix!r})"))
    monkeypatch.syspath_prepend(str(tmp_path))  # the driver imports it; no addPyFile
    try:
        frame = source.audit_frame(spark, f"{name}:make_endpoint", partitions=1)
        with pytest.raises(PythonException, match="addPyFile") as failed:
            frame.count()
        assert f"cannot import {name!r}" in str(failed.value)
    finally:
        sys.modules.pop(name, None)
