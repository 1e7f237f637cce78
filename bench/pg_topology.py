"""The driver's side of a run's broker and database objects: create, count, delete.

Every object is named after the run (:class:`bench.pg_common.RunNames`) and deleted when
the run ends, failed or not (:class:`Cleanup`). Frameworks that declare objects of their own
(Celery's exchange per queue, Dramatiq's ``.DQ``/``.XQ`` queues, idembus' error queue and
tables) tell the cleanup about them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import kombu
import psycopg
from kombu import Exchange, Queue

from bench.pg_common import AGGREGATES, EVENT_NAME, RunNames

log = logging.getLogger(__name__)


class Broker:
    """One driver connection to RabbitMQ (no confirms: the driver only prepares and counts)."""

    def __init__(self, url: str) -> None:
        self.connection = kombu.Connection(url)
        self.connection.ensure_connection(max_retries=5, interval_start=1, interval_step=2)
        self.channel = self.connection.channel()

    def declare_sink(self, names: RunNames, *, bind: bool = True) -> None:
        """The run's topic exchange and, with ``bind``, the sink queue collecting every
        published event (without it the broker confirms and drops them)."""
        exchange = Exchange(names.exchange, type="topic", durable=True)
        exchange(self.channel).declare()
        if bind:
            Queue(names.sink_queue, exchange, routing_key=EVENT_NAME,
                  durable=True)(self.channel).declare()

    def declare_queue(self, queue: str) -> None:
        Queue(queue, durable=True)(self.channel).declare()

    def depth(self, queue: str) -> int:
        """Messages ready in ``queue`` (a passive declare: nothing is consumed)."""
        _, count, _ = self.channel.queue_declare(queue=queue, passive=True)
        return int(count)

    def publish_raw(self, queue: str, body: bytes, headers: dict[str, Any]) -> None:
        """Put one persistent JSON message on ``queue`` through the default exchange."""
        kombu.Producer(self.channel).publish(
            body, exchange="", routing_key=queue, headers=headers,
            content_type="application/json", content_encoding="utf-8", delivery_mode=2)

    def delete_queue(self, queue: str) -> None:
        self.channel.queue_delete(queue=queue)

    def delete_exchange(self, exchange: str) -> None:
        self.channel.exchange_delete(exchange=exchange)

    def close(self) -> None:
        try:
            self.connection.close()
        except Exception:  # noqa: BLE001 - a broken connection; the objects are gone or not
            log.debug("closing the driver connection failed", exc_info=True)


def create_peer_tables(names: RunNames) -> None:
    """The peers' tables, with one row per aggregate at n = 0."""
    with psycopg.connect(names.postgres_url, autocommit=True) as connection:
        connection.execute(
            f"CREATE TABLE {names.counters_table} (id text PRIMARY KEY, n bigint NOT NULL)")
        connection.execute(
            f"CREATE TABLE {names.processed_table} (message_id text PRIMARY KEY)")
        connection.execute(
            f"INSERT INTO {names.counters_table} (id, n) "
            "SELECT 'agg-' || lpad(g::text, 4, '0'), 0 "
            f"FROM generate_series(0, {AGGREGATES - 1}) g")


def peer_totals(names: RunNames) -> tuple[int, int]:
    """(sum of the counters, processed rows) of a peer's run."""
    with psycopg.connect(names.postgres_url, autocommit=True) as connection:
        row = connection.execute(
            f"SELECT (SELECT coalesce(sum(n), 0) FROM {names.counters_table}), "
            f"(SELECT count(*) FROM {names.processed_table})").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def drop_tables(postgres_url: str, *tables: str) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as connection:
        connection.execute(f"DROP TABLE IF EXISTS {', '.join(tables)}")


class Cleanup:
    """Deletes a run's queues, exchanges and tables, each even if another fails."""

    def __init__(self, names: RunNames) -> None:
        self.names = names
        self.queues: list[str] = [names.input_queue, names.sink_queue]
        self.exchanges: list[str] = [names.exchange]
        self.tables: list[str] = []
        self.extra: list[Callable[[], None]] = []

    def run(self) -> None:
        steps: list[tuple[str, Callable[[], None]]] = []
        if self.tables:
            steps.append((f"tables {self.tables}",
                          lambda: drop_tables(self.names.postgres_url, *self.tables)))
        steps += [(f"cleanup {step}", step) for step in self.extra]
        broker: Broker | None = None
        try:
            broker = Broker(self.names.amqp_url)
        except Exception as exc:  # noqa: BLE001 - reported below, tables still dropped
            log.error("cannot connect to delete queues %s: %s", self.queues, exc)
        if broker is not None:
            for queue in self.queues:
                steps.append((f"queue {queue}", _bound(broker.delete_queue, queue)))
            for exchange in self.exchanges:
                steps.append((f"exchange {exchange}", _bound(broker.delete_exchange, exchange)))
        try:
            for label, step in steps:
                try:
                    step()
                except Exception as exc:  # noqa: BLE001 - go on deleting the rest
                    log.error("could not delete %s: %s", label, exc)
                    if broker is not None and broker.channel.is_open is False:
                        broker.channel = broker.connection.channel()
        finally:
            if broker is not None:
                broker.close()


def _bound(function: Callable[[str], None], argument: str) -> Callable[[], None]:
    return lambda: function(argument)
