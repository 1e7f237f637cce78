"""The per-message work of the peers (raw kombu, Celery, Dramatiq), written once for all.

For each input message a peer calls :meth:`PeerWork.handle`, then acknowledges the message
its own way (the raw loop and Dramatiq after the call returns; Celery with ``acks_late``):

1. one SQL transaction (psycopg 3)::

       BEGIN;
       UPDATE <counters> SET n = n + 1 WHERE id = <aggregate> RETURNING n;
       INSERT INTO <done> (message_id) VALUES (<message id>);
       COMMIT;

2. one persistent message published with publisher confirms to the run's topic exchange,
   routed to the sink queue (kombu, on a connection used for nothing else, as idembus does).

idembus does the equivalent in its own way (load, one conditional commit of the aggregate
and the processed record with the outgoing event, publish with confirms, ack, and its
batched marks) — see :mod:`bench.pg_handlers`.

Connections are opened lazily and kept per thread, so the same object serves a
single-threaded loop, Celery's forked pool processes and Dramatiq's worker threads.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import kombu
import psycopg

from bench.pg_common import EVENT_NAME, RunNames


class PeerWork:
    """One message's SQL transaction and confirmed publish, with per-thread connections."""

    def __init__(self, names: RunNames) -> None:
        self.names = names
        self._local = threading.local()
        self._update = (f"UPDATE {names.counters_table} SET n = n + 1 WHERE id = %s "
                        "RETURNING n")
        self._insert = f"INSERT INTO {names.processed_table} (message_id) VALUES (%s)"
        self._lock = threading.Lock()
        self._opened: list[Any] = []

    def handle(self, message_id: str, aggregate: str) -> None:
        """Record the message and change the aggregate in one transaction; publish one
        event and wait for the broker's confirm."""
        database = self._database()
        with database.transaction():
            row = database.execute(self._update, (aggregate,)).fetchone()
            database.execute(self._insert, (message_id,))
        if row is None:
            raise LookupError(f"no counter row {aggregate!r} in {self.names.counters_table}")
        body = json.dumps({"aggregate": aggregate, "n": row[0]})
        self._producer().publish(
            body.encode(), exchange=self.names.exchange, routing_key=EVENT_NAME,
            headers={"message_id": f"{message_id}/0", "causation_id": message_id},
            content_type="application/json", content_encoding="utf-8", delivery_mode=2,
        )

    def _database(self) -> psycopg.Connection[Any]:
        connection = getattr(self._local, "database", None)
        if connection is None:
            connection = psycopg.connect(self.names.postgres_url, autocommit=True)
            self._local.database = connection
            self._keep(connection)
        return connection

    def _producer(self) -> kombu.Producer:
        producer = getattr(self._local, "producer", None)
        if producer is None:
            connection = kombu.Connection(self.names.amqp_url,
                                          transport_options={"confirm_publish": True})
            producer = kombu.Producer(connection.default_channel)
            self._local.producer = producer
            self._keep(connection)
        return producer

    def _keep(self, connection: Any) -> None:
        with self._lock:
            self._opened.append(connection)

    def close(self) -> None:
        """Close every connection any thread opened."""
        with self._lock:
            opened, self._opened = self._opened, []
        for connection in opened:
            try:
                connection.close()
            except Exception:  # noqa: BLE001 - closing a broken connection; nothing to do
                pass
        self._local = threading.local()
