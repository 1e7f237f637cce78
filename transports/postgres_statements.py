"""The statements of the PostgreSQL transport (:mod:`idembus.transports.postgres`): the
columns a claim or a read returns (sizes before bodies), the claim, the move aside of
oversized or malformed rows, and :class:`QueuePart` — the insert of envelopes and the
delete of a delivery's row, run alone or inside the storage's commit (the shared
transaction)."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import headers as h
from ..envelope import Envelope
from ..routing import base_queue
from .base import OrderedKeys, QueueDepth
from .database import STORY_TAIL, encode_headers, routing_names
from .postgres_schema import QueueSchema

if TYPE_CHECKING:
    from .postgres_rows import _PostgresDelivery

#: In a statement of its own (autocommit), lets its transaction commit without waiting for
#: the disk: for what a crash of the database may forget (a notification, a requeue).
NO_DISK_WAIT = "set_config('synchronous_commit', 'off', true)"
#: The columns :meth:`~idembus.transports.postgres.PostgresTransport.get` returns (a
#: message taken whole), in the order :class:`~.postgres_rows._PostgresDelivery` reads them.
COLUMNS = "m.id, m.headers::text, m.body, m.content_type, m.content_encoding, m.deliveries"
#: The bytes of a row's headers, content type and content encoding.
METADATA = ("(octet_length(m.headers::text) + coalesce(octet_length(m.content_type), 0)"
            " + coalesce(octet_length(m.content_encoding), 0))")
#: The columns a claim or a read returns: :data:`COLUMNS`, but the body only if it is
#: within ``%(max_body)s`` bytes and the rest only within ``%(max_metadata)s`` (else NULL,
#: never read), then the sizes of the body and of the rest, and, where the headers were not
#: read, their end (where a move aside wrote the failure story: :func:`~.database.story_at_end`).
SIZED_COLUMNS = (
    f"m.id, CASE WHEN {METADATA} <= %(max_metadata)s THEN m.headers::text END,"
    f" CASE WHEN {METADATA} <= %(max_metadata)s AND octet_length(m.body) <= %(max_body)s"
    f" THEN m.body END, CASE WHEN {METADATA} <= %(max_metadata)s THEN m.content_type END,"
    f" CASE WHEN {METADATA} <= %(max_metadata)s THEN m.content_encoding END, m.deliveries,"
    f" octet_length(m.body), {METADATA}, CASE WHEN {METADATA} > %(max_metadata)s"
    f" THEN right(m.headers::text, {STORY_TAIL}) END")
#: Largest value of the ``integer`` column ``deliveries``: the count stops there.
MAX_DELIVERIES = 2**31 - 1


@dataclass(frozen=True)
class Statements:
    """The statements of one set of tables that a consumer runs again and again."""

    #: Claims up to ``%(limit)s`` due rows of ``%(queue)s`` under the lease ``%(token)s``.
    claim: str
    #: Moves claimed rows to ``%(error_queue)s`` with their failure headers.
    move: str
    #: Deletes the row ``%(id)s`` (an acknowledgement); if it was an ordered message, wakes
    #: the queue's idle consumers (``%(channel)s``): the next message of its key is free.
    delete: str

    @classmethod
    def of(cls, schema: QueueSchema) -> Statements:
        """The statements on ``schema``'s tables."""
        # Claims up to a limit; one row more says in how many seconds the next delayed
        # message or lease of the queue is due (NULL: none). Whatever a row holds, the
        # statement succeeds: the count saturates, and a due time of 'infinity' (a row
        # written by another client) is never waited for.
        due = ("visible_at <= clock_timestamp() AND (leased_until IS NULL"
               " OR leased_until <= clock_timestamp())")
        # An ordered message (its ordering_key, the idembus.ordering.key header as the
        # sender wrote it) is claimed only when no older row of its key is left in its
        # queue: none waiting, none claimed and not yet settled.
        first_of_key = (
            f"(m.ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {schema.messages} o"
            " WHERE o.queue = %(queue)s AND o.ordering_key = m.ordering_key"
            " AND o.id < m.id))")
        claim = (
            f"WITH c AS (SELECT id, visible_at FROM {schema.messages} m WHERE queue = %(queue)s"
            f" AND {due} AND {first_of_key} ORDER BY visible_at, id LIMIT %(limit)s"
            " FOR UPDATE SKIP LOCKED), "
            f"u AS (UPDATE {schema.messages} AS m SET leased_until = clock_timestamp() +"
            " %(lease)s * interval '1 second', lease = %(token)s,"
            f" deliveries = least(m.deliveries, {MAX_DELIVERIES - 1}) + 1 FROM c"
            f" WHERE m.id = c.id RETURNING {SIZED_COLUMNS}, c.visible_at) "
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
        move = (
            "WITH d AS (SELECT * FROM unnest(%(ids)s::bigint[], %(leases)s::bigint[],"
            " %(stories)s::text[]) AS d(id, lease, story)), "
            f"moved AS (UPDATE {schema.messages} AS m SET queue = %(error_queue)s,"
            f" headers = ({headers})::json, visible_at = clock_timestamp(),"
            " leased_until = NULL, lease = NULL, deliveries = 0, ordering_key = NULL FROM d"
            " WHERE m.id = d.id AND m.lease = d.lease RETURNING 1) "
            f"SELECT {NO_DISK_WAIT}, pg_notify(%(channel)s, '') "
            "WHERE EXISTS (SELECT 1 FROM moved)")
        delete = (f"WITH gone AS (DELETE FROM {schema.messages} WHERE id = %(id)s"
                  " RETURNING ordering_key) SELECT pg_notify(%(channel)s, '') FROM gone"
                  " WHERE ordering_key IS NOT NULL")
        return cls(claim, move, delete)


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
    row ``remove`` (or nothing). :meth:`~idembus.transports.postgres.PostgresTransport.enqueue`
    runs it alone; the shared transaction runs it inside the storage's commit statement
    (:mod:`idembus.storage.postgres_shared`), its effects guarded by the commit's write."""

    schema: QueueSchema
    envelopes: tuple[Envelope, ...]
    params: dict[str, Any]

    @classmethod
    def of(cls, schema: QueueSchema, envelopes: Sequence[Envelope], *,
           remove: _PostgresDelivery | None) -> QueuePart:
        """The part that inserts ``envelopes`` into ``schema``'s tables and deletes the row
        of ``remove`` (``None``: none); if that is an ordered message, its queue's idle
        consumers are woken after the commit too (the next message of its key is free)."""
        now = datetime.datetime.now(datetime.timezone.utc)
        params: dict[str, Any] = {name: [] for name in (
            "bus_ord", "bus_headers", "bus_body", "bus_content_type", "bus_content_encoding",
            "bus_delay", "bus_key", "bus_target_ord", "bus_target", "bus_published")}
        for ordinal, envelope in enumerate(envelopes):
            due = envelope.deliver_at
            for name, value in (
                    ("bus_ord", ordinal), ("bus_headers", encode_headers(envelope.headers)),
                    ("bus_body", envelope.body.encode("utf-8", "surrogateescape")),
                    ("bus_content_type", envelope.content_type),
                    ("bus_content_encoding", envelope.content_encoding),
                    ("bus_delay", max(0.0, (due - now).total_seconds()) if due else 0.0),
                    ("bus_key", envelope.headers.get(h.ORDERING_KEY)
                     if envelope.destination is not None else None)):
                params[name].append(value)
            for target in _targets(envelope):
                params["bus_target_ord"].append(ordinal)
                params["bus_target"].append(target)
                params["bus_published"].append(envelope.destination is None)
        params["bus_remove"] = remove.row_id if remove is not None else None
        params["bus_wake"] = (remove.queue if remove is not None
                              and h.ORDERING_KEY in remove.headers else None)
        params["bus_prefix"] = schema.prefix
        return cls(schema, tuple(envelopes), params)

    @property
    def inputs(self) -> str:
        return ("bus_m(ord, headers, body, content_type, content_encoding, delay, key) AS ("
                "SELECT * FROM unnest(%(bus_ord)s::int[], %(bus_headers)s::text[],"
                " %(bus_body)s::bytea[], %(bus_content_type)s::text[],"
                " %(bus_content_encoding)s::text[], %(bus_delay)s::float8[],"
                " %(bus_key)s::text[])), "
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
            " (queue, headers, body, content_type, content_encoding, visible_at, ordering_key)"
            " SELECT bus_targets.queue, m.headers::json, m.body, m.content_type,"
            " m.content_encoding, clock_timestamp() + m.delay * interval '1 second', m.key"
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
        a crash of the database only leaves a consumer to look ``max_idle_wait`` later).
        Pipelined, it must follow a sync: the statements up to one are one implicit
        transaction, and the commit before it must wait for the disk and the standby."""
        schema = self.schema
        return (f"WITH {self.inputs} SELECT {NO_DISK_WAIT}, pg_notify(%(bus_prefix)s || '_' "
                "|| left(md5(q.queue), 16), '') FROM ("
                f"SELECT q.name AS queue FROM bus_t t JOIN {schema.queues} q"
                " ON NOT t.published AND q.name = t.name "
                f"UNION SELECT s.queue FROM bus_t t JOIN {schema.subscriptions} s"
                " ON t.published AND s.message_type = t.name "
                "UNION SELECT %(bus_wake)s::text WHERE %(bus_wake)s::text IS NOT NULL) AS q")

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



def _targets(envelope: Envelope) -> list[str]:
    """The queue a sent envelope goes to — an endpoint's own for one of its partition
    queues: ordered messages are ordered by key in it — or the type names a published one
    is routed by."""
    return [base_queue(envelope.destination)] if envelope.destination is not None else (
        routing_names(envelope))


#: Due and not leased: what a consumer may claim now (``m`` is the messages table).
_READY = ("m.visible_at <= clock_timestamp() AND (m.leased_until IS NULL"
          " OR m.leased_until <= clock_timestamp())")
_LEASED = "m.leased_until > clock_timestamp()"


def count_ready(connection: Any, schema: QueueSchema, queue: str) -> int:
    """The messages of ``queue`` due and not leased (0 for a queue nobody declared)."""
    row = connection.execute(
        f"SELECT count(*) FROM {schema.messages} m WHERE m.queue = %s AND {_READY}",
        (queue,)).fetchone()
    return int(row[0]) if row else 0


def queue_depth(connection: Any, schema: QueueSchema, queue: str) -> QueueDepth:
    """Ready, leased (unacknowledged) and delayed messages of ``queue`` and how long the
    oldest ready one has been due, in one statement over the queue's rows. Consumers are
    not counted: a consumer holds no row while it waits."""
    row = connection.execute(
        f"SELECT count(*) FILTER (WHERE {_READY}), count(*) FILTER (WHERE {_LEASED}),"
        f" count(*) FILTER (WHERE m.visible_at > clock_timestamp() AND NOT"
        f" coalesce({_LEASED}, false)),"
        f" extract(epoch FROM clock_timestamp() - min(m.visible_at) FILTER (WHERE {_READY}))"
        f" FROM {schema.messages} m WHERE m.queue = %s", (queue,)).fetchone()
    ready, leased, delayed, oldest = row if row else (0, 0, 0, None)
    return QueueDepth(ready=int(ready), unacked=int(leased), delayed=int(delayed),
                      oldest_seconds=max(0.0, float(oldest)) if oldest is not None else None)


def ordered_keys(connection: Any, schema: QueueSchema, queue: str) -> OrderedKeys:
    """The keys of ``queue``'s ordered rows with one claimed and not settled, and its
    ordered rows no consumer holds, in one statement over the queue's ordered rows (the
    ordering index)."""
    row = connection.execute(
        f"SELECT count(DISTINCT m.ordering_key) FILTER (WHERE {_LEASED}),"
        f" count(*) FILTER (WHERE NOT coalesce({_LEASED}, false))"
        f" FROM {schema.messages} m WHERE m.queue = %s AND m.ordering_key IS NOT NULL",
        (queue,)).fetchone()
    in_flight, waiting = row if row else (0, 0)
    return OrderedKeys(in_flight=int(in_flight), waiting=int(waiting))
