"""The tables of the PostgreSQL transport, and how they are created.

One table holds the messages of every queue (a ``queue`` column), beside the declared
queues and the subscriptions::

    <prefix>_queues        (name) -> declared_at
    <prefix>_subscriptions (message_type, queue)
    <prefix>_messages      (id identity) -> queue, headers json, body bytea, content_type,
                           content_encoding, visible_at, leased_until, lease, deliveries,
                           enqueued_at
    index (queue, visible_at, id): the ready messages of a queue, oldest due first

``visible_at`` is when a message may be delivered (its due time: now, or later for a
delayed one) and never changes; a consumer's claim sets ``leased_until`` and ``lease``,
which no index covers, so a claim is an update PostgreSQL can make in place. A statement
trigger notifies the channel of each queue it inserted into (:func:`channel`), on commit,
so an idle consumer listening there wakes at once.

:meth:`QueueSchema.migrate` creates what is missing under an advisory lock (safe to run
concurrently); :meth:`QueueSchema.missing` only reads the catalogue, so that a role without
DDL rights can start an endpoint once ``idembus migrate`` has run.
"""

from __future__ import annotations

import hashlib
from typing import Any

import psycopg

from .database import check_prefix

#: Key of the advisory lock that serialises the creation of these tables.
_SCHEMA_LOCK = 0x1DE3B06


def channel(prefix: str, queue: str) -> str:
    """The LISTEN/NOTIFY channel of ``queue``: the prefix and the start of the queue name's
    MD5, which the trigger computes alike (a channel name holds at most 63 bytes)."""
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
        self.notify_function = f"{prefix}_notify"
        self.trigger = f"{prefix}_messages_notify"
        #: Every table, in the order they are dropped.
        self.tables = (self.messages, self.subscriptions, self.queues)

    def migrate(self, connection: psycopg.Connection[Any]) -> None:
        """Create the tables, index, notify function and trigger that do not exist."""
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
                    enqueued_at timestamptz NOT NULL DEFAULT clock_timestamp()
                )""")
            connection.execute(f"""
                CREATE INDEX IF NOT EXISTS {self.messages}_ready
                ON {self.messages} (queue, visible_at, id)""")
            # Channel names as channel() computes them; one notification per queue and
            # statement (PostgreSQL folds equal ones of one transaction).
            connection.execute(f"""
                CREATE OR REPLACE FUNCTION {self.notify_function}() RETURNS trigger
                LANGUAGE plpgsql AS $$
                BEGIN
                    PERFORM pg_notify(TG_ARGV[0] || '_' || left(md5(q.queue), 16), '')
                    FROM (SELECT DISTINCT queue FROM inserted) AS q;
                    RETURN NULL;
                END $$""")
            if not self._has_trigger(connection):
                connection.execute(f"""
                    CREATE TRIGGER {self.trigger} AFTER INSERT ON {self.messages}
                    REFERENCING NEW TABLE AS inserted FOR EACH STATEMENT
                    EXECUTE FUNCTION {self.notify_function}('{self.prefix}')""")

    def missing(self, connection: psycopg.Connection[Any]) -> list[str]:
        """What of this schema does not exist (tables, then the trigger); reads only."""
        present = connection.execute(
            "SELECT t FROM unnest(%s::text[]) AS t WHERE to_regclass(t) IS NOT NULL",
            (list(self.tables),)).fetchall()
        missing = sorted(set(self.tables) - {row[0] for row in present})
        if self.messages not in missing and not self._has_trigger(connection):
            missing.append(f"trigger {self.trigger}")
        return missing

    def drop(self, connection: psycopg.Connection[Any]) -> None:
        """Drop the tables (with every message) and the notify function."""
        connection.execute(f"DROP TABLE IF EXISTS {', '.join(self.tables)}")
        connection.execute(f"DROP FUNCTION IF EXISTS {self.notify_function}()")

    def _has_trigger(self, connection: psycopg.Connection[Any]) -> bool:
        row = connection.execute(
            "SELECT 1 FROM pg_trigger WHERE tgrelid = to_regclass(%s) AND tgname = %s",
            (self.messages, self.trigger)).fetchone()
        return row is not None
