"""PostgreSQL storage over psycopg 3 and a connection pool (the ``[postgres]`` extra).

Features
========
* Two tables (``<prefix>_aggregates`` and ``<prefix>_processed``)::

      aggregates (aggregate_type, aggregate_id) -> version, state jsonb, state_version,
                                                   updated_at, completed
      processed  (aggregate_type, aggregate_id, key) -> outgoing jsonb, outgoing_ids jsonb,
                                                       dispatched, processed_at,
                                                       message_type

* A commit is one atomic statement (a data-modifying CTE, in autocommit): update the
  aggregate row where the version is the one loaded (or insert it for a new aggregate,
  ``ON CONFLICT DO NOTHING``) and, only if that changed a row, insert the processed row,
  unique per aggregate and handler-scoped message id, with the outgoing messages. Both
  happen or neither. A unique violation on the processed row, or a write that changed
  nothing, is explained by looking again: ``AlreadyProcessed`` with the stored outgoing
  messages if the message is recorded, ``ConcurrencyConflict`` otherwise. One statement
  instead of BEGIN, INSERT, UPDATE, COMMIT saved three round trips per message.
* Loading reads the aggregate row and the processed row of the incoming message in one
  query. Stateless handlers' inbox records are processed rows alone.
* ``mark_dispatched`` is applied in batches, one statement every 50 ms at most, by a
  background thread: a per-message UPDATE cost a quarter of the throughput. A mark lost in
  a crash only means a late duplicate re-sends its messages, which downstream deduplicates.
* Delayed messages wait in ``<prefix>_scheduled``; pollers claim due rows with
  ``FOR UPDATE SKIP LOCKED`` and a lease. Each row counts its failed sends (``attempts``).
* Processed rows are not bounded by count (``processed_window`` is ``None``); with
  ``retention=`` the ones whose messages were dispatched are deleted once older than it, in
  batches of 1000 by the outbox dispatcher's rounds. Undispatched rows are never deleted.
* A completed aggregate (a saga's ``complete()``) keeps its row as a tombstone:
  ``completed`` true, ``state`` its last state (read as ``final_state``), its processed
  rows untouched, each with its message's type (``message_type``: NULL for rows written
  before the column was added by ``migrate``). With ``retention=`` the same
  rounds delete tombstones completed longer ago than that none of whose processed rows
  waits for dispatch (a partial index finds them).
* The event journal is ``<prefix>_journal`` (position bigint primary key, message_id
  unique). An append is one transaction that first takes an advisory lock of its own (a
  key derived from the table name), then inserts each entry at ``max(position) + 1``
  unless its message id is journaled. The lock serialises appenders across processes, so
  positions are dense and become visible in order: a reader going by position misses
  nothing. Trimming deletes the oldest entries, never the newest, so positions never
  restart.
* The schema is created idempotently at start (``verify``) or by ``idembus migrate``;
  concurrent creators serialise on an advisory lock.

Connection String
=================
``PostgresStorage("postgresql://user@host:5432/dbname")`` (any libpq conninfo).

Options
=======
``table_prefix``   prefix of its eight tables (``idembus``); one per endpoint sharing a database
``pool_size``      most connections the pool opens (10)
``connect_timeout`` seconds to wait for a connection at start before failing (5)
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, NamedTuple

from pydantic_core import from_json

try:
    import psycopg
    import psycopg.errors
    from psycopg.types.json import Jsonb
    from psycopg_pool import ConnectionPool, PoolTimeout
except ImportError as missing:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        f"PostgresStorage needs psycopg 3 and psycopg-pool: pip install 'idembus[postgres]' "
        f"({missing})") from missing

from .. import headers as h
from ..envelope import Envelope
from ..errors import ConfigurationError
from ..redaction import redact
from . import postgres_json as pg_json
from .base import (
    INBOX,
    OVERDUE_DELAYED,
    OVERDUE_ENTRIES,
    AggregateRecord,
    AuditRecord,
    JournalBounds,
    JournalEntry,
    Lease,
    LimitStore,
    Overdue,
    ParkedKey,
    ParkedMessage,
    PayloadStore,
    PendingCommit,
    ProcessedMessage,
    StatusReport,
    Storage,
    Undispatched,
    scheduled_key,
)
from .errors import StaleLease, StorageAccessDenied, StorageError, StorageUnavailable
from .journal import journal_size, resume_position
from .parked import body_bytes, envelope_bytes, envelope_from
from .postgres_errors import (
    PoolAttempts,
    classified,
    discarding,
    is_privilege_refusal,
    login_problem,
)
from .postgres_shared import StatementPart
from .postgres_shared import statement as shared_statement
from .write_behind import Batcher

log = logging.getLogger(__name__)

#: A dispatch mark: aggregate type, aggregate id, key, keep the bodies.
_Mark = tuple[str, str, str, bool]

_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,40}")
#: Key of the advisory lock that serialises schema creation (an arbitrary constant).
_SCHEMA_LOCK = 0x1DE3B05


class PostgresStorage(Storage, LimitStore, PayloadStore):
    """Storage backend for PostgreSQL; see the module docstring.

    Parameters
    ----------
    conninfo:
        A libpq connection string or ``postgresql://`` URL.
    table_prefix:
        The prefix of the storage's ten tables (``<prefix>_aggregates``, ...): one per
        endpoint that shares the database but not its data. Lower-case letters, digits
        and ``_``; anything else raises ``ConfigurationError``.
    pool_size:
        The most connections the pool opens.
    connect_timeout:
        Seconds to wait for a connection at start before failing.
    retention:
        Delete dispatched processed rows and completed sagas' tombstones once older than
        this (``None``: keep them).
    """

    def __init__(
        self,
        conninfo: str,
        *,
        table_prefix: str = "idembus",
        pool_size: int = 10,
        connect_timeout: float = 5.0,
        retention: datetime.timedelta | None = None,
    ) -> None:
        super().__init__(processed_window=None)
        #: Processed rows whose messages were dispatched are deleted after this long
        #: (``None``: kept). Undispatched rows are never deleted.
        self.retention = retention
        if not _IDENTIFIER.fullmatch(table_prefix):
            raise ConfigurationError(
                f"table_prefix {table_prefix!r} must be lower-case letters, digits and '_'"
            )
        self.conninfo = conninfo
        #: The prefix of this storage's tables.
        self.table_prefix = table_prefix
        self._aggregates = f"{table_prefix}_aggregates"
        self._processed = f"{table_prefix}_processed"
        self._scheduled = f"{table_prefix}_scheduled"
        self._leases = f"{table_prefix}_leases"
        self._audit = f"{table_prefix}_audit"
        self._status = f"{table_prefix}_status"
        self._journal = f"{table_prefix}_journal"
        self._parked = f"{table_prefix}_parked"
        self._rates = f"{table_prefix}_rates"
        self._slots = f"{table_prefix}_slots"
        self._payloads = f"{table_prefix}_payloads"
        #: Every table of this schema.
        self._tables = (self._aggregates, self._processed, self._scheduled, self._leases,
                        self._audit, self._status, self._journal, self._parked, self._rates,
                        self._slots, self._payloads)
        #: Advisory lock serialising the appenders of this journal, in every process.
        self._journal_lock = _advisory_key(self._journal)
        #: Aggregates read per query by ``records`` (which pages through a type).
        self.records_page = 1000
        self._connect_timeout = connect_timeout
        self._pool = ConnectionPool(
            conninfo, min_size=1, max_size=pool_size, open=False, timeout=connect_timeout,
            kwargs={"autocommit": True}, name=f"idembus-{table_prefix}",
            configure=pg_json.read_quickly,
        )
        self._pool_attempts = PoolAttempts(self._pool.name)
        self._opened = False
        self._opening = threading.Lock()
        # A commit is one statement, atomic on its own: the aggregate's conditional update
        # (or insert) and the processed row succeed or fail together, in one round trip.
        record = (f"INSERT INTO {self._processed} (aggregate_type, aggregate_id, key, "
                  "outgoing, outgoing_ids, dispatched, message_type) ")
        # (an inbox entry recorded already writes nothing, as a refused update does)
        self._insert_inbox = (f"{record} VALUES (%s, %s, %s, %s, %s, %s, %s) "
                              "ON CONFLICT DO NOTHING")
        self._update_and_record = (
            f"WITH changed AS (UPDATE {self._aggregates} SET state = %s, version = version + 1,"
            " state_version = %s, updated_at = clock_timestamp(), completed = %s"
            " WHERE aggregate_type = %s AND aggregate_id = %s AND version = %s RETURNING 1) "
            f"{record} SELECT %s, %s, %s, %s, %s, %s, %s FROM changed")
        self._create_and_record = (
            f"WITH changed AS (INSERT INTO {self._aggregates}"
            " (aggregate_type, aggregate_id, version, state, state_version, updated_at,"
            " completed) VALUES (%s, %s, 1, %s, %s, clock_timestamp(), %s)"
            " ON CONFLICT DO NOTHING RETURNING 1) "
            f"{record} SELECT %s, %s, %s, %s, %s, %s, %s FROM changed")
        # The groups below take their rows as one JSON array (jsonb_to_recordset): one
        # parameter that json.dumps writes at C speed, where an array a column costs
        # psycopg Python work for every element.
        # A group of loads in one statement: a row for each (type, id, key) given, with its
        # position among them.
        self._load_group = (
            f"SELECT r.position, a.version, {_documents('a.state')}, a.state_version, p.key,"
            f" {_OUTGOING}, p.dispatched, p.processed_at, a.completed, p.message_type"
            " FROM jsonb_to_recordset(%s) AS r(position integer, aggregate_type text,"
            " aggregate_id text, key text)"
            f" LEFT JOIN {self._aggregates} a"
            " ON a.aggregate_type = r.aggregate_type AND a.aggregate_id = r.aggregate_id"
            f" LEFT JOIN {self._processed} p ON p.aggregate_type = r.aggregate_type"
            " AND p.aggregate_id = r.aggregate_id AND p.key = r.key")
        # The inbox entries of a group of loads: a row for each (id, key) that has one,
        # with the position of its request; as the single load's statement.
        self._load_inbox_group = (
            f"SELECT r.position, 1, {_documents('NULL::jsonb')}, NULL::integer, p.key,"
            f" {_OUTGOING}, p.dispatched, p.processed_at, false, p.message_type"
            " FROM jsonb_to_recordset(%s) AS r(position integer, aggregate_id text, key text)"
            f" JOIN {self._processed} p ON p.aggregate_type = %s"
            " AND p.aggregate_id = r.aggregate_id AND p.key = r.key")
        entry_columns = ("aggregate_type text, aggregate_id text, key text, outgoing jsonb,"
                         " outgoing_ids jsonb, dispatched boolean, message_type text")
        # The inbox entries of a group of commits in one statement: those recorded already
        # write nothing, as a single one; the rows written are returned.
        self._inbox_group = (
            f"{record} SELECT aggregate_type, aggregate_id, key, outgoing, outgoing_ids,"
            f" dispatched, message_type FROM jsonb_to_recordset(%s) AS r({entry_columns})"
            " ON CONFLICT DO NOTHING RETURNING aggregate_type, aggregate_id, key")
        # The new aggregates of a group of commits (each a different aggregate) in one
        # statement: an aggregate created meanwhile is not written, nor its processed row,
        # as a refused single create; the processed rows written are returned.
        self._create_group = (
            "WITH input AS (SELECT * FROM jsonb_to_recordset(%s) AS i(state jsonb,"
            f" state_version integer, completed boolean, {entry_columns})),"
            f" changed AS (INSERT INTO {self._aggregates} (aggregate_type, aggregate_id,"
            " version, state, state_version, updated_at, completed)"
            " SELECT aggregate_type, aggregate_id, 1, state, state_version, clock_timestamp(),"
            " completed FROM input ON CONFLICT DO NOTHING"
            " RETURNING aggregate_type, aggregate_id) "
            f"{record} SELECT i.aggregate_type, i.aggregate_id, i.key, i.outgoing,"
            " i.outgoing_ids, i.dispatched, i.message_type FROM input i JOIN changed c"
            " ON (c.aggregate_type, c.aggregate_id) = (i.aggregate_type, i.aggregate_id)"
            " RETURNING aggregate_type, aggregate_id, key")
        # The updates of a group of commits in one statement: each row's update applies
        # only at its loaded version, and only the rows updated get their processed row
        # (returned); the others write nothing, as a refused single commit. A processed row
        # that exists already raises, and the group is committed again one by one. The
        # input comes sorted by aggregate, the order in which a group of a few dozen rows
        # is joined to the aggregates (by their primary key), so two workers' groups lock
        # rows in one order (commit_many locks every aggregate of the batch first, in one
        # order, so that statements of different kinds cannot lock them in opposite ones).
        self._update_group = (
            "WITH input AS (SELECT * FROM jsonb_to_recordset(%s) AS i(version bigint,"
            f" state jsonb, state_version integer, completed boolean, {entry_columns})),"
            f" changed AS (UPDATE {self._aggregates} a SET state = i.state,"
            " version = a.version + 1, state_version = i.state_version,"
            " updated_at = clock_timestamp(), completed = i.completed FROM input i"
            " WHERE a.aggregate_type = i.aggregate_type AND a.aggregate_id = i.aggregate_id"
            " AND a.version = i.version RETURNING i.aggregate_type, i.aggregate_id, i.key) "
            f"{record} SELECT i.aggregate_type, i.aggregate_id, i.key, i.outgoing,"
            " i.outgoing_ids, i.dispatched, i.message_type FROM input i JOIN changed c"
            " ON (c.aggregate_type, c.aggregate_id, c.key)"
            " = (i.aggregate_type, i.aggregate_id, i.key)"
            " RETURNING aggregate_type, aggregate_id, key")
        self._marks: Batcher[tuple[_Mark, tuple[JournalEntry, ...]]] = Batcher(
            self._write_marks, name=f"idembus-{table_prefix}-marks")

    # -- schema and life cycle ----------------------------------------------------------

    @property
    def table_names(self) -> tuple[str, ...]:
        """Every table of this storage's schema (what ``drop_tables`` drops)."""
        return self._tables

    def migrate(self) -> None:
        """Create the tables and indexes if they do not exist, add the columns later
        versions added. Safe to run concurrently."""
        with self._connection() as connection, connection.transaction():
            connection.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            connection.execute(f"""
                CREATE TABLE IF NOT EXISTS {self._aggregates} (
                    aggregate_type text NOT NULL,
                    aggregate_id text NOT NULL,
                    version bigint NOT NULL,
                    state jsonb,
                    updated_at timestamptz,
                    completed boolean NOT NULL DEFAULT false,
                    state_version integer,
                    PRIMARY KEY (aggregate_type, aggregate_id)
                )""")
            if not _has_column(connection, self._aggregates, "updated_at"):  # older schema
                connection.execute(f"""
                    ALTER TABLE {self._aggregates}
                    ADD COLUMN IF NOT EXISTS updated_at timestamptz""")
            if not _has_column(connection, self._aggregates, "completed"):  # older schema
                connection.execute(f"""
                    ALTER TABLE {self._aggregates}
                    ADD COLUMN IF NOT EXISTS completed boolean NOT NULL DEFAULT false""")
            connection.execute(f"""
                CREATE INDEX IF NOT EXISTS {self._aggregates}_tombstones
                ON {self._aggregates} (updated_at) WHERE completed""")
            if not _has_column(connection, self._aggregates, "state_version"):  # older schema
                connection.execute(f"""
                    ALTER TABLE {self._aggregates}
                    ADD COLUMN IF NOT EXISTS state_version integer""")
            connection.execute(f"""
                CREATE TABLE IF NOT EXISTS {self._processed} (
                    aggregate_type text NOT NULL,
                    aggregate_id text NOT NULL,
                    key text NOT NULL,
                    outgoing jsonb NOT NULL,
                    outgoing_ids jsonb NOT NULL,
                    dispatched boolean NOT NULL DEFAULT false,
                    processed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                    attempts integer NOT NULL DEFAULT 0,
                    message_type text,
                    PRIMARY KEY (aggregate_type, aggregate_id, key)
                )""")
            if not _has_column(connection, self._processed, "attempts"):  # older schema
                connection.execute(f"""
                    ALTER TABLE {self._processed}
                    ADD COLUMN IF NOT EXISTS attempts integer NOT NULL DEFAULT 0""")
            if not _has_column(connection, self._processed, "message_type"):  # older schema
                connection.execute(f"""
                    ALTER TABLE {self._processed} ADD COLUMN IF NOT EXISTS message_type text""")
            connection.execute(f"""
                CREATE TABLE IF NOT EXISTS {self._scheduled} (
                    message_id text NOT NULL,
                    destination text NOT NULL,
                    deliver_at text NOT NULL,
                    envelope jsonb NOT NULL,
                    due timestamptz NOT NULL,
                    leased_until timestamptz,
                    owner text,
                    attempts integer NOT NULL DEFAULT 0,
                    PRIMARY KEY (message_id, destination, deliver_at)
                )""")
            if not _has_column(connection, self._scheduled, "owner"):  # older schema
                connection.execute(f"""
                    ALTER TABLE {self._scheduled} ADD COLUMN IF NOT EXISTS owner text""")
            if not _has_column(connection, self._scheduled, "attempts"):  # older schema
                connection.execute(f"""
                    ALTER TABLE {self._scheduled}
                    ADD COLUMN IF NOT EXISTS attempts integer NOT NULL DEFAULT 0""")
            connection.execute(f"""
                CREATE INDEX IF NOT EXISTS {self._scheduled}_due ON {self._scheduled} (due)""")
            connection.execute(f"""
                CREATE INDEX IF NOT EXISTS {self._processed}_expiry
                ON {self._processed} (processed_at) WHERE dispatched""")
            connection.execute(f"""
                CREATE INDEX IF NOT EXISTS {self._processed}_undispatched
                ON {self._processed} (processed_at) WHERE NOT dispatched""")
            connection.execute(f"""
                CREATE TABLE IF NOT EXISTS {self._leases} (
                    name text PRIMARY KEY,
                    owner text NOT NULL,
                    token bigint NOT NULL,
                    expires_at timestamptz NOT NULL
                )""")
            connection.execute(f"""
                CREATE TABLE IF NOT EXISTS {self._audit} (
                    endpoint text NOT NULL,
                    handler text NOT NULL,
                    message_id text NOT NULL,
                    message_type text NOT NULL,
                    outcome text NOT NULL,
                    time_sent timestamptz,
                    recorded_at timestamptz NOT NULL,
                    bucket integer NOT NULL
                )""")
            connection.execute(f"""
                CREATE TABLE IF NOT EXISTS {self._status} (
                    endpoint text NOT NULL,
                    instance text NOT NULL,
                    counters jsonb NOT NULL,
                    started_at timestamptz NOT NULL,
                    updated_at timestamptz NOT NULL,
                    stopped boolean NOT NULL,
                    problems jsonb NOT NULL DEFAULT '{{}}',
                    PRIMARY KEY (endpoint, instance)
                )""")
            if not _has_column(connection, self._status, "problems"):  # older schema
                connection.execute(f"""
                    ALTER TABLE {self._status}
                    ADD COLUMN IF NOT EXISTS problems jsonb NOT NULL DEFAULT '{{}}'""")
            connection.execute(f"""
                CREATE TABLE IF NOT EXISTS {self._parked} (
                    parked_id text PRIMARY KEY,
                    endpoint text NOT NULL,
                    source text NOT NULL,
                    envelope bytea NOT NULL,
                    body bytea NOT NULL,
                    parked_at timestamptz NOT NULL
                )""")
            connection.execute(f"CREATE INDEX IF NOT EXISTS {self._parked}_pages ON "
                               f"{self._parked} (endpoint, parked_at, parked_id)")
            connection.execute(f"""
                CREATE TABLE IF NOT EXISTS {self._journal} (
                    position bigint PRIMARY KEY,
                    message_id text NOT NULL UNIQUE,
                    message_type text NOT NULL,
                    aggregate_type text,
                    aggregate_id text,
                    parents text[] NOT NULL,
                    headers jsonb NOT NULL,
                    body text NOT NULL,
                    recorded_at timestamptz NOT NULL
                )""")
            connection.execute(f"""
                CREATE INDEX IF NOT EXISTS {self._journal}_recorded_at
                ON {self._journal} (recorded_at)""")
            connection.execute(f"""
                CREATE TABLE IF NOT EXISTS {self._rates} (
                    name text PRIMARY KEY,
                    tat double precision NOT NULL
                )""")
            connection.execute(f"""
                CREATE TABLE IF NOT EXISTS {self._slots} (
                    name text NOT NULL,
                    holder text NOT NULL,
                    expires_at double precision NOT NULL,
                    PRIMARY KEY (name, holder)
                )""")
            connection.execute(f"""
                CREATE TABLE IF NOT EXISTS {self._payloads} (
                    payload_id text PRIMARY KEY,
                    body bytea NOT NULL,
                    keep_until timestamptz NOT NULL,
                    holds text[] NOT NULL DEFAULT '{{}}'
                )""")
            connection.execute(f"""
                ALTER TABLE {self._payloads}
                    ADD COLUMN IF NOT EXISTS holds text[] NOT NULL DEFAULT '{{}}'""")
            connection.execute(f"""
                CREATE INDEX IF NOT EXISTS {self._payloads}_keep_until
                ON {self._payloads} (keep_until)""")
            connection.execute(f"""
                CREATE INDEX IF NOT EXISTS {self._payloads}_holds
                ON {self._payloads} USING gin (holds)""")

    def verify(self) -> None:
        """Check at start that the schema is in place — only reads, so a role without DDL
        rights can run an endpoint. If something is missing, create it when the role may.
        What only an operator can cure fails the start with
        :class:`~idembus.errors.ConfigurationError` (exit status 2, one line): a refused login
        or database, a role that may not create what is missing (run ``idembus migrate``
        with a role that may), a table of the same name that idembus cannot use."""
        try:
            with self._connection() as connection:
                missing = self._missing_schema(connection)
        except StorageAccessDenied as refused:
            raise ConfigurationError(
                f"{refused}; check the role, password and database of the connection "
                "string, and that the role may connect") from refused
        if not missing:
            return
        try:
            self.migrate()
        except StorageAccessDenied as refused:
            if is_privilege_refusal(refused):
                raise ConfigurationError(
                    f"PostgreSQL at {redact(self.conninfo)} lacks {', '.join(missing)} and "
                    f"this role may not create them ({refused}); run `idembus migrate "
                    "package.module:endpoint` once with a role that may, then start again"
                ) from refused
            raise ConfigurationError(
                f"PostgreSQL at {redact(self.conninfo)}: {', '.join(missing)} cannot be "
                f"created or brought up to date ({refused}); a table of that name that "
                "idembus did not create is in the way: rename or drop it, or give the "
                "endpoint another table_prefix") from refused

    def _missing_schema(self, connection: psycopg.Connection[Any]) -> list[str]:
        """The tables and later-added columns of this schema that do not exist."""
        present = connection.execute(
            "SELECT t FROM unnest(%s::text[]) AS t WHERE to_regclass(t) IS NOT NULL",
            (list(self._tables),)).fetchall()
        missing = sorted(set(self._tables) - {row[0] for row in present})
        for table, column in ((self._aggregates, "updated_at"),
                              (self._aggregates, "completed"),
                              (self._aggregates, "state_version"), (self._scheduled, "owner"),
                              (self._status, "problems"), (self._processed, "attempts"),
                              (self._scheduled, "attempts"),
                              (self._processed, "message_type"),
                              (self._payloads, "holds")):
            if table not in missing and not _has_column(connection, table, column):
                missing.append(f"{table}.{column}")
        return missing

    def close(self) -> None:
        self._marks.close()
        with self._opening:
            if self._opened:
                self._pool.close()
                self._opened = False
            self._pool_attempts.detach()

    def drop_tables(self) -> None:
        """Drop the tables and everything in them (tests and samples clean up with this)."""
        self._marks.flush()
        with self._connection() as connection:
            connection.execute(f"DROP TABLE IF EXISTS {', '.join(self._tables)}")

    # -- the contract -------------------------------------------------------------------

    def load(
        self, aggregate_type: str, aggregate_id: str, key: str | None = None
    ) -> AggregateRecord:
        with self._connection() as connection:
            row = connection.execute(*self._load_statement(aggregate_type, aggregate_id,
                                                           key)).fetchone()
        return _record(aggregate_type, aggregate_id, row)

    def load_many(
        self, requests: Sequence[tuple[str, str, str | None]]
    ) -> list[AggregateRecord | Exception]:
        """Every load in one round trip: the aggregates' in one statement (one row a
        request, by its position), inbox entries' in another, in one pipeline; if that
        fails (input PostgreSQL refuses), each again on its own, with its own answer."""
        if len(requests) < 2:
            return super().load_many(requests)
        grouped = [index for index, request in enumerate(requests) if request[0] != INBOX]
        inbox = [index for index, request in enumerate(requests) if request[0] == INBOX]
        rows: list[Any] = [None] * len(requests)
        try:
            with self._connection() as connection:
                # two statements share a round trip in a pipeline; one needs none
                with connection.pipeline() if inbox and grouped else nullcontext():
                    entries = connection.execute(self._load_inbox_group, (_jsonb_of([
                        {"position": position, "aggregate_id": requests[index][1],
                         "key": requests[index][2] or requests[index][1]}
                        for position, index in enumerate(inbox, 1)]), INBOX)) if inbox else None
                    group = connection.execute(self._load_group, (_jsonb_of([
                        {"position": position, "aggregate_type": requests[index][0],
                         "aggregate_id": requests[index][1], "key": requests[index][2]}
                        for position, index in enumerate(grouped, 1)]),)) if grouped else None
                for position, *row in entries.fetchall() if entries is not None else ():
                    rows[inbox[position - 1]] = row
                for position, *row in group.fetchall() if group is not None else ():
                    rows[grouped[position - 1]] = row
        except StorageUnavailable:
            raise
        except StorageError:
            return super().load_many(requests)
        return [_record(aggregate_type, aggregate_id, row)
                for (aggregate_type, aggregate_id, _), row in zip(requests, rows, strict=True)]

    def _load_statement(self, aggregate_type: str, aggregate_id: str,
                        key: str | None) -> tuple[str, tuple[Any, ...]]:
        if aggregate_type == INBOX:
            return (f"SELECT 1, {_documents('NULL::jsonb')}, NULL::integer, key, "
                    f"{_OUTGOING}, dispatched, processed_at, false, message_type "
                    f"FROM {self._processed} p "
                    "WHERE aggregate_type = %s AND aggregate_id = %s AND key = %s",
                    (INBOX, aggregate_id, key or aggregate_id))
        return (f"""SELECT a.version, {_documents('a.state')}, a.state_version, p.key,
                           {_OUTGOING}, p.dispatched, p.processed_at, a.completed,
                           p.message_type
                    FROM (SELECT 1) AS one
                    LEFT JOIN {self._aggregates} a
                           ON a.aggregate_type = %s AND a.aggregate_id = %s
                    LEFT JOIN {self._processed} p
                           ON p.aggregate_type = %s AND p.aggregate_id = %s AND p.key = %s""",
                (aggregate_type, aggregate_id, aggregate_type, aggregate_id, key))

    def commit(
        self,
        loaded: AggregateRecord,
        *,
        key: str,
        state: Mapping[str, Any] | None,
        outgoing: Sequence[Envelope],
        completed: bool = False,
        state_version: int | None = None,
        message_type: str | None = None,
    ) -> None:
        statement = self._commit_statement(PendingCommit(
            loaded, key, state, tuple(outgoing),
            {"completed": completed, "state_version": state_version,
             "message_type": message_type}))
        with self._connection() as connection:
            try:
                written = connection.execute(*statement).rowcount
            except psycopg.errors.UniqueViolation:
                written = 0  # the processed row exists: the message was handled
        if written != 1:
            raise self._refusal(loaded.aggregate_type, loaded.aggregate_id, key)

    def commit_many(self, commits: Sequence[PendingCommit]) -> list[Exception | None]:
        """The commits' statements in one round trip (pipeline mode, one implicit
        transaction). The first takes an advisory lock per aggregate, in the order of their
        keys, so that two workers' batches over the same aggregates never deadlock; should
        PostgreSQL roll the batch back all the same (a deadlock with another writer, a
        serialization failure), it is committed one by one, not waited out as an outage.
        Each statement is the same conditional write as :meth:`commit`'s, which
        writes nothing when refused; the refused ones are then explained one by one. A
        statement that raises (bad data) rolls the group back: the group is then committed
        one by one, each with its own answer."""
        if len(commits) < 2:
            return super().commit_many(commits)
        order = sorted(range(len(commits)), key=lambda index: (
            commits[index].loaded.aggregate_type, commits[index].loaded.aggregate_id,
            commits[index].key))
        groups = self._commit_groups(commits, order)
        grouped = {index for _, _, indexes in groups for index in indexes}
        try:
            with self._connection() as connection:
                with connection.pipeline():
                    # First, in one order every batch follows, a lock per aggregate: the
                    # statements below lock rows kind by kind (alone, updates, creates,
                    # entries), which in two batches over the same aggregates could be
                    # opposite orders, a deadlock.
                    connection.execute(_LOCK_IN_ORDER, (self._batch_locks(commits),))
                    alone = {index: connection.execute(*self._commit_statement(commits[index]))
                             for index in order if index not in grouped}
                    answers = [(connection.execute(statement, arguments), indexes)
                               for statement, arguments, indexes in groups]
                written = {index: cursor.rowcount for index, cursor in alone.items()}
                for cursor, indexes in answers:
                    position: dict[tuple[Any, ...], int] = {}
                    for index in indexes:  # the same entry twice: the first is written
                        position.setdefault((commits[index].loaded.aggregate_type,
                                             commits[index].loaded.aggregate_id,
                                             commits[index].key), index)
                    for row in cursor.fetchall():
                        written[position[tuple(row)]] = 1
        except StorageUnavailable as unavailable:
            if not _lost_to_another(unavailable):
                raise
            # A deadlock or a serialization failure all the same (with a commit that is
            # not a batch's): nothing of the group was written, and one statement per
            # commit cannot meet it again, so it is no outage to wait out.
            log.info("a batch of %d commits was rolled back by PostgreSQL (%s); committed "
                     "one by one", len(commits), unavailable)
            return super().commit_many(commits)
        except StorageError:  # nothing of the group was written
            return super().commit_many(commits)
        return [None if written.get(index) == 1 else self._refusal_in_group(pending)
                for index, pending in enumerate(commits)]

    def _batch_locks(self, commits: Sequence[PendingCommit]) -> str:
        """The advisory-lock keys of the aggregates (of the inbox entries: the entries)
        ``commits`` write, sorted: the order in which every batch takes them; as the text
        of a ``bigint[]`` (psycopg would dump a list element by element in Python)."""
        keys = set()
        for pending in commits:
            loaded = pending.loaded
            name = f"{self.table_prefix}\n{loaded.aggregate_type}\n{loaded.aggregate_id}"
            if loaded.aggregate_type == INBOX:  # one id holds every entry of a handler
                name = f"{name}\n{pending.key}"
            keys.add(_advisory_key(name))
        return "{" + ",".join(map(str, sorted(keys))) + "}"

    def _commit_groups(self, commits: Sequence[PendingCommit], order: Sequence[int]
                       ) -> list[tuple[str, tuple[Any, ...], list[int]]]:
        """The group statements of :meth:`commit_many`: updates, creates and inbox entries,
        each kind with two commits or more (one would gain nothing) in one statement, as
        (statement, arguments, the commits' indexes in ``order``). A second create of one
        aggregate is left to its own statement, which the first makes refuse."""
        updates: list[int] = []
        creates: list[int] = []
        entries: list[int] = []
        created: set[tuple[str, str]] = set()
        for index in order:
            loaded = commits[index].loaded
            if loaded.aggregate_type == INBOX:
                entries.append(index)
            elif loaded.exists:
                updates.append(index)
            elif (loaded.aggregate_type, loaded.aggregate_id) not in created:
                created.add((loaded.aggregate_type, loaded.aggregate_id))
                creates.append(index)
        groups = []
        for statement, arguments, indexes in (
                (self._update_group, _update_group_arguments, updates),
                (self._create_group, _create_group_arguments, creates),
                (self._inbox_group, _inbox_group_arguments, entries)):
            if len(indexes) >= 2:
                groups.append((statement, arguments([commits[index] for index in indexes]),
                               indexes))
        return groups

    def _commit_statement(self, pending: PendingCommit) -> tuple[str, tuple[Any, ...]]:
        """The one statement of a commit: it writes one processed row (and the aggregate's
        row), or nothing when its condition fails."""
        loaded = pending.loaded
        values = _CommitValues.of(pending)
        if loaded.aggregate_type == INBOX:
            return self._insert_inbox, values.entry
        if loaded.exists:
            return self._update_and_record, (values.document, values.state_version,
                                             values.completed, loaded.aggregate_type,
                                             loaded.aggregate_id, loaded.version,
                                             *values.entry)
        return self._create_and_record, (loaded.aggregate_type, loaded.aggregate_id,
                                         values.document, values.state_version,
                                         values.completed, *values.entry)

    def commit_with(
        self,
        loaded: AggregateRecord,
        *,
        key: str,
        state: Mapping[str, Any] | None,
        outgoing: Sequence[Envelope],
        part: StatementPart,
        keep_bodies: bool = False,
        journal: Sequence[JournalEntry] = (),
        completed: bool = False,
        state_version: int | None = None,
        message_type: str | None = None,
    ) -> Any:
        """:meth:`commit`, in one statement with another's ``part``
        (:mod:`idembus.storage.postgres_shared`; the PostgreSQL transport inserting the
        outgoing messages into their queues and deleting the incoming one, for
        :mod:`idembus.runtime.shared_transaction`), and with the ``journal`` entries in the same
        transaction; then the part's ``after`` statement, in a transaction of its own. The
        outgoing messages are recorded as dispatched already (their bodies kept only with
        ``keep_bodies``): no outbox sends them, no mark follows.

        Returns the part's result; ``None`` if the part's precondition failed (nothing was
        written: commit another way); raises as :meth:`commit` does when the write is
        refused (nothing was written either)."""
        kind = ("inbox" if loaded.aggregate_type == INBOX
                else "update" if loaded.exists else "create")
        parameters = {
            **part.params, "type": loaded.aggregate_type, "id": loaded.aggregate_id,
            "key": key, "version": loaded.version, "completed": completed,
            "state": Jsonb(dict(state)) if state is not None else None,
            "state_version": state_version, "message_type": message_type,
            "outgoing": Jsonb([e.to_record() for e in outgoing] if keep_bodies else []),
            "ids": Jsonb([envelope.message_id for envelope in outgoing]),
        }
        query = shared_statement(self._aggregates, self._processed, kind=kind, part=part)
        with self._connection() as connection:
            try:
                if not journal:
                    with connection.pipeline() as pipeline:
                        cursor = connection.execute(query, parameters)
                        pipeline.sync()  # the wake-up in a transaction of its own
                        connection.execute(part.after, parameters)
                        row = cursor.fetchone()
                else:
                    with connection.transaction():
                        self._append_journal(connection, journal)
                        row = connection.execute(query, parameters).fetchone()
                        if not row or not row[0]:
                            raise _Refused(row)  # rolls the journal entries back
                    connection.execute(part.after, parameters)
            except psycopg.errors.UniqueViolation:
                row = (0, True, None)  # the processed row exists: the message was handled
            except _Refused as refused:
                row = refused.row
        written, deliverable, result = row if row else (0, True, None)
        if written:
            return result
        if not deliverable:
            return None
        raise self._refusal(loaded.aggregate_type, loaded.aggregate_id, key)

    def mark_dispatched(self, aggregate_type: str, aggregate_id: str, key: str, *,
                        keep_bodies: bool = False, lease: Lease | None = None,
                        journal: Sequence[JournalEntry] = ()) -> None:
        mark = (aggregate_type, aggregate_id, key, keep_bodies)
        if lease is None:
            self._marks.add((mark, tuple(journal)))
            return
        if journal:
            self.append_journal(journal)
        with self._connection() as connection:
            valid = connection.execute(
                f"WITH valid AS (SELECT 1 FROM {self._leases} WHERE name = %s AND token = %s), "
                f"marked AS ({self._mark_statement} AND EXISTS (SELECT 1 FROM valid) "
                "RETURNING 1) SELECT EXISTS (SELECT 1 FROM valid)",
                (lease.name, lease.token, *self._mark_arguments([mark])),
            ).fetchone()
        if not valid or not valid[0]:
            raise StaleLease(f"lease {lease.name!r} token {lease.token} was superseded")

    def flush(self) -> None:
        self._marks.flush()

    @property
    def _mark_statement(self) -> str:
        return (f"UPDATE {self._processed} AS p SET dispatched = true, outgoing = CASE "
                "WHEN m.keep THEN p.outgoing ELSE '[]'::jsonb END "
                "FROM jsonb_to_recordset(%s) AS m(t text, i text, k text, keep boolean) "
                "WHERE p.aggregate_type = m.t AND p.aggregate_id = m.i AND p.key = m.k "
                "AND NOT p.dispatched")

    @staticmethod
    def _mark_arguments(marks: list[_Mark]) -> list[Jsonb]:
        """The marks as one JSON parameter, as the groups take their rows (an array a
        column made psycopg quote every element in Python, with a regular expression)."""
        return [pg_json.jsonb(pg_json.text_json(
            [{"t": aggregate_type, "i": aggregate_id, "k": key, "keep": keep}
             for aggregate_type, aggregate_id, key, keep in marks]))]

    def _write_marks(self, batch: list[tuple[_Mark, tuple[JournalEntry, ...]]]) -> None:
        """One transaction: the batch's journal entries, then its marks."""
        marks = sorted(mark for mark, _ in batch)  # rows locked in one order by every batch
        entries = [entry for _, journal in batch for entry in journal]
        with self._connection() as connection:
            if not entries:  # one statement: atomic on its own, no BEGIN and COMMIT
                connection.execute(self._mark_statement, self._mark_arguments(marks))
                return
            with connection.transaction():
                self._append_journal(connection, entries)
                connection.execute(self._mark_statement, self._mark_arguments(marks))

    def expire(self, now: datetime.datetime, *, batch: int = 1000) -> int:
        if self.retention is None:
            return 0
        horizon = now - self.retention
        with self._connection() as connection:
            # Bounded: one batch per call, found through the partial indexes; never one
            # unbounded DELETE holding locks on millions of rows.
            removed = connection.execute(
                f"DELETE FROM {self._processed} WHERE ctid = ANY(ARRAY("
                f"SELECT ctid FROM {self._processed} WHERE dispatched AND processed_at < %s "
                "LIMIT %s))",
                (horizon, batch),
            ).rowcount
            if removed >= batch:
                return removed
            # Tombstones none of whose processed rows waits for dispatch. The conditions
            # stand in the outer WHERE too: a row a commit changed meanwhile (revived it,
            # or added a row to dispatch) is checked again, as changed, before deletion.
            return removed + connection.execute(
                f"DELETE FROM {self._aggregates} a WHERE {self._expired_tombstone('a')} "
                "AND (a.aggregate_type, a.aggregate_id) IN ("
                f"SELECT t.aggregate_type, t.aggregate_id FROM {self._aggregates} t "
                f"WHERE {self._expired_tombstone('t')} LIMIT %s)",
                (horizon, horizon, batch - removed),
            ).rowcount

    def _expired_tombstone(self, row: str) -> str:
        """A condition on aggregate row ``row``: a tombstone completed before its
        parameter, none of whose processed rows waits for dispatch."""
        return (f"{row}.completed AND {row}.updated_at < %s AND NOT EXISTS (SELECT 1 FROM "
                f"{self._processed} p WHERE NOT p.dispatched AND p.aggregate_type = "
                f"{row}.aggregate_type AND p.aggregate_id = {row}.aggregate_id)")

    def undispatched(self, *, committed_before: datetime.datetime, limit: int = 100,
                     endpoint: str | None = None) -> list[Undispatched]:
        # The committing endpoint is in the first message's headers (no column: the partial
        # index on undispatched rows keeps the scan small).
        mine = ("" if endpoint is None else
                "AND coalesce(outgoing->0->'headers'->>%s, %s) = %s ")
        parameters: tuple[Any, ...] = (committed_before,) + (
            () if endpoint is None else (h.ORIGINATING_ENDPOINT, endpoint, endpoint))
        with self._connection() as connection:
            rows = connection.execute(
                f"SELECT aggregate_type, aggregate_id, key, outgoing, attempts "
                f"FROM {self._processed} WHERE NOT dispatched AND processed_at < %s {mine}"
                "ORDER BY processed_at LIMIT %s",
                (*parameters, limit),
            ).fetchall()
        return [Undispatched(t, i, k, tuple(Envelope.from_record(o) for o in outgoing), n)
                for t, i, k, outgoing, n in rows]

    def note_repair_failure(self, aggregate_type: str, aggregate_id: str, key: str) -> None:
        with self._connection() as connection:
            connection.execute(
                f"UPDATE {self._processed} SET attempts = attempts + 1 "
                "WHERE aggregate_type = %s AND aggregate_id = %s AND key = %s",
                (aggregate_type, aggregate_id, key))

    def _overdue(self, before: datetime.datetime) -> list[Overdue]:
        with self._connection() as connection:
            entries = connection.execute(
                f"SELECT outgoing->0->'headers'->>%s, count(*), min(processed_at) "
                f"FROM {self._processed} WHERE NOT dispatched AND processed_at < %s GROUP BY 1",
                (h.ORIGINATING_ENDPOINT, before)).fetchall()
            delayed = connection.execute(
                f"SELECT owner, count(*), min(due) FROM {self._scheduled} WHERE due < %s "
                "GROUP BY owner", (before,)).fetchall()
        return [Overdue(endpoint, kind, int(count), _utc(since) or before)
                for kind, rows in ((OVERDUE_ENTRIES, entries), (OVERDUE_DELAYED, delayed))
                for endpoint, count, since in rows]

    def acquire_lease(self, name: str, owner: str, *, ttl: float,
                      now: datetime.datetime) -> Lease | None:
        until = now + datetime.timedelta(seconds=ttl)
        with self._connection() as connection:
            row = connection.execute(
                f"""INSERT INTO {self._leases} AS l (name, owner, token, expires_at)
                    VALUES (%s, %s, 1, %s)
                    ON CONFLICT (name) DO UPDATE SET
                        token = CASE WHEN l.owner = EXCLUDED.owner THEN l.token
                                     ELSE l.token + 1 END,
                        owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at
                    WHERE l.owner = EXCLUDED.owner OR l.expires_at <= %s
                    RETURNING token""",
                (name, owner, until, now),
            ).fetchone()
        return Lease(name, owner, int(row[0]), until) if row else None

    def release_lease(self, lease: Lease) -> None:
        with self._connection() as connection:
            connection.execute(
                f"UPDATE {self._leases} SET expires_at = '-infinity' "
                "WHERE name = %s AND owner = %s AND token = %s",
                (lease.name, lease.owner, lease.token),
            )

    def _schedule(self, envelope: Envelope, due: datetime.datetime,
                  owner: str | None) -> None:
        with self._connection() as connection:
            connection.execute(
                f"INSERT INTO {self._scheduled} "
                "(message_id, destination, deliver_at, envelope, due, owner) "
                "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                (*scheduled_key(envelope), Jsonb(envelope.to_record()), due, owner),
            )

    def _claim_due(
        self, now: datetime.datetime, *, limit: int, lease: float, owner: str | None
    ) -> list[Envelope]:
        mine = "" if owner is None else "AND (owner IS NULL OR owner = %s)"
        with self._connection() as connection:
            rows = connection.execute(
                f"""UPDATE {self._scheduled} SET leased_until = %s
                    WHERE (message_id, destination, deliver_at) IN (
                        SELECT message_id, destination, deliver_at FROM {self._scheduled}
                        WHERE due <= %s AND (leased_until IS NULL OR leased_until <= %s)
                        {mine} ORDER BY due LIMIT %s FOR UPDATE SKIP LOCKED)
                    RETURNING envelope, due""",
                (now + datetime.timedelta(seconds=lease), now, now,
                 *(() if owner is None else (owner,)), limit),
            ).fetchall()
        return [Envelope.from_record(row[0]) for row in sorted(rows, key=lambda row: row[1])]

    def forget_scheduled(self, envelopes: Sequence[Envelope]) -> None:
        if not envelopes:
            return
        ids, destinations, times = (
            list(column) for column in zip(*map(scheduled_key, envelopes), strict=True))
        with self._connection() as connection:
            connection.execute(
                f"DELETE FROM {self._scheduled} WHERE (message_id, destination, deliver_at) IN "
                "(SELECT * FROM unnest(%s::text[], %s::text[], %s::text[]))",
                (ids, destinations, times),
            )

    def note_scheduled_failure(self, envelope: Envelope) -> int:
        with self._connection() as connection:
            row = connection.execute(
                f"UPDATE {self._scheduled} SET attempts = attempts + 1 "
                "WHERE (message_id, destination, deliver_at) = (%s, %s, %s) RETURNING attempts",
                scheduled_key(envelope)).fetchone()
        return 0 if row is None else int(row[0])

    def write_audit(self, records: Sequence[AuditRecord]) -> None:
        if not records:
            return
        with self._connection() as connection, connection.cursor() as cursor:
            cursor.executemany(
                f"INSERT INTO {self._audit} (endpoint, handler, message_id, message_type, "
                "outcome, time_sent, recorded_at, bucket) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                [(r.endpoint, r.handler, r.message_id, r.message_type, r.outcome, r.time_sent,
                  r.recorded_at, r.bucket) for r in records],
            )

    def read_audit(self, *, part: int = 0, parts: int = 1) -> Iterator[AuditRecord]:
        with self._connection() as connection:
            rows = connection.execute(
                f"SELECT endpoint, handler, message_id, message_type, outcome, time_sent, "
                f"recorded_at FROM {self._audit} WHERE bucket %% %s = %s",
                (parts, part),
            ).fetchall()
        return iter([AuditRecord(*row) for row in rows])

    def park(self, parked: ParkedMessage) -> None:
        with self._connection() as connection:
            connection.execute(
                f"INSERT INTO {self._parked} "
                "(parked_id, endpoint, source, envelope, body, parked_at) "
                "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (parked_id) DO NOTHING",
                (parked.parked_id, parked.endpoint, parked.source,
                 envelope_bytes(parked.envelope), body_bytes(parked.envelope),
                 parked.parked_at))

    def parked_messages(self, endpoint: str) -> list[ParkedMessage]:
        with self._connection() as connection:
            rows = connection.execute(
                f"SELECT parked_id, endpoint, source, envelope, body, parked_at "
                f"FROM {self._parked} WHERE endpoint = %s ORDER BY parked_at", (endpoint,),
            ).fetchall()
        return [self._parked_of(row) for row in rows]

    def unpark(self, parked_ids: Sequence[str]) -> int:
        with self._connection() as connection:
            return connection.execute(
                f"DELETE FROM {self._parked} WHERE parked_id = ANY(%s)", (list(parked_ids),),
            ).rowcount

    def parked_page(self, endpoint: str | None, *, after: ParkedKey | None = None,
                    limit: int = 100) -> list[ParkedMessage]:
        at, parked_id = after if after is not None else (None, "")
        with self._connection() as connection:
            rows = connection.execute(
                f"SELECT parked_id, endpoint, source, envelope, body, parked_at "
                f"FROM {self._parked} WHERE (%s::text IS NULL OR endpoint = %s) AND "
                "(%s::timestamptz IS NULL OR (parked_at, parked_id) > (%s, %s)) "
                "ORDER BY parked_at, parked_id LIMIT %s",
                (endpoint, endpoint, at, at, parked_id, limit)).fetchall()
        return [self._parked_of(row) for row in rows]

    def parked_by_ids(self, endpoint: str, parked_ids: Sequence[str]) -> list[ParkedMessage]:
        with self._connection() as connection:
            rows = connection.execute(
                f"SELECT parked_id, endpoint, source, envelope, body, parked_at "
                f"FROM {self._parked} WHERE parked_id = ANY(%s) AND endpoint = %s "
                "ORDER BY parked_at, parked_id", (list(parked_ids), endpoint)).fetchall()
        return [self._parked_of(row) for row in rows]

    @staticmethod
    def _parked_of(row: Sequence[Any]) -> ParkedMessage:
        return ParkedMessage(row[0], row[1], row[2], envelope_from(row[3], row[4]),
                             _utc(row[5]) or row[5])

    def report_status(self, report: StatusReport) -> None:
        with self._connection() as connection:
            connection.execute(
                f"INSERT INTO {self._status} "
                "(endpoint, instance, counters, started_at, updated_at, stopped, problems) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (endpoint, instance) DO UPDATE "
                "SET counters = EXCLUDED.counters, updated_at = EXCLUDED.updated_at, "
                "stopped = EXCLUDED.stopped, problems = EXCLUDED.problems",
                (report.endpoint, report.instance, Jsonb(dict(report.counters)),
                 report.started_at, report.updated_at, report.stopped,
                 Jsonb({k: v.replace("\x00", "") for k, v in report.problems.items()})),
            )

    def status_reports(self, endpoint: str) -> list[StatusReport]:
        with self._connection() as connection:
            rows = connection.execute(
                f"SELECT endpoint, instance, counters, started_at, updated_at, stopped, "
                f"problems FROM {self._status} WHERE endpoint = %s ORDER BY updated_at DESC",
                (endpoint,),
            ).fetchall()
        return [StatusReport(*row) for row in rows]

    def forget_status(self, endpoint: str, *, updated_before: datetime.datetime) -> int:
        with self._connection() as connection:
            return connection.execute(
                f"DELETE FROM {self._status} WHERE endpoint = %s AND updated_at < %s",
                (endpoint, updated_before)).rowcount

    def reserve_rate(self, name: str, *, interval: float, burst: int,
                     now: datetime.datetime) -> float:
        moment = now.timestamp()
        with self._connection() as connection:
            row = connection.execute(
                f"INSERT INTO {self._rates} AS r (name, tat) VALUES (%(name)s, %(tat)s) "
                "ON CONFLICT (name) DO UPDATE SET tat = greatest(r.tat, %(now)s) + %(interval)s "
                "RETURNING tat",
                {"name": name, "now": moment, "interval": interval, "tat": moment + interval},
            ).fetchone()
        assert row is not None
        return max(0.0, float(row[0]) - moment - burst * interval)

    def acquire_slot(self, name: str, *, slots: int, holder: str, lease: float,
                     now: datetime.datetime) -> bool:
        moment = now.timestamp()
        # One transaction, the name's rows locked by an advisory lock on the name: count the
        # live holders, then take a slot; two processes cannot both take the last one.
        with self._connection() as connection, connection.transaction():
            connection.execute("SELECT pg_advisory_xact_lock(%s)", (_advisory_key(
                f"{self._slots}:{name}"),))
            connection.execute(f"DELETE FROM {self._slots} WHERE name = %s AND expires_at <= %s",
                               (name, moment))
            row = connection.execute(
                f"SELECT count(*), count(*) FILTER (WHERE holder = %s) FROM {self._slots} "
                "WHERE name = %s", (holder, name)).fetchone()
            assert row is not None
            if not row[1] and row[0] >= slots:
                return False
            connection.execute(
                f"INSERT INTO {self._slots} (name, holder, expires_at) VALUES (%s, %s, %s) "
                "ON CONFLICT (name, holder) DO UPDATE SET expires_at = EXCLUDED.expires_at",
                (name, holder, moment + lease))
            return True

    def release_slot(self, name: str, holder: str) -> None:
        with self._connection() as connection:
            connection.execute(f"DELETE FROM {self._slots} WHERE name = %s AND holder = %s",
                               (name, holder))

    def put_payload(self, payload_id: str, body: bytes, *,
                    keep_until: datetime.datetime) -> None:
        with self._connection() as connection:
            connection.execute(
                f"INSERT INTO {self._payloads} AS p (payload_id, body, keep_until) "
                "VALUES (%s, %s, %s) ON CONFLICT (payload_id) DO UPDATE SET "
                "body = EXCLUDED.body, keep_until = greatest(p.keep_until, EXCLUDED.keep_until)",
                (payload_id, body, keep_until))

    def get_payload(self, payload_id: str) -> bytes | None:
        with self._connection() as connection:
            row = connection.execute(f"SELECT body FROM {self._payloads} WHERE payload_id = %s",
                                     (payload_id,)).fetchone()
        return None if row is None else bytes(row[0])

    def collect_payloads(self, now: datetime.datetime, *, batch: int = 100) -> int:
        # The holds are a column of the body's row, and the DELETE's own condition is
        # checked again on a row a concurrent hold changed: a held body stays.
        with self._connection() as connection:
            return connection.execute(
                f"DELETE FROM {self._payloads} WHERE payload_id IN (SELECT payload_id FROM "
                f"{self._payloads} WHERE keep_until < %s AND cardinality(holds) = 0 "
                "LIMIT %s FOR UPDATE SKIP LOCKED) AND keep_until < %s "
                "AND cardinality(holds) = 0", (now, batch, now)).rowcount

    def hold_payload(self, payload_id: str, hold_id: str) -> bool:
        with self._connection() as connection:
            return connection.execute(
                f"UPDATE {self._payloads} SET holds = CASE WHEN %s = ANY(holds) THEN holds "
                "ELSE array_append(holds, %s) END WHERE payload_id = %s",
                (hold_id, hold_id, payload_id)).rowcount > 0

    def release_payload(self, hold_id: str, *, keep_until: datetime.datetime) -> bool:
        with self._connection() as connection:
            return connection.execute(
                f"UPDATE {self._payloads} SET holds = array_remove(holds, %s), "
                "keep_until = greatest(keep_until, %s) WHERE holds @> ARRAY[%s]::text[]",
                (hold_id, keep_until, hold_id)).rowcount > 0

    def history(self, aggregate_type: str, aggregate_id: str, *,
                entries: int = 200) -> AggregateRecord:
        """The aggregate's row and its ``entries`` newest processed rows (newest last)."""
        if entries < 0:
            raise ValueError(f"entries cannot be negative, got {entries}")
        with self._connection() as connection:
            row = connection.execute(
                f"SELECT version, state, state_version, completed, updated_at "
                f"FROM {self._aggregates} WHERE aggregate_type = %s AND aggregate_id = %s",
                (aggregate_type, aggregate_id)).fetchone()
            rows = connection.execute(
                f"SELECT key, outgoing, outgoing_ids, dispatched, processed_at, message_type "
                f"FROM {self._processed} WHERE aggregate_type = %s AND aggregate_id = %s "
                "ORDER BY processed_at DESC, key DESC LIMIT %s",
                (aggregate_type, aggregate_id, entries)).fetchall()
        processed = {found[0]: _entry(*found) for found in reversed(rows)}
        newest = next(reversed(processed.values())).at if processed else None
        if row is None:
            return AggregateRecord(aggregate_type, aggregate_id, processed=processed,
                                   updated_at=newest)
        version, state, state_version, completed, updated_at = row
        return _kept_state(AggregateRecord(
            aggregate_type, aggregate_id, version, state, processed,
            updated_at=_utc(updated_at) or newest, completed=bool(completed),
            state_version=state_version))

    def records(self, aggregate_type: str) -> Iterator[AggregateRecord]:
        if aggregate_type != INBOX:
            return self._aggregate_records(aggregate_type)
        with self._connection() as connection:
            rows = connection.execute(
                f"SELECT key, outgoing, outgoing_ids, dispatched, processed_at "
                f"FROM {self._processed} WHERE aggregate_type = %s",
                (INBOX,),
            ).fetchall()
        return iter([
            AggregateRecord(INBOX, row[0], 1, None, {row[0]: _entry(*row)},
                            updated_at=_utc(row[4]))
            for row in rows
        ])

    def _aggregate_records(self, aggregate_type: str) -> Iterator[AggregateRecord]:
        """The aggregates of one type in pages of ``records_page`` (keyset on the primary
        key): memory stays bounded, and no connection is held between pages."""
        after = ""
        while True:
            with self._connection() as connection:
                # Rows committed before updated_at existed: their newest processed row's time.
                rows = connection.execute(
                    f"SELECT a.aggregate_id, a.version, a.state, a.state_version, "
                    "coalesce(a.updated_at, "
                    f"(SELECT max(p.processed_at) FROM {self._processed} p "
                    "WHERE p.aggregate_type = a.aggregate_type "
                    "AND p.aggregate_id = a.aggregate_id)), a.completed "
                    f"FROM {self._aggregates} a WHERE a.aggregate_type = %s "
                    "AND a.aggregate_id > %s ORDER BY a.aggregate_id LIMIT %s",
                    (aggregate_type, after, self.records_page),
                ).fetchall()
            for r in rows:
                yield _kept_state(AggregateRecord(aggregate_type, r[0], r[1], r[2],
                                                  updated_at=_utc(r[4]), state_version=r[3],
                                                  completed=r[5]))
            if len(rows) < self.records_page:
                return
            after = rows[-1][0]

    def aggregate_page(self, aggregate_type: str, *, completed: bool = False,
                       after: str | None = None, limit: int = 50,
                       id_prefix: str = "") -> list[AggregateRecord]:
        """One query along the primary key, without the processed rows."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        with self._connection() as connection:
            rows = connection.execute(
                f"SELECT aggregate_id, version, state, state_version, updated_at "
                f"FROM {self._aggregates} WHERE aggregate_type = %s AND completed = %s "
                "AND aggregate_id > %s AND starts_with(aggregate_id, %s) "
                "ORDER BY aggregate_id LIMIT %s",
                (aggregate_type, completed, after or "", id_prefix, limit)).fetchall()
        return [_kept_state(AggregateRecord(aggregate_type, r[0], r[1], r[2],
                                            updated_at=_utc(r[4]), state_version=r[3],
                                            completed=completed)) for r in rows]

    # -- event journal ------------------------------------------------------------------

    def append_journal(self, entries: Sequence[JournalEntry]) -> None:
        if not entries:
            return
        with self._connection() as connection, connection.transaction():
            self._append_journal(connection, entries)

    def _append_journal(self, connection: psycopg.Connection[Any],
                        entries: Sequence[JournalEntry]) -> None:
        """Append inside the caller's transaction (which holds the journal lock till it
        ends)."""
        rows = [(e.message_id, e.message_type, e.aggregate_type, e.aggregate_id,
                 list(e.parents), Jsonb(dict(e.headers)), e.body) for e in entries]
        # Its own statement, before the inserts: each insert's snapshot then sees every
        # append committed before this one took the lock, so max(position) is the newest.
        connection.execute("SELECT pg_advisory_xact_lock(%s)", (self._journal_lock,))
        with connection.cursor() as cursor:
            cursor.executemany(
                f"INSERT INTO {self._journal} (position, message_id, message_type, "
                "aggregate_type, aggregate_id, parents, headers, body, recorded_at) "
                "SELECT coalesce(max(position), 0) + 1, %s, %s, %s, %s, %s::text[], %s, "
                f"%s, clock_timestamp() FROM {self._journal} "
                "ON CONFLICT (message_id) DO NOTHING",
                rows,
            )

    def read_journal(self, *, after: int, limit: int = 500) -> list[JournalEntry]:
        with self._connection() as connection:
            rows = connection.execute(
                f"SELECT message_id, message_type, headers, body, aggregate_type, aggregate_id, "
                f"parents, recorded_at, position FROM {self._journal} "
                "WHERE position > %s ORDER BY position LIMIT %s",
                (after, limit),
            ).fetchall()
        return [JournalEntry(i, t, dict(headers), body, agg_type, agg_id, tuple(parents),
                             _utc(at), position)
                for i, t, headers, body, agg_type, agg_id, parents, at, position in rows]

    def journal_bounds(self) -> JournalBounds:
        with self._connection() as connection:
            row = connection.execute(
                f"SELECT min(position), max(position) FROM {self._journal}").fetchone()
        oldest, newest = row if row else (None, None)
        return JournalBounds(oldest, newest or 0, journal_size(oldest, newest or 0))

    def journal_position_at(self, moment: datetime.datetime) -> int | None:
        with self._connection() as connection:
            # One statement, one snapshot: the three positions agree with each other.
            row = connection.execute(
                f"SELECT (SELECT max(position) FROM {self._journal}), "
                f"(SELECT min(position) FROM {self._journal}), "
                f"({self._first_since})",
                (moment,),
            ).fetchone()
        newest, oldest, first_since = row if row else (None, None, None)
        return resume_position(newest=newest or 0, oldest=oldest, first_since=first_since)

    def trim_journal(self, before: datetime.datetime, *, batch: int = 1000) -> int:
        with self._connection() as connection:
            # The oldest entries up to the first recorded since ``before``, never the newest
            # (LEAST ignores a NULL: with none recorded since, up to the newest).
            return connection.execute(
                f"DELETE FROM {self._journal} WHERE position IN ("
                f"SELECT position FROM {self._journal} WHERE position < LEAST("
                f"(SELECT max(position) FROM {self._journal}), ({self._first_since})) "
                "ORDER BY position LIMIT %s)",
                (before, batch),
            ).rowcount

    @property
    def _first_since(self) -> str:
        """A query: the position of the first entry recorded at or after its parameter."""
        return (f"SELECT position FROM {self._journal} WHERE recorded_at >= %s "
                "ORDER BY position LIMIT 1")

    # -- connections --------------------------------------------------------------------

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled autocommit connection; driver failures become storage errors by the
        taxonomy of :mod:`idembus.storage.postgres_errors`. A connection that may be attached to a
        read-only standby is closed, so that the pool connects afresh."""
        try:
            if not self._opened:
                with self._opening:
                    if not self._opened:
                        self._pool_attempts.attach()  # one clear line, not one per attempt
                        try:
                            self._pool.open(wait=True, timeout=self._connect_timeout)
                        except PoolTimeout:  # which closes a psycopg pool for good
                            self._pool = _renewed(self._pool)
                            raise
                        self._opened = True
            with self._pool.connection() as pooled, discarding(pooled) as connection:
                yield connection
        except PoolTimeout as exc:
            refusal = login_problem(self.conninfo, self._connect_timeout)
            raise (refusal or classified(exc, redact(self.conninfo))) from exc
        except psycopg.Error as exc:
            raise classified(exc, redact(self.conninfo)) from exc


def _record(aggregate_type: str, aggregate_id: str, row: Any) -> AggregateRecord:
    """The record a load's row describes (none: the aggregate does not exist)."""
    if row is None:
        return AggregateRecord(aggregate_type, aggregate_id)
    (version, documents, state_version, found_key, outgoing, dispatched, at, completed,
     message_type) = row
    state, outgoing_ids = from_json(documents)  # one parse of both (see _documents)
    processed = {}
    if found_key is not None:
        processed[found_key] = _entry(found_key, outgoing, outgoing_ids, dispatched, at,
                                      message_type)
    if completed:
        return _kept_state(AggregateRecord(aggregate_type, aggregate_id, version or 0, state,
                                           processed, completed=True,
                                           state_version=state_version))
    # AggregateRecord(...) of a live record (or none), every field given: a frozen
    # dataclass sets each through object.__setattr__, twice a load of every message.
    record = _new_record(AggregateRecord)
    record.__dict__.update(aggregate_type=aggregate_type, aggregate_id=aggregate_id,
                           version=version or 0, state=state, processed=processed,
                           updated_at=None, completed=False, state_version=state_version,
                           final_state=None)
    return record


def _kept_state(record: AggregateRecord) -> AggregateRecord:
    """``record`` as the contract reads it: a tombstone's ``state`` column holds its last
    state (``final_state``), and a tombstone has no state."""
    if not record.completed:
        return record
    return dataclasses.replace(record, state=None, final_state=record.state)


class _CommitValues(NamedTuple):
    """What a commit writes, as statement parameters."""

    #: The processed row: type, id, key, outgoing records, their ids, dispatched, the
    #: message's type.
    entry: tuple[Any, ...]
    #: The aggregate's new state, or a tombstone's last (``None``: none).
    document: Jsonb | None
    completed: bool
    state_version: int | None

    @classmethod
    def of(cls, pending: PendingCommit) -> _CommitValues:
        loaded, outgoing = pending.loaded, pending.outgoing
        completed = bool(pending.options.get("completed", False))
        return cls(
            entry=(loaded.aggregate_type, loaded.aggregate_id, pending.key,
                   pg_json.jsonb(pg_json.text_json(
                       [envelope.to_record() for envelope in outgoing])),
                   pg_json.jsonb(pg_json.text_json(
                       [envelope.message_id for envelope in outgoing])), not outgoing,
                   pending.options.get("message_type")),
            # A tombstone keeps the state it was given as its last (``final_state``).
            document=Jsonb(dict(pending.state)) if pending.state is not None else None,
            completed=completed,
            state_version=pending.options.get("state_version"),
        )


def _update_group_arguments(commits: Sequence[PendingCommit]) -> tuple[Jsonb]:
    """The rows of ``_update_group``: each aggregate's loaded version, new state and
    processed row."""
    return (pg_json.jsonb_array(_aggregate_row(pending, version=pending.loaded.version)
                                for pending in commits),)


def _create_group_arguments(commits: Sequence[PendingCommit]) -> tuple[Jsonb]:
    """The rows of ``_create_group``: the new aggregates' and their processed rows'."""
    return (pg_json.jsonb_array(_aggregate_row(pending) for pending in commits),)


def _jsonb_of(rows: list[dict[str, Any]]) -> Jsonb:
    """``rows`` (text and numbers) as one ``jsonb`` parameter."""
    return pg_json.jsonb(pg_json.text_json(rows))


def _aggregate_row(pending: PendingCommit, **more: Any) -> str:
    """The aggregate's columns and the processed row of ``pending`` (and ``more``), as
    JSON text; the state written by ``json.dumps``."""
    return pg_json.row_with_state(
        {**_entry_row(pending), "state_version": pending.options.get("state_version"),
         "completed": bool(pending.options.get("completed", False)), **more},
        pending.state)


def _inbox_group_arguments(commits: Sequence[PendingCommit]) -> tuple[Jsonb]:
    """The rows of ``_inbox_group``: the processed rows."""
    return (pg_json.jsonb_array(pg_json.text_json(_entry_row(pending))
                                for pending in commits),)


def _entry_row(pending: PendingCommit) -> dict[str, Any]:
    """The processed row of ``pending`` as a JSON object (what ``_CommitValues.entry``
    holds as parameters)."""
    loaded, outgoing = pending.loaded, pending.outgoing
    return {"aggregate_type": loaded.aggregate_type, "aggregate_id": loaded.aggregate_id,
            "key": pending.key, "outgoing": [envelope.to_record() for envelope in outgoing],
            "outgoing_ids": [envelope.headers[h.MESSAGE_ID] for envelope in outgoing],
            "dispatched": not outgoing, "message_type": pending.options.get("message_type")}


class _Refused(Exception):
    """A commit's conditional write changed nothing (inside a transaction, to roll back)."""

    def __init__(self, row: Any) -> None:
        super().__init__("nothing written")
        self.row = row


def _entry(key: str, outgoing: Any, outgoing_ids: Any, dispatched: Any,
           at: Any, message_type: str | None = None) -> ProcessedMessage:
    # ProcessedMessage(...), every field given, as _record makes its record
    entry = _new_record(ProcessedMessage)
    entry.__dict__.update(
        key=key,
        outgoing=tuple([Envelope.from_record(record) for record in outgoing])
        if outgoing else (),
        outgoing_ids=tuple(outgoing_ids) if outgoing_ids else (),
        dispatched=bool(dispatched),
        at=at,
        attempts=0,
        stored_bytes=0,
        message_type=message_type,
    )
    return entry


#: An instance of a dataclass without its ``__init__``: the caller sets every field.
_new_record = object.__new__


def _has_column(connection: psycopg.Connection[Any], table: str, column: str) -> bool:
    """Whether ``table`` has ``column``. Looked up first because ALTER TABLE takes an
    exclusive lock even when IF NOT EXISTS finds the column: it would wait behind any long
    read of the table, and hold up every commit queued behind it, at each start."""
    row = connection.execute(
        "SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attname = %s "
        "AND NOT attisdropped", (table, column)).fetchone()
    return row is not None


def _utc(moment: datetime.datetime | None) -> datetime.datetime | None:
    """A ``timestamptz`` in UTC, whatever the session's time zone."""
    return moment.astimezone(datetime.timezone.utc) if moment is not None else None


def _renewed(pool: ConnectionPool) -> ConnectionPool:
    """A new, unopened pool with the settings of ``pool``: psycopg closes a pool whose
    first wait timed out, and a closed pool cannot be opened again."""
    return ConnectionPool(pool.conninfo, min_size=pool.min_size, max_size=pool.max_size,
                          open=False, timeout=pool.timeout, kwargs=pool.kwargs,
                          name=pool.name, configure=pg_json.read_quickly)


#: A load's outgoing messages of a processed row: none once they are compacted (an empty
#: array, which ``NULL`` stands for, read without a JSON parse).
_OUTGOING = "NULLIF(p.outgoing, '[]'::jsonb)"


def _documents(state: str) -> str:
    """A load's column of its aggregate's ``state`` and its processed row's outgoing ids,
    as the text of one JSON array: parsed once (:func:`_record`), not twice, each by
    psycopg's JSON loader."""
    return f"jsonb_build_array({state}, p.outgoing_ids)::text"


#: Takes the transaction-level advisory locks of an array (given as its text), in the
#: array's order (a scan of ``unnest`` yields its elements in order, and each is locked as
#: it is read).
_LOCK_IN_ORDER = "SELECT count(pg_advisory_xact_lock(k)) FROM unnest(%s::bigint[]) AS k"
#: What PostgreSQL answers a transaction it rolled back for another's sake.
_LOST_STATES = frozenset({"40P01", "40001"})


def _lost_to_another(error: StorageError) -> bool:
    """Whether ``error`` is a deadlock or a serialization failure (SQLSTATE 40P01, 40001)."""
    return getattr(error.__cause__, "sqlstate", None) in _LOST_STATES


def _advisory_key(name: str) -> int:
    """A bigint advisory-lock key for ``name``, the same in every process (unlike hash())."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)

