"""The PostgreSQL transport's pool of connections for sends, acknowledgements and tools.

Opened on first use, waiting up to ``connect_timeout`` for its first connection. When that
wait times out — the database unreachable, failing over, still starting — psycopg closes
the pool for good (a closed pool cannot be opened again), so the pool is replaced by a new,
unopened one with the same settings: the next use tries again, and a transport first used
during an outage works once the database is back.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout


class TransportPool:
    """A :class:`~psycopg_pool.ConnectionPool` of autocommit connections to ``url``, at most
    ``size``, named ``name``; see the module docstring. Raises
    :class:`psycopg.ProgrammingError` for a conninfo libpq cannot parse."""

    def __init__(self, url: str, *, size: int, connect_timeout: float, name: str) -> None:
        self._url = url
        self._size = size
        self._connect_timeout = connect_timeout
        self._name = name
        self._pool = self._new()
        self._opened = False
        self._opening = threading.Lock()

    def _new(self) -> ConnectionPool:
        return ConnectionPool(self._url, min_size=1, max_size=self._size, open=False,
                              timeout=self._connect_timeout,
                              kwargs={"autocommit": True, "application_name": "idembus"},
                              name=self._name)

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection, the pool opened first if it is not (``PoolTimeout`` when no
        connection came within ``connect_timeout``)."""
        if not self._opened:
            with self._opening:
                if not self._opened:
                    try:
                        self._pool.open(wait=True, timeout=self._connect_timeout)
                    except PoolTimeout:  # which closes a psycopg pool for good
                        self._pool = self._new()
                        raise
                    self._opened = True
        with self._pool.connection() as connection:
            yield connection

    def close(self) -> None:
        """Close the pool's connections if it was opened."""
        with self._opening:
            if self._opened:
                self._pool.close()
                self._opened = False
