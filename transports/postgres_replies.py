"""Reply queues of the PostgreSQL transport tied to a session, as RabbitMQ's exclusive
queues are tied to a connection (``bus.request``, :mod:`idembus.runtime.requests`).

The process that consumes a reply queue holds a session-level advisory lock named after
the queue (``pg_advisory_lock(hashtextextended(<queue>, 0))``) on a connection of its
own, for as long as it consumes. PostgreSQL releases the lock when that session ends,
however it ends — the process closed, killed, or its machine gone (once the server notices
the connection is dead). Whenever a process opens a reply queue, and then every third of
``reply_lease`` seconds while it consumes one, and whenever an endpoint starts, it deletes
the reply queues (``<endpoint>.replies.<32 hex digits>``) whose lock nobody holds, with the
replies in them: their requesters are gone. A reply sent to a queue deleted so is refused,
and the responder drops it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg

from .base import OnDelivery, Transport
from .postgres_rows import _close_quietly, consumer_connection
from .postgres_schema import QueueSchema
from .reply_leases import REPLY_QUEUE_PATTERN

log = logging.getLogger(__name__)

_REPLY_QUEUE = REPLY_QUEUE_PATTERN
_KEY = "hashtextextended(%s, 0)"


class PostgresReplyQueues(Transport):
    """``consume_replies`` for :class:`~idembus.transports.postgres.PostgresTransport`."""

    #: No lease to renew (the session's lock is one), but sweeps by every process that
    #: consumes a reply queue, every third of ``reply_lease``, and at an endpoint's start.
    expiring_reply_queues = True

    url: str
    schema: QueueSchema
    _connect_timeout: float

    #: PostgresTransport's pooled autocommit connections.
    _connection: Callable[..., contextlib.AbstractContextManager[psycopg.Connection[Any]]]

    def consume_replies(self, queue: str, on_delivery: OnDelivery, *,
                        stop: threading.Event, ready: threading.Event) -> None:
        """See the contract: hold the queue's advisory lock while consuming it, after
        deleting the reply queues of requesters that are gone."""
        with self._holding(queue):  # the contract's default sweeps, at once and then
            super().consume_replies(queue, on_delivery, stop=stop, ready=ready)

    @contextlib.contextmanager
    def _holding(self, queue: str) -> Iterator[None]:
        holder = consumer_connection(self.url, self._connect_timeout, "replies", queue)
        try:
            holder.execute(f"SELECT pg_advisory_lock({_KEY})", (queue,))
            yield
        finally:
            _close_quietly(holder)

    def sweep_reply_queues(self) -> list[str]:
        """Delete the reply queues whose requester is gone (nobody holds their lock), with
        their messages; return their names."""
        schema = self.schema
        swept: list[str] = []
        with self._connection("deleting the reply queues of requesters that are gone") as c:
            names = [row[0] for row in c.execute(
                f"SELECT name FROM {schema.queues} WHERE name ~ %s", (_REPLY_QUEUE,))]
            for name in names:
                with c.transaction():
                    free = c.execute(f"SELECT pg_try_advisory_xact_lock({_KEY})",
                                     (name,)).fetchone()
                    if not free or not free[0]:
                        continue  # its requester consumes it
                    for table, column in ((schema.messages, "queue"),
                                          (schema.subscriptions, "queue"),
                                          (schema.queues, "name")):
                        c.execute(f"DELETE FROM {table} WHERE {column} = %s", (name,))
                swept.append(name)
        if swept:
            log.info("deleted %d reply queue(s) whose requesters are gone: %s", len(swept),
                     ", ".join(swept))
        return swept
