"""The audit trail as a Spark DataFrame: a Python data source (``pyspark.sql.datasource``, no
JVM jars) reading the audit records of an endpoint's storage (``Endpoint(middleware=[Audit()])``).

::

    frame = audit_frame(spark, "myshop.sales:make_endpoint", partitions=8)

or, once :class:`AuditSource` is registered, ``spark.read.format("idembus_audit")
.option("endpoint", "myshop.sales:make_endpoint").option("partitions", "8").load()``.

Each of the ``partitions`` Spark partitions resolves the endpoint reference itself, in its
worker (:func:`idembus.runtime.loading.load_endpoint`), reads its part of the trail with
``storage.read_audit(part=i, parts=n)`` and closes the endpoint again. So:

* the module naming the endpoint must be importable by Spark's workers (an installed
  package, or a file shipped with ``spark.sparkContext.addPyFile``);
* what Spark pickles (the data source and its reader) holds only the reference and the
  number of parts, never a client, a pool or a lock;
* the storage must be one that other processes share: PostgreSQL or a MongoDB server.
  memory and mongomock live inside one process, which the workers cannot see, so they are
  refused with a :class:`~idembus.errors.ConfigurationError`.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator, Sequence
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import (
    DoubleType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from ..errors import ConfigurationError
from ..storage.base import AuditRecord, Storage, StorageRole

#: The format name under which :class:`AuditSource` is registered.
FORMAT = "idembus_audit"

#: Parts the audit trail is read in unless the ``partitions`` option says otherwise.
DEFAULT_PARTITIONS = 4

#: One row per audit record; ``latency_ms`` is ``recorded_at - time_sent`` (null without
#: ``time_sent``).
AUDIT_SCHEMA = StructType([
    StructField("endpoint", StringType(), nullable=False),
    StructField("handler", StringType(), nullable=False),
    StructField("message_id", StringType(), nullable=False),
    StructField("message_type", StringType(), nullable=False),
    StructField("outcome", StringType(), nullable=False),
    StructField("time_sent", TimestampType(), nullable=True),
    StructField("recorded_at", TimestampType(), nullable=False),
    StructField("latency_ms", DoubleType(), nullable=True),
])

AuditRow = tuple[str, str, str, str, str, datetime.datetime | None, datetime.datetime,
                 float | None]


class AuditSource(DataSource):
    """``spark.read.format("idembus_audit")``: options ``endpoint`` (package.module:attribute,
    required) and ``partitions`` (default 4)."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        return AUDIT_SCHEMA

    def reader(self, schema: StructType) -> AuditReader:
        reference = self.options.get("endpoint")
        if not reference:
            raise ConfigurationError(
                f'the {FORMAT} data source needs .option("endpoint", "package.module:endpoint")')
        return AuditReader(reference, parse_partitions(self.options.get("partitions")))


class AuditReader(DataSourceReader):
    """Reads the audit trail in ``parts`` partitions. Pickled to the workers: it holds the
    endpoint reference and the number of parts only."""

    def __init__(self, endpoint: str, parts: int) -> None:
        self.endpoint = endpoint
        self.parts = parts

    def partitions(self) -> Sequence[InputPartition]:
        return [InputPartition(part) for part in range(self.parts)]

    def read(self, partition: InputPartition) -> Iterator[AuditRow]:
        part: int = partition.value
        with shared_storage(self.endpoint, in_worker=True) as storage:
            for record in storage.read_audit(part=part, parts=self.parts):
                yield audit_row(record)


def parse_partitions(value: str | int | None) -> int:
    """The ``partitions`` option as a positive int (default :data:`DEFAULT_PARTITIONS`)."""
    if value is None or value == "":
        return DEFAULT_PARTITIONS
    try:
        parts = int(value)
    except ValueError:
        raise ConfigurationError(f"partitions must be a whole number, got {value!r}") from None
    if parts < 1:
        raise ConfigurationError(f"partitions must be at least 1, got {parts}")
    return parts


@contextlib.contextmanager
def shared_storage(reference: str, *, in_worker: bool = False) -> Iterator[Storage]:
    """Resolve ``reference`` and yield its endpoint's storage, refusing one that lives in
    this process only; the endpoint (transport and storage) is closed afterwards."""
    endpoint = _load(reference, in_worker=in_worker)
    try:
        refuse_process_local(reference, endpoint.storage)
        yield endpoint.storage
    finally:
        endpoint.close()


def _load(reference: str, *, in_worker: bool) -> Any:
    from ..runtime.loading import load_endpoint

    try:
        return load_endpoint(reference)
    except ConfigurationError as exc:
        if not in_worker:
            raise
        raise ConfigurationError(
            f"in a Spark worker: {exc}. The workers import the endpoint's module "
            "themselves: install its package where they run, or ship the module "
            "(spark.sparkContext.addPyFile, spark-submit --py-files)."
        ) from exc


def check_reference(reference: str) -> None:
    """Resolve ``reference`` here (the driver) and refuse a process-local storage."""
    with shared_storage(reference):
        return


def refuse_process_local(reference: str, storage: StorageRole) -> None:
    """Raise a ConfigurationError naming the fix if ``storage`` cannot be read by other
    processes (memory, mongomock): Spark's workers would see an empty trail of their own."""
    if storage.process_local:
        raise ConfigurationError(
            f"{reference} keeps its audit trail in {type(storage).__name__} inside one "
            "process (memory or mongomock), which Spark's worker processes cannot read. "
            "Give the endpoint a storage that processes share: "
            "PostgresStorage('postgresql://...') or MongoStorage('mongodb://...') on a "
            "MongoDB server, with the Audit middleware."
        )


def audit_row(record: AuditRecord) -> AuditRow:
    """One record as a row of :data:`AUDIT_SCHEMA` (times as aware UTC datetimes)."""
    sent = _aware(record.time_sent) if record.time_sent is not None else None
    recorded = _aware(record.recorded_at)
    latency = (recorded - sent).total_seconds() * 1000.0 if sent is not None else None
    return (record.endpoint, record.handler, record.message_id, record.message_type,
            record.outcome, sent, recorded, latency)


def _aware(moment: datetime.datetime) -> datetime.datetime:
    """Storages return aware UTC times; a naive one is taken as UTC, as idembus stores."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=datetime.timezone.utc)


def audit_frame(spark: SparkSession, endpoint_reference: str,
                partitions: int = DEFAULT_PARTITIONS) -> DataFrame:
    """The audit trail of ``endpoint_reference``'s storage as a DataFrame of
    :data:`AUDIT_SCHEMA`, read in ``partitions`` parallel parts.

    The reference is resolved here first, so that a wrong reference or a process-local
    storage fails at once, with the reason, instead of inside a Spark task.
    """
    parts = parse_partitions(partitions)
    check_reference(endpoint_reference)
    # Registered on every call: registration captures the session's shipped files
    # (addPyFile) for the workers, and is cheap.
    spark.dataSource.register(AuditSource)
    return (spark.read.format(FORMAT).option("endpoint", endpoint_reference)
            .option("partitions", str(parts)).load())
