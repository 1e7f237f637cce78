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
* A reply queue (``bus.request``) is held by its process's session, and deleted with its
  messages once that session is gone, by the next sweep of a process that consumes a
  reply queue or starts an endpoint (:mod:`.postgres_replies`).
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
``reply_lease``         how often, in seconds, a process consuming a reply queue looks for
                        those of requesters that are gone: every third of it (30)
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import psycopg
from psycopg_pool import PoolTimeout

from .. import headers as h
from ..envelope import Envelope
from ..errors import ConfigurationError
from ..policies import Backoff
from ..redaction import redact
from ..storage.postgres_errors import classified, discarding, login_problem
from .base import Delivery, OrderedKeys, QueueDepth
from .database import MAX_METADATA_BYTES, oversize, transport_error
from .db_engine import Claim, DatabaseTransport, check_times
from .errors import BrokerAccessDenied, DestinationRefused, TransportError
from .postgres_listener import Listener
from .postgres_pool import TransportPool
from .postgres_replies import PostgresReplyQueues
from .postgres_rows import (
    _close_quietly,
    _database_of,
    _PostgresDelivery,
    _seam,
    consumer_connection,
    moved_aside,
)
from .postgres_schema import QueueSchema, cannot_create, channel
from .postgres_statements import (
    COLUMNS,
    NO_DISK_WAIT,
    SIZED_COLUMNS,
    Enqueued,
    QueuePart,
    Statements,
    count_ready,
    ordered_keys,
    queue_depth,
)

log = logging.getLogger(__name__)

__all__ = ["Enqueued", "PostgresTransport", "QueuePart"]


class PostgresTransport(PostgresReplyQueues,
                        DatabaseTransport[_PostgresDelivery, "psycopg.Connection[Any]"]):
    """Transport on PostgreSQL tables; see the module docstring."""

    process_local = False
    connects_per_consumer = True

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
        reply_lease: float = 30.0,
    ) -> None:
        check_times(visibility_timeout, max_idle_wait)
        if not reply_lease > 0:
            raise ConfigurationError(f"reply_lease must be positive seconds, got {reply_lease!r}")
        self.reply_lease = float(reply_lease)
        if pool_size < 1:
            raise ConfigurationError(f"pool_size must be at least 1, got {pool_size}")
        super().__init__()
        self.url = url
        #: The URL as it may be shown: without its password.
        self.safe_url = redact(url)
        self.schema = QueueSchema(table_prefix)
        #: Whether an endpoint whose PostgresStorage is in this database commits, sends and
        #: acknowledges in one transaction (:meth:`shares_database_with`).
        self.shared_transactions = shared_transactions
        self._connect_timeout = connect_timeout
        self._start_engine(url=self.safe_url, visibility_timeout=visibility_timeout,
                           max_idle_wait=max_idle_wait, backoff=reconnect_backoff,
                           name="idembus-postgres-leases")
        try:
            self._pool = TransportPool(url, size=pool_size, connect_timeout=connect_timeout,
                                       name=f"idembus-transport-{table_prefix}")
        except psycopg.ProgrammingError as exc:  # a conninfo libpq cannot parse
            raise ConfigurationError(
                f"transport URL {self.safe_url!r} cannot be used: {redact(str(exc))}; use "
                "postgresql://user:password@host:5432/dbname") from exc
        self._schema_ready = False
        self._consumers: set[psycopg.Connection[Any]] = set()
        self._listeners: dict[str, Listener] = {}
        self._consumers_lock = threading.Lock()
        self._statements = Statements.of(self.schema)

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
                raise cannot_create(missing, refused, self.safe_url) from refused
        self._schema_ready = True

    def drop_tables(self) -> None:
        """Drop the tables and every message in them (tests and samples clean up; works
        after :meth:`close` too)."""
        with _seam(self.url, "dropping the transport's tables"), psycopg.connect(
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
        in autocommit, committed, then the one that wakes the consumers in a transaction
        of its own); the caller looks at what found no queue."""
        if not envelopes:
            return Enqueued(())
        part = self.part(envelopes)
        with connection.pipeline() as pipeline:
            cursor = connection.execute(f"WITH {part.inputs}, {part.effects('true')} "
                                        f"SELECT {part.result}", part.params)
            pipeline.sync()  # else one transaction with the wake-up's synchronous_commit=off
            connection.execute(part.after, part.params)
            row = cursor.fetchone()
        return part.enqueued(row[0] if row else None)

    def part(self, envelopes: Sequence[Envelope], *,
             remove: Delivery | None = None) -> QueuePart:
        """The statement part that inserts ``envelopes`` and deletes ``remove``'s row —
        if it is a delivery of this transport's table (another one, a tool's own, is left
        to be acknowledged as usual); see :class:`QueuePart`."""
        own = self._own(remove)
        return QueuePart.of(self.schema, envelopes, remove=own)

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

    # -- consuming: the engine's primitives ------------------------------------------

    @contextlib.contextmanager
    def _session(self, queue: str) -> Iterator[psycopg.Connection[Any]]:
        """A consumer's own connection, hung up when it ends."""
        connection = self._consumer_connection("consume", queue)
        try:
            yield connection
        finally:
            self._hang_up(connection)

    @contextlib.contextmanager
    def _waiter(self, queue: str) -> Iterator[Listener]:
        """The listener of ``queue`` in this process, joined while the consumer runs."""
        listener = self._listener(queue)
        listener.join()
        try:
            yield listener
        finally:
            listener.leave()

    def _claim(self, session: psycopg.Connection[Any], queue: str,
               limit: int) -> Claim[_PostgresDelivery]:
        """Up to ``limit`` rows, oversized ones moved aside; claim again at once if all
        ``limit`` were claimed (the queue had no more otherwise: what came since has
        notified, and what comes due has its time)."""
        with _seam(self.url, f"consuming {queue!r}", refusal=BrokerAccessDenied):
            deliveries, due, full = self._claim_rows(session, queue, limit,
                                                     move_oversized=True)
        return Claim(deliveries, again=full, due=due)

    def _idle_wait(self, session: psycopg.Connection[Any], queue: str,
                   claim: Claim[_PostgresDelivery]) -> float:
        wait = self.max_idle_wait if claim.due is None else min(claim.due, self.max_idle_wait)
        return max(0.0, wait)

    def _take(self, queue: str, limit: int | None) -> list[_PostgresDelivery]:
        """A tool's claim (see :meth:`inspect`): a body over the queue's limit is read when a
        tool reads it; a message whose headers are too large to read is given back at once
        (a tool that retried it without them would lose them): ``browse`` lists it, and SQL
        removes it."""
        with self._connection(f"taking the messages of {queue!r}") as connection:
            taken, _, _ = self._claim_rows(connection, queue, limit, move_oversized=False)
        unread = [delivery for delivery in taken if delivery.headers_left]
        if unread:
            log.warning("%d message(s) of %r left out: their headers are too large to read "
                        "(see them with browse; remove them with SQL)", len(unread), queue)
            self._give_back(unread)
            taken = [delivery for delivery in taken if not delivery.headers_left]
        for delivery in taken:
            delivery.connection = None  # settled through the pool, from any thread
        return taken

    def _claim_rows(self, connection: psycopg.Connection[Any], queue: str, limit: int | None, *,
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
        rows = connection.execute(self._statements.claim, {
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
        stories = moved_aside(rows, queue, limits)
        connection.execute(self._statements.move, {
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
        connection = consumer_connection(self.url, self._connect_timeout, role, queue)
        with self._consumers_lock:
            self._consumers.add(connection)
        return connection

    def _hang_up(self, connection: psycopg.Connection[Any]) -> None:
        with self._consumers_lock:
            self._consumers.discard(connection)
        _close_quietly(connection)

    # -- settling -----------------------------------------------------------------------

    def _delete_row(self, delivery: _PostgresDelivery) -> None:
        with self._settling(delivery, "acknowledge") as connection:
            connection.execute(self._statements.delete, {
                "id": delivery.row_id, "channel": channel(self.schema.prefix, delivery.queue)})

    def _clear_leases(self, deliveries: Sequence[_PostgresDelivery]) -> None:
        """Clear the leases of ``deliveries`` still held by their claims (they keep their
        places) and wake the queue's idle consumers."""
        first = deliveries[0]
        with self._settling(first, "requeue") as connection:
            connection.execute(
                f"WITH back AS (UPDATE {self.schema.messages} AS m SET leased_until = NULL, "
                "lease = NULL FROM unnest(%s::bigint[], %s::bigint[]) AS d(id, lease) "
                "WHERE m.id = d.id AND m.lease = d.lease RETURNING 1) "
                f"SELECT {NO_DISK_WAIT}, pg_notify(%s, '') WHERE EXISTS (SELECT 1 FROM back)",
                ([d.row_id for d in deliveries], [d.lease for d in deliveries],
                 channel(self.schema.prefix, first.queue)))

    @contextlib.contextmanager
    def _settling(self, delivery: _PostgresDelivery,
                  action: str) -> Iterator[psycopg.Connection[Any]]:
        """The connection that settles ``delivery``: the one its consumer claimed it on
        (in the consumer's thread), else a pooled one."""
        what = f"{action} a message of {delivery.queue!r}"
        own = delivery.connection
        if own is not None and not own.closed:
            with _seam(self.url, what):
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
                f" FOR UPDATE SKIP LOCKED) RETURNING {COLUMNS}", (queue,)).fetchone()
        if row is None:
            return None
        return _PostgresDelivery(self, queue, row, lease=0, settled=True)

    def pending(self, queue: str) -> int:
        """Messages of ``queue`` due and not leased (0 for a queue nobody declared)."""
        with self._connection(f"counting {queue!r}", refusal=BrokerAccessDenied) as connection:
            return count_ready(connection, self.schema, queue)

    def depth(self, queue: str) -> QueueDepth:
        """Ready, leased and delayed rows of ``queue``, and the oldest ready one's wait."""
        with self._connection(f"counting {queue!r}", refusal=BrokerAccessDenied) as connection:
            return queue_depth(connection, self.schema, queue)

    def ordered_keys(self, queue: str) -> OrderedKeys:
        """Keys of ``queue`` in flight and ordered rows waiting (one statement)."""
        with self._connection(f"counting {queue!r}", refusal=BrokerAccessDenied) as connection:
            return ordered_keys(connection, self.schema, queue)

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
                        f"SELECT {SIZED_COLUMNS} FROM {self.schema.messages} AS m WHERE "
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
            with self._pool.connection() as pooled, _seam(self.url, what, refusal=refusal), \
                    discarding(pooled) as connection:
                yield connection
        except PoolTimeout as exc:
            found = login_problem(self.url, self._connect_timeout)
            raise transport_error(found or classified(exc, self.url), what) from exc

    def _disconnect(self) -> None:
        with self._consumers_lock:
            consumers, self._consumers = self._consumers, set()
            listeners, self._listeners = list(self._listeners.values()), {}
        for listener in listeners:
            listener.close()
        for connection in consumers:
            _close_quietly(connection)
        self._pool.close()

