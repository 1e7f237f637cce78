"""A transport whose queues are tables of a PostgreSQL database (psycopg 3, the
``[postgres]`` extra): no broker to run.

Features
========
* One table holds the messages of every queue (:mod:`idembus.transports.postgres_schema`),
  beside the declared queues and the subscriptions. ``declare`` records the queue and
  subscribes it to its event types; it needs no DDL, so a role with only SELECT, INSERT,
  UPDATE and DELETE on the tables can run an endpoint once ``idembus migrate`` (or a start
  by a role that may) created them.
* Competing consumers claim the oldest due messages of their queue with ``FOR UPDATE SKIP
  LOCKED``, up to ``prefetch`` at a time, in one statement that sets their lease
  (``leased_until``, ``lease``). Claims and acknowledgements on a consumer's connection
  are committed without waiting for the disk (``synchronous_commit=off``): one that a crash
  of the database forgets only delivers its message again, which is deduplicated; sends
  and the shared transaction's commits wait for it. A delivery is acknowledged by
  deleting its row, requeued by clearing its lease: it keeps its place in the queue.
  While a delivery is unsettled its lease is renewed every third of
  ``visibility_timeout``; a consumer that dies (SIGKILL) renews nothing, and its messages
  are due again once their leases run out.
* An idle consumer does not poll: its queue's channel is listened on (``LISTEN``, one
  connection per queue and process, :mod:`~idembus.transports.postgres_listener`) and a
  notification wakes one idle consumer thread; a send or a commit that inserted messages
  notifies right after committing (another writer should do the same: ``SELECT
  pg_notify(<channel>, '')``, :func:`~idembus.transports.postgres_schema.channel`), and a
  requeue notifies too. A consumer also wakes when the next delayed message or lease of
  its queue is due, and at least every ``max_idle_wait`` seconds (one cheap query).
* Size before body: a claim returns each row's body size (``octet_length``) and reads a
  body only within the queue's limit (``limit_bodies``: the endpoint's
  ``max_message_bytes``), and headers, content type and encoding only within
  :data:`~idembus.transports.database.MAX_METADATA_BYTES`. A consumer moves the rows over
  them to the endpoint's error queue in one ``UPDATE``: the failure headers are appended
  to the stored JSON text (after the original ones, so they win; beside the original text,
  in ``idembus.wire.original_headers``, where that is not a JSON object), the body stays
  where it is and never reaches this process. ``browse`` and ``inspect`` leave such a body
  in the database until a tool reads that delivery's body (``errors show``/``retry``);
  ``get`` takes a message whole.
* No row stops a queue: the delivery count saturates at 2**31 - 1 and a due time or lease
  of ``'infinity'`` is never waited for, so a claim succeeds whatever a row holds; headers
  that are not a JSON object reach the endpoint, which moves them to the error queue.
* Delayed delivery is native (``native_delay``): a message whose ``idembus.deliver_at``
  is in the future is inserted with that due time (``visible_at``), to the microsecond;
  the delay is reckoned from this process's clock, the due time on the database's.
* Publish/subscribe: ``publish`` inserts one copy for each queue subscribed to the
  event's type or to a type it derives from (``idembus.enclosed_types``), in one
  statement; it returns False when no queue took it.
* Sends are loud: a message to a queue nobody declared is refused
  (``DestinationRefused``), never stored where nobody reads.
* ``send`` and ``publish`` return once the insert is committed (``publisher_confirms``).
* The error queue is a queue like any other: ``inspect`` (lease held and renewed for the
  block, unsettled ones given back in their places) and ``browse`` (a keyset read of the
  rows, nothing taken) serve ``idembus errors``.
* When the endpoint's :class:`~idembus.storage.postgres.PostgresStorage` is in the same
  database, the commit, the outgoing messages and the removal of the incoming one are one
  statement (:mod:`idembus.runtime.shared_transaction`, with :meth:`PostgresTransport.part`).

Failures
========
The SQLSTATE decides, by the taxonomy of :mod:`idembus.storage.postgres_errors`: an outage
(class 08, 57P01 at a restart, 53, ...) is ``TransportUnavailable`` and a consumer waits it
out, reconnecting with backoff; a refused login, a missing table or privilege (28, 42, ...)
is ``BrokerAccessDenied``, the endpoint's to fix; what the database refuses of one message
(22, 54: a body over 1 GB, an impossible due time) is ``DestinationRefused``.

Connection String
=================
``PostgresTransport("postgresql://user@host:5432/dbname")`` (``postgres://`` too, or any
libpq conninfo); ``Endpoint(transport="postgresql://...")`` builds one with the defaults.

Options
=======
``table_prefix``        prefix of the tables (``idembus``: ``idembus_messages``, ...); one
                        per deployment sharing the database, as a virtual host is
``pool_size``           most connections for sends, acknowledgements and tools (4); each
                        consumer holds one more, which it listens on
``connect_timeout``     seconds to wait for a connection (5)
``visibility_timeout``  seconds after which a claimed message whose consumer stopped
                        renewing its lease is delivered again (15)
``max_idle_wait``       most seconds an idle consumer waits without looking (5)
``reconnect_backoff``   waits between a consumer's attempts to reconnect
                        (:class:`idembus.policies.Backoff`)
``shared_transactions`` commit, send and acknowledge in one transaction with a
                        PostgresStorage in the same database (``True``)
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import secrets
import threading
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolTimeout

from .. import headers as h
from .. import wire
from ..envelope import Envelope
from ..errors import ConfigurationError
from ..policies import Backoff
from ..redaction import redact
from ..storage.postgres_errors import (
    classified,
    discarding,
    is_privilege_refusal,
    login_problem,
)
from .base import Delivery, OnDelivery, Transport
from .database import (
    MAX_METADATA_BYTES,
    STORY_TAIL,
    BodyLimits,
    BodyOnDemand,
    LeaseKeeper,
    Reconnects,
    deliver_claimed,
    encode_headers,
    failure_story,
    oversize,
    read_headers,
    routing_names,
    story_at_end,
    transport_error,
)
from .errors import BrokerAccessDenied, DestinationRefused, TransportError, TransportUnavailable
from .postgres_listener import Listener
from .postgres_schema import QueueSchema, channel

log = logging.getLogger(__name__)

#: In a statement of its own (autocommit), lets its transaction commit without waiting for
#: the disk: for what a crash of the database may forget (a notification, a requeue).
_NO_DISK_WAIT = "set_config('synchronous_commit', 'off', true)"
#: The columns :meth:`PostgresTransport.get` returns (a message taken whole), in the order
#: :class:`_PostgresDelivery` reads them.
_COLUMNS = "m.id, m.headers::text, m.body, m.content_type, m.content_encoding, m.deliveries"
#: The bytes of a row's headers, content type and content encoding.
_METADATA = ("(octet_length(m.headers::text) + coalesce(octet_length(m.content_type), 0)"
             " + coalesce(octet_length(m.content_encoding), 0))")
#: The columns a claim or a read returns: :data:`_COLUMNS`, but the body only if it is
#: within ``%(max_body)s`` bytes and the rest only within ``%(max_metadata)s`` (else NULL,
#: never read), then the sizes of the body and of the rest, and, where the headers were not
#: read, their end (where a move aside wrote the failure story: :func:`story_at_end`).
_SIZED_COLUMNS = (
    f"m.id, CASE WHEN {_METADATA} <= %(max_metadata)s THEN m.headers::text END,"
    f" CASE WHEN {_METADATA} <= %(max_metadata)s AND octet_length(m.body) <= %(max_body)s"
    f" THEN m.body END, CASE WHEN {_METADATA} <= %(max_metadata)s THEN m.content_type END,"
    f" CASE WHEN {_METADATA} <= %(max_metadata)s THEN m.content_encoding END, m.deliveries,"
    f" octet_length(m.body), {_METADATA}, CASE WHEN {_METADATA} > %(max_metadata)s"
    f" THEN right(m.headers::text, {STORY_TAIL}) END")
#: Largest value of the ``integer`` column ``deliveries``: the count stops there.
_MAX_DELIVERIES = 2**31 - 1


@dataclass(frozen=True)
class Enqueued:
    """What one insert of envelopes did: copies per envelope, in order, and the queues
    that got any (whose consumers to wake once it committed)."""

    copies: tuple[int, ...]
    queues: tuple[str, ...] = ()

    def refused(self, envelopes: Sequence[Envelope]) -> list[Envelope]:
        """The sent ones (with a destination) that found no declared queue."""
        return [e for e, n in zip(envelopes, self.copies, strict=True)
                if e.destination is not None and n == 0]

    def unrouted(self, envelopes: Sequence[Envelope]) -> list[Envelope]:
        """The published ones no queue subscribed to."""
        return [e for e, n in zip(envelopes, self.copies, strict=True)
                if e.destination is None and n == 0]


@dataclass(frozen=True)
class QueuePart:
    """The transport's part of a statement (named parameters, all ``bus_*``): insert
    ``envelopes`` — each sent one into its destination queue if that queue was declared,
    each published one into every queue subscribed to one of its types — and delete the
    row ``remove`` (or nothing). :meth:`PostgresTransport.enqueue` runs it alone; the
    shared transaction runs it inside the storage's commit statement
    (:mod:`idembus.storage.postgres_shared`), its effects guarded by the commit's write."""

    schema: QueueSchema
    envelopes: tuple[Envelope, ...]
    params: dict[str, Any]

    @property
    def inputs(self) -> str:
        return ("bus_m(ord, headers, body, content_type, content_encoding, delay) AS ("
                "SELECT * FROM unnest(%(bus_ord)s::int[], %(bus_headers)s::text[],"
                " %(bus_body)s::bytea[], %(bus_content_type)s::text[],"
                " %(bus_content_encoding)s::text[], %(bus_delay)s::float8[])), "
                "bus_t(ord, name, published) AS (SELECT * FROM unnest("
                "%(bus_target_ord)s::int[], %(bus_target)s::text[], %(bus_published)s::bool[]))")

    @property
    def precondition(self) -> str:
        """Every sent envelope has a declared queue."""
        return ("NOT EXISTS (SELECT 1 FROM bus_t WHERE NOT bus_t.published AND NOT EXISTS ("
                f"SELECT 1 FROM {self.schema.queues} q WHERE q.name = bus_t.name))")

    def effects(self, guard: str) -> str:
        schema = self.schema
        return (
            f"bus_targets AS (SELECT t.ord, q.name AS queue FROM bus_t t JOIN {schema.queues} q"
            f" ON NOT t.published AND q.name = t.name WHERE {guard} "
            f"UNION SELECT t.ord, s.queue FROM bus_t t JOIN {schema.subscriptions} s"
            f" ON t.published AND s.message_type = t.name WHERE {guard}), "
            f"bus_inserted AS (INSERT INTO {schema.messages}"
            " (queue, headers, body, content_type, content_encoding, visible_at)"
            " SELECT bus_targets.queue, m.headers::json, m.body, m.content_type,"
            " m.content_encoding, clock_timestamp() + m.delay * interval '1 second'"
            " FROM bus_targets JOIN bus_m m USING (ord) ORDER BY m.ord, bus_targets.queue), "
            f"bus_removed AS (DELETE FROM {schema.messages} WHERE id = %(bus_remove)s"
            f" AND {guard})")

    @property
    def after(self) -> str:
        """Wake the consumers of the queues written to (a statement of its own, after the
        commit: see :mod:`.postgres_schema`). Each queue the envelopes may go to is
        notified, written to or not: a consumer woken for nothing claims nothing. A NOTIFY
        gives its transaction an id, whose commit would wait for the disk while holding
        the database's notification lock: this one does not wait (a notification lost in
        a crash of the database only leaves a consumer to look ``max_idle_wait`` later)."""
        schema = self.schema
        return (f"WITH {self.inputs} SELECT {_NO_DISK_WAIT}, pg_notify(%(bus_prefix)s || '_' "
                "|| left(md5(q.queue), 16), '') FROM ("
                f"SELECT q.name AS queue FROM bus_t t JOIN {schema.queues} q"
                " ON NOT t.published AND q.name = t.name "
                f"UNION SELECT s.queue FROM bus_t t JOIN {schema.subscriptions} s"
                " ON t.published AND s.message_type = t.name) AS q")

    @property
    def result(self) -> str:
        """How many copies each envelope got and the queues that got any, as JSON
        ``[[[ordinal, copies], ...], [queue, ...]]``."""
        return ("json_build_array((SELECT coalesce(json_agg(json_build_array(ord, n)), '[]') "
                "FROM (SELECT ord, count(*) AS n FROM bus_targets GROUP BY ord) AS routed), "
                "(SELECT coalesce(json_agg(DISTINCT queue), '[]') FROM bus_targets))")

    def enqueued(self, result: Any) -> Enqueued:
        """What :attr:`result` says, per envelope."""
        routed, queues = result or ((), ())
        copies = {int(ordinal): int(count) for ordinal, count in routed}
        return Enqueued(tuple(copies.get(ordinal, 0) for ordinal in range(len(self.envelopes))),
                        tuple(queues))


class PostgresTransport(BodyLimits, Transport):
    """Transport on PostgreSQL tables; see the module docstring."""

    native_delay = True
    publisher_confirms = True
    process_local = False

    def __init__(
        self,
        url: str,
        *,
        table_prefix: str = "idembus",
        pool_size: int = 4,
        connect_timeout: float = 5.0,
        visibility_timeout: float = 15.0,
        max_idle_wait: float = 5.0,
        reconnect_backoff: Backoff | None = None,
        shared_transactions: bool = True,
    ) -> None:
        if visibility_timeout <= 0 or max_idle_wait <= 0:
            raise ConfigurationError(
                f"visibility_timeout and max_idle_wait must be positive seconds, got "
                f"{visibility_timeout!r} and {max_idle_wait!r}")
        if pool_size < 1:
            raise ConfigurationError(f"pool_size must be at least 1, got {pool_size}")
        super().__init__()
        self.url = url
        #: The URL as it may be shown: without its password.
        self.safe_url = redact(url)
        self.schema = QueueSchema(table_prefix)
        self.visibility_timeout = visibility_timeout
        self.max_idle_wait = max_idle_wait
        #: Whether an endpoint whose PostgresStorage is in this database commits, sends and
        #: acknowledges in one transaction (:meth:`shares_database_with`).
        self.shared_transactions = shared_transactions
        self._connect_timeout = connect_timeout
        self._reconnects = Reconnects(reconnect_backoff, self.safe_url)
        try:
            self._pool = ConnectionPool(
                url, min_size=1, max_size=pool_size, open=False, timeout=connect_timeout,
                kwargs={"autocommit": True, "application_name": "idembus"},
                name=f"idembus-transport-{table_prefix}")
        except psycopg.ProgrammingError as exc:  # a conninfo libpq cannot parse
            raise ConfigurationError(
                f"transport URL {self.safe_url!r} cannot be used: {redact(str(exc))}; use "
                "postgresql://user:password@host:5432/dbname") from exc
        self._opened = False
        self._opening = threading.Lock()
        self._schema_ready = False
        self._leases: LeaseKeeper[_PostgresDelivery] = LeaseKeeper(
            self.renew, visibility_timeout, name="idembus-postgres-leases")
        self._consumers: set[psycopg.Connection[Any]] = set()
        self._listeners: dict[str, Listener] = {}
        self._consumers_lock = threading.Lock()
        schema = self.schema
        # Claims up to a limit; one row more says in how many seconds the next delayed
        # message or lease of the queue is due (NULL: none). Whatever a row holds, the
        # statement succeeds: the count saturates, and a due time of 'infinity' (a row
        # written by another client) is never waited for.
        due = ("visible_at <= clock_timestamp() AND (leased_until IS NULL"
               " OR leased_until <= clock_timestamp())")
        self._claim_sql = (
            f"WITH c AS (SELECT id, visible_at FROM {schema.messages} WHERE queue = %(queue)s"
            f" AND {due} ORDER BY visible_at, id LIMIT %(limit)s FOR UPDATE SKIP LOCKED), "
            f"u AS (UPDATE {schema.messages} AS m SET leased_until = clock_timestamp() +"
            " %(lease)s * interval '1 second', lease = %(token)s,"
            f" deliveries = least(m.deliveries, {_MAX_DELIVERIES - 1}) + 1 FROM c"
            f" WHERE m.id = c.id RETURNING {_SIZED_COLUMNS}, c.visible_at) "
            "SELECT *, NULL::float8 FROM u UNION ALL "
            "SELECT NULL::bigint, NULL::text, NULL::bytea, NULL::text, NULL::text, NULL::int,"
            " NULL::int, NULL::int, NULL::text, NULL::timestamptz, extract(epoch FROM least("
            f"(SELECT min(visible_at) FROM {schema.messages} WHERE queue = %(queue)s"
            " AND visible_at > clock_timestamp() AND isfinite(visible_at)), "
            f"(SELECT min(leased_until) FROM {schema.messages} WHERE queue = %(queue)s"
            " AND visible_at <= clock_timestamp() AND leased_until > clock_timestamp()"
            " AND isfinite(leased_until))) - clock_timestamp())::float8")
        # Moves claimed rows (ids, leases) to an error queue inside the database, their
        # failure headers (JSON members, %(stories)s) written after the original ones —
        # or, where those are not a JSON object, beside their text — body untouched.
        headers = (
            "CASE WHEN json_typeof(m.headers) <> 'object' THEN '{' || d.story"
            " || ', \"idembus.wire.original_headers\": ' || to_json(m.headers::text)::text"
            " || '}' WHEN btrim(m.headers::text, E'{} \\t\\n\\r') = '' THEN '{' || d.story"
            " || '}' ELSE left(rtrim(m.headers::text, E' \\t\\n\\r'), -1) || ', ' || d.story"
            " || '}' END")
        self._move_sql = (
            "WITH d AS (SELECT * FROM unnest(%(ids)s::bigint[], %(leases)s::bigint[],"
            " %(stories)s::text[]) AS d(id, lease, story)), "
            f"moved AS (UPDATE {schema.messages} AS m SET queue = %(error_queue)s,"
            f" headers = ({headers})::json, visible_at = clock_timestamp(),"
            " leased_until = NULL, lease = NULL, deliveries = 0 FROM d"
            " WHERE m.id = d.id AND m.lease = d.lease RETURNING 1) "
            f"SELECT {_NO_DISK_WAIT}, pg_notify(%(channel)s, '') "
            "WHERE EXISTS (SELECT 1 FROM moved)")

    # -- schema -----------------------------------------------------------------------

    def migrate(self) -> bool:
        """Create the tables, index and notify trigger that do not exist (idempotent, safe
        to run concurrently; ``idembus migrate`` runs it)."""
        with self._connection("creating the transport's tables") as connection:
            self.schema.migrate(connection)
        self._schema_ready = True
        return True

    def verify(self) -> None:
        """Check that the tables exist — only reads — and create what is missing when the
        role may. A refused login, or tables this role may not create, fail with
        :class:`~idembus.errors.ConfigurationError` saying what to do."""
        try:
            with self._connection("looking for the transport's tables") as connection:
                missing = self.schema.missing(connection)
        except BrokerAccessDenied as refused:
            raise ConfigurationError(
                f"{refused}; check the role, password and database of the transport URL"
            ) from refused
        if missing:
            try:
                self.migrate()
            except BrokerAccessDenied as refused:
                if is_privilege_refusal(refused):
                    raise ConfigurationError(
                        f"PostgreSQL at {self.safe_url} lacks {', '.join(missing)} and this "
                        f"role may not create them ({refused}); run `idembus migrate "
                        "package.module:endpoint` once with a role that may, then start "
                        "again") from refused
                raise ConfigurationError(
                    f"PostgreSQL at {self.safe_url}: {', '.join(missing)} cannot be created "
                    f"({refused}); a table of that name that idembus did not create is in "
                    "the way: rename or drop it, or give the transport another "
                    "table_prefix") from refused
        self._schema_ready = True

    def drop_tables(self) -> None:
        """Drop the tables and every message in them (tests and samples clean up; works
        after :meth:`close` too)."""
        with _seam(self, "dropping the transport's tables"), psycopg.connect(
                self.url, autocommit=True,
                connect_timeout=max(1, int(self._connect_timeout))) as connection:
            self.schema.drop(connection)
        self._schema_ready = False

    # -- topology ---------------------------------------------------------------------

    def declare(self, queue: str, *, subscriptions: Collection[str] = ()) -> None:
        """Record ``queue`` and subscribe it to ``subscriptions`` (idempotent); the tables
        are checked (and created where they may be) the first time."""
        if not queue:
            raise ConfigurationError("a queue needs a name")
        if not self._schema_ready:
            self.verify()
        schema = self.schema
        with self._connection(f"declaring queue {queue!r}", refusal=BrokerAccessDenied) as c:
            c.execute(f"INSERT INTO {schema.queues} (name) VALUES (%s) ON CONFLICT DO NOTHING",
                      (queue,))
            if subscriptions:
                c.execute(f"INSERT INTO {schema.subscriptions} (message_type, queue) "
                          "SELECT unnest(%s::text[]), %s ON CONFLICT DO NOTHING",
                          (sorted(subscriptions), queue))

    def delete_queue(self, queue: str) -> None:
        """Delete ``queue``, its messages and its subscriptions (tests and samples)."""
        with self._connection(f"deleting queue {queue!r}") as connection:
            for table, column in ((self.schema.messages, "queue"),
                                  (self.schema.subscriptions, "queue"),
                                  (self.schema.queues, "name")):
                connection.execute(f"DELETE FROM {table} WHERE {column} = %s", (queue,))

    # -- sending ----------------------------------------------------------------------

    def send(self, envelope: Envelope) -> None:
        if not envelope.destination:
            raise ValueError(f"message {envelope.headers.get(h.MESSAGE_ID)} has no destination "
                             "queue")
        self._insert(envelope)

    def publish(self, envelope: Envelope) -> bool:
        """Insert a copy for every queue subscribed to one of the event's types; False if
        there was none."""
        return self._insert(envelope) > 0

    def _insert(self, envelope: Envelope) -> int:
        where = (repr(envelope.destination) if envelope.destination
                 else f"the queues subscribed to {envelope.message_type}")
        what = f"putting {envelope.headers.get(h.MESSAGE_ID, 'a message without id')} on {where}"
        with self._connection(what) as connection:
            enqueued = self.enqueue(connection, [envelope])
        if enqueued.refused([envelope]):
            raise DestinationRefused(
                f"no queue {envelope.destination!r} in {self.schema.queues} at {self.safe_url}:"
                " no endpoint declared it (start the endpoint that consumes it, or correct "
                "the route)")
        return enqueued.copies[0]

    def enqueue(self, connection: psycopg.Connection[Any],
                envelopes: Sequence[Envelope]) -> Enqueued:
        """Insert ``envelopes`` on ``connection`` (:class:`QueuePart`, alone: one statement
        in autocommit, then the one that wakes the consumers, in one round trip); the
        caller looks at what found no queue."""
        if not envelopes:
            return Enqueued(())
        part = self.part(envelopes)
        with connection.pipeline():
            cursor = connection.execute(f"WITH {part.inputs}, {part.effects('true')} "
                                        f"SELECT {part.result}", part.params)
            connection.execute(part.after, part.params)
            row = cursor.fetchone()
        return part.enqueued(row[0] if row else None)

    def part(self, envelopes: Sequence[Envelope], *,
             remove: Delivery | None = None) -> QueuePart:
        """The statement part that inserts ``envelopes`` and deletes ``remove``'s row —
        if it is a delivery of this transport's table (another one, a tool's own, is left
        to be acknowledged as usual); see :class:`QueuePart`."""
        remove = self._own(remove)
        now = datetime.datetime.now(datetime.timezone.utc)
        params: dict[str, Any] = {name: [] for name in (
            "bus_ord", "bus_headers", "bus_body", "bus_content_type", "bus_content_encoding",
            "bus_delay", "bus_target_ord", "bus_target", "bus_published")}
        for ordinal, envelope in enumerate(envelopes):
            due = envelope.deliver_at
            for name, value in (
                    ("bus_ord", ordinal), ("bus_headers", encode_headers(envelope.headers)),
                    ("bus_body", envelope.body.encode("utf-8", "surrogateescape")),
                    ("bus_content_type", envelope.content_type),
                    ("bus_content_encoding", envelope.content_encoding),
                    ("bus_delay", max(0.0, (due - now).total_seconds()) if due else 0.0)):
                params[name].append(value)
            for target in _targets(envelope):
                params["bus_target_ord"].append(ordinal)
                params["bus_target"].append(target)
                params["bus_published"].append(envelope.destination is None)
        params["bus_remove"] = remove.row_id if remove is not None else None
        params["bus_prefix"] = self.schema.prefix
        return QueuePart(self.schema, tuple(envelopes), params)

    def removed(self, delivery: Delivery) -> None:
        """``delivery``'s row was deleted by a transaction that committed: acknowledging or
        requeueing it has nothing left to do, and its lease is no longer renewed."""
        own = self._own(delivery)
        if own is not None:
            own.removed = True
            self._leases.drop([own])

    def _own(self, delivery: Delivery | None) -> _PostgresDelivery | None:
        """``delivery`` if it is a row of this transport's messages table."""
        if (isinstance(delivery, _PostgresDelivery) and not delivery.settled
                and delivery.table == self.schema.messages):
            return delivery
        return None

    def shares_database_with(self, storage: object) -> bool:
        """Whether ``storage`` is a :class:`~idembus.storage.postgres.PostgresStorage` in
        this transport's database (same host, port, database and role), so that a handler's
        commit, its outgoing messages and the removal of the incoming one can be one
        transaction (:mod:`idembus.runtime.shared_transaction`); never with
        ``shared_transactions=False``."""
        from ..storage.postgres import PostgresStorage

        return (self.shared_transactions and isinstance(storage, PostgresStorage)
                and _database_of(storage.conninfo) == _database_of(self.url))

    # -- consuming --------------------------------------------------------------------

    def consume(
        self, queue: str, on_delivery: OnDelivery, *, stop: threading.Event, prefetch: int = 1
    ) -> None:
        """See the contract; outages are waited out here (reconnecting with backoff), and a
        refusal only an operator can end (``BrokerAccessDenied``) is raised."""
        listener = self._listener(queue)
        listener.join()
        try:
            failures = 0
            while not stop.is_set():
                try:
                    connection = self._consumer_connection("consume", queue)
                except BrokerAccessDenied:
                    raise
                except TransportUnavailable as exc:
                    failures = self._reconnects.pause(queue, exc, failures, stop)
                    continue
                try:
                    failures = 0
                    self._consume_on(connection, listener, on_delivery, stop, max(1, prefetch))
                except BrokerAccessDenied:
                    raise
                except TransportUnavailable as exc:
                    failures = self._reconnects.pause(queue, exc, failures, stop)
                finally:
                    self._hang_up(connection)
        finally:
            listener.leave()

    def _consume_on(self, connection: psycopg.Connection[Any], listener: Listener,
                    on_delivery: OnDelivery, stop: threading.Event, prefetch: int) -> None:
        queue = listener.queue
        while not stop.is_set():
            with _seam(self, f"consuming {queue!r}", refusal=BrokerAccessDenied):
                deliveries, due, full = self._claim(connection, queue, prefetch,
                                                    move_oversized=True)
            if full:
                listener.pass_on()  # more may be waiting: another idle consumer looks
            deliver_claimed(deliveries, on_delivery, stop, self._give_back)
            if not full:
                # The queue had no more when claimed: what came since has notified, and
                # what comes due has its time (no claim that would find nothing)
                wait = self.max_idle_wait if due is None else min(due, self.max_idle_wait)
                listener.wait(max(0.0, wait), stop)

    def _claim(self, connection: psycopg.Connection[Any], queue: str, limit: int | None, *,
               move_oversized: bool) -> tuple[list[_PostgresDelivery], float | None, bool]:
        """Up to ``limit`` due messages of ``queue`` (every one for ``None``), leased to
        this process, oldest due first (their leases are renewed until they are settled),
        the seconds until the next delayed message or lease is due, if any, and whether
        ``limit`` were claimed. Their sizes come first: a body over the queue's
        :class:`~idembus.transports.database.BodyLimit` (or headers over
        :data:`~idembus.transports.database.MAX_METADATA_BYTES`) is not read; such a
        message is moved to the error queue inside the database (``move_oversized``: a
        consumer), or delivered with its body left there (a tool)."""
        token = secrets.randbits(63)
        limits = self.body_limit(queue)
        rows = connection.execute(self._claim_sql, {
            "queue": queue, "limit": limit, "lease": self.visibility_timeout,
            "token": token, "max_body": limits.max_bytes,
            "max_metadata": MAX_METADATA_BYTES}).fetchall()
        due = next((row[-1] for row in rows if row[0] is None), None)
        claimed = sorted((row for row in rows if row[0] is not None),
                         key=lambda row: (row[-2], row[0]))
        full = limit is not None and len(claimed) == limit
        if move_oversized and limits.error_queue != queue:
            oversized = [row for row in claimed
                         if oversize(row[6], row[7], limits.max_bytes) is not None]
            if oversized:
                self._move_aside(connection, queue, oversized, token)
                moved = {row[0] for row in oversized}
                claimed = [row for row in claimed if row[0] not in moved]
        deliveries = [_PostgresDelivery(self, queue, row[:-2], lease=token,
                                        connection=connection) for row in claimed]
        self._leases.hold(deliveries)
        return deliveries, due, full

    def _move_aside(self, connection: psycopg.Connection[Any], queue: str,
                    rows: Sequence[Sequence[Any]], lease: int) -> None:
        """Move the claimed ``rows`` (sizes and what was read) to ``queue``'s error queue
        in one statement, with their failure headers; their bodies never leave the
        database."""
        limits = self.body_limit(queue)
        stories = []
        for row in rows:
            reason = oversize(row[6], row[7], limits.max_bytes) or "too large"
            headers, _ = read_headers(row[1], row[4]) if row[1] is not None else ({}, None)
            story = failure_story(headers, f"{reason} (moved to {limits.error_queue!r} by "
                                  "the database, unread)", queue=queue)
            stories.append(encode_headers(story)[1:-1])
            log.warning("moved %s from %r to %r inside the database, unread: %s",
                        wire.shown(headers.get(h.MESSAGE_ID, "a message without id")), queue,
                        limits.error_queue, reason)
        connection.execute(self._move_sql, {
            "ids": [row[0] for row in rows], "leases": [lease] * len(rows),
            "stories": stories, "error_queue": limits.error_queue,
            "channel": channel(self.schema.prefix, limits.error_queue)})

    def _listener(self, queue: str) -> Listener:
        """The listener of ``queue`` in this process (one for all its consumer threads)."""
        with self._consumers_lock:
            listener = self._listeners.get(queue)
            if listener is None:
                listener = self._listeners[queue] = Listener(
                    queue, channel(self.schema.prefix, queue),
                    connect=lambda role: self._consumer_connection(role, queue),
                    reconnects=self._reconnects)
            return listener

    def _consumer_connection(self, role: str, queue: str) -> psycopg.Connection[Any]:
        """A connection of its own for a consumer (``role`` ``consume``) or the listener
        (``listen``) of ``queue``, named ``idembus <role> <queue>`` in
        ``pg_stat_activity``."""
        if not self._schema_ready:
            self.verify()
        try:
            connection = psycopg.connect(
                self.url, autocommit=True, connect_timeout=max(1, int(self._connect_timeout)),
                application_name=f"idembus {role} {queue}"[:63])
        except psycopg.Error as exc:
            raise transport_error(classified(exc, self.url), f"consuming {queue!r}") from exc
        try:
            # Claims and acknowledgements need not wait for the disk: one a crash of the
            # database forgets only delivers its message again, which is deduplicated.
            connection.execute("SET synchronous_commit TO off")
        except psycopg.Error as exc:
            _close_quietly(connection)
            raise transport_error(classified(exc, self.url), f"consuming {queue!r}") from exc
        with self._consumers_lock:
            self._consumers.add(connection)
        return connection

    def _hang_up(self, connection: psycopg.Connection[Any]) -> None:
        with self._consumers_lock:
            self._consumers.discard(connection)
        _close_quietly(connection)

    # -- settling -----------------------------------------------------------------------

    def _delete(self, delivery: _PostgresDelivery) -> None:
        with self._settling(delivery, "acknowledge") as connection:
            connection.execute(f"DELETE FROM {self.schema.messages} WHERE id = %s",
                               (delivery.row_id,))
        self._leases.drop([delivery])

    def _give_back(self, deliveries: Sequence[_PostgresDelivery]) -> None:
        """Clear the leases of ``deliveries`` still held by their claims (they keep their
        places) and wake the queue's idle consumers."""
        if not deliveries:
            return
        first = deliveries[0]
        with self._settling(first, "requeue") as connection:
            connection.execute(
                f"WITH back AS (UPDATE {self.schema.messages} AS m SET leased_until = NULL, "
                "lease = NULL FROM unnest(%s::bigint[], %s::bigint[]) AS d(id, lease) "
                "WHERE m.id = d.id AND m.lease = d.lease RETURNING 1) "
                f"SELECT {_NO_DISK_WAIT}, pg_notify(%s, '') WHERE EXISTS (SELECT 1 FROM back)",
                ([d.row_id for d in deliveries], [d.lease for d in deliveries],
                 channel(self.schema.prefix, first.queue)))
        self._leases.drop(deliveries)

    @contextlib.contextmanager
    def _settling(self, delivery: _PostgresDelivery,
                  action: str) -> Iterator[psycopg.Connection[Any]]:
        """The connection that settles ``delivery``: the one its consumer claimed it on
        (in the consumer's thread), else a pooled one."""
        what = f"{action} a message of {delivery.queue!r}"
        own = delivery.connection
        if own is not None and not own.closed:
            with _seam(self, what):
                yield own
            return
        with self._connection(what) as connection:
            yield connection

    def renew(self, deliveries: Sequence[_PostgresDelivery]) -> None:
        """Extend the leases of ``deliveries`` that their claims still hold (its
        :class:`~idembus.transports.database.LeaseKeeper` calls this every third of
        ``visibility_timeout``)."""
        with self._connection("renewing leases") as connection:
            connection.execute(
                f"UPDATE {self.schema.messages} AS m SET leased_until = clock_timestamp() + %s "
                "* interval '1 second' FROM unnest(%s::bigint[], %s::bigint[]) AS d(id, lease) "
                "WHERE m.id = d.id AND m.lease = d.lease",
                (self.visibility_timeout, [d.row_id for d in deliveries],
                 [d.lease for d in deliveries]))

    # -- tools ------------------------------------------------------------------------

    def get(self, queue: str) -> Delivery | None:
        with self._connection(f"taking a message of {queue!r}") as connection:
            row = connection.execute(
                f"DELETE FROM {self.schema.messages} AS m WHERE id = ("
                f"SELECT id FROM {self.schema.messages} WHERE queue = %s"
                " AND visible_at <= clock_timestamp() AND (leased_until IS NULL"
                " OR leased_until <= clock_timestamp()) ORDER BY visible_at, id LIMIT 1"
                f" FOR UPDATE SKIP LOCKED) RETURNING {_COLUMNS}", (queue,)).fetchone()
        if row is None:
            return None
        return _PostgresDelivery(self, queue, row, lease=0, settled=True)

    def pending(self, queue: str) -> int:
        """Messages of ``queue`` due and not leased (0 for a queue nobody declared)."""
        with self._connection(f"counting {queue!r}", refusal=BrokerAccessDenied) as connection:
            row = connection.execute(
                f"SELECT count(*) FROM {self.schema.messages} WHERE queue = %s"
                " AND visible_at <= clock_timestamp() AND (leased_until IS NULL"
                " OR leased_until <= clock_timestamp())", (queue,)).fetchone()
        return int(row[0]) if row else 0

    @contextlib.contextmanager
    def inspect(self, queue: str, *, limit: int | None = None) -> Iterator[list[Delivery]]:
        """The messages due in ``queue`` now, claimed (their leases renewed while the block
        runs); see the contract. Those left unsettled go back to their places; had the
        process died, they would be due again after ``visibility_timeout``. A body over the
        queue's limit is read when a tool reads it; a message whose headers are too large
        to read is given back at once (a tool that retried it without them would lose
        them): ``browse`` lists it, and SQL removes it."""
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be at least 0, got {limit}")
        if limit == 0:
            yield []
            return
        with self._connection(f"taking the messages of {queue!r}") as connection:
            taken, _, _ = self._claim(connection, queue, limit, move_oversized=False)
        unread = [delivery for delivery in taken if delivery.headers_left]
        if unread:
            log.warning("%d message(s) of %r left out: their headers are too large to read "
                        "(see them with browse; remove them with SQL)", len(unread), queue)
            self._give_back(unread)
            taken = [delivery for delivery in taken if not delivery.headers_left]
        for delivery in taken:
            delivery.connection = None  # settled through the pool, from any thread
        try:
            yield list(taken)
        finally:
            self._give_back([delivery for delivery in taken if not delivery.settled])

    @contextlib.contextmanager
    def browse(self, queue: str, *, page: int = 100) -> Iterator[Iterator[Delivery]]:
        """Read the messages stored in ``queue`` now (due, delayed or in flight), each once,
        oldest first, holding at most ``page`` at a time; nothing is taken, and the
        deliveries are for reading only (settled)."""
        if page < 1:
            raise ValueError(f"page must be at least 1, got {page}")
        with self._connection(f"reading {queue!r}") as connection:
            row = connection.execute(
                f"SELECT max(id) FROM {self.schema.messages} WHERE queue = %s",
                (queue,)).fetchone()
        last = row[0] if row and row[0] is not None else 0

        max_body = self.body_limit(queue).max_bytes

        def read() -> Iterator[Delivery]:
            after = 0
            while after < last:
                with self._connection(f"reading {queue!r}") as connection:
                    rows = connection.execute(
                        f"SELECT {_SIZED_COLUMNS} FROM {self.schema.messages} AS m WHERE "
                        "queue = %(queue)s AND id > %(after)s AND id <= %(last)s ORDER BY id"
                        " LIMIT %(page)s", {
                            "queue": queue, "after": after, "last": last, "page": page,
                            "max_body": max_body, "max_metadata": MAX_METADATA_BYTES,
                        }).fetchall()
                if not rows:
                    return
                after = rows[-1][0]
                for found in rows:
                    yield _PostgresDelivery(self, queue, found, lease=0, settled=True)

        yield read()

    def _body_of(self, row_id: int, queue: str) -> bytes:
        """The body of the row ``row_id``, read now (a tool asked for a body that a claim
        or read left in the database)."""
        with self._connection(f"reading a body of {queue!r}") as connection:
            row = connection.execute(f"SELECT body FROM {self.schema.messages} WHERE id = %s",
                                     (row_id,)).fetchone()
        if row is None:
            raise DestinationRefused(f"the message is no longer in {queue!r}: its body "
                                     "cannot be read")
        return bytes(row[0])

    # -- connections --------------------------------------------------------------------

    @contextlib.contextmanager
    def _connection(self, what: str, *, refusal: type[TransportError] = DestinationRefused,
                    ) -> Iterator[psycopg.Connection[Any]]:
        """A pooled autocommit connection; the database's failures become transport errors
        (``refusal`` for what it refuses of the work itself)."""
        try:
            if not self._opened:
                with self._opening:
                    if not self._opened:
                        self._pool.open(wait=True, timeout=self._connect_timeout)
                        self._opened = True
            with self._pool.connection() as pooled, _seam(self, what, refusal=refusal), \
                    discarding(pooled) as connection:
                yield connection
        except PoolTimeout as exc:
            found = login_problem(self.url, self._connect_timeout)
            raise transport_error(found or classified(exc, self.url), what) from exc

    def close(self) -> None:
        self._leases.close()
        with self._consumers_lock:
            consumers, self._consumers = self._consumers, set()
            listeners, self._listeners = list(self._listeners.values()), {}
        for listener in listeners:
            listener.close()
        for connection in consumers:
            _close_quietly(connection)
        with self._opening:
            if self._opened:
                self._pool.close()
                self._opened = False


class _PostgresDelivery(BodyOnDemand, Delivery):
    """A row of the messages table, claimed (or read): the columns of :data:`_COLUMNS`,
    or of :data:`_SIZED_COLUMNS` (a body or headers not read are fetched on demand)."""

    def __init__(self, transport: PostgresTransport, queue: str, row: Sequence[Any], *,
                 lease: int, connection: psycopg.Connection[Any] | None = None,
                 settled: bool = False) -> None:
        row_id, raw_headers, body, content_type, content_encoding, deliveries = row[:6]
        body_size, metadata_size, tail = row[6:9] if len(row) >= 9 else (None, None, None)
        unread = (oversize(None, metadata_size, MAX_METADATA_BYTES)
                  if raw_headers is None else None)
        headers, problem = ((story_at_end(tail), unread) if unread
                            else read_headers(raw_headers, content_encoding))
        super().__init__(queue=queue, headers=headers,
                         body=b"" if body is None else bytes(body),
                         content_type=content_type, content_encoding=content_encoding,
                         redelivered=int(deliveries) > 1, wire_error=problem)
        if body is None and body_size is not None:
            self.leave_body(body_size, lambda: transport._body_of(row_id, queue))
        #: Its headers were too large to read: :attr:`headers` holds only the failure
        #: story found at their end, if any.
        self.headers_left = unread is not None
        self.settled = settled
        #: The row's id and the claim's lease token.
        self.row_id: int = row_id
        self.lease = lease
        #: The consumer connection it was claimed on (``None``: settled through the pool).
        self.connection = connection
        self._transport = transport
        #: The table its row is in.
        self.table = transport.schema.messages
        #: Its row was deleted by a committed transaction (the shared transaction).
        self.removed = False

    def _ack(self) -> None:
        if not self.removed:
            self._transport._delete(self)

    def _requeue(self) -> None:
        if not self.removed:
            self._transport._give_back([self])


@contextlib.contextmanager
def _seam(transport: PostgresTransport, what: str, *,
          refusal: type[TransportError] = DestinationRefused) -> Iterator[None]:
    """The driver's failures met while doing ``what``, as transport errors; ``refusal``
    stands for what the database refuses that is not an outage or the endpoint's."""
    try:
        yield
    except psycopg.Error as exc:
        error = transport_error(classified(exc, transport.url), what)
        if isinstance(error, DestinationRefused) and refusal is not DestinationRefused:
            error = refusal(str(error))
        raise error from exc
    except UnicodeEncodeError as exc:  # text the database cannot hold as UTF-8
        raise refusal(f"{what}: {exc}") from exc


def _targets(envelope: Envelope) -> list[str]:
    """The queue a sent envelope goes to, or the type names a published one is routed by."""
    return [envelope.destination] if envelope.destination is not None else routing_names(
        envelope)


def _database_of(conninfo: str) -> tuple[str, str, str, str]:
    """Host, port, database and role a conninfo names (libpq's defaults where absent)."""
    try:
        parts = conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        return (conninfo, "", "", "")
    user = str(parts.get("user") or "")
    return (str(parts.get("host") or ""), str(parts.get("port") or "5432"),
            str(parts.get("dbname") or user), user)


def _close_quietly(connection: psycopg.Connection[Any]) -> None:
    try:
        connection.close()
    except Exception:  # closing a broken connection may raise; nothing to do about it
        log.debug("closing a PostgreSQL connection failed", exc_info=True)
