"""Feeding messages from a DataFrame through an endpoint's handlers, on Spark.

::

    summary = replay(spark.read.parquet("archive/"), "shop.endpoints:make_sales")
    print(summary.line())   # replayed=... handled=... duplicates=... dead_lettered=...

The DataFrame is repartitioned by ``partition_by`` (the aggregate id: one aggregate's
messages stay in one partition) and sorted within each partition by ``order_by`` (a sequence
number or a time), so each aggregate sees its messages in order. Every partition builds the
endpoint from its reference (``package.module:attribute``, an Endpoint or a function returning
one, imported in the worker: nothing is pickled but the reference and the column names),
does **not** start its consumers, and hands the rows to the endpoint's
:class:`~idembus.runtime.processing.MessageProcessor` exactly like messages taken from its queue, in
batches as its consumers take them (:meth:`~idembus.runtime.endpoint.Endpoint.process_batch`): the
handlers' effects commit through the endpoint's storage, deduplicated per handler and message
id; outgoing messages leave through its transport with their deterministic ids; bad input
goes to its error queue; a handler that keeps failing is retried as the endpoint's retry
policy says (a delayed retry goes back to the endpoint's queue, for its consumers).
The module must be importable where the workers run: an installed package, or one shipped
with ``--py-files`` / ``SparkContext.addPyFile``; its configuration lives in its code or in
the environment the executors get.

Spark re-executes tasks (a lost executor, a failed attempt, speculation): a re-executed
partition finds its committed messages recorded and applies nothing twice, and sends again,
with the same ids, only what was committed but not yet confirmed sent. Several processes
share the storage and the broker, so an endpoint on a process-local one (``memory://``,
mongomock) is refused.

While the database or the broker is unreachable a partition waits and tries again, as a
consumer does (see :class:`~idembus.policies.Backoff`); the task does not fail meanwhile.

:func:`foreach_batch_sink` applies a Structured Streaming query's micro-batches the same way;
a micro-batch Spark runs again after a failure changes nothing.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError
from ..runtime.endpoint import Endpoint
from ..runtime.loading import built_by_loading, load_endpoint
from ..storage.base import AggregateStore
from .rows import HEADERS_COLUMN, REQUIRED_COLUMNS, RowDelivery, row_delivery

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

#: Counters of the endpoint reported per partition, and their names in the summary.
_COUNTED = {"handled": "handled", "duplicate": "duplicates", "redispatched": "redispatched",
            "dead_lettered": "dead_lettered"}


@dataclass(frozen=True)
class ReplaySummary:
    """What a replay did, summed over its partitions.

    ``handled``, ``duplicates`` and ``redispatched`` count per handler (a message two
    handlers handle counts twice); the rest per message.
    """

    #: Rows processed.
    replayed: int = 0
    #: Handler effects committed now.
    handled: int = 0
    #: Handler effects found already committed (nothing applied again).
    duplicates: int = 0
    #: Duplicates whose stored outgoing messages were sent again (same ids).
    redispatched: int = 0
    #: Messages moved to the error queue (bad input, retries exhausted).
    dead_lettered: int = 0
    #: Messages sent back to the endpoint's queue for a delayed retry.
    retried_later: int = 0
    #: Rows the processor neither acknowledged nor failed on (never expected).
    unsettled: int = 0
    #: Partitions that had rows (each built its endpoint once).
    partitions: int = 0

    @property
    def ok(self) -> bool:
        """True if every row was handled or found handled: none went to the error queue,
        none is waiting for a delayed retry."""
        return self.dead_lettered == 0 and self.retried_later == 0 and self.unsettled == 0

    def line(self) -> str:
        """``replayed=N handled=H duplicates=D ...``: one line for logs and the CLI."""
        return " ".join(f"{field.name}={getattr(self, field.name)}" for field in fields(self))

    def __add__(self, other: ReplaySummary) -> ReplaySummary:
        return ReplaySummary(**{field.name: getattr(self, field.name)
                                + getattr(other, field.name) for field in fields(self)})

    @classmethod
    def total(cls, parts: Iterable[Mapping[str, int]]) -> ReplaySummary:
        """The sum of the per-partition counts."""
        return sum((cls(**part) for part in parts), cls())


# -- the driver's side ------------------------------------------------------------------


def replay(
    df: DataFrame,
    endpoint_factory: str,
    *,
    partition_by: str | None = "aggregate_id",
    order_by: str | None = "sequence",
    partitions: int | None = None,
) -> ReplaySummary:
    """Apply the messages of ``df`` through the endpoint ``endpoint_factory`` names.

    ``partition_by``: the column keeping one aggregate's messages together (``None``: keep
    the DataFrame's partitioning, or spread rows evenly over ``partitions``); ``order_by``:
    the column ordering them (``None``: as they come); ``partitions``: how many partitions,
    hence endpoints, work at once (default: the session's default parallelism).
    """
    prepare_endpoint(endpoint_factory)
    return _replay_prepared(df, endpoint_factory, partition_by=partition_by,
                            order_by=order_by, partitions=partitions)


def replay_files(
    spark: SparkSession,
    inputs: Sequence[str],
    endpoint_factory: str,
    *,
    file_format: str = "json",
    partition_by: str | None = "aggregate_id",
    order_by: str | None = "sequence",
    partitions: int | None = None,
) -> ReplaySummary:
    """:func:`replay` of the messages in files: JSON lines (``file_format="json"``: a body
    or headers written as an object is read back as its JSON text), Parquet, or any other
    format Spark reads."""
    if not inputs:
        raise ConfigurationError("name at least one file or directory of messages to replay")
    prepare_endpoint(endpoint_factory)
    df = _read_json(spark, inputs) if file_format == "json" else (
        spark.read.format(file_format).load(list(inputs)))
    return _replay_prepared(df, endpoint_factory, partition_by=partition_by,
                            order_by=order_by, partitions=partitions)


def _read_json(spark: SparkSession, inputs: Sequence[str]) -> DataFrame:
    """JSON lines with ``body`` and ``headers`` as text whatever their JSON shape (Spark
    gives the JSON text of an object read into a string column)."""
    from pyspark.sql.types import StringType, StructField, StructType

    inferred = spark.read.json(list(inputs)).schema
    as_text = {"body", HEADERS_COLUMN}
    schema = StructType([
        StructField(field.name, StringType()) if field.name in as_text else field
        for field in inferred.fields])
    return spark.read.schema(schema).json(list(inputs))


class ReplaySink:
    """A ``foreachBatch`` function: ``query.writeStream.foreachBatch(sink)``.

    Each micro-batch is replayed (:func:`replay`); a batch Spark runs again finds its
    messages processed and changes nothing. ``batches`` keeps each batch's summary, on the
    driver, where Spark calls the function.
    """

    def __init__(self, endpoint_factory: str, *, partition_by: str | None = "aggregate_id",
                 order_by: str | None = "sequence", partitions: int | None = None) -> None:
        prepare_endpoint(endpoint_factory)  # refused now rather than at the first batch
        self.endpoint_factory = endpoint_factory
        self.partition_by = partition_by
        self.order_by = order_by
        self.partitions = partitions
        self.batches: list[tuple[int, ReplaySummary]] = []

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        summary = _replay_prepared(batch, self.endpoint_factory, partition_by=self.partition_by,
                                   order_by=self.order_by, partitions=self.partitions)
        self.batches.append((batch_id, summary))
        log.log(logging.INFO if summary.ok else logging.WARNING, "micro-batch %d: %s",
                batch_id, summary.line())

    @property
    def total(self) -> ReplaySummary:
        """Everything the batches did so far (a batch run twice counts twice)."""
        return sum((summary for _, summary in self.batches), ReplaySummary())


def foreach_batch_sink(endpoint_factory: str, *, partition_by: str | None = "aggregate_id",
                       order_by: str | None = "sequence",
                       partitions: int | None = None) -> ReplaySink:
    """A function for ``writeStream.foreachBatch`` replaying each micro-batch."""
    return ReplaySink(endpoint_factory, partition_by=partition_by, order_by=order_by,
                      partitions=partitions)


def prepare_endpoint(endpoint_factory: str) -> None:
    """On the driver, before any task: build the endpoint once to refuse one Spark's worker
    processes cannot share, check its storage (creating its schema) and declare its queue
    and error queue, as starting it would."""
    endpoint = load_endpoint(endpoint_factory)
    try:
        refuse_process_local(endpoint, endpoint_factory)
        endpoint.storage.verify()
        endpoint.transport.declare(endpoint.name, subscriptions=endpoint.subscriptions)
        endpoint.transport.declare(endpoint.error_queue)
    finally:
        if built_by_loading(endpoint_factory, endpoint):
            endpoint.close()


def refuse_process_local(endpoint: Endpoint, endpoint_factory: str) -> None:
    """Raise :class:`ConfigurationError` if the endpoint's storage or transport lives in
    one process (each Spark worker would get its own, empty one)."""
    local = [f"{kind} {type(part).__name__}"
             for kind, part in (("storage", endpoint.storage), ("transport", endpoint.transport))
             if part.process_local]
    if local:
        raise ConfigurationError(
            f"{endpoint_factory} builds endpoint {endpoint.name!r} on a process-local "
            f"{' and '.join(local)} (memory:// and mongomock live inside one process): "
            "Spark's workers are separate processes and would each deduplicate against their "
            "own, empty copy. Give the endpoint a shared storage (PostgresStorage, or "
            "MongoStorage on a MongoDB server) and a broker (amqp:// or redis://)."
        )


def _replay_prepared(df: DataFrame, endpoint_factory: str, *, partition_by: str | None,
                     order_by: str | None, partitions: int | None) -> ReplaySummary:
    arranged = _arranged(df, partition_by=partition_by, order_by=order_by,
                         partitions=partitions)
    work = functools.partial(_replay_arrow_partition, endpoint_factory)
    counts = arranged.mapInArrow(work, _COUNTS_SCHEMA).collect()
    summary = ReplaySummary.total(row.asDict() for row in counts)
    log.info("replay through %s: %s", endpoint_factory, summary.line())
    return summary


def _arranged(df: DataFrame, *, partition_by: str | None, order_by: str | None,
              partitions: int | None) -> DataFrame:
    """The needed columns, one aggregate per partition, in order within each partition."""
    if partitions is not None and partitions < 1:
        raise ConfigurationError(f"partitions must be at least 1, got {partitions}")
    wanted = _columns(df.columns, partition_by=partition_by, order_by=order_by)
    selected = df.select(*wanted)
    if partition_by is not None:
        count = partitions or df.sparkSession.sparkContext.defaultParallelism
        selected = selected.repartition(count, partition_by)
    elif partitions is not None:
        selected = selected.repartition(partitions)
    return selected.sortWithinPartitions(order_by) if order_by is not None else selected


def _columns(present: Sequence[str], *, partition_by: str | None,
             order_by: str | None) -> list[str]:
    """The columns a replay reads, checked against those of the input."""
    wanted = [*REQUIRED_COLUMNS, *([HEADERS_COLUMN] if HEADERS_COLUMN in present else [])]
    for option, column in (("partition_by", partition_by), ("order_by", order_by)):
        if column is None:
            continue
        if column not in present:
            flag = option.replace("_", "-")
            raise ConfigurationError(
                f"the messages have no column {column!r} to {flag.replace('-', ' ')} "
                f"(columns: {', '.join(present)}); pass {option}=<column> (--{flag} on "
                "the command line), or None to go without"
            )
        if column not in wanted:
            wanted.append(column)
    missing = [column for column in REQUIRED_COLUMNS if column not in present]
    if missing:
        raise ConfigurationError(
            f"the messages lack the column(s) {', '.join(missing)}: a replay reads "
            f"{', '.join(REQUIRED_COLUMNS)} (the JSON text), optionally {HEADERS_COLUMN} "
            f"(columns: {', '.join(present)})"
        )
    return wanted


# -- a worker's side: one partition ----------------------------------------------------


class _Tally:
    """What one partition did, from the endpoint's counters (deltas: a module-level
    endpoint is shared by the partitions a reused worker process runs)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._counters = endpoint.counters
        self._before = endpoint.counters.snapshot()
        self._retried = endpoint.signals.retried
        self._retried.connect(self._on_retried)
        self.replayed = 0
        self.unsettled = 0
        self.retried_later = 0

    def _on_retried(self, sender: object, **details: Any) -> None:
        if details.get("kind") == "delayed":
            self.retried_later += 1

    def settled(self, delivery: RowDelivery) -> None:
        self.replayed += 1
        if not delivery.acked:
            self.unsettled += 1

    def close(self) -> None:
        self._retried.disconnect(self._on_retried)

    def counts(self) -> dict[str, int]:
        after = self._counters.snapshot()
        counts = {name: after[counter] - self._before[counter]
                  for counter, name in _COUNTED.items()}
        return {**counts, "replayed": self.replayed, "unsettled": self.unsettled,
                "retried_later": self.retried_later, "partitions": 1}


#: Rows of an Arrow record batch turned into Python values at a time (a record batch may
#: hold thousands of large messages).
_ROWS_AT_ONCE = 256
#: What each partition reports (:meth:`_Tally.counts`), as a Spark schema.
_COUNTS_SCHEMA = ", ".join(f"{field.name} long" for field in fields(ReplaySummary))


def _replay_arrow_partition(endpoint_factory: str, batches: Iterable[Any]) -> Iterator[Any]:
    """:func:`_replay_partition` of the rows of one partition as Spark hands them over in
    Arrow record batches (``DataFrame.mapInArrow``: columns, not a pickled ``Row`` per row,
    cross from the executor's JVM; maps arrive as dictionaries, structs as dictionaries);
    its counts as one record batch. A record batch holds up to Spark's
    ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows (10,000 by default); they become
    Python values :data:`_ROWS_AT_ONCE` at a time."""
    import pyarrow

    rows = (row for batch in batches for start in range(0, batch.num_rows, _ROWS_AT_ONCE)
            for row in batch.slice(start, _ROWS_AT_ONCE).to_pylist(maps_as_pydicts="strict"))
    for counts in _replay_partition(endpoint_factory, rows):
        yield pyarrow.RecordBatch.from_pylist(
            [{field.name: counts[field.name] for field in fields(ReplaySummary)}])


def _replay_partition(endpoint_factory: str, rows: Iterable[Any]) -> Iterator[dict[str, int]]:
    """Process one partition's rows in order through a fresh endpoint; yield its counts.

    An exception escaping the processor (a process dying, in tests a ``SimulatedCrash``)
    fails the task and Spark runs it again from the first row.
    """
    remaining = iter(rows)
    first = next(remaining, None)
    if first is None:
        return  # an empty partition builds no endpoint
    endpoint = load_endpoint(endpoint_factory)
    owned = built_by_loading(endpoint_factory, endpoint)
    tally = _Tally(endpoint)
    try:
        refuse_process_local(endpoint, endpoint_factory)
        redelivered = _task_attempt() > 0
        batch: list[RowDelivery] = []
        size = endpoint.batch_size or 1
        for row in itertools.chain([first], remaining):
            values = row if isinstance(row, Mapping) else row.asDict()
            delivery = row_delivery(values, queue=endpoint.name, redelivered=redelivered)
            if delivery.problem is not None:
                # Unreadable as a message before decoding even starts: bad input, error queue.
                endpoint.reject(delivery, delivery.problem)
                tally.settled(delivery)
                continue
            batch.append(delivery)
            if len(batch) == size:
                _process(endpoint, batch, tally)
        _process(endpoint, batch, tally)
        _flush(endpoint)
    finally:
        tally.close()
        if owned:
            endpoint.close()
    yield tally.counts()


def _process(endpoint: Endpoint, batch: list[RowDelivery], tally: _Tally) -> None:
    """The rows of ``batch`` through the endpoint's processor, as a batch of deliveries from
    the endpoint's queue (in order; one at a time where the endpoint does not batch); then
    ``batch`` is emptied."""
    endpoint.process_batch(batch)
    for delivery in batch:
        tally.settled(delivery)
    batch.clear()


def _flush(endpoint: Endpoint) -> None:
    """Write what the endpoint batches (dispatch marks, audit records) before the task
    reports success."""
    endpoint.storage_as(AggregateStore).flush()
    if endpoint.audit is not None:
        endpoint.audit.flush()


def _task_attempt() -> int:
    """Which attempt of its task this is (0 the first; Spark retries failed tasks)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    return context.attemptNumber() if context is not None else 0
