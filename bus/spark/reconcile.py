"""Reconciling the aggregates an endpoint stores with an authoritative dump of the source
data, on Spark (``idembus spark reconcile``).

::

    summary = reconcile(spark, "shop.endpoints:make_sales", ["dumps/users/"])
    print(summary.line())   # reconcile: dump=N stored=M missing=a stale=b deleted=c ...

**The dump** is JSON lines, one source object per line::

    {"type": "Account", "id": "a7", "timestamp": "2026-01-01T12:00:00Z", "parents": ["user/42"]}

``type``
    the aggregate type as idembus stores it (``AggregateHandler.storage_name()``); it must
    be the storage name of one of the endpoint's aggregate handlers (a misspelt type would
    otherwise report every object of the dump missing).
``id``
    the aggregate id (a JSON number is taken as its text).
``timestamp``
    when the source object last changed: milliseconds since the epoch (an integer, as a
    number or a string), or ISO 8601 in the extended form ``YYYY-MM-DD[Thh:mm[:ss[.f]]]``
    with an optional zone ``Z`` or ``±hh[:mm]``; a time without a zone is UTC.
``parents``
    optional: references such as ``user/42`` (no commas, no whitespace), carried by the
    corrections and kept in the event journal.

Every line must be like that: one bad line (not JSON, a field missing or unreadable)
fails the whole reconciliation with :class:`BadDump`, naming the file, the line and what is
wrong, before anything is emitted. A line left out would otherwise report its aggregate
deleted. An object appearing several times (overlapping files) counts once, with its
newest timestamp and that line's parents.

**The comparison** is a full outer join on (type, id) between the dump and the aggregates
the endpoint's storage holds *of the types that appear in the dump* (``Storage.records``,
read on the driver). Each difference is a correction:

``missing``
    in the dump, not in the storage.
``stale``
    in both, and the dump's timestamp is later than the stored ``updated_at``, or the
    storage cannot tell when the aggregate changed (``updated_at`` unknown).
``deleted``
    in the storage, not in the dump, only for types that appear in the dump (a dump of
    users never deletes videos), and only if the stored ``updated_at`` is not later than
    the newest timestamp anywhere in the dump: an aggregate changed after the dump was
    taken is left alone. An unknown ``updated_at`` counts as not later.

A completed saga (a tombstone, :attr:`~idembus.storage.base.AggregateRecord.completed`) counts
as deleted from the storage: in the dump, it is ``missing`` — unless it was completed after
the dump's newest timestamp, which leaves it alone like any change after the dump; absent
from the dump, it needs nothing. ``stored`` in the summary counts live aggregates only.

**The corrections** are :class:`Reconciled` events, published through the endpoint's
transport and appended to its storage's event journal (whether or not the endpoint
journals events itself) with the aggregate they are about and their parents. Each has a
deterministic message id (:attr:`Correction.message_id`): reconciling the same dump against
the same storage again emits the same ids, which the journal keeps once and subscribers
deduplicate. Reconciling changes no aggregate: handling the events is the subscribers'
business.

Everything touching the endpoint (its storage, its transport) runs on the driver; Spark's
workers see only the dump and (type, id, updated_at) rows. So, unlike
:func:`idembus.spark.replay.replay`, reconciling accepts a process-local endpoint
(``memory://``, ``MemoryStorage``, mongomock), useful in-process and in tests.

This module imports pyspark only inside the functions that run Spark: :class:`Reconciled`
can be imported by subscribers without it.
"""

from __future__ import annotations

import datetime
import logging
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from ..envelope import Envelope, format_utc
from ..errors import ConfigurationError
from ..handlers import AggregateHandler
from ..messages import Event
from ..runtime.endpoint import Endpoint
from ..runtime.journal import entry_of
from ..runtime.loading import built_by_loading, load_endpoint
from ..sending import Bus
from ..storage.base import AggregateStore, JournalEntry, JournalStore

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

log = logging.getLogger(__name__)

Action = Literal["missing", "stale", "deleted"]

#: The kinds of correction.
ACTIONS: tuple[Action, ...] = ("missing", "stale", "deleted")

#: The namespace of the corrections' uuid5 message ids (never change it: the ids of
#: corrections already emitted would no longer match).
MESSAGE_ID_NAMESPACE = uuid.UUID("5d0f4a3e-8c1b-4f6e-9a27-3b6c1e0d7f42")

#: How many corrections a summary keeps to show (``--dry-run`` prints them).
PREVIEW = 20

#: Journal entries appended per call to ``Storage.append_journal``.
JOURNAL_BATCH = 500

#: How many bad lines a :class:`BadDump` message quotes.
QUOTED_BAD_LINES = 5

_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_MICROSECOND = datetime.timedelta(microseconds=1)

#: Milliseconds since the epoch (at most 15 digits: microseconds still fit in a long).
_MILLIS = r"^-?[0-9]{1,15}$"
#: ISO 8601, extended form: date, optional time (hh:mm, seconds, fraction), optional zone.
_ISO = (r"^([0-9]{4}-[0-9]{2}-[0-9]{2})(?:[Tt ]([0-9]{2}:[0-9]{2})(:[0-9]{2}(?:\.[0-9]+)?)?)?"
        r"([Zz]|[+-][0-9]{2}(?::?[0-9]{2})?)?$")
#: A valid parent reference (as :func:`idembus.messages.parents_of` checks). Java's ``$``,
#: like Python's, also matches before a final line break: ``\z`` is the end of the text.
_PARENT = r"^[^,\s]+\z"


class Reconciled(Event, message_name="idembus.Reconciled"):
    """A difference between the source data (the dump) and the stored aggregate.

    ``action``: ``missing`` (in the source, not stored), ``stale`` (the source changed
    after the stored aggregate) or ``deleted`` (stored, gone from the source).
    """

    aggregate_type: str
    aggregate_id: str
    action: Action
    #: When the source object last changed (``None`` for ``deleted``).
    source_timestamp: datetime.datetime | None = None
    #: When the stored aggregate last changed (``None`` if missing or unknown).
    stored_updated_at: datetime.datetime | None = None
    #: The source object's parents, such as ``user/42``.
    parents: list[str] = Field(default_factory=list)

    def journal_parents(self) -> list[str]:
        """The source object's parents."""
        return list(self.parents)


class BadDump(ConfigurationError):
    """The dump cannot be read, or some of its lines are not valid source objects."""


@dataclass(frozen=True)
class Correction:
    """One difference found, and the :class:`Reconciled` event that reports it."""

    aggregate_type: str
    aggregate_id: str
    action: Action
    source_timestamp: datetime.datetime | None
    stored_updated_at: datetime.datetime | None
    parents: tuple[str, ...] = ()

    @property
    def message_id(self) -> str:
        """uuid5 of ``type/id/action/time``, the time being the source timestamp (the
        stored time for ``deleted``): the same correction always gets the same id."""
        moment = self.stored_updated_at if self.action == "deleted" else self.source_timestamp
        key = (f"{self.aggregate_type}/{self.aggregate_id}/{self.action}/"
               f"{_text(moment) if moment is not None else 'unknown'}")
        return str(uuid.uuid5(MESSAGE_ID_NAMESPACE, key))

    def event(self) -> Reconciled:
        """The event published for this correction."""
        return Reconciled(aggregate_type=self.aggregate_type, aggregate_id=self.aggregate_id,
                          action=self.action, source_timestamp=self.source_timestamp,
                          stored_updated_at=self.stored_updated_at, parents=list(self.parents))

    def line(self) -> str:
        """``missing Account/a7 source=... stored=- parents=user/42``."""
        parents = ",".join(self.parents) or "-"
        return (f"{self.action} {self.aggregate_type}/{self.aggregate_id} "
                f"source={_text(self.source_timestamp)} stored={_text(self.stored_updated_at)} "
                f"parents={parents}")


@dataclass(frozen=True)
class ReconcileSummary:
    """What a reconciliation found and emitted."""

    #: Distinct (type, id) in the dump.
    dump: int = 0
    #: Stored aggregates of the dump's types (live ones: a completed saga counts as deleted).
    stored: int = 0
    missing: int = 0
    stale: int = 0
    deleted: int = 0
    #: Corrections published and journaled (0 with ``dry_run``).
    emitted: int = 0
    dry_run: bool = False
    #: The first :data:`PREVIEW` corrections, by type and id.
    preview: tuple[Correction, ...] = ()

    @property
    def corrections(self) -> int:
        """How many corrections were found."""
        return self.missing + self.stale + self.deleted

    def line(self) -> str:
        """``reconcile: dump=N stored=M missing=a stale=b deleted=c emitted=E dry_run=false``."""
        return (f"reconcile: dump={self.dump} stored={self.stored} missing={self.missing} "
                f"stale={self.stale} deleted={self.deleted} emitted={self.emitted} "
                f"dry_run={str(self.dry_run).lower()}")


# -- the whole reconciliation -----------------------------------------------------------


def reconcile(spark: SparkSession, endpoint: Endpoint | str, dump_paths: Sequence[str], *,
              dry_run: bool = False) -> ReconcileSummary:
    """Compare the dump in ``dump_paths`` (files or directories of JSON lines, read by
    Spark) with the aggregates ``endpoint`` stores, and publish and journal a
    :class:`Reconciled` event per difference (none with ``dry_run``); see the module
    docstring for the rules.

    ``endpoint`` is an Endpoint or a ``package.module:attribute`` reference to one (an
    endpoint a factory builds for the call is closed afterwards). Raises :class:`BadDump`
    for an unreadable dump, :class:`~idembus.errors.ConfigurationError` for a type the endpoint
    does not store.
    """
    if isinstance(endpoint, str):
        loaded = load_endpoint(endpoint)
        try:
            return reconcile(spark, loaded, dump_paths, dry_run=dry_run)
        finally:
            if built_by_loading(endpoint, loaded):
                loaded.close()
    if not dump_paths:
        raise BadDump("name at least one file or directory of the dump")
    endpoint.storage.verify()
    lines = _read_lines(spark, dump_paths).cache()
    try:
        _refuse_bad_lines(lines)
        return _reconcile_dump(spark, endpoint, _latest(lines), dry_run=dry_run)
    finally:
        lines.unpersist()


def _reconcile_dump(spark: SparkSession, endpoint: Endpoint, dump: DataFrame, *,
                    dry_run: bool) -> ReconcileSummary:
    from pyspark.sql import functions as F

    facts = dump.agg(F.count("*").alias("objects"), F.max("source_micros").alias("newest"),
                     F.collect_set("type").alias("types")).collect()[0]
    types = sorted(facts["types"])
    _check_types(endpoint, types)
    stored = _stored_rows(endpoint, types)
    corrections = _corrections(dump, _stored_frame(spark, stored), facts["newest"])
    emitter = None if dry_run else _Emitter(endpoint)
    counts, preview = _go_through(_local_corrections(corrections), emitter)
    summary = ReconcileSummary(
        dump=facts["objects"], stored=sum(1 for *_, completed in stored if not completed),
        missing=counts["missing"],
        stale=counts["stale"], deleted=counts["deleted"],
        emitted=emitter.emitted if emitter is not None else 0, dry_run=dry_run,
        preview=preview)
    log.info("%s (endpoint %s)", summary.line(), endpoint.name)
    return summary


def _go_through(corrections: Iterable[Correction], emitter: _Emitter | None,
                ) -> tuple[dict[Action, int], tuple[Correction, ...]]:
    """Emit each correction (unless ``emitter`` is None); return the number of each kind
    and the first :data:`PREVIEW`. What was dispatched is journaled even if a later
    dispatch fails."""
    counts = dict.fromkeys(ACTIONS, 0)
    preview: list[Correction] = []
    try:
        for correction in corrections:
            counts[correction.action] += 1
            if len(preview) < PREVIEW:
                preview.append(correction)
            if emitter is not None:
                emitter.emit(correction)
    finally:
        if emitter is not None:
            emitter.flush()
    return counts, tuple(preview)


# -- the dump ---------------------------------------------------------------------------


def _latest(lines: DataFrame) -> DataFrame:
    """One row per (type, id) of the dump: ``type``, ``id``, ``source_micros`` (its newest
    timestamp, microseconds since the epoch) and that line's ``parents``."""
    from pyspark.sql import functions as F

    newest = F.max(F.struct("source_micros", "parents")).alias("newest")
    return (lines.groupBy("type", "id").agg(newest)
            .select("type", "id", F.col("newest.source_micros").alias("source_micros"),
                    F.col("newest.parents").alias("parents")))


def _read_lines(spark: SparkSession, paths: Sequence[str]) -> DataFrame:
    """Every line with its parsed fields, its file, and ``problem`` (None if valid). Cache
    it: the corrupt-record column is reliable only if every column is parsed."""
    from pyspark.errors import AnalysisException
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, StringType, StructField, StructType

    schema = StructType([
        StructField("type", StringType()), StructField("id", StringType()),
        StructField("timestamp", StringType()),  # a number is read as its text
        StructField("parents", ArrayType(StringType())),
        StructField("_corrupt_record", StringType())])
    try:
        raw = (spark.read.schema(schema).option("mode", "PERMISSIVE")
               .option("columnNameOfCorruptRecord", "_corrupt_record").json(list(paths)))
    except AnalysisException as exc:
        raise BadDump(f"cannot read the dump {', '.join(paths)}: {exc}") from exc
    micros = _source_micros(F.trim(F.col("timestamp")))
    return raw.select(
        "type", "id", "timestamp", F.coalesce("parents", F.array()).alias("parents"),
        micros.alias("source_micros"), F.col("_metadata.file_path").alias("file"),
        F.coalesce("_corrupt_record", F.to_json(F.struct("type", "id", "timestamp", "parents")))
        .alias("line"),
        _problem(micros).alias("problem"))


def _source_micros(text: Column) -> Column:
    """A dump timestamp as microseconds since the epoch; null if unreadable."""
    from pyspark.sql import functions as F

    def group(index: int) -> Column:
        return F.nullif(F.regexp_extract(text, _ISO, index), F.lit(""))

    iso = F.concat(group(1), F.lit("T"), F.coalesce(group(2), F.lit("00:00")),
                   F.coalesce(group(3), F.lit(":00")), F.coalesce(F.upper(group(4)), F.lit("Z")))
    return (F.when(text.rlike(_MILLIS), text.try_cast("long") * 1000)
            .when(text.rlike(_ISO), F.unix_micros(iso.try_cast("timestamp"))))


def _problem(micros: Column) -> Column:
    """What is wrong with a line, or null."""
    from pyspark.sql import functions as F

    def blank(name: str) -> Column:
        return F.col(name).isNull() | (F.trim(F.col(name)) == "")

    bad_parent = F.exists(F.col("parents"), lambda parent: parent.isNull()
                          | ~parent.rlike(_PARENT))
    return (F.when(F.col("_corrupt_record").isNotNull(),
                   "not a JSON object with type, id, timestamp and parents (a list of strings)")
            .when(blank("type"), "no type")
            .when(blank("id"), "no id")
            .when(blank("timestamp"), "no timestamp")
            .when(micros.isNull(), "the timestamp is neither ISO 8601 (2026-01-01T12:00:00Z) "
                                   "nor milliseconds since the epoch")
            .when(F.coalesce(bad_parent, F.lit(False)),
                  "parents must be strings without commas or whitespace, such as user/42"))


def _refuse_bad_lines(lines: DataFrame) -> None:
    """Raise :class:`BadDump` quoting the first bad lines, if there are any."""
    bad = lines.where(lines["problem"].isNotNull())
    quoted = bad.select("file", "problem", "line").limit(QUOTED_BAD_LINES).collect()
    if not quoted:
        return
    details = "\n".join(f"  {row['file']}: {row['problem']}: {_shortened(row['line'])}"
                        for row in quoted)
    raise BadDump(f"the dump has {bad.count()} bad line(s); nothing was reconciled. "
                  f"The first:\n{details}")


def _shortened(line: str | None, limit: int = 200) -> str:
    text = (line or "").strip()
    return text if len(text) <= limit else text[:limit] + "..."


# -- the storage ------------------------------------------------------------------------


def _check_types(endpoint: Endpoint, types: Iterable[str]) -> None:
    """Refuse types that none of the endpoint's aggregate handlers stores."""
    known = sorted({type(handler).storage_name() for handler in endpoint.table.handlers
                    if isinstance(handler, AggregateHandler)})
    unknown = [name for name in types if name not in known]
    if unknown:
        raise ConfigurationError(
            f"the dump has objects of type(s) {', '.join(unknown)}, which no aggregate "
            f"handler of endpoint {endpoint.name!r} stores (it stores: "
            f"{', '.join(known) or 'nothing'}); the type is AggregateHandler.storage_name()")


#: A stored aggregate as reconciling sees it: type, id, updated_at (microseconds since the
#: epoch, or None) and whether it is a tombstone (a completed saga).
_Stored = tuple[str, str, int | None, bool]


def _stored_rows(endpoint: Endpoint, types: Iterable[str]) -> list[_Stored]:
    """Every stored aggregate and tombstone of ``types``, read on the driver."""
    aggregates = endpoint.storage_as(AggregateStore)
    return [(record.aggregate_type, record.aggregate_id, _micros(record.updated_at),
             record.completed)
            for name in types for record in aggregates.records(name) if record.exists]


def _stored_frame(spark: SparkSession, rows: list[_Stored]) -> DataFrame:
    return spark.createDataFrame(
        rows, "type string, id string, stored_micros long, completed boolean")


# -- the comparison ---------------------------------------------------------------------


def _corrections(dump: DataFrame, stored: DataFrame, newest: int | None) -> DataFrame:
    """The differences: ``type``, ``id``, ``action``, ``source_micros``,
    ``stored_micros``, ``parents``."""
    from pyspark.sql import functions as F

    in_dump = F.col("in_dump").isNotNull()
    in_storage = F.col("in_storage").isNotNull()
    tombstone = in_storage & F.coalesce(F.col("completed"), F.lit(False))
    unknown = F.col("stored_micros").isNull()
    before_dump = unknown | (F.col("stored_micros") <= F.lit(newest))
    nothing = F.lit(None).cast("string")
    action = (
        F.when(in_dump & ~in_storage, "missing")
        .when(tombstone, F.when(in_dump & before_dump, "missing").otherwise(nothing))
        .when(in_dump & (unknown | (F.col("source_micros") > F.col("stored_micros"))), "stale")
        .when(~in_dump & before_dump, "deleted"))
    joined = dump.withColumn("in_dump", F.lit(True)).join(
        stored.withColumn("in_storage", F.lit(True)), on=["type", "id"], how="full_outer")
    stored_micros = F.when(tombstone, None).otherwise(F.col("stored_micros"))
    return (joined.select("type", "id", action.alias("action"), "source_micros",
                          stored_micros.alias("stored_micros"), "parents")
            .where(F.col("action").isNotNull()))


def _local_corrections(corrections: DataFrame) -> Iterator[Correction]:
    """The corrections on the driver, by type and id, one partition at a time."""
    for row in corrections.orderBy("type", "id").toLocalIterator():
        yield Correction(
            aggregate_type=row["type"], aggregate_id=row["id"], action=row["action"],
            source_timestamp=_moment(row["source_micros"]),
            stored_updated_at=_moment(row["stored_micros"]),
            parents=tuple(row["parents"] or ()))


# -- emitting ---------------------------------------------------------------------------


class _Emitter:
    """Publishes corrections through the endpoint's transport and journals them in its
    storage, in batches, after they were dispatched."""

    def __init__(self, endpoint: Endpoint, batch: int = JOURNAL_BATCH) -> None:
        self._transport = endpoint.transport
        self._storage = endpoint.storage_as(JournalStore)
        self._batch = batch
        self._bus = Bus(endpoint.name, endpoint.router, self._dispatch)
        self._sent: list[Envelope] = []
        self._pending: list[JournalEntry] = []
        self.emitted = 0

    def _dispatch(self, envelope: Envelope) -> None:
        self._transport.dispatch(envelope)
        self._sent.append(envelope)

    def emit(self, correction: Correction) -> None:
        self._bus.publish(correction.event(), message_id=correction.message_id)
        self._pending.extend(entry_of(envelope, correction.aggregate_type,
                                      correction.aggregate_id) for envelope in self._sent)
        self.emitted += len(self._sent)
        self._sent.clear()
        if len(self._pending) >= self._batch:
            self.flush()

    def flush(self) -> None:
        """Journal what was dispatched and is not journaled yet."""
        if self._pending:
            self._storage.append_journal(self._pending)
            self._pending = []


# -- times ------------------------------------------------------------------------------


def _micros(moment: datetime.datetime | None) -> int | None:
    """Microseconds since the epoch (a naive time is taken as UTC)."""
    if moment is None:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return (moment - _EPOCH) // _MICROSECOND


def _moment(micros: Any) -> datetime.datetime | None:
    """An aware UTC datetime from microseconds since the epoch."""
    return None if micros is None else _EPOCH + int(micros) * _MICROSECOND


def _text(moment: datetime.datetime | None) -> str:
    return format_utc(moment) if moment is not None else "-"
