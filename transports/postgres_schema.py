"""The tables of the PostgreSQL transport, and how they are created.

One table holds the messages of every queue (a ``queue`` column), beside the declared
queues and the subscriptions::

    <prefix>_queues        (name) -> declared_at
    <prefix>_subscriptions (message_type, queue)
    <prefix>_messages      (id identity) -> queue, headers json, body bytea, content_type,
                           content_encoding, visible_at, leased_until, lease, deliveries,
                           enqueued_at, ordering_key
    index (queue, visible_at, id): the ready messages of a queue, oldest due first
    index (queue, ordering_key, id) where ordering_key is set: the older rows of a key

``ordering_key`` is the ``idembus.ordering.key`` header of a sent message of an ordered
type, written by the sender (never read from the headers in the database: a claim must
succeed whatever another client wrote there); a claim skips a row while an older row of
its key is in its queue (:mod:`.postgres_statements`). Tables made by an earlier idembus
get the column and its index from :meth:`QueueSchema.migrate`, which looks them up in the
catalogue first and alters the table only when one is missing (an ``ALTER TABLE`` waits
for, and then holds up, every transaction on the table).

``visible_at`` is when a message may be delivered (its due time: now, or later for a
delayed one) and never changes; a consumer's claim sets ``leased_until`` and ``lease``,
which no index covers, so a claim is an update PostgreSQL can make in place (the table
leaves 30 % of each page free for them).

Idle consumers listen on their queue's channel (:func:`channel`). Whoever inserts messages
notifies those channels *after* its transaction committed, in a statement of its own: a
``NOTIFY`` inside a transaction takes a database-wide lock until that transaction's commit
is on disk, which would put every commit with outgoing messages in one line (a trigger
did, and halved the throughput).

:meth:`QueueSchema.migrate` creates what is missing under an advisory lock (safe to run
concurrently); :meth:`QueueSchema.missing` only reads the catalogue, so that a role without
DDL rights can start an endpoint once ``idembus migrate`` has run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import psycopg

from ..errors import ConfigurationError
from ..storage.postgres_errors import is_privilege_refusal
from .database import check_prefix
from .errors import BrokerAccessDenied

#: Key of the advisory lock that serialises the creation of these tables.
_SCHEMA_LOCK = 0x1DE3B06


def channel(prefix: str, queue: str) -> str:
    """The LISTEN/NOTIFY channel of ``queue``: the prefix and the start of the queue name's
    MD5 (a channel name holds at most 63 bytes, a queue name any number)."""
    digest = hashlib.md5(queue.encode("utf-8"), usedforsecurity=False).hexdigest()
    return f"{prefix}_{digest[:16]}"


class QueueSchema:
    """The names and the DDL of one transport's tables (``table_prefix``)."""

    def __init__(self, prefix: str) -> None:
        check_prefix(prefix)
        self.prefix = prefix
        self.messages = f"{prefix}_messages"
        self.queues = f"{prefix}_queues"
        self.subscriptions = f"{prefix}_subscriptions"
        #: Every table, in the order they are dropped.
        self.tables = (self.messages, self.subscriptions, self.queues)

    def migrate(self, connection: psycopg.Connection[Any]) -> None:
        """Create the tables and the index that do not exist."""
        with connection.transaction():
            connection.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            connection.execute(f"""
                CREATE TABLE IF NOT EXISTS {self.queues} (
                    name text PRIMARY KEY,
                    declared_at timestamptz NOT NULL DEFAULT clock_timestamp()
                )""")
            connection.execute(f"""
                CREATE TABLE IF NOT EXISTS {self.subscriptions} (
                    message_type text NOT NULL,
                    queue text NOT NULL,
                    PRIMARY KEY (message_type, queue)
                )""")
            connection.execute(f"""
                CREATE TABLE IF NOT EXISTS {self.messages} (
                    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                    queue text NOT NULL,
                    headers json NOT NULL,
                    body bytea NOT NULL,
                    content_type text,
                    content_encoding text,
                    visible_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                    leased_until timestamptz,
                    lease bigint,
                    deliveries integer NOT NULL DEFAULT 0,
                    enqueued_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                    ordering_key text
                ) WITH (fillfactor = 70)""")
            # Looked up first: ALTER TABLE takes an ACCESS EXCLUSIVE lock and CREATE INDEX
            # a SHARE lock even when IF NOT EXISTS finds what they would make, so on a busy
            # queue table they would wait behind every open transaction, and hold up every
            # claim and send queued behind them, at each migration.
            if not _has_index(connection, f"{self.messages}_ready"):
                connection.execute(f"""
                    CREATE INDEX IF NOT EXISTS {self.messages}_ready
                    ON {self.messages} (queue, visible_at, id)""")
            if not _has_column(connection, self.messages, "ordering_key"):
                connection.execute(f"""
                    ALTER TABLE {self.messages} ADD COLUMN IF NOT EXISTS ordering_key text""")
            if not _has_index(connection, f"{self.messages}_ordering"):
                connection.execute(f"""
                    CREATE INDEX IF NOT EXISTS {self.messages}_ordering
                    ON {self.messages} (queue, ordering_key, id)
                    WHERE ordering_key IS NOT NULL""")

    def missing(self, connection: psycopg.Connection[Any]) -> list[str]:
        """The tables of this schema that do not exist, and the columns an earlier idembus
        did not make (``<table>.<column>``); reads only."""
        present = connection.execute(
            "SELECT t FROM unnest(%s::text[]) AS t WHERE to_regclass(t) IS NOT NULL",
            (list(self.tables),)).fetchall()
        missing = sorted(set(self.tables) - {row[0] for row in present})
        if self.messages not in missing:
            if not _has_column(connection, self.messages, "ordering_key"):
                missing.append(f"{self.messages}.ordering_key")
            if not _has_index(connection, f"{self.messages}_ordering"):
                missing.append(f"index {self.messages}_ordering")
        return missing

    def drop(self, connection: psycopg.Connection[Any]) -> None:
        """Drop the tables, with every message."""
        connection.execute(f"DROP TABLE IF EXISTS {', '.join(self.tables)}")


def _has_column(connection: psycopg.Connection[Any], table: str, column: str) -> bool:
    """Whether ``table`` has ``column`` (the catalogue only: no lock on the table)."""
    return connection.execute(
        "SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attname = %s"
        " AND NOT attisdropped", (table, column)).fetchone() is not None


def _has_index(connection: psycopg.Connection[Any], index: str) -> bool:
    """Whether the index ``index`` exists (the catalogue only: no lock on its table)."""
    return connection.execute("SELECT to_regclass(%s) IS NOT NULL",
                              (index,)).fetchone() == (True,)


def cannot_create(missing: Sequence[str], refused: BrokerAccessDenied,
                  safe_url: str) -> ConfigurationError:
    """What to do when the tables ``missing`` at ``safe_url`` cannot be created
    (``refused``): a role that may not, or a table in the way."""
    if is_privilege_refusal(refused):
        return ConfigurationError(
            f"PostgreSQL at {safe_url} lacks {', '.join(missing)} and this role may not "
            f"create them ({refused}); run `idembus migrate package.module:endpoint` once "
            "with a role that may, then start again")
    return ConfigurationError(
        f"PostgreSQL at {safe_url}: {', '.join(missing)} cannot be created ({refused}); a "
        "table of that name that idembus did not create is in the way: rename or drop it, "
        "or give the transport another table_prefix")
