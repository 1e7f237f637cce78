"""A payment gateway whose charges live in PostgreSQL (needs the ``[postgres]`` extra).

:class:`~samples.ordering.billing.FakePaymentGateway` keeps its charges in one process;
this one keeps them in a table, so that they outlive the worker processes that make them
and every Billing worker sees the same ones. Like a real payment API it honours
idempotency keys: the table's primary key is the key, a charge is an
``INSERT ... ON CONFLICT DO NOTHING`` followed by reading the row back, so a repeated call
with the same key returns the first charge instead of making a second one::

    gateway = PostgresPaymentGateway("postgresql://postgres@127.0.0.1:5432/test",
                                     table="shop_charges")
    charge = gateway.charge("order-1", 1250, idempotency_key=key)

Every call is counted, in this object (:attr:`calls`) and in the charge's row
(:meth:`total_calls` sums them over every process). The table is created on first use
(concurrent creators serialise on an advisory lock); :meth:`drop_table` removes it.
"""

from __future__ import annotations

import re
import threading
import uuid
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from samples.ordering.billing import Charge

_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class PostgresPaymentGateway:
    """Charges kept in the PostgreSQL table ``table``; see the module docstring."""

    def __init__(self, conninfo: str, *, table: str = "payment_charges",
                 pool_size: int = 4, connect_timeout: float = 5.0) -> None:
        if not _IDENTIFIER.match(table):
            raise ValueError(f"table {table!r} must be lower-case letters, digits and '_'")
        self.table = table
        #: Calls of :meth:`charge` made through this object.
        self.calls = 0
        self._lock = threading.Lock()
        self._ready = False
        self._connect_timeout = connect_timeout
        self._pool = ConnectionPool(conninfo, min_size=1, max_size=pool_size, open=False,
                                    timeout=connect_timeout, kwargs={"autocommit": True},
                                    name=f"gateway-{table}")

    def charge(self, order_id: str, amount_cents: int, *, idempotency_key: str) -> Charge:
        """Charge ``amount_cents`` for ``order_id`` once per ``idempotency_key``; a repeated
        call returns the charge the first one made."""
        with self._lock:
            self.calls += 1
        with self._connection() as connection, connection.transaction():
            connection.execute(
                f"INSERT INTO {self.table} (idempotency_key, charge_id, order_id, amount_cents) "
                "VALUES (%s, %s, %s, %s) ON CONFLICT (idempotency_key) DO NOTHING",
                (idempotency_key, str(uuid.uuid4()), order_id, amount_cents),
            )
            row = connection.execute(
                f"UPDATE {self.table} SET calls = calls + 1 WHERE idempotency_key = %s "
                "RETURNING charge_id, order_id, amount_cents",
                (idempotency_key,),
            ).fetchone()
        assert row is not None, "the charge of this key was inserted or existed"
        return Charge(charge_id=row[0], order_id=row[1], amount_cents=row[2])

    @property
    def charges(self) -> list[Charge]:
        """Every charge made, by any process."""
        with self._connection() as connection:
            rows = connection.execute(
                f"SELECT charge_id, order_id, amount_cents FROM {self.table} ORDER BY charged_at"
            ).fetchall()
        return [Charge(charge_id=row[0], order_id=row[1], amount_cents=row[2]) for row in rows]

    def total_calls(self) -> int:
        """Calls of :meth:`charge` made by every process (a repeated key counts again)."""
        with self._connection() as connection:
            row = connection.execute(f"SELECT coalesce(sum(calls), 0) FROM {self.table}")
            return int(row.fetchone()[0])  # type: ignore[index]

    def migrate(self) -> None:
        """Open the pool and create the table if it does not exist (every method does so
        on first use). Safe to run concurrently."""
        with self._lock:
            if not self._ready:
                self._pool.open(wait=True, timeout=self._connect_timeout)
                with self._pool.connection() as connection:
                    self._create_table(connection)
                self._ready = True

    def drop_table(self) -> None:
        """Drop the table and every charge in it."""
        with self._connection() as connection:
            connection.execute(f"DROP TABLE IF EXISTS {self.table}")
        self._ready = False

    def close(self) -> None:
        """Close the connection pool. Idempotent."""
        self._pool.close()

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled autocommit connection; the pool is opened and the table created on
        first use."""
        if not self._ready:
            self.migrate()
        with self._pool.connection() as connection:
            yield connection

    def _create_table(self, connection: psycopg.Connection[Any]) -> None:
        with connection.transaction():
            connection.execute("SELECT pg_advisory_xact_lock(%s)",
                               (zlib.crc32(self.table.encode()),))
            connection.execute(f"""
                CREATE TABLE IF NOT EXISTS {self.table} (
                    idempotency_key text PRIMARY KEY,
                    charge_id text NOT NULL,
                    order_id text NOT NULL,
                    amount_cents bigint NOT NULL,
                    calls bigint NOT NULL DEFAULT 0,
                    charged_at timestamptz NOT NULL DEFAULT clock_timestamp()
                )""")
